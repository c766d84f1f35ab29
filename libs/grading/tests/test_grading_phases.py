"""The two phases: partition, grading each phase, and score order across phases."""

from __future__ import annotations

import pytest

from evalbus_contracts import (
    AnswerMatchGrader,
    CommandGrader,
    CostGrader,
    GraderSpec,
    LatencyGrader,
    Measured,
    ScriptScoreGrader,
    StepsGrader,
    TestsPassGrader,
    TextMetricGrader,
    ToolCall,
    Unmeasured,
    needs_compute,
)
from evalbus_grading import (
    Evidence,
    Sandbox,
    grade_compute,
    grade_observations,
    in_grader_order,
    metric_of,
    partition,
    unmeasured_scores,
)

pytestmark = pytest.mark.unit

MIXED: tuple[GraderSpec, ...] = (
    StepsGrader(id="steps"),
    TestsPassGrader(id="tests", command="true"),
    AnswerMatchGrader(id="answer"),
    ScriptScoreGrader(id="script", command="echo SCORE=0.9"),
    CostGrader(id="cost"),
    CommandGrader(id="cmd", command="true"),
    LatencyGrader(id="latency"),
    TextMetricGrader(id="text", pattern=r"(\d+)"),
)


def test_partition_follows_needs_compute_and_keeps_order() -> None:
    compute, observation = partition(MIXED)
    assert [g.id for g in compute] == ["tests", "script", "cmd"]
    assert [g.id for g in observation] == ["steps", "answer", "cost", "latency", "text"]
    assert all(needs_compute(g) for g in compute)
    assert not any(needs_compute(g) for g in observation)


def test_metric_names() -> None:
    assert [metric_of(g) for g in MIXED] == [
        "tool_calls", "tests_pass", "answer_match", "score", "cost_usd", "command", "latency_s", "text",
    ]  # fmt: skip


@pytest.mark.integration
async def test_score_order_is_grader_order_across_phases(shell: Sandbox, shell_log: list[str]) -> None:
    compute_scores = await grade_compute(MIXED, shell)
    assert shell_log == ["true", "echo SCORE=0.9", "true"]  # only compute graders ran, in order
    evidence = Evidence(answer="42", trace=(ToolCall(id="1", name="x", t=1.0),), expected="42")
    observation_scores = grade_observations(MIXED, evidence)
    assert [s.grader_id for s in compute_scores] == ["tests", "script", "cmd"]
    assert [s.grader_id for s in observation_scores] == ["steps", "answer", "cost", "latency", "text"]
    # Whichever phase is merged first, the result is in grader order.
    for phases in ((compute_scores, observation_scores), (observation_scores, compute_scores)):
        merged = in_grader_order(MIXED, *phases)
        assert [s.grader_id for s in merged] == [g.id for g in MIXED]


def test_in_grader_order_keeps_unknown_scores_last_and_repeated_ids_in_turn() -> None:
    graders = (StepsGrader(id="a"), StepsGrader(id="b"), StepsGrader(id="a"))
    scores = [
        Measured(grader_id="x", metric="m", value=9),
        Measured(grader_id="a", metric="m", value=1),
        Measured(grader_id="b", metric="m", value=2),
        Measured(grader_id="a", metric="m", value=3),
    ]
    merged = in_grader_order(graders, scores)
    assert [(s.grader_id, s.value) for s in merged if isinstance(s, Measured)] == [
        ("a", 1), ("b", 2), ("a", 3), ("x", 9),
    ]  # fmt: skip


def test_unmeasured_placeholders() -> None:
    _, observation = partition(MIXED)
    scores = unmeasured_scores(observation, "missing_evidence", "no trace", retryable=True)
    assert [(s.grader_id, s.metric) for s in scores] == [(g.id, metric_of(g)) for g in observation]
    assert all(isinstance(s, Unmeasured) and s.reason == "missing_evidence" and s.retryable for s in scores)
