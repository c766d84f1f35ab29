"""Aggregates a finalised batch carries: per-metric summaries, verdict counts, pass@k, export status.

Every mean and rate carries its 95 % interval (`Interval`) with the n it was computed from.
"""

from __future__ import annotations

from typing import Literal

import msgspec


class _Data(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


IntervalMethod = Literal["wilson", "bootstrap", "normal"]
"""How an interval was computed: the Wilson score interval (a proportion), a seeded percentile
bootstrap of the mean, or the normal approximation (large samples)."""


class Interval(_Data, frozen=True, kw_only=True):
    """A 95 % confidence interval."""

    low: float
    """Lower bound."""
    high: float
    """Upper bound."""
    n: int
    """Observations it was computed from."""
    method: IntervalMethod
    """How it was computed."""


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
    mean_ci: Interval | None = None
    """95 % interval of the mean (n = count)."""
    pass_rate_ci: Interval | None = None
    """95 % Wilson interval of the pass rate (n = scores that carry pass/fail)."""


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
    pass_rate_ci: Interval | None = None
    """95 % Wilson interval of the pass rate (n = verdicted)."""


class PassAtK(_Data, frozen=True, kw_only=True):
    """The unbiased pass@k estimate over cases (Chen et al. 2021)."""

    k: int
    """Trials drawn."""
    value: float
    """Mean over cases of 1 − C(n−c, k) / C(n, k) (n trials of the case, c of them passed)."""
    ci: Interval
    """95 % interval (n = cases with at least k counted trials)."""


class TrialSummary(_Data, frozen=True, kw_only=True):
    """pass@1 and pass@k over cases with trials, and the flaky cases."""

    k: int
    """Trials per case."""
    pass_at_1: float | None = None
    """Mean per-case fraction of passing trials."""
    pass_at_k: float | None = None
    """Fraction of cases with at least one passing trial."""
    cases: int = 0
    """Cases with at least one counted trial (cancelled trials are not counted)."""
    pass_at_1_ci: Interval | None = None
    """95 % interval of pass@1 (n = cases)."""
    pass_at_k_ci: Interval | None = None
    """95 % Wilson interval of pass@k (n = cases)."""
    pass_at: tuple[PassAtK, ...] = ()
    """The unbiased pass@k for every k up to 10 trials (beyond: 1, 2, 5, 10, 20, 50, 100 below the
    trial count, and the trial count), each over the cases with at least k counted trials."""
    flaky: int = 0
    """Cases that both passed and failed across their trials."""
    flaky_cases: tuple[str, ...] = ()
    """Their ids, sorted (the first `FLAKY_CASES_LISTED`)."""


FLAKY_CASES_LISTED = 200
"""Flaky case ids a summary lists by name (the count is always whole)."""


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


class JudgeUsageSummary(_Data, frozen=True, kw_only=True):
    """Tokens and cost of the model-judge calls behind a batch's (or a suite's) judge scores, kept
    apart from the agent's own cost metrics."""

    calls: int = 0
    """Billed model-judge calls."""
    input_tokens: int = 0
    """Prompt tokens the providers reported."""
    output_tokens: int = 0
    """Completion tokens the providers reported."""
    cost_usd: float | None = None
    """Dollars of the calls whose cost is known (None: none is)."""
    unpriced_calls: int = 0
    """Calls whose cost is unknown (no price in the spec, none reported): `cost_usd` leaves them out."""


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
    judge_usage: JudgeUsageSummary | None = None
    """Tokens and cost of the model judges (None: no model judge was called)."""


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
