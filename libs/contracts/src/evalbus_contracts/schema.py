"""JSON Schemas of every event and of the batch spec, for `docs/schemas/` (pure: returns data)."""

from __future__ import annotations

from typing import Any

import msgspec

from evalbus_contracts.events import EVENT_TYPES
from evalbus_contracts.objects import ObjectRef
from evalbus_contracts.specs import BatchSpec, OnlineSuiteSpec


def schemas() -> dict[str, dict[str, Any]]:
    """File name → JSON Schema, one per event type plus the batch spec, the online suite spec and
    the object reference (`POST /v1/datasets` answers one)."""
    out: dict[str, dict[str, Any]] = {}
    for kind in EVENT_TYPES:
        tag = str(kind.__struct_config__.tag)
        out[f"{tag}.json"] = msgspec.json.schema(kind)
    out["batch-spec.json"] = msgspec.json.schema(BatchSpec)
    out["online-suite.json"] = msgspec.json.schema(OnlineSuiteSpec)
    out["object-ref.json"] = msgspec.json.schema(ObjectRef)
    return out
