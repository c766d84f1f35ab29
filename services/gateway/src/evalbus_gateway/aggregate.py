"""A batch's aggregate, export status and final status from its runs (pure).

`summarize` follows the everdict scorecard semantics: per metric the count of measured values,
their mean (None when there are none), the pass rate over measured scores that carry pass/fail,
and a tally of non-measurements by reason (`invalid` counts as `contract_violation`). Cancelled
runs and runs without an outcome (not executed yet) are left out of the metrics. Verdicts come from
the authority ladder in `verdict`; with trials, pass@1 is the mean per-case fraction of passing
trials and pass@k the fraction of cases with at least one passing trial, and the unbiased pass@k
estimator is reported for every k up to the trial count. Every mean and rate carries its 95 %
interval (`evalbus_grading.stats`: Wilson for proportions, a seeded bootstrap otherwise), and the
cases that both passed and failed across their trials are listed as flaky.

`judge_usage` adds up the tokens and cost of the model-judge calls behind the runs' judge scores
(each score carries its own `usage`), apart from the agent's own cost metrics; a call of unknown
cost is counted as `unpriced_calls`, never as 0.

`build_finalized` turns all of it into the `batch.finalized` event; the store's
`finalize_batch` reads the runs and calls it.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

from evalbus_contracts import (
    FLAKY_CASES_LISTED,
    BatchError,
    BatchFinalized,
    BatchSummary,
    CaseFailure,
    ExportSummary,
    Interval,
    Invalid,
    JudgeUsageSummary,
    Measured,
    MetricSummary,
    PassAtK,
    Score,
    SinkOutcome,
    StageCounts,
    TrialSummary,
    Unmeasured,
    VerdictSummary,
)
from evalbus_grading.stats import mean_interval, pass_at_k, wilson
from evalbus_grading.verdict import Verdict, decide

ExecutedStatus = Literal["succeeded", "failed", "cancelled"]
JudgedStatus = Literal["judged", "skipped"]
ExportedStatus = Literal["exported", "partial", "failed", "skipped"]
FinalStatus = Literal["succeeded", "failed", "cancelled", "superseded"]
CancelReason = Literal["cancelled", "superseded"]


class RunOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What the aggregate needs to know about one run (from the `runs` read model)."""

    run_id: str
    """Run id."""
    case_id: str
    """Case id (trials of one case share it)."""
    trial: int | None = None
    """Trial number when trials > 1."""
    requested: bool = True
    """`case.requested` was recorded."""
    executed_status: ExecutedStatus | None = None
    """Execution outcome; None before `case.executed`."""
    collected: bool = False
    """`case.collected` was recorded."""
    judged_status: JudgedStatus | None = None
    """Judge stage outcome."""
    exported_status: ExportedStatus | None = None
    """Export stage outcome."""
    failure: CaseFailure | None = None
    """The run's failure, if any."""
    scores: tuple[Score, ...] = ()
    """Scores of the furthest stage recorded (graders, then judges)."""
    judge_error: str | None = None
    """An error that escaped a judge."""
    export_outcomes: tuple[SinkOutcome, ...] = ()
    """Per-sink outcomes of `case.exported`."""
    objective_metrics: frozenset[str] = frozenset()
    """The case's command / script-score metrics (objective rung)."""

    @property
    def cancelled(self) -> bool:
        """The run was cancelled (before or while it ran)."""
        return self.executed_status == "cancelled" or (
            self.failure is not None and self.failure.failure_class == "cancelled"
        )

    @property
    def has_outcome(self) -> bool:
        """Execution produced an outcome (successful or not)."""
        return self.executed_status is not None

    def verdict(self) -> Verdict:
        """This run's verdict by the ladder."""
        if not self.has_outcome:
            return Verdict(reason="no_outcome")
        return decide(
            self.scores, failure=self.failure, cancelled=self.cancelled, objective_metrics=self.objective_metrics
        )


class _MetricAcc:
    __slots__ = ("count", "passed", "unmeasured", "values", "with_pass")

    def __init__(self) -> None:
        self.count = 0
        self.values: list[float] = []
        self.with_pass = 0
        self.passed = 0
        self.unmeasured: dict[str, int] = defaultdict(int)

    def add(self, score: Score) -> None:
        if isinstance(score, Measured):
            self.count += 1
            self.values.append(score.value)
            if score.passed is not None:
                self.with_pass += 1
                self.passed += int(score.passed)
        elif isinstance(score, Unmeasured):
            self.unmeasured[score.reason] += 1
        elif isinstance(score, Invalid):
            self.unmeasured["contract_violation"] += 1

    def summary(self, metric: str) -> MetricSummary:
        return MetricSummary(
            metric=metric,
            count=self.count,
            # fsum is exact, so the mean does not depend on the order cases finished in
            mean=math.fsum(self.values) / self.count if self.count else None,
            pass_rate=self.passed / self.with_pass if self.with_pass else None,
            unmeasured=dict(sorted(self.unmeasured.items())),
            # sorted: the bootstrap then does not depend on the order cases finished in either
            mean_ci=mean_ci(sorted(self.values), metric) if self.count else None,
            pass_rate_ci=proportion_ci(self.passed, self.with_pass) if self.with_pass else None,
        )


