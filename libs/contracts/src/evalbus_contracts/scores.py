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


class JudgeUsage(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What producing one judge score cost: the model calls a model judge made for it."""

    model: str | None = None
    """Model name the judge asked for."""
    calls: int = 1
    """Completed (billed) calls; attempts answered 429 or 5xx are not billed and not counted."""
    input_tokens: int | None = None
    """Prompt tokens, as the provider reported them (None: it reported none)."""
    output_tokens: int | None = None
    """Completion tokens, as the provider reported them."""
    cost_usd: float | None = None
    """Cost in US dollars: from the judge spec's `price` and the tokens, else the provider's own
    reported cost; None when neither is known (unmeasured, never 0)."""
    cost_source: Literal["price", "provider"] | None = None
    """Where `cost_usd` came from."""


class _ScoreBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="status", omit_defaults=True):
    grader_id: str
    """Id of the grader or judge that produced the score."""
    metric: str
    """Metric name (`tests_pass`, `answer_match`, `judge:<id>`...)."""
    source: ScoreSource = "grader"
    """Grader (execution side) or judge."""
    detail: str | None = None
    """Human-readable explanation."""
    usage: JudgeUsage | None = None
    """Tokens and cost of the model calls behind a judge score (None: no model was called)."""


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
