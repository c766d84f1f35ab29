"""Observation-only graders: answer-match, text-metric, steps, cost, latency."""

from __future__ import annotations

import math

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evalbus_contracts import (
    AnswerMatchGrader,
    CostGrader,
    Infra,
    LatencyGrader,
    LlmCall,
    Measured,
    Message,
    StepsGrader,
    TextMetricGrader,
    ToolCall,
    ToolResult,
    Unmeasured,
    decode,
    encode,
)
from evalbus_contracts.scores import Score
from evalbus_grading import Evidence, ObservationGrader, grade_observation, normalize_text

pytestmark = pytest.mark.unit


def ev(answer: str | None, expected: str | None = None, trace: tuple[object, ...] = ()) -> Evidence:
    return Evidence(answer=answer, trace=trace, expected=expected)  # type: ignore[arg-type]


def measured(score: Score) -> Measured:
    assert isinstance(score, Measured), score
    return score


def unmeasured(score: Score) -> Unmeasured:
    assert isinstance(score, Unmeasured), score
    return score


# ---------------------------------------------------------------- answer-match


@pytest.mark.parametrize(
    ("mode", "answer", "expected", "passed"),
    [
        ("exact", "Paris", "Paris", True),
        ("exact", "paris", "Paris", False),
        ("exact", "Paris ", "Paris", False),
        ("contains", "The capital is Paris.", "Paris", True),
        ("contains", "The capital is paris.", "Paris", False),
        ("normalized", "  PARIS!! ", "paris", True),
        ("normalized", "New\n  York,  city", "new york city", True),
        ("normalized", "Straße", "STRASSE", True),
        ("normalized", "Paris, France", "Paris", False),
    ],
)
def test_answer_match_modes(mode: str, answer: str, expected: str, passed: bool) -> None:
    grader = AnswerMatchGrader(id="am", mode=mode)  # type: ignore[arg-type]
    score = measured(grade_observation(grader, ev(answer, expected)))
    assert score.metric == "answer_match"
    assert score.grader_id == "am"
    assert score.passed is passed
    assert score.value == (1.0 if passed else 0.0)


@pytest.mark.parametrize("expected", [None, ""])
@pytest.mark.parametrize("mode", ["exact", "contains", "normalized"])
def test_answer_match_empty_expected_fails(mode: str, expected: str | None) -> None:
    # "" is contained in every answer: without the rule, `contains` would pass anything.
    grader = AnswerMatchGrader(id="am", mode=mode)  # type: ignore[arg-type]
    score = measured(grade_observation(grader, ev("anything", expected)))
    assert score.passed is False
    assert score.value == 0.0


def test_answer_match_expected_of_only_punctuation_fails_normalized() -> None:
    score = measured(grade_observation(AnswerMatchGrader(id="am"), ev("", "?!")))
    assert score.passed is False


def test_answer_match_falls_back_to_last_assistant_message() -> None:
    trace = (
        Message(role="assistant", text="first"),
        Message(role="user", text="again"),
        Message(role="assistant", text="Final answer"),
    )
    score = measured(grade_observation(AnswerMatchGrader(id="am"), ev(None, "final answer", trace)))
    assert score.passed is True


def test_answer_match_without_any_answer_fails() -> None:
    score = measured(grade_observation(AnswerMatchGrader(id="am"), ev(None, "x")))
    assert score.passed is False


def test_normalize_text() -> None:
    assert normalize_text("  Hello,\tWORLD!\n\n  It's   me. ") == "hello world its me"


# ---------------------------------------------------------------- text-metric


def test_text_metric_captures_group_one_without_pass() -> None:
    grader = TextMetricGrader(id="tm", pattern=r"accuracy=([-\d.]+)", metric="accuracy")
    score = measured(grade_observation(grader, ev("run done, accuracy=0.875 (n=8)")))
    assert score.metric == "accuracy"
    assert score.value == 0.875
    assert score.passed is None
    assert b'"pass"' not in encode(score)


def test_text_metric_no_match_is_missing_evidence() -> None:
    grader = TextMetricGrader(id="tm", pattern=r"accuracy=([\d.]+)")
    score = unmeasured(grade_observation(grader, ev("no number here")))
    assert score.reason == "missing_evidence"
    assert score.metric == "text"


@pytest.mark.parametrize("captured", ["1.2.3", "-", "nan", "inf"])
def test_text_metric_non_numeric_or_non_finite_capture_is_missing_evidence(captured: str) -> None:
    grader = TextMetricGrader(id="tm", pattern=r"v=(\S+)")
    score = unmeasured(grade_observation(grader, ev(f"v={captured}")))
    assert score.reason == "missing_evidence"