def proportion_ci(successes: int, n: int) -> Interval:
    """The Wilson interval of a proportion (n > 0)."""
    low, high = wilson(successes, n)
    return Interval(low=low, high=high, n=n, method="wilson")


def mean_ci(values: Sequence[float], seed: str) -> Interval:
    """The interval of a mean (Wilson for 0/1 values, else bootstrap or normal), seeded by `seed`."""
    low, high, method = mean_interval(values, seed)
    return Interval(low=low, high=high, n=len(values), method=method)


NOT_EXECUTED = "not_executed"
"""The unmeasured reason of every metric for a run whose harness never ran (`CaseFailure.never_ran`):
it is not graded, so it is counted here instead of pulling a mean down with a zero."""


def metric_summaries(runs: Iterable[RunOutcome]) -> tuple[MetricSummary, ...]:
    """Per-metric summaries, sorted by metric, over runs with an outcome that were not cancelled;
    a run whose harness never ran counts as `not_executed` under every metric the others have."""
    accs: dict[str, _MetricAcc] = defaultdict(_MetricAcc)
    never_ran = 0
    for run in runs:
        if not run.has_outcome or run.cancelled:
            continue
        if run.failure is not None and run.failure.never_ran():
            never_ran += 1
            continue
        for score in run.scores:
            accs[score.metric].add(score)
    if never_ran:
        for acc in accs.values():
            acc.unmeasured[NOT_EXECUTED] += never_ran
    return tuple(accs[m].summary(m) for m in sorted(accs))


def verdict_summary(verdicts: Sequence[Verdict]) -> VerdictSummary:
    """Verdict counts (every run counts; a run without a verdict is `no_verdict`)."""
    passed = sum(1 for v in verdicts if v.outcome == "pass")
    failed = sum(1 for v in verdicts if v.outcome == "fail")
    verdicted = passed + failed
    return VerdictSummary(
        verdicted=verdicted,
        passed=passed,
        failed=failed,
        no_verdict=len(verdicts) - verdicted,
        pass_rate=passed / verdicted if verdicted else None,
        pass_rate_ci=proportion_ci(passed, verdicted) if verdicted else None,
    )


def pass_at_ks(trials: int) -> tuple[int, ...]:
    """The k values pass@k is reported for: every k up to 10 trials, else 1, 2, 5, 10, 20, 50,
    100 below the trial count, and the trial count."""
    if trials <= 10:
        return tuple(range(1, trials + 1))
    return tuple(sorted({k for k in (1, 2, 5, 10, 20, 50, 100) if k < trials} | {trials}))


def trial_summary(runs: Sequence[RunOutcome], verdicts: Sequence[Verdict], k: int) -> TrialSummary:
    """pass@1 and pass@k over cases with their intervals, the unbiased pass@k for each k of
    `pass_at_ks`, and the flaky cases (a `pass` and a `fail` verdict among their trials).
    Cancelled trials are left out; a trial without a verdict fails."""
    per_case: dict[str, list[bool]] = defaultdict(list)
    outcomes: dict[str, set[str]] = defaultdict(set)
    for run, verdict in zip(runs, verdicts, strict=True):
        if run.cancelled:
            continue
        per_case[run.case_id].append(verdict.outcome == "pass")
        if verdict.outcome is not None:
            outcomes[run.case_id].add(verdict.outcome)
    flaky = {case for case, seen in outcomes.items() if len(seen) == 2}
    cases = [per_case[case] for case in sorted(per_case) if per_case[case]]
    if not cases:
        return TrialSummary(k=k)
    fractions = [sum(t) / len(t) for t in cases]
    any_pass = sum(1 for t in cases if any(t))
    estimates = []
    for draw in pass_at_ks(k):
        values = [pass_at_k(len(t), sum(t), draw) for t in cases if len(t) >= draw]
        if values:
            estimates.append(PassAtK(k=draw, value=math.fsum(values) / len(values), ci=mean_ci(values, f"pass@{draw}")))
    return TrialSummary(
        k=k,
        pass_at_1=math.fsum(fractions) / len(cases),
        pass_at_k=any_pass / len(cases),
        cases=len(cases),
        pass_at_1_ci=mean_ci(fractions, "pass@1"),
        pass_at_k_ci=proportion_ci(any_pass, len(cases)),
        pass_at=tuple(estimates),
        flaky=len(flaky),
        flaky_cases=tuple(sorted(flaky)[:FLAKY_CASES_LISTED]),
    )


