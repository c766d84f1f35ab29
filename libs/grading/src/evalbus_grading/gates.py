"""CI gates (pure): parse a gate, and decide it from a batch summary or a comparison.

A **threshold** is `<path> <op> <number>`, the number optionally a percentage (`80%` is 0.8):

| path | measures |
|---|---|
| `verdicts.pass_rate`, `.passed`, `.failed`, `.no_verdict`, `.verdicted` | the verdicts |
| `metric.<name>.mean`, `.pass_rate`, `.count`, `.unmeasured` | one metric (`unmeasured`: all reasons) |
| `trials.pass_at_1`, `trials.pass_at_k`, `trials.flaky` | trials (a batch with more than one) |
| `pass@<k>` | the unbiased pass@k estimate |
| `counts.requested`, `.executed`, `.failed`, `.cancelled`… | runs per stage |

A rate or mean may end in `.ci_low` or `.ci_high` to gate its 95 % interval instead
(`metric.answer_match.pass_rate.ci_low > 0.6`). Operators: `>=`, `<=`, `>`, `<`, `==`, `!=`.

A **regression gate** (`no_significant_regression: answer_match, verdicts`, or the mapping
`RegressionGate`) fails when any named metric (or `verdicts`) regressed significantly against
the baseline (its comparison row's `change` is `regressed`).

A gate never passes vacuously: on a metric that was not measured, a rate with nothing to count,
trials a batch did not run, or a regression gate without a baseline or without cases both batches
measured, it fails and says why.
"""

from __future__ import annotations

import math
import operator
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, cast

import msgspec

from evalbus_contracts import BatchSummary, GateSpec, Interval, RegressionGate, StageCounts
from evalbus_grading.compare import Comparison

Op = Literal[">=", "<=", ">", "<", "==", "!="]
Bound = Literal["ci_low", "ci_high"]

OPERATORS: dict[str, Callable[[float, float], bool]] = {
    ">=": operator.ge,
    "<=": operator.le,
    ">": operator.gt,
    "<": operator.lt,
    "==": operator.eq,
    "!=": operator.ne,
}
VERDICT_STATS = ("pass_rate", "passed", "failed", "no_verdict", "verdicted")
METRIC_STATS = ("mean", "pass_rate", "count", "unmeasured")
TRIAL_STATS = ("pass_at_1", "pass_at_k", "flaky")
COUNT_STATS = tuple(StageCounts.__struct_fields__)
INTERVAL_STATS = frozenset({"pass_rate", "mean", "pass_at_1", "pass_at_k", "pass@"})
"""Statistics that carry an interval (`.ci_low`, `.ci_high`)."""
REGRESSION = "no_significant_regression"

_THRESHOLD = re.compile(r"^\s*(?P<path>[^\s<>=!]+)\s*(?P<op>>=|<=|==|!=|>|<)\s*(?P<value>\S+)\s*$")
_REGRESSION = re.compile(rf"^\s*{REGRESSION}\s*(?::(?P<colon>.*)|\((?P<paren>.*)\))\s*$")
_PASS_AT = re.compile(r"^pass@(?P<k>[1-9][0-9]*)$")


class GateError(ValueError):
    """A gate that does not parse."""


@dataclass(frozen=True, slots=True)
class Threshold:
    """`<path> <op> <number>`."""

    text: str
    """The gate as written (whitespace normalised)."""
    source: Literal["verdicts", "metric", "trials", "pass_at", "counts"]
    """Which part of the summary it reads."""
    stat: str
    """The statistic (`pass_rate`, `mean`…; `pass@` for pass@k)."""
    op: Op
    """The comparison."""
    value: float
    """The threshold."""
    metric: str | None = None
    """The metric of a `metric.` path."""
    k: int | None = None
    """k of a `pass@k` path."""
    bound: Bound | None = None
    """Gate the interval's bound instead of the estimate."""


@dataclass(frozen=True, slots=True)
class NoRegression:
    """No named metric may regress significantly against the baseline."""

    text: str
    """The gate as written (normalised)."""
    metrics: tuple[str, ...]
    """Metric names (or `verdicts`)."""
    baseline: str | None = None
    """The batch to compare against (None: the suite's baseline)."""


Gate = Threshold | NoRegression


class GateResult(msgspec.Struct, frozen=True, kw_only=True):
    """One gate, decided."""

    gate: str
    """The gate."""
    passed: bool
    """Whether it holds."""
    measured: float | None = None
    """What it measured (a regression gate: how many metrics regressed); None when nothing was."""
    detail: str = ""
    """Why, in a few words: the measured value against the threshold, or what is missing."""


