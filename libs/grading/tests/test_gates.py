"""CI gates: every path and operator, intervals, percentages, a gate on what nobody measured (it
fails with the reason, never passes vacuously), regression gates on a comparison, and bad gates
refused with what is wrong."""

from __future__ import annotations

import re

import pytest

from evalbus_contracts import (
    BatchSummary,
    Interval,
    Measured,
    MetricSummary,
    PassAtK,
    RegressionGate,
    StageCounts,
    TrialSummary,
    VerdictSummary,
)
from evalbus_grading.compare import CaseRun, compare
from evalbus_grading.gates import (
    GateError,
    NoRegression,
    Threshold,
    decide_regression,
    decide_threshold,
    gate_problems,
    parse_gate,
)

pytestmark = pytest.mark.unit

SUMMARY = BatchSummary(
    metrics=(
        MetricSummary(
            metric="answer_match",
            count=30,
            mean=0.8,
            pass_rate=0.8,
            mean_ci=Interval(low=0.627, high=0.905, n=30, method="wilson"),
            pass_rate_ci=Interval(low=0.627, high=0.905, n=30, method="wilson"),
        ),
        MetricSummary(
            metric="cost_usd",
            count=30,
            mean=0.04,
            mean_ci=Interval(low=0.03, high=0.05, n=30, method="bootstrap"),
            unmeasured={"missing_evidence": 2},
        ),
        MetricSummary(metric="judge:rubric", count=0, unmeasured={"unsupported": 30}),
    ),
    verdicts=VerdictSummary(
        verdicted=30,
        passed=24,
        failed=6,
        pass_rate=0.8,
        pass_rate_ci=Interval(low=0.627, high=0.905, n=30, method="wilson"),
    ),
    counts=StageCounts(requested=30, executed=30, judged=30, exported=30, failed=1),
)
TRIALS = BatchSummary(
    trials=TrialSummary(
        k=3,
        pass_at_1=0.5,
        pass_at_k=0.75,
        cases=4,
        pass_at_1_ci=Interval(low=0.2, high=0.8, n=4, method="bootstrap"),
        pass_at=(PassAtK(k=2, value=0.66, ci=Interval(low=0.3, high=0.9, n=4, method="bootstrap")),),
        flaky=2,
    )
)


def decide(text: str, summary: BatchSummary = SUMMARY) -> tuple[bool, float | None, str]:
    gate = parse_gate(text)
    assert isinstance(gate, Threshold)
    result = decide_threshold(gate, summary)
    return result.passed, result.measured, result.detail


@pytest.mark.parametrize(
    ("text", "passed"),
    [
        ("verdicts.pass_rate >= 0.8", True),
        ("verdicts.pass_rate > 0.8", False),
        ("verdicts.pass_rate <= 0.8", True),
        ("verdicts.pass_rate < 0.8", False),
        ("verdicts.pass_rate == 0.8", True),
        ("verdicts.pass_rate != 0.8", False),
        ("verdicts.pass_rate>=80%", True),
        ("verdicts.failed <= 5", False),
        ("verdicts.passed == 24", True),
        ("verdicts.pass_rate.ci_low >= 0.6", True),
        ("verdicts.pass_rate.ci_high < 0.9", False),
        ("metric.cost_usd.mean <= 0.05", True),
        ("metric.cost_usd.mean.ci_high <= 0.045", False),
        ("metric.cost_usd.unmeasured == 2", True),
        ("metric.answer_match.pass_rate.ci_low > 0.6", True),
        ("metric.answer_match.count >= 30", True),
        ("counts.failed == 0", False),
        ("counts.exported >= 30", True),
    ],
)
def test_threshold_gates(text: str, passed: bool) -> None:
    assert decide(text)[0] is passed


def test_a_decided_gate_says_what_it_measured() -> None:
    assert decide("metric.cost_usd.mean <= 0.05") == (True, 0.04, "measured 0.04 (needs <= 0.05)")
    assert decide("verdicts.pass_rate.ci_low >= 0.7") == (False, 0.627, "measured 0.627 (needs >= 0.7)")


@pytest.mark.parametrize(
    ("text", "why"),
    [
        ("metric.latency_s.mean <= 1", "metric latency_s was not measured (the batch has no score of it)"),
        ("metric.latency_s.count <= 10", "metric latency_s was not measured (the batch has no score of it)"),
        ("metric.judge:rubric.mean >= 0.5", "metric judge:rubric was not measured (unsupported 30)"),
        ("metric.cost_usd.pass_rate >= 0.5", "metric cost_usd has no pass/fail scores"),
        ("trials.pass_at_k >= 0.5", "the batch ran one trial per case (set policy.trials)"),
        ("pass@2 >= 0.5", "the batch ran one trial per case (set policy.trials)"),
    ],
)
def test_a_gate_on_what_nobody_measured_fails_with_the_reason(text: str, why: str) -> None:
    assert decide(text) == (False, None, why)


def test_no_verdicts_fail_a_pass_rate_gate() -> None:
    assert decide("verdicts.pass_rate >= 0", BatchSummary()) == (False, None, "no run has a verdict")
    assert decide("verdicts.verdicted == 0", BatchSummary())[0] is True


