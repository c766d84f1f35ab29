"""Request and response bodies of `GET /v1/compare` and `GET|PUT /v1/suites/{suite_id}/baseline`."""

from __future__ import annotations

from datetime import datetime

import msgspec

from evalbus_grading.compare import Comparison
from evalbus_grading.gates import GateResult


class BaselineRequest(msgspec.Struct, frozen=True, kw_only=True):
    """Make a batch its suite's baseline."""

    batch_id: str
    """A batch of the suite, finalized `succeeded`."""


class BaselineView(msgspec.Struct, frozen=True, kw_only=True):
    """A suite's baseline."""

    suite_id: str
    """The suite."""
    batch_id: str
    """The baseline batch."""
    set_by: str
    """Who set it."""
    set_at: datetime
    """When."""


class ComparisonView(Comparison, frozen=True, kw_only=True):
    """A comparison as `GET /v1/compare` answers it."""

    gates: tuple[GateResult, ...] = ()
    """The candidate's gates (its suite's `gates:` and any `--gate` it was run with, as its spec
    recorded them), each decided as `evalbus run` decides it: a threshold on the candidate's summary, a
    regression gate against the batch it names or the suite's baseline (this comparison when that
    is the base). Empty when it declared none."""