# ---------------------------------------------------------------- parsing


def _number(raw: str, text: str) -> float:
    percent = raw.endswith("%")
    try:
        value = float(raw[:-1] if percent else raw)
    except ValueError:
        raise GateError(f"{text!r}: {raw!r} is not a number") from None
    if not math.isfinite(value):
        raise GateError(f"{text!r}: the threshold must be a finite number")
    return value / 100 if percent else value


def _split_bound(path: str) -> tuple[str, Bound | None]:
    if path.endswith(".ci_low"):
        return path.removesuffix(".ci_low"), "ci_low"
    if path.endswith(".ci_high"):
        return path.removesuffix(".ci_high"), "ci_high"
    return path, None


def _one_of(stat: str, allowed: Sequence[str], where: str, text: str) -> str:
    if stat not in allowed:
        raise GateError(f"{text!r}: {where} has no {stat!r} (one of {', '.join(allowed)})")
    return stat


def parse_threshold(text: str) -> Threshold:
    """A threshold gate; `GateError` naming what is wrong."""
    found = _THRESHOLD.match(text)
    if found is None:
        raise GateError(
            f"{text!r} is not a gate: expected `<path> <op> <number>` (e.g. `verdicts.pass_rate >= 0.8`) "
            f"or `{REGRESSION}: <metric>, …`"
        )
    raw_path, op, raw_value = found["path"], cast("Op", found["op"]), found["value"]
    normal = f"{raw_path} {op} {raw_value}"
    value = _number(raw_value, normal)
    path, bound = _split_bound(raw_path)
    head, _, rest = path.partition(".")
    gate: Threshold
    if head == "verdicts":
        gate = Threshold(normal, "verdicts", _one_of(rest, VERDICT_STATS, "verdicts", normal), op, value)
    elif head == "metric":
        name, dot, stat = rest.rpartition(".")
        if not dot or not name:
            raise GateError(f"{normal!r}: a metric path is `metric.<name>.<statistic>` (e.g. metric.cost_usd.mean)")
        gate = Threshold(normal, "metric", _one_of(stat, METRIC_STATS, "a metric", normal), op, value, metric=name)
    elif head == "trials":
        gate = Threshold(normal, "trials", _one_of(rest, TRIAL_STATS, "trials", normal), op, value)
    elif head == "counts":
        gate = Threshold(normal, "counts", _one_of(rest, COUNT_STATS, "counts", normal), op, value)
    elif (pass_at := _PASS_AT.match(path)) is not None:
        gate = Threshold(normal, "pass_at", "pass@", op, value, k=int(pass_at["k"]))
    else:
        raise GateError(f"{normal!r}: unknown path {raw_path!r} (verdicts., metric., trials., counts. or pass@<k>)")
    if bound is not None:
        if gate.stat not in INTERVAL_STATS:
            raise GateError(f"{normal!r}: {gate.stat} has no interval (only rates, means and pass@k do)")
        gate = Threshold(gate.text, gate.source, gate.stat, gate.op, gate.value, gate.metric, gate.k, bound)
    return gate


def _regression(metrics: Sequence[str], baseline: str | None, text: str) -> NoRegression:
    names = tuple(m.strip() for m in metrics)
    if not names or any(not m for m in names):
        raise GateError(f"{text!r}: name at least one metric (or `verdicts`), separated by commas")
    normal = f"{REGRESSION}: {', '.join(names)}" + (f" against {baseline}" if baseline else "")
    return NoRegression(normal, names, baseline)


def parse_gate(spec: GateSpec) -> Gate:
    """A gate of a suite (a string, or a `RegressionGate`); `GateError` naming what is wrong."""
    if isinstance(spec, RegressionGate):
        return _regression(spec.no_significant_regression, spec.baseline, REGRESSION)
    found = _REGRESSION.match(spec)
    if found is not None:
        listed = found["colon"] if found["colon"] is not None else found["paren"]
        return _regression(listed.strip().strip("[]").split(","), None, spec.strip())
    return parse_threshold(spec)


def gate_problems(gates: Sequence[GateSpec], at: str) -> list[tuple[str, str]]:
    """`(field, message)` for every gate that does not parse."""
    out = []
    for i, spec in enumerate(gates):
        field = f"{at}[{i}]" + (".no_significant_regression" if isinstance(spec, RegressionGate) else "")
        try:
            parse_gate(spec)
        except GateError as e:
            out.append((field, str(e)))
    return out


