"""Completing a control-plane case: pulled events appended, deferred graders graded in grader order,
ground truth kept, soft degradation and missing secrets visible."""

from __future__ import annotations

import msgspec
import pytest

from evalbus_collector.complete import complete, deferred_graders
from evalbus_contracts import (
    AnswerMatchGrader,
    CaseExecuted,
    CasePlan,
    CaseResult,
    CaseSpec,
    Error,
    LlmCall,
    Measured,
    StepsGrader,
    TestsPassGrader,
    ToolCall,
    TraceRef,
    Unmeasured,
)
from evalbus_traces import CollectOutcome

pytestmark = pytest.mark.unit

GRADERS = (
    TestsPassGrader(id="tests", command="true"),
    StepsGrader(id="steps", max_steps=3),
    AnswerMatchGrader(id="answer"),
)


def executed() -> CaseExecuted:
    result = CaseResult(
        case_id="c1",
        run_id="evb-b-c1",
        harness="h@1",
        answer="42",
        scores=(Measured(grader_id="tests", metric="tests_pass", value=1.0, passed=True),),
        trace_ref=TraceRef(kind="mlflow", endpoint="http://127.0.0.1:1", run_id="evb-b-c1"),
    )
    return CaseExecuted(
        batch_id="b",
        case_id="c1",
        run_id="evb-b-c1",
        status="succeeded",
        result=result,
        plan=CasePlan(),
        case=CaseSpec(id="c1", input="q", expected="42", graders=GRADERS),
        trace_complete=False,
        deferred_graders=("steps", "answer"),
    )


def test_deferred_graders_are_the_ones_left_to_the_collector_in_grader_order() -> None:
    assert [g.id for g in deferred_graders(executed())] == ["steps", "answer"]


def test_pulled_events_are_appended_and_deferred_graders_graded_in_order() -> None:
    pulled = (
        LlmCall(t=0.1, model="m", cost_usd=0.01),
        ToolCall(t=0.2, id="1", name="calc"),
        ToolCall(t=0.3, id="2", name="calc"),
    )
    out = complete(executed(), CollectOutcome(status="ok", events=pulled, attempts=1))
    assert out.result.trace[:3] == pulled  # the dispatcher's trace was empty; pulled events follow it
    assert [s.grader_id for s in out.result.scores] == ["tests", "steps", "answer"]
    steps = out.result.scores[1]
    assert isinstance(steps, Measured)
    assert steps.value == 2.0
    assert steps.passed is True
    answer = out.result.scores[2]
    assert isinstance(answer, Measured)
    assert answer.passed is True
    assert out.case_id == "c1"
    assert out.run_id == "evb-b-c1"


def test_an_empty_pull_keeps_ground_truth_and_names_the_key() -> None:
    error = Error(t=0.0, message="collected 0 traces for evalbus.run_id=evb-b-c1 (3 attempts)")
    out = complete(executed(), CollectOutcome(status="empty", error_event=error, attempts=3))
    assert out.result.scores[0] == executed().result.scores[0]  # the sandbox's verdict stands
    assert error in out.result.trace
    steps = out.result.scores[1]
    assert isinstance(steps, Measured)
    assert steps.value == 0.0


def test_a_dead_endpoint_soft_degrades_with_an_error_event() -> None:
    out = complete(executed(), CollectOutcome(status="unavailable", error="refused"), degraded="trace unavailable")
    assert any(isinstance(e, Error) and e.message == "trace unavailable" for e in out.result.trace)
    assert out.result.scores[0] == executed().result.scores[0]


def test_a_missing_secret_is_a_visible_unmeasured_score() -> None:
    outcome = CollectOutcome(status="missing_secret", missing_secret="tok", error="secret 'tok' is not set")
    out = complete(executed(), outcome)
    reasons = [s.reason for s in out.result.scores if isinstance(s, Unmeasured)]
    assert reasons == ["missing_secret", "missing_secret"]


def test_pulled_events_are_put_on_the_run_clock_from_the_started_mark() -> None:
    from evalbus_contracts import Infra

    base = executed()
    marked = msgspec.structs.replace(
        base, result=msgspec.structs.replace(base.result, trace=(Infra(scope="placement", event="started", t=0.5),))
    )
    out = complete(marked, CollectOutcome(status="ok", events=(ToolCall(t=0.25, id="1", name="calc"),), attempts=1))
    pulled = [e for e in out.result.trace if isinstance(e, ToolCall)]
    assert pulled[0].t == 0.75  # 0.25 s after the first span, which began when the harness started
