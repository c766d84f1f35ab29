"""Two batches compared case by case (pure): is the candidate better or worse than the base?

Cases are matched by case id; the trials of a case are pooled into one value per case and metric:

- a **pass/fail metric** (one whose measured scores carry pass/fail, in either batch) is the
  fraction of the case's measured scores that passed;
- **verdicts** (the row named `verdicts`) is the fraction of the case's runs with a verdict whose
  verdict is `pass` (a run without a verdict — an infrastructure failure — does not count);
- any **other metric** is the mean of the case's measured values.

Per metric, over the cases both batches measured (`n`): the base and candidate means of those
per-case values, the delta (candidate − base) with the 95 % interval of a paired bootstrap over
the cases (seeded by the metric; normal beyond 500 cases), and a paired test — the exact McNemar
test when every per-case value is 0 or 1 on both sides (one trial per case: pass/fail pairs), else
the Wilcoxon signed-rank test on the per-case differences. The p-values of all metrics get
Benjamini–Hochberg q-values, and a metric is `significant` when its q-value is below `alpha`. Its
`change` is `regressed` or `improved` by its direction: higher is better, except the mean of
`cost_usd`, `latency_s` and `tool_calls`.

Each case is put in one bucket by its verdicts: `regressed` (the candidate's verdict pass rate is
lower than the base's), `improved`, `unchanged`, `no_verdict` (one side has no run with a
verdict), `only_in_base`, `only_in_candidate` — with both sides' runs (answer, verdict, scores).
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

from evalbus_contracts import Measured, Score
from evalbus_grading.stats import (
    IntervalMethod,
    benjamini_hochberg,
    difference_interval,
    is_binary,
    mcnemar_exact,
    wilcoxon_signed_rank,
)
from evalbus_grading.verdict import OBSERVATIONAL_METRICS

VERDICTS = "verdicts"
"""The name of the verdicts row."""
DEFAULT_ALPHA = 0.05
"""The false discovery rate below which a q-value is significant."""
LOWER_IS_BETTER: frozenset[str] = OBSERVATIONAL_METRICS
"""Metrics whose mean should go down (cost, latency, tool calls)."""

Statistic = Literal["pass_rate", "mean"]
Test = Literal["mcnemar", "wilcoxon"]
Direction = Literal["higher", "lower"]
MetricChange = Literal["regressed", "improved", "unchanged"]
CaseChange = Literal["regressed", "improved", "unchanged", "no_verdict", "only_in_base", "only_in_candidate"]


class CaseRun(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One run of a case, as a comparison shows it."""

    run_id: str
    """Run id (its trajectory: `GET /v1/runs/{run_id}/trajectory`)."""
    case_id: str
    """Case id."""
    trial: int | None = None
    """Trial number when the batch ran trials."""
    answer: str | None = None
    """The final answer."""
    verdict: Literal["pass", "fail"] | None = None
    """Verdict by the authority ladder (None: no verdict)."""
    scores: tuple[Score, ...] = ()
    """Its scores."""


class CaseSide(msgspec.Struct, frozen=True, kw_only=True):
    """A case in one of the two batches."""

    pass_rate: float | None
    """Fraction of its runs with a verdict that passed (None: no run has a verdict)."""
    runs: tuple[CaseRun, ...]
    """Its runs, by trial."""


class CaseComparison(msgspec.Struct, frozen=True, kw_only=True):
    """One case in both batches."""

    case_id: str
    """Case id."""
    change: CaseChange
    """Which bucket it is in."""
    base: CaseSide | None
    """In the base batch (None: only in the candidate)."""
    candidate: CaseSide | None
    """In the candidate batch (None: only in the base)."""


class CaseChanges(msgspec.Struct, frozen=True, kw_only=True):
    """The cases by what became of their verdicts, each bucket by case id."""

    regressed: tuple[CaseComparison, ...] = ()
    """The candidate's verdict pass rate is lower."""
    improved: tuple[CaseComparison, ...] = ()
    """The candidate's verdict pass rate is higher."""
    unchanged: tuple[CaseComparison, ...] = ()
    """The same verdict pass rate."""
    no_verdict: tuple[CaseComparison, ...] = ()
    """In both batches, but without a verdict in at least one of them."""
    only_in_base: tuple[CaseComparison, ...] = ()
    """Not in the candidate."""
    only_in_candidate: tuple[CaseComparison, ...] = ()
    """Not in the base."""


