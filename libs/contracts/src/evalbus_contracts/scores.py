"""The score union: a measurement, an honest non-measurement, or a contract violation.

Non-measurements carry no `value`, so no failure can pass for a normal number.
"""

from __future__ import annotations

from typing import Literal

import msgspec

UnmeasuredReason = Literal[
    "grader_error",
    "missing_evidence",
    "missing_secret",
    "unsupported",
    "policy_skip",
    "contract_violation",
    "grader_timeout",
]
"""Why a score could not be measured."""

ScoreSource = Literal["grader", "judge"]
"""Who produced a score."""


class _ScoreBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="status", omit_defaults=True):
    grader_id: str
    """Id of the grader or judge that produced the score."""
    metric: str
    """Metric name (`tests_pass`, `answer_match`, `judge:<id>`...)."""
    source: ScoreSource = "grader"
    """Grader (execution side) or judge."""
    detail: str | None = None
    """Human-readable explanation."""


class Measured(_ScoreBase, frozen=True, kw_only=True, tag="measured"):
    """A measured value."""

    value: float
    """The measurement."""
    passed: bool | None = msgspec.field(default=None, name="pass")
    """Pass/fail when the metric has a threshold; absent for pure observations."""
    label: str | None = None
    """Optional categorical label."""


class Unmeasured(_ScoreBase, frozen=True, kw_only=True, tag="unmeasured"):
    """No measurement, with the reason."""

    reason: UnmeasuredReason
    """Why nothing was measured."""
    retryable: bool = False
    """Whether trying again could measure it."""
    attempts: int | None = None
    """How many attempts were made."""


class Invalid(_ScoreBase, frozen=True, kw_only=True, tag="invalid"):
    """A grader or judge returned something that breaks the score contract."""

    reason: Literal["contract_violation"] = "contract_violation"
    """Always `contract_violation`."""


Score = Measured | Unmeasured | Invalid
"""Any score, discriminated on `status`."""
