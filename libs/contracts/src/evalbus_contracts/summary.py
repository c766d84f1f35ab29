"""Aggregates a finalised batch carries: per-metric summaries, verdict counts, pass@k, export status."""

from __future__ import annotations

from typing import Literal

import msgspec


class _Data(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


class MetricSummary(_Data, frozen=True, kw_only=True):
    """One metric over the batch's measured scores."""

    metric: str
    """Metric name."""
    count: int
    """Measured values."""
    mean: float | None = None
    """Mean of measured values (absent when count is 0)."""
    pass_rate: float | None = None
    """Passes over scores that carry pass/fail."""
    unmeasured: dict[str, int] = msgspec.field(default_factory=dict)
    """Unmeasured and invalid scores by reason."""


class VerdictSummary(_Data, frozen=True, kw_only=True):
    """Verdicts by the authority ladder."""

    verdicted: int = 0
    """Cases with a verdict."""
    passed: int = 0
    """Cases that passed."""
    failed: int = 0
    """Cases that failed."""
    no_verdict: int = 0
    """Cases without a verdict (infrastructure failure, cancelled, nothing decisive)."""
    pass_rate: float | None = None
    """passed / verdicted."""


class TrialSummary(_Data, frozen=True, kw_only=True):
    """pass@1 and pass@k over cases with trials."""

    k: int
    """Trials per case."""
    pass_at_1: float | None = None
    """Mean per-case fraction of passing trials."""
    pass_at_k: float | None = None
    """Fraction of cases with at least one passing trial."""


class StageCounts(_Data, frozen=True, kw_only=True):
    """How many runs reached each stage."""

    requested: int = 0
    """Runs requested."""
    executed: int = 0
    """Runs executed (including failed and cancelled)."""
    collected: int = 0
    """Runs whose deferred trace was collected."""
    judged: int = 0
    """Runs judged (including skipped)."""
    exported: int = 0
    """Runs exported (including skipped)."""
    failed: int = 0
    """Runs with an execution failure."""
    cancelled: int = 0
    """Runs cancelled before they started."""


class BatchSummary(_Data, frozen=True, kw_only=True):
    """The batch's aggregate."""

    metrics: tuple[MetricSummary, ...] = ()
    """Per metric, sorted by name."""
    verdicts: VerdictSummary = msgspec.field(default_factory=VerdictSummary)
    """Verdict counts."""
    trials: TrialSummary | None = None
    """pass@k when trials > 1."""
    counts: StageCounts = msgspec.field(default_factory=StageCounts)
    """Stage counts."""


class SinkOutcome(_Data, frozen=True, kw_only=True):
    """One case exported to one sink."""

    sink: str
    """Sink name (`jsonl`, `mlflow`...)."""
    status: Literal["ok", "failed", "skipped"]
    """Outcome."""
    external_id: str | None = None
    """Id on the platform."""
    url: str | None = None
    """Link to it."""
    error: str | None = None
    """Error text when failed."""


class ExportSummary(_Data, frozen=True, kw_only=True):
    """The batch's export status."""

    status: Literal["succeeded", "partial", "failed", "skipped"] = "skipped"
    """All cases exported, some, none; or no sink."""
    exported: int = 0
    """Cases exported everywhere."""
    failed: int = 0
    """Cases with at least one failed sink."""
    message: str | None = None
    """First error when everything failed."""
    url: str | None = None
    """Link to the batch on the platform."""


class BatchError(_Data, frozen=True, kw_only=True):
    """Why a batch failed."""

    code: str
    """Machine code."""
    message: str
    """Human text."""
    phase: Literal["dispatch", "judges", "export", "finalize"] | None = None
    """Where it failed."""