class MetricComparison(msgspec.Struct, frozen=True, kw_only=True):
    """One metric (or the verdicts) in both batches."""

    metric: str
    """Metric name, or `verdicts`."""
    statistic: Statistic
    """What is compared: the pass rate, or the mean of the values."""
    direction: Direction
    """Which way is better."""
    n: int
    """Cases both batches measured (the pairs)."""
    base: float | None
    """Base value over the pairs (over the base's own cases when there are none)."""
    candidate: float | None
    """Candidate value over the pairs (over its own cases when there are none)."""
    delta: float | None
    """candidate − base over the pairs (None without pairs)."""
    ci_low: float | None
    """Lower bound of the delta's 95 % interval."""
    ci_high: float | None
    """Upper bound of the delta's 95 % interval."""
    ci_method: IntervalMethod | None
    """How the interval was computed (`bootstrap`, or `normal` beyond 500 pairs)."""
    test: Test | None
    """The paired test: `mcnemar` (0/1 values) or `wilcoxon`."""
    p_value: float | None
    """Two-sided p-value of the paired test."""
    q_value: float | None
    """Benjamini–Hochberg q-value across the compared metrics."""
    significant: bool
    """q-value below the comparison's alpha."""
    change: MetricChange
    """`regressed` or `improved` when significant (by the direction), else `unchanged`."""
    base_cases: int
    """Cases the base measured."""
    candidate_cases: int
    """Cases the candidate measured."""
    base_only: int | None = None
    """McNemar: pairs that passed only in the base."""
    candidate_only: int | None = None
    """McNemar: pairs that passed only in the candidate."""


class Comparison(msgspec.Struct, frozen=True, kw_only=True):
    """A candidate batch against a base batch."""

    base: str
    """Base batch id."""
    candidate: str
    """Candidate batch id."""
    base_suite: str | None = None
    """The base batch's suite."""
    candidate_suite: str | None = None
    """The candidate batch's suite."""
    baseline: bool = False
    """The base is the candidate suite's baseline (no base was named)."""
    alpha: float = DEFAULT_ALPHA
    """False discovery rate of `significant`."""
    metrics: tuple[MetricComparison, ...] = ()
    """`verdicts` first, then every metric by name."""
    cases: CaseChanges = msgspec.field(default_factory=CaseChanges)
    """The cases by what became of their verdicts."""

    def metric(self, name: str) -> MetricComparison | None:
        """The row of a metric (or `verdicts`)."""
        return next((m for m in self.metrics if m.metric == name), None)


# ---------------------------------------------------------------- pooling


def _pass_metrics(runs: Iterable[CaseRun]) -> set[str]:
    return {s.metric for r in runs for s in r.scores if isinstance(s, Measured) and s.passed is not None}


def _per_case(runs: Sequence[CaseRun], pass_metrics: set[str]) -> dict[str, dict[str, float]]:
    """metric → case → pooled value (only cases with something measured)."""
    samples: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    for run in runs:
        if run.verdict is not None:
            samples[VERDICTS][run.case_id].append(1.0 if run.verdict == "pass" else 0.0)
        for score in run.scores:
            if not isinstance(score, Measured):
                continue
            if score.metric in pass_metrics:
                if score.passed is not None:
                    samples[score.metric][run.case_id].append(1.0 if score.passed else 0.0)
            else:
                samples[score.metric][run.case_id].append(score.value)
    return {
        metric: {case: math.fsum(values) / len(values) for case, values in by_case.items()}
        for metric, by_case in samples.items()
    }


def _mean(values: Iterable[float]) -> float | None:
    items = list(values)
    return math.fsum(items) / len(items) if items else None


def _compare_metric(
    metric: str, base: dict[str, float], candidate: dict[str, float], statistic: Statistic
) -> MetricComparison:
    """A metric's row before the q-values are known (q None, not significant)."""
    pairs = sorted(set(base) & set(candidate))
    direction: Direction = "lower" if statistic == "mean" and metric in LOWER_IS_BETTER else "higher"
    row = MetricComparison(
        metric=metric,
        statistic=statistic,
        direction=direction,
        n=len(pairs),
        base=_mean(base.values()),
        candidate=_mean(candidate.values()),
        delta=None,
        ci_low=None,
        ci_high=None,
        ci_method=None,
        test=None,
        p_value=None,
        q_value=None,
        significant=False,
        change="unchanged",
        base_cases=len(base),
        candidate_cases=len(candidate),
    )
    if not pairs:
        return row
    b = [base[c] for c in pairs]
    k = [candidate[c] for c in pairs]
    differences = [y - x for x, y in zip(b, k, strict=True)]
    low, high, method = difference_interval(differences, metric)
    base_mean, candidate_mean = math.fsum(b) / len(b), math.fsum(k) / len(k)
    row = msgspec.structs.replace(
        row,
        base=base_mean,
        candidate=candidate_mean,
        delta=candidate_mean - base_mean,
        ci_low=low,
        ci_high=high,
        ci_method=method,
    )
    if is_binary(b) and is_binary(k):
        base_only = sum(1 for x, y in zip(b, k, strict=True) if x > y)
        candidate_only = sum(1 for x, y in zip(b, k, strict=True) if y > x)
        return msgspec.structs.replace(
            row,
            test="mcnemar",
            p_value=mcnemar_exact(base_only, candidate_only),
            base_only=base_only,
            candidate_only=candidate_only,
        )
    return msgspec.structs.replace(row, test="wilcoxon", p_value=wilcoxon_signed_rank(differences)[1])