@pytest.mark.parametrize("pattern", ["(unclosed", r"v=\d+"])
def test_text_metric_bad_pattern_is_grader_error(pattern: str) -> None:
    score = unmeasured(grade_observation(TextMetricGrader(id="tm", pattern=pattern), ev("v=3")))
    assert score.reason == "grader_error"


# ---------------------------------------------------------------- steps


def _calls(n: int) -> tuple[object, ...]:
    out: list[object] = []
    for i in range(n):
        out += [ToolCall(id=str(i), name="search", t=float(i)), ToolResult(id=str(i), output="ok", t=i + 0.5)]
    return tuple(out)


def test_steps_counts_tool_calls_only() -> None:
    score = measured(grade_observation(StepsGrader(id="s"), ev("a", trace=_calls(3))))
    assert (score.metric, score.value, score.passed) == ("tool_calls", 3.0, None)


@pytest.mark.parametrize(("calls", "passed"), [(2, True), (3, True), (4, False)])
def test_steps_budget(calls: int, passed: bool) -> None:
    score = measured(grade_observation(StepsGrader(id="s", max_steps=3), ev("a", trace=_calls(calls))))
    assert score.passed is passed


def test_steps_with_no_calls_is_zero() -> None:
    assert measured(grade_observation(StepsGrader(id="s"), ev("a"))).value == 0.0


# ---------------------------------------------------------------- cost


def test_cost_sums_llm_call_costs() -> None:
    trace = (
        LlmCall(model="m", cost_usd=0.1),
        LlmCall(model="m"),
        ToolCall(id="1", name="x"),
        LlmCall(model="m", cost_usd=0.2),
    )
    score = measured(grade_observation(CostGrader(id="c"), ev("a", trace=trace)))
    assert score.metric == "cost_usd"
    assert math.isclose(score.value, 0.3)
    assert score.passed is None


def test_cost_budget_sets_pass() -> None:
    trace = (LlmCall(model="m", cost_usd=0.5),)
    assert measured(grade_observation(CostGrader(id="c", max_usd=0.4), ev("a", trace=trace))).passed is False
    assert measured(grade_observation(CostGrader(id="c", max_usd=0.5), ev("a", trace=trace))).passed is True


@pytest.mark.parametrize("trace", [(), (LlmCall(model="m"), LlmCall(model="n", input_tokens=3))])
def test_cost_without_any_cost_is_missing_evidence(trace: tuple[object, ...]) -> None:
    score = unmeasured(grade_observation(CostGrader(id="c"), ev("a", trace=trace)))
    assert score.reason == "missing_evidence"
    assert score.metric == "cost_usd"


# ---------------------------------------------------------------- latency


def test_latency_is_last_minus_first_ignoring_infra_marks() -> None:
    trace = (
        Infra(scope="placement", event="accepted", t=0.0),
        Message(role="user", text="q", t=1.5),
        ToolCall(id="1", name="x", t=2.0),
        Message(role="assistant", text="a", t=4.25),
        Infra(scope="placement", event="released", t=9.0),
    )
    score = measured(grade_observation(LatencyGrader(id="l"), ev("a", trace=trace)))
    assert score.metric == "latency_s"
    assert score.value == 2.75
    assert score.passed is None
    budget = measured(grade_observation(LatencyGrader(id="l", max_s=2.0), ev("a", trace=trace)))
    assert budget.passed is False


def test_latency_without_events_is_missing_evidence() -> None:
    trace = (Infra(scope="placement", event="accepted", t=0.0),)
    score = unmeasured(grade_observation(LatencyGrader(id="l"), ev("a", trace=trace)))
    assert score.reason == "missing_evidence"


# ---------------------------------------------------------------- contract


@given(st.text(max_size=200), st.one_of(st.none(), st.text(max_size=50)), st.text(max_size=30))
def test_observation_graders_never_raise_and_scores_round_trip(answer: str, expected: str | None, pat: str) -> None:
    graders: list[ObservationGrader] = [
        AnswerMatchGrader(id="a", mode="normalized"),
        AnswerMatchGrader(id="b", mode="contains"),
        TextMetricGrader(id="c", pattern=pat),
        StepsGrader(id="d", max_steps=1),
        CostGrader(id="e"),
        LatencyGrader(id="f"),
    ]
    for grader in graders:
        score = grade_observation(grader, ev(answer, expected))
        assert score.grader_id == grader.id
        assert decode(encode(score), Score) == score  # type: ignore[arg-type]
