"""The batch aggregate's intervals: every mean and pass rate with its 95 % interval and n, the
unbiased pass@k for each k with its interval, and the flaky cases."""

from __future__ import annotations

import random

import pytest

from evalbus_contracts import FLAKY_CASES_LISTED, Interval, Measured, Score, decode, encode
from evalbus_contracts.summary import BatchSummary
from evalbus_gateway.aggregate import RunOutcome, pass_at_ks, summarize
from evalbus_grading.stats import pass_at_k, wilson

pytestmark = pytest.mark.unit


def m(metric: str, value: float, passed: bool | None = None) -> Measured:
    return Measured(grader_id=metric, metric=metric, value=value, passed=passed)


def run(case: str, *scores: Score, trial: int | None = None, status: str = "succeeded") -> RunOutcome:
    return RunOutcome(
        run_id=f"{case}-{trial}",
        case_id=case,
        trial=trial,
        executed_status=status,  # type: ignore[arg-type]
        judged_status="judged",
        exported_status="exported",
        scores=scores,
    )


def test_means_and_pass_rates_carry_their_interval_and_n() -> None:
    costs = [0.01, 0.03, 0.02, 0.05, 0.04]
    runs = [
        run(f"c{i}", m("tests_pass", float(i < 4), i < 4), m("cost_usd", cost), m("judge:j", 0.5 + i / 10, i % 2 == 0))
        for i, cost in enumerate(costs)
    ]
    summary = summarize(runs)
    by = {s.metric: s for s in summary.metrics}

    tests = by["tests_pass"]
    assert tests.pass_rate_ci == Interval(low=wilson(4, 5)[0], high=wilson(4, 5)[1], n=5, method="wilson")
    assert tests.mean_ci == tests.pass_rate_ci  # a 0/1 mean is a proportion

    cost = by["cost_usd"]
    assert cost.pass_rate_ci is None
    assert cost.mean_ci is not None
    assert cost.mean_ci.method == "bootstrap"
    assert cost.mean_ci.n == 5
    assert cost.mean is not None
    assert min(costs) <= cost.mean_ci.low < cost.mean < cost.mean_ci.high <= max(costs)

    judge = by["judge:j"]  # values are not 0/1, passes are: bootstrap mean, Wilson pass rate
    assert judge.mean_ci is not None
    assert judge.mean_ci.method == "bootstrap"
    assert judge.pass_rate_ci is not None
    assert (judge.pass_rate_ci.n, judge.pass_rate_ci.method) == (5, "wilson")

    verdicts = summary.verdicts
    assert verdicts.pass_rate_ci == Interval(low=wilson(4, 5)[0], high=wilson(4, 5)[1], n=5, method="wilson")

    # Round trip through the contract (what batch.finalized carries).
    assert decode(encode(summary), BatchSummary) == summary


def test_intervals_do_not_depend_on_the_order_runs_finished_in() -> None:
    runs = [run(f"c{i}", m("latency_s", random.Random(i).random() * 3)) for i in range(40)]
    first = summarize(runs)
    shuffled = list(runs)
    random.Random(7).shuffle(shuffled)
    assert summarize(shuffled) == first


def test_unmeasured_metric_has_no_interval() -> None:
    summary = summarize([run("a"), run("b")])
    assert summary.metrics == ()
    assert summary.verdicts.pass_rate_ci is None


def test_pass_at_k_is_the_unbiased_estimator_for_each_k_with_flaky_cases() -> None:
    # a: 2 of 4 pass (flaky), b: 4 of 4, c: 0 of 4, d: 1 of 3 counted (one trial cancelled; flaky)
    plan = {"a": [1, 1, 0, 0], "b": [1, 1, 1, 1], "c": [0, 0, 0, 0], "d": [1, 0, 0]}
    runs = [
        run(case, m("tests_pass", float(p), bool(p)), trial=t)
        for case, passes in plan.items()
        for t, p in enumerate(passes, start=1)
    ]
    runs.append(run("d", trial=4, status="cancelled"))
    summary = summarize(runs)
    trials = summary.trials
    assert trials is not None
    assert (trials.k, trials.cases) == (4, 4)
    assert trials.flaky == 2
    assert trials.flaky_cases == ("a", "d")
    assert [p.k for p in trials.pass_at] == [1, 2, 3, 4]
    by_k = {p.k: p for p in trials.pass_at}
    counts = {case: (len(p), sum(p)) for case, p in plan.items()}
    for k in (1, 2, 3):
        expected = sum(pass_at_k(n, c, k) for n, c in counts.values()) / 4
        assert by_k[k].value == pytest.approx(expected)
        assert by_k[k].ci.n == 4
        assert by_k[k].ci.low <= by_k[k].value <= by_k[k].ci.high
    # k = 4: d has only 3 counted trials and is left out
    assert by_k[4].ci.n == 3
    assert by_k[4].value == pytest.approx(2 / 3)
    assert by_k[1].value == pytest.approx(trials.pass_at_1 or 0.0)
    assert trials.pass_at_k == pytest.approx(3 / 4)  # any passing trial, over every case
    assert trials.pass_at_k_ci == Interval(low=wilson(3, 4)[0], high=wilson(3, 4)[1], n=4, method="wilson")
    assert trials.pass_at_1_ci is not None
    assert trials.pass_at_1_ci.n == 4


def test_a_case_that_never_got_a_verdict_is_not_flaky() -> None:
    runs = [run("a", m("tests_pass", 1.0, True), trial=1), run("a", trial=2), run("b", trial=1), run("b", trial=2)]
    trials = summarize(runs).trials
    assert trials is not None
    assert (trials.flaky, trials.flaky_cases) == (0, ())


def test_flaky_cases_listed_are_capped_but_counted_whole() -> None:
    runs = [
        run(f"case-{i:04d}", m("tests_pass", float(t == 1), t == 1), trial=t)
        for i in range(FLAKY_CASES_LISTED + 5)
        for t in (1, 2)
    ]
    trials = summarize(runs).trials
    assert trials is not None
    assert trials.flaky == FLAKY_CASES_LISTED + 5
    assert len(trials.flaky_cases) == FLAKY_CASES_LISTED
    assert trials.flaky_cases[0] == "case-0000"


def test_pass_at_ks() -> None:
    assert pass_at_ks(1) == (1,)
    assert pass_at_ks(3) == (1, 2, 3)
    assert pass_at_ks(10) == tuple(range(1, 11))
    assert pass_at_ks(16) == (1, 2, 5, 10, 16)
    assert pass_at_ks(100) == (1, 2, 5, 10, 20, 50, 100)
