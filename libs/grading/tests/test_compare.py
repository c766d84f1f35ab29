"""Comparing two batches: cases matched by id with trials pooled, paired tests per metric with
Benjamini–Hochberg q-values, the delta's interval, the direction of a change, and the cases in
their buckets — on disjoint and overlapping cases, with and without trials; identical batches are
never significant."""

from __future__ import annotations

from typing import Literal

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from evalbus_contracts import Measured, Unmeasured
from evalbus_grading.compare import VERDICTS, CaseRun, compare
from evalbus_grading.stats import benjamini_hochberg, mcnemar_exact, wilcoxon_signed_rank

pytestmark = pytest.mark.unit


def case_run(
    case: str,
    passed: bool | None,
    *,
    trial: int | None = None,
    cost: float | None = None,
    batch: str = "b",
    answer: str | None = None,
) -> CaseRun:
    scores: list[Measured | Unmeasured] = []
    if passed is not None:
        scores.append(Measured(grader_id="a", metric="answer_match", value=float(passed), passed=passed))
    else:
        scores.append(Unmeasured(grader_id="a", metric="answer_match", reason="missing_evidence"))
    if cost is not None:
        scores.append(Measured(grader_id="c", metric="cost_usd", value=cost))
    verdict: Literal["pass", "fail"] | None = None if passed is None else ("pass" if passed else "fail")
    return CaseRun(
        run_id=f"evb-{batch}-{case}" + (f"-t{trial}" if trial else ""),
        case_id=case,
        trial=trial,
        answer=answer,
        verdict=verdict,
        scores=tuple(scores),
    )


def test_a_designed_regression_is_significant_and_its_cases_are_listed() -> None:
    cases = [f"c{i:02d}" for i in range(12)]
    base = [case_run(c, True, cost=0.01, batch="base", answer="right") for c in cases]
    candidate = [
        case_run(c, i >= 8, cost=0.01, batch="cand", answer="right" if i >= 8 else "wrong") for i, c in enumerate(cases)
    ]
    result = compare("base", base, "cand", candidate)
    assert [m.metric for m in result.metrics] == [VERDICTS, "answer_match", "cost_usd"]

    verdicts = result.metric(VERDICTS)
    assert verdicts is not None
    assert (verdicts.statistic, verdicts.test, verdicts.n) == ("pass_rate", "mcnemar", 12)
    assert (verdicts.base_only, verdicts.candidate_only) == (8, 0)
    assert verdicts.base == 1.0
    assert verdicts.candidate == pytest.approx(4 / 12)
    assert verdicts.delta == pytest.approx(-8 / 12)
    assert verdicts.ci_low is not None
    assert verdicts.ci_high is not None
    assert verdicts.delta is not None
    assert verdicts.ci_low <= verdicts.delta <= verdicts.ci_high < 0
    assert verdicts.p_value == pytest.approx(mcnemar_exact(8, 0))
    assert verdicts.significant
    assert verdicts.change == "regressed"

    cost = result.metric("cost_usd")
    assert cost is not None
    assert (cost.statistic, cost.direction, cost.test) == ("mean", "lower", "wilcoxon")
    assert (cost.delta, cost.p_value, cost.significant, cost.change) == (0.0, 1.0, False, "unchanged")
    # q-values: BH over the three p-values in row order
    p_values = [m.p_value for m in result.metrics]
    assert [m.q_value for m in result.metrics] == pytest.approx(benjamini_hochberg([p or 0.0 for p in p_values]))

    assert [c.case_id for c in result.cases.regressed] == cases[:8]
    assert [c.case_id for c in result.cases.unchanged] == cases[8:]
    first = result.cases.regressed[0]
    assert first.base is not None
    assert first.candidate is not None
    assert (first.base.pass_rate, first.candidate.pass_rate) == (1.0, 0.0)
    assert first.base.runs[0].answer == "right"
    assert first.candidate.runs[0].answer == "wrong"
    assert first.candidate.runs[0].scores[0] == Measured(grader_id="a", metric="answer_match", value=0.0, passed=False)