def stage_counts(runs: Iterable[RunOutcome]) -> StageCounts:
    """How many runs reached each stage."""
    requested = executed = collected = judged = exported = failed = cancelled = 0
    for run in runs:
        requested += run.requested
        executed += run.executed_status is not None
        collected += run.collected
        judged += run.judged_status is not None
        exported += run.exported_status is not None
        failed += run.executed_status == "failed"
        cancelled += run.cancelled
    return StageCounts(
        requested=requested,
        executed=executed,
        collected=collected,
        judged=judged,
        exported=exported,
        failed=failed,
        cancelled=cancelled,
    )


def summarize(runs: Sequence[RunOutcome], *, trials: int | None = None) -> BatchSummary:
    """The batch's aggregate. `trials` defaults to the highest trial number seen; pass@k needs > 1."""
    verdicts = [run.verdict() for run in runs]
    k = trials if trials is not None else max((run.trial or 1 for run in runs), default=1)
    return BatchSummary(
        metrics=metric_summaries(runs),
        verdicts=verdict_summary(verdicts),
        trials=trial_summary(runs, verdicts, k) if k > 1 else None,
        counts=stage_counts(runs),
        judge_usage=judge_usage(score for run in runs for score in run.scores),
    )


def judge_usage(scores: Iterable[Score]) -> JudgeUsageSummary | None:
    """Tokens and cost of the model calls behind judge scores (None: no score carries usage)."""
    calls = unpriced = input_tokens = output_tokens = 0
    cost: float | None = None
    for score in scores:
        usage = score.usage
        if usage is None or score.source != "judge":
            continue
        calls += usage.calls
        input_tokens += usage.input_tokens or 0
        output_tokens += usage.output_tokens or 0
        if usage.cost_usd is None:
            unpriced += usage.calls
        else:
            cost = (cost or 0.0) + usage.cost_usd
    if calls == 0:
        return None
    return JudgeUsageSummary(
        calls=calls, input_tokens=input_tokens, output_tokens=output_tokens, cost_usd=cost, unpriced_calls=unpriced
    )


def export_summary(runs: Sequence[RunOutcome], *, has_sinks: bool) -> ExportSummary:
    """The batch's export status from each run's `case.exported`.

    No sink: `skipped`. Otherwise `succeeded` when no run failed at any sink (runs skipped by the
    exporter, such as cancelled ones, do not count against it), `failed` when runs were attempted
    and none reached every sink (the first error becomes the message), else `partial`.
    """
    exported = sum(1 for r in runs if r.exported_status == "exported")
    failed = sum(1 for r in runs if r.exported_status in ("failed", "partial"))
    if not has_sinks:
        return ExportSummary(status="skipped", exported=exported, failed=failed)
    if failed == 0:
        return ExportSummary(status="succeeded", exported=exported, failed=0)
    if exported == 0 and not any(r.exported_status == "partial" for r in runs):
        message = next(
            (o.error for r in runs for o in r.export_outcomes if o.status == "failed" and o.error),
            "every export failed",
        )
        return ExportSummary(status="failed", exported=0, failed=failed, message=message)
    return ExportSummary(status="partial", exported=exported, failed=failed)


def final_status(
    runs: Iterable[RunOutcome], *, cancel_reason: CancelReason | None
) -> tuple[FinalStatus, BatchError | None]:
    """`cancelled`/`superseded` when a `batch.cancelled` was recorded; `failed` when no run's harness
    ran at all (`no_run_executed`, `error.phase = "dispatch"`, with the first run's reason: a
    missing program, a spec error — grading nothing is no success) or an error escaped a judge
    (`error.phase = "judges"`); else `succeeded`."""
    if cancel_reason is not None:
        return cancel_reason, None
    runs = list(runs)
    never = [r.failure for r in runs if r.failure is not None and r.failure.never_ran()]
    if runs and len(never) == len(runs):
        first = never[0]
        message = f"no run executed; {len(runs)} of {len(runs)} failed before their harness ran, e.g. {first.code}: {first.message}"
        return "failed", BatchError(code="no_run_executed", message=message, phase="dispatch")
    first_error = next((r.judge_error for r in runs if r.judge_error), None)
    if first_error is not None:
        return "failed", BatchError(code="judge_error", message=first_error, phase="judges")
    return "succeeded", None


def build_finalized(
    batch_id: str,
    runs: Sequence[RunOutcome],
    *,
    trials: int | None = None,
    has_sinks: bool,
    cancel_reason: CancelReason | None = None,
) -> BatchFinalized:
    """The `batch.finalized` event for a batch whose runs are all exported (or that was stopped)."""
    status, error = final_status(runs, cancel_reason=cancel_reason)
    return BatchFinalized(
        batch_id=batch_id,
        status=status,
        summary=summarize(runs, trials=trials),
        export=export_summary(runs, has_sinks=has_sinks),
        error=error,
    )
