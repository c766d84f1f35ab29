"""The authority ladder: each rung, what never decides, and when there is no verdict."""

from __future__ import annotations

import pytest

from evalbus_contracts import (
    AnswerMatchGrader,
    CaseFailure,
    CommandGrader,
    CostGrader,
    Invalid,
    Measured,
    Score,
    ScriptScoreGrader,
    TestsPassGrader,
    Unmeasured,
)
from evalbus_grading.verdict import decide, is_judge_metric, objective_metrics_of

pytestmark = pytest.mark.unit


def m(metric: str, passed: bool | None, value: float | None = None) -> Measured:
    return Measured(
        grader_id=metric, metric=metric, value=float(passed or 0) if value is None else value, passed=passed
    )


def u(metric: str) -> Unmeasured:
    return Unmeasured(grader_id=metric, metric=metric, reason="grader_error")


def failure(stage: str, cls: str = "infra") -> CaseFailure:
    return CaseFailure(stage=stage, failure_class=cls, code="x", message="x")  # type: ignore[arg-type]


def test_ground_truth_first_declared_wins_over_everything() -> None:
    scores: list[Score] = [m("answer_match", False), m("tests_pass", True), m("tests_pass", False), m("judge:a", False)]
    v = decide(scores)
    assert (v.outcome, v.rung, v.metrics) == ("pass", "ground_truth", ("tests_pass",))
    assert decide([m("tests_pass", False), m("judge:a", True)]).outcome == "fail"


def test_objective_rung_all_must_pass() -> None:
    assert decide([m("answer_match", True), m("url_matches", True), m("judge:a", False)]).outcome == "pass"
    v = decide([m("answer_match", True), m("dom_contains", False), m("judge:a", True)])
    assert (v.outcome, v.rung, v.metrics) == ("fail", "objective", ("answer_match", "dom_contains"))


def test_command_and_script_score_metrics_are_objective_when_mapped() -> None:
    graders = (
        CommandGrader(id="lint", command="ruff", metric="lint_ok"),
        ScriptScoreGrader(id="s", command="x"),
        AnswerMatchGrader(id="a"),
        TestsPassGrader(id="t", command="pytest"),
        CostGrader(id="c"),
    )
    objective = objective_metrics_of(graders)
    assert objective == frozenset({"lint_ok", "score"})
    scores = [m("lint_ok", False), m("judge:a", True)]
    assert decide(scores, objective_metrics=objective).rung == "objective"
    assert decide(scores).rung == "judge"  # without the mapping the judge decides


def test_judge_rung_and_deeper_judge_metrics_never_decide() -> None:
    v = decide([m("judge:a", True), m("judge:b", True), m("judge:a:clarity", False)])
    assert (v.outcome, v.rung, v.metrics) == ("pass", "judge", ("judge:a", "judge:b"))
    assert decide([m("judge", False)]).outcome == "fail"
    only_deep = decide([m("judge:a:clarity", False), m("judge:a:milestone:m1", False)])
    assert only_deep.outcome is None
    assert only_deep.reason == "nothing_decisive"
    assert is_judge_metric("judge:x")
    assert not is_judge_metric("judge:x:y")
    assert not is_judge_metric("judgement")


def test_fallback_rung_any_other_pass_metric() -> None:
    v = decide([m("custom", True), m("other", False), m("text", None, 3.0)])
    assert (v.outcome, v.rung, v.metrics) == ("fail", "fallback", ("custom", "other"))
    assert decide([m("custom", True)]).outcome == "pass"


def test_cost_latency_steps_never_decide() -> None:
    v = decide([m("cost_usd", False, 9.0), m("latency_s", False, 99.0), m("tool_calls", False, 50)])
    assert v.outcome is None
    assert v.reason == "nothing_decisive"
    assert decide([m("cost_usd", False), m("custom", True)]).outcome == "pass"


def test_only_measured_scores_with_pass_count() -> None:
    scores: list[Score] = [
        u("tests_pass"),
        Invalid(grader_id="x", metric="tests_pass"),
        m("tests_pass", None, 1.0),
        m("judge:a", True),
    ]
    assert decide(scores).rung == "judge"
    assert decide([u("judge:a")]).outcome is None


@pytest.mark.parametrize("stage", ["dispatch", "install", "run"])
def test_infrastructure_failure_has_no_verdict(stage: str) -> None:
    v = decide([m("tests_pass", True)], failure=failure(stage))
    assert v.outcome is None
    assert v.reason == f"failure:{stage}"


def test_cancelled_has_no_verdict() -> None:
    assert decide([m("tests_pass", True)], cancelled=True).reason == "cancelled"
    assert decide([m("tests_pass", True)], failure=failure("grade", "cancelled")).reason == "cancelled"


def test_collect_failure_keeps_the_compute_bound_verdict() -> None:
    scores: list[Score] = [
        m("tests_pass", False),
        Unmeasured(grader_id="a", metric="answer_match", reason="missing_evidence", retryable=True),
    ]
    v = decide(scores, failure=failure("collect"))
    assert (v.outcome, v.rung) == ("fail", "ground_truth")
    assert decide([m("tests_pass", True)], failure=failure("grade", "harness")).outcome == "pass"