def test_cost_going_up_is_a_regression_and_going_down_an_improvement() -> None:
    cases = [f"c{i}" for i in range(10)]
    base = [case_run(c, True, cost=0.01 * (i + 1)) for i, c in enumerate(cases)]
    dearer = [case_run(c, True, cost=0.01 * (i + 1) + 0.005 + i / 1000) for i, c in enumerate(cases)]
    up = compare("b", base, "c", dearer).metric("cost_usd")
    assert up is not None
    assert up.test == "wilcoxon"
    assert up.p_value == pytest.approx(wilcoxon_signed_rank([0.005 + i / 1000 for i in range(10)])[1])
    assert up.p_value == pytest.approx(2 / 1024)
    assert (up.significant, up.change) == (True, "regressed")
    down = compare("c", dearer, "b", base).metric("cost_usd")
    assert down is not None
    assert (down.significant, down.change) == (True, "improved")


def test_disjoint_batches_have_no_pairs_and_nothing_significant() -> None:
    base = [case_run("a", True, cost=0.5), case_run("b", False, cost=0.5)]
    candidate = [case_run("c", False, cost=1.0)]
    result = compare("b", base, "c", candidate)
    for row in result.metrics:
        assert row.n == 0
        assert (row.delta, row.p_value, row.q_value, row.significant) == (None, None, None, False)
    verdicts = result.metric(VERDICTS)
    assert verdicts is not None
    assert (verdicts.base, verdicts.candidate, verdicts.base_cases, verdicts.candidate_cases) == (0.5, 0.0, 2, 1)
    assert [c.case_id for c in result.cases.only_in_base] == ["a", "b"]
    assert [c.case_id for c in result.cases.only_in_candidate] == ["c"]
    assert result.cases.only_in_base[0].candidate is None
    assert result.cases.only_in_candidate[0].base is None


def test_trials_are_pooled_per_case_and_compared_by_the_signed_rank_test() -> None:
    # base: c0..c5 pass 1 of 3 trials; candidate: the same cases pass 3 of 3; c6 only in candidate
    base = [case_run(f"c{i}", t == 1, trial=t) for i in range(6) for t in (1, 2, 3)]
    candidate = [case_run(f"c{i}", True, trial=t) for i in range(7) for t in (1, 2, 3)]
    result = compare("b", base, "c", candidate)
    row = result.metric("answer_match")
    assert row is not None
    assert (row.n, row.test, row.base_cases, row.candidate_cases) == (6, "wilcoxon", 6, 7)
    assert row.base == pytest.approx(1 / 3)
    assert row.candidate == 1.0
    assert row.delta == pytest.approx(2 / 3)
    assert row.p_value == pytest.approx(wilcoxon_signed_rank([2 / 3] * 6)[1])
    assert [c.case_id for c in result.cases.improved] == [f"c{i}" for i in range(6)]
    assert [c.case_id for c in result.cases.only_in_candidate] == ["c6"]
    side = result.cases.improved[0].base
    assert side is not None
    assert [r.trial for r in side.runs] == [1, 2, 3]
    assert side.pass_rate == pytest.approx(1 / 3)


def test_a_case_without_a_verdict_on_one_side_is_its_own_bucket() -> None:
    base = [case_run("a", True), case_run("b", True)]
    candidate = [case_run("a", None), case_run("b", True)]
    result = compare("b", base, "c", candidate)
    assert [c.case_id for c in result.cases.no_verdict] == ["a"]
    assert [c.case_id for c in result.cases.unchanged] == ["b"]
    answer = result.metric("answer_match")
    assert answer is not None
    assert answer.n == 1  # a's unmeasured score is not a pair


_runs = st.lists(
    st.tuples(
        st.integers(0, 15),
        st.one_of(st.none(), st.booleans()),
        st.one_of(st.none(), st.floats(0, 10, allow_nan=False)),
    ),
    max_size=40,
)


@settings(max_examples=60, deadline=None)
@given(_runs)
def test_identical_batches_are_never_significant(plan: list[tuple[int, bool | None, float | None]]) -> None:
    runs = [case_run(f"c{case}", passed, trial=t, cost=cost) for t, (case, passed, cost) in enumerate(plan, 1)]
    result = compare("b", runs, "b2", runs)
    for row in result.metrics:
        assert not row.significant
        assert row.change == "unchanged"
        assert row.p_value in (None, 1.0)
        if row.n:
            assert row.delta == 0.0
    assert not result.cases.regressed
    assert not result.cases.improved
    assert not result.cases.only_in_base
    assert not result.cases.only_in_candidate