def _judged(row: MetricComparison, q_value: float, alpha: float) -> MetricComparison:
    significant = q_value < alpha
    change: MetricChange = "unchanged"
    if significant and row.delta:
        better = row.delta > 0 if row.direction == "higher" else row.delta < 0
        change = "improved" if better else "regressed"
    return msgspec.structs.replace(row, q_value=q_value, significant=significant, change=change)


def compare_metrics(
    base: Sequence[CaseRun], candidate: Sequence[CaseRun], *, alpha: float = DEFAULT_ALPHA
) -> tuple[MetricComparison, ...]:
    """Every metric of either batch (and the verdicts), compared over the cases both measured."""
    pass_metrics = _pass_metrics(base) | _pass_metrics(candidate)
    base_values = _per_case(base, pass_metrics)
    candidate_values = _per_case(candidate, pass_metrics)
    names = sorted((set(base_values) | set(candidate_values)) - {VERDICTS})
    rows = [
        _compare_metric(
            metric,
            base_values.get(metric, {}),
            candidate_values.get(metric, {}),
            "pass_rate" if metric == VERDICTS or metric in pass_metrics else "mean",
        )
        for metric in [VERDICTS, *names]
    ]
    tested = [i for i, row in enumerate(rows) if row.p_value is not None]
    q_values = benjamini_hochberg([p for row in rows if (p := row.p_value) is not None])
    for i, q in zip(tested, q_values, strict=True):
        rows[i] = _judged(rows[i], q, alpha)
    return tuple(rows)


# ---------------------------------------------------------------- cases


def _side(runs: Sequence[CaseRun]) -> CaseSide:
    verdicts = [r.verdict for r in runs if r.verdict is not None]
    rate = sum(1 for v in verdicts if v == "pass") / len(verdicts) if verdicts else None
    ordered = tuple(sorted(runs, key=lambda r: (r.trial or 0, r.run_id)))
    return CaseSide(pass_rate=rate, runs=ordered)


def compare_cases(base: Sequence[CaseRun], candidate: Sequence[CaseRun]) -> CaseChanges:
    """Every case of either batch, in its bucket."""
    base_by: dict[str, list[CaseRun]] = defaultdict(list)
    candidate_by: dict[str, list[CaseRun]] = defaultdict(list)
    for run in base:
        base_by[run.case_id].append(run)
    for run in candidate:
        candidate_by[run.case_id].append(run)
    buckets: dict[CaseChange, list[CaseComparison]] = defaultdict(list)
    for case_id in sorted(set(base_by) | set(candidate_by)):
        b = _side(base_by[case_id]) if case_id in base_by else None
        k = _side(candidate_by[case_id]) if case_id in candidate_by else None
        change: CaseChange
        if k is None:
            change = "only_in_base"
        elif b is None:
            change = "only_in_candidate"
        elif b.pass_rate is None or k.pass_rate is None:
            change = "no_verdict"
        elif k.pass_rate < b.pass_rate:
            change = "regressed"
        elif k.pass_rate > b.pass_rate:
            change = "improved"
        else:
            change = "unchanged"
        buckets[change].append(CaseComparison(case_id=case_id, change=change, base=b, candidate=k))
    return CaseChanges(**{name: tuple(items) for name, items in buckets.items()})


def compare(
    base_id: str,
    base: Sequence[CaseRun],
    candidate_id: str,
    candidate: Sequence[CaseRun],
    *,
    alpha: float = DEFAULT_ALPHA,
) -> Comparison:
    """The comparison of two batches' runs (cancelled runs and runs not executed are the caller's
    to leave out)."""
    return Comparison(
        base=base_id,
        candidate=candidate_id,
        alpha=alpha,
        metrics=compare_metrics(base, candidate, alpha=alpha),
        cases=compare_cases(base, candidate),
    )