def test_trial_gates() -> None:
    assert decide("trials.pass_at_1 >= 0.5", TRIALS)[:2] == (True, 0.5)
    assert decide("trials.pass_at_1.ci_low >= 0.3", TRIALS)[:2] == (False, 0.2)
    assert decide("trials.pass_at_k.ci_low >= 0", TRIALS) == (False, None, "nothing to measure")
    assert decide("trials.flaky == 0", TRIALS)[:2] == (False, 2.0)
    assert decide("pass@2 >= 0.6", TRIALS)[:2] == (True, 0.66)
    assert decide("pass@2.ci_high > 0.95", TRIALS)[:2] == (False, 0.9)
    assert decide("pass@3 >= 0.5", TRIALS) == (False, None, "pass@3 was not estimated (3 trials per case)")


def test_metric_names_may_hold_colons_and_dots() -> None:
    gate = parse_gate("metric.judge:rubric:accuracy.v2.pass_rate.ci_low >= 0.5")
    assert isinstance(gate, Threshold)
    assert (gate.metric, gate.stat, gate.bound, gate.op, gate.value) == (
        "judge:rubric:accuracy.v2",
        "pass_rate",
        "ci_low",
        ">=",
        0.5,
    )


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("verdicts.pass_rate", "is not a gate"),
        ("verdicts.pass_rate >= high", "'high' is not a number"),
        ("verdicts.pass_rate >= nan", "finite"),
        ("verdicts.rate >= 0.5", "verdicts has no 'rate' (one of pass_rate, passed"),
        ("metric.cost_usd >= 0.5", "a metric path is `metric.<name>.<statistic>`"),
        ("metric.cost_usd.median >= 0.5", "a metric has no 'median' (one of mean, pass_rate, count, unmeasured)"),
        ("metric.mean >= 0.5", "a metric path is `metric.<name>.<statistic>`"),
        ("metric.cost_usd.count.ci_low >= 1", "count has no interval"),
        ("trials.pass_at_2 >= 1", "trials has no 'pass_at_2'"),
        ("counts.nothing >= 1", "counts has no 'nothing'"),
        ("pass@0 >= 1", "unknown path 'pass@0'"),
        ("score >= 1", "unknown path 'score'"),
        ("no_significant_regression:", "name at least one metric"),
        ("no_significant_regression(a, )", "name at least one metric"),
    ],
)
def test_bad_gates_are_refused_with_what_is_wrong(text: str, message: str) -> None:
    with pytest.raises(GateError, match=re.escape(message)):
        parse_gate(text)


def test_gate_problems_name_the_field() -> None:
    gates = ("verdicts.pass_rate >= 0.8", "nope", RegressionGate(no_significant_regression=()))
    problems = gate_problems(gates, "$.gates")
    assert [field for field, _ in problems] == ["$.gates[1]", "$.gates[2].no_significant_regression"]


def test_regression_gates_parse_in_three_spellings() -> None:
    expected = NoRegression("no_significant_regression: answer_match, verdicts", ("answer_match", "verdicts"))
    assert parse_gate("no_significant_regression: answer_match, verdicts") == expected
    assert parse_gate("no_significant_regression: [answer_match, verdicts]") == expected
    assert parse_gate("no_significant_regression(answer_match,verdicts)") == expected
    mapped = parse_gate(RegressionGate(no_significant_regression=("answer_match",), baseline="b1"))
    assert mapped == NoRegression("no_significant_regression: answer_match against b1", ("answer_match",), "b1")


def _runs(batch: str, passes: list[bool]) -> list[CaseRun]:
    return [
        CaseRun(
            run_id=f"evb-{batch}-c{i}",
            case_id=f"c{i}",
            verdict="pass" if ok else "fail",
            scores=(Measured(grader_id="a", metric="answer_match", value=float(ok), passed=ok),),
        )
        for i, ok in enumerate(passes)
    ]


def test_regression_gate_fails_on_a_significant_regression_only() -> None:
    base = _runs("base", [True] * 12)
    worse = compare("base", base, "cand", _runs("cand", [False] * 8 + [True] * 4))
    slightly = compare("base", base, "cand", _runs("cand", [False] + [True] * 11))
    gate = parse_gate("no_significant_regression: answer_match, verdicts")
    assert isinstance(gate, NoRegression)

    failed = decide_regression(gate, worse)
    assert (failed.passed, failed.measured) == (False, 2.0)
    assert failed.detail.startswith("against base: answer_match regressed: Δ -0.667 [")
    assert "verdicts regressed" in failed.detail

    held = decide_regression(gate, slightly)  # one case of twelve: not significant
    assert (held.passed, held.measured) == (True, 0.0)
    assert "answer_match Δ -0.0833" in held.detail
    assert "unchanged" in held.detail


def test_regression_gate_without_a_baseline_or_a_pair_fails() -> None:
    gate = parse_gate("no_significant_regression: answer_match, cost_usd")
    assert isinstance(gate, NoRegression)
    none = decide_regression(gate, None, "suite demo has no baseline")
    assert (none.passed, none.measured, none.detail) == (False, None, "suite demo has no baseline")
    base = _runs("base", [True, True])
    disjoint = compare("base", base, "cand", [CaseRun(run_id="x", case_id="other", verdict="pass")])
    result = decide_regression(gate, disjoint)
    assert result.passed is False
    assert "answer_match has no case measured in both batches" in result.detail
    assert "cost_usd not measured in either batch" in result.detail
