"""Claim checks: what an event or a spec carries instead of a payload too large for the bus.

The payload itself lives in a JetStream object store bucket (`datasets`, `artifacts`; declared in
`evalbus_contracts.streams`); the reference names it and pins its bytes with a SHA-256 digest that
every reader checks before trusting what it read.
"""

from __future__ import annotations

from typing import Annotated

import msgspec

Sha256Hex = Annotated[str, msgspec.Meta(pattern="^[0-9a-f]{64}$")]
"""A SHA-256 digest as 64 lower-case hexadecimal digits."""


class ObjectRef(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """Where a large payload is and which bytes it must be."""

    bucket: Annotated[str, msgspec.Meta(pattern="^[A-Za-z0-9_-]+$", max_length=64)]
    """Object store bucket (`datasets` or `artifacts`)."""
    name: Annotated[str, msgspec.Meta(pattern="^[-/_=.A-Za-z0-9]+$", max_length=256)]
    """Object name in the bucket."""
    size: Annotated[int, msgspec.Meta(ge=0)]
    """Length in bytes; a reader refuses an object of another length."""
    sha256: Sha256Hex
    """Digest of the bytes; a reader refuses an object whose bytes hash otherwise (tampered or
    replaced under the same name)."""


class DatasetIndex(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False, omit_defaults=True):
    """What the services need to know of an uploaded dataset without reading it, written by the
    gateway once it has read and validated every case (a value a client sends is replaced)."""

    cases: Annotated[int, msgspec.Meta(ge=0)]
    """Distinct case ids in the dataset (the batch has this many × trials runs)."""
    objective_metrics: tuple[str, ...] = ()
    """Metric names of the dataset's `command` and `script-score` graders (the objective rung of
    the verdict ladder), over all cases: a case's own objective metrics are a subset."""