# ---------------------------------------------------------------- deciding


def _interval_value(estimate: float | None, ci: Interval | None, bound: Bound | None) -> float | None:
    if bound is None:
        return estimate
    if ci is None:
        return None
    return ci.low if bound == "ci_low" else ci.high


def _measure(gate: Threshold, summary: BatchSummary) -> tuple[float | None, str]:
    """The value a threshold reads, or None and why there is none."""
    if gate.source == "verdicts":
        v = summary.verdicts
        if gate.stat == "pass_rate":
            if v.pass_rate is None:
                return None, "no run has a verdict"
            return _interval_value(v.pass_rate, v.pass_rate_ci, gate.bound), ""
        return float(getattr(v, gate.stat)), ""
    if gate.source == "counts":
        return float(getattr(summary.counts, gate.stat)), ""
    if gate.source == "metric":
        metric = next((m for m in summary.metrics if m.metric == gate.metric), None)
        if metric is None:
            return None, f"metric {gate.metric} was not measured (the batch has no score of it)"
        unmeasured = sum(metric.unmeasured.values())
        if gate.stat == "count":
            return float(metric.count), ""
        if gate.stat == "unmeasured":
            return float(unmeasured), ""
        if metric.count == 0:
            reasons = ", ".join(f"{reason} {n}" for reason, n in sorted(metric.unmeasured.items()))
            return None, f"metric {gate.metric} was not measured ({reasons or 'no scores'})"
        if gate.stat == "mean":
            return _interval_value(metric.mean, metric.mean_ci, gate.bound), ""
        if metric.pass_rate is None:
            return None, f"metric {gate.metric} has no pass/fail scores"
        return _interval_value(metric.pass_rate, metric.pass_rate_ci, gate.bound), ""
    trials = summary.trials
    if trials is None:
        return None, "the batch ran one trial per case (set policy.trials)"
    if gate.source == "pass_at":
        found = next((p for p in trials.pass_at if p.k == gate.k), None)
        if found is None:
            return None, f"pass@{gate.k} was not estimated ({trials.k} trials per case)"
        return _interval_value(found.value, found.ci, gate.bound), ""
    if gate.stat == "flaky":
        return float(trials.flaky), ""
    estimate, ci = (
        (trials.pass_at_1, trials.pass_at_1_ci) if gate.stat == "pass_at_1" else (trials.pass_at_k, trials.pass_at_k_ci)
    )
    if estimate is None:
        return None, "no case has a counted trial"
    return _interval_value(estimate, ci, gate.bound), ""


def decide_threshold(gate: Threshold, summary: BatchSummary) -> GateResult:
    """A threshold against the batch's summary."""
    measured, why = _measure(gate, summary)
    if measured is None:
        return GateResult(gate=gate.text, passed=False, detail=why or "nothing to measure")
    passed = OPERATORS[gate.op](measured, gate.value)
    return GateResult(
        gate=gate.text,
        passed=passed,
        measured=measured,
        detail=f"measured {measured:.4g} (needs {gate.op} {gate.value:g})",
    )


def _signed(value: float | None) -> str:
    return "-" if value is None else f"{value:+.3g}"


def decide_regression(gate: NoRegression, comparison: Comparison | None, why_none: str = "") -> GateResult:
    """A regression gate against the comparison with the baseline (None: there is none, `why_none`)."""
    if comparison is None:
        return GateResult(gate=gate.text, passed=False, detail=why_none or "no baseline to compare against")
    regressed = 0
    missing = 0
    notes = []
    for name in gate.metrics:
        row = comparison.metric(name)
        if row is None:
            missing += 1
            notes.append(f"{name} not measured in either batch")
            continue
        if row.n == 0:
            missing += 1
            notes.append(f"{name} has no case measured in both batches")
            continue
        q = "-" if row.q_value is None else f"{row.q_value:.3g}"
        interval = f"[{_signed(row.ci_low)}, {_signed(row.ci_high)}]"
        if row.change == "regressed":
            regressed += 1
            notes.append(f"{name} regressed: Δ {_signed(row.delta)} {interval}, q {q}")
        else:
            notes.append(f"{name} Δ {_signed(row.delta)} {interval}, q {q}, {row.change}")
    return GateResult(
        gate=gate.text,
        passed=regressed == 0 and missing == 0,
        measured=float(regressed),
        detail=f"against {comparison.base}: " + "; ".join(notes),
    )
