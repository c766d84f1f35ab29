"""Deterministic platform ids derived from evalbus run ids (pure).

Id correlation means "the platform trace id is the run id". A run id that already has the
platform's id shape (32 hex digits, `tr-<hex>` for MLflow, a UUID for LangSmith) is used as it is;
any other run id (`evb-<batch>-<case>`) is hashed into that shape with `trace_id_for`, so an agent
that knows `EVALBUS_RUN_ID` can mint the same trace id with one SHA-256.

Exported cases get ids of their own, derived from the run id in another namespace, so a
redelivered case maps to the same platform objects and is not exported twice.
"""

from __future__ import annotations

import hashlib
import re
import uuid

_HEX32 = re.compile(r"^[0-9a-f]{32}$")
_UUID = re.compile(r"^[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$")

EVALBUS_NAMESPACE = uuid.UUID("6f1c8a52-5a0e-4c33-9d0b-0e4a1b7c2d11")
"""UUID namespace for uuid5 ids evalbus mints (LangSmith runs and feedback, Langfuse events)."""


def trace_id_for(run_id: str) -> str:
    """The 32-hex OpenTelemetry trace id of a run under id correlation.

    `abc…` (32 hex) and `tr-abc…` pass through (lower-cased); a UUID loses its dashes; anything
    else is the first 32 hex digits of SHA-256(run id).
    """
    raw = run_id.strip().lower()
    if raw.startswith("tr-"):
        raw = raw[3:]
    if _HEX32.match(raw):
        return raw
    if _UUID.match(raw):
        return raw.replace("-", "")
    return hashlib.sha256(run_id.encode("utf-8")).hexdigest()[:32]


def as_uuid(hex32: str) -> str:
    """A 32-hex id written as a UUID (LangSmith trace ids are UUIDs)."""
    return str(uuid.UUID(hex=hex32))


def export_trace_id(run_id: str) -> str:
    """The 32-hex trace id of the trace evalbus exports for a judged run."""
    return hashlib.sha256(b"evalbus/export/trace/" + run_id.encode("utf-8")).hexdigest()[:32]


def export_span_id(run_id: str, part: str = "root") -> str:
    """A 16-hex span id for one span of an exported run (`root`, or a step key)."""
    data = b"evalbus/export/span/" + run_id.encode("utf-8") + b"/" + part.encode("utf-8")
    digest = hashlib.sha256(data).hexdigest()[:16]
    # an all-zero span id is invalid in OTLP; SHA-256 makes it astronomically unlikely, but be exact
    return digest if digest != "0" * 16 else "0" * 15 + "1"


def export_uuid(run_id: str, *parts: str) -> str:
    """A uuid5 for an object evalbus creates for a run (a run, a feedback, an ingestion event)."""
    return str(uuid.uuid5(EVALBUS_NAMESPACE, "/".join((run_id, *parts))))
