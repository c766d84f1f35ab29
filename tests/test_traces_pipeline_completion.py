"""Trace completion without the bus: the collector's `complete` (the final answer made explicit,
a missing secret made visible) and the dispatcher's job-mode pull with a missing trace secret
(the real `PlatformTracePuller` and local backend, a loopback HTTP server that must never be asked).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import msgspec
import pytest
from aiohttp import web

from evalbus_collector.complete import complete, with_final_answer
from evalbus_contracts import (
    AnswerMatchGrader,
    CasePlan,
    CaseRequested,
    CaseResult,
    CaseSpec,
    CommandHarness,
    CostGrader,
    Error,
    Infra,
    LlmCall,
    Measured,
    Message,
    StepsGrader,
    TestsPassGrader,
    ToolCall,
    TraceEvent,
    TraceRef,
    TraceSpec,
    Unmeasured,
)
from evalbus_contracts.events import CaseExecuted
from evalbus_contracts.placement import PlacementSample
from evalbus_dispatcher import LocalBackend, OutputStream, execute_case
from evalbus_dispatcher.trace_puller import PlatformTracePuller
from evalbus_runtime import MissingSecretError, SecretStore
from evalbus_traces import CollectOutcome

GRADERS = (
    TestsPassGrader(id="tests", command="true"),
    StepsGrader(id="steps"),
    CostGrader(id="cost"),
    AnswerMatchGrader(id="answer"),
)


def _executed(trace: tuple[TraceEvent, ...], answer: str | None = "42") -> CaseExecuted:
    ref = TraceRef(kind="mlflow", endpoint="http://127.0.0.1:1", run_id="evb-b-c")
    result = CaseResult(
        case_id="c",
        run_id="evb-b-c",
        harness="h@1",
        answer=answer,
        trace=trace,
        scores=(Measured(grader_id="tests", metric="tests_pass", value=1.0, passed=True),),
        trace_ref=ref,
    )
    return CaseExecuted(
        batch_id="b",
        case_id="c",
        run_id="evb-b-c",
        status="succeeded",
        result=result,
        plan=CasePlan(),
        case=CaseSpec(id="c", input="What is 6*7?", expected="42", graders=GRADERS),
        trace_complete=False,
        deferred_graders=("steps", "cost", "answer"),
    )


MARKS = (
    Infra(scope="placement", event="accepted", t=0.0),
    Infra(scope="placement", event="started", t=0.1),
    Infra(scope="placement", event="released", t=1.5),
)
PULLED = (
    Message(role="user", text="What is 6*7?", t=0.0, span_id="a"),
    LlmCall(model="m", cost_usd=0.5, t=0.1, span_id="b", parent_id="a"),
    ToolCall(id="t1", name="calculator", t=0.2, span_id="c", parent_id="a"),
)


@pytest.mark.unit
def test_a_trace_without_an_assistant_message_gets_the_answer_last() -> None:
    trace = with_final_answer((*MARKS, *PULLED), "42")
    assert trace[:-1] == (*MARKS, *PULLED)
    assert trace[-1] == Message(role="assistant", text="42", t=1.5)


@pytest.mark.unit
@pytest.mark.parametrize("answer", [None, ""])
def test_no_answer_adds_nothing(answer: str | None) -> None:
    assert with_final_answer(PULLED, answer) == PULLED


@pytest.mark.unit
def test_an_assistant_message_already_there_is_the_answer() -> None:
    trace = (*PULLED, Message(role="assistant", text="forty-two", t=0.3))
    assert with_final_answer(trace, "42") == trace


@pytest.mark.unit
def test_collected_case_carries_pulled_events_scores_and_the_answer() -> None:
    outcome = CollectOutcome(status="ok", events=PULLED, attempts=1)
    collected = complete(_executed(MARKS), outcome)
    trace = collected.result.trace
    # pulled spans are put on the run's clock from the `started` mark (t=0.1)
    on_run_clock = tuple(msgspec.structs.replace(e, t=round(e.t + 0.1, 9)) for e in PULLED)
    got = tuple(msgspec.structs.replace(e, t=round(e.t, 9)) for e in trace[: len(MARKS) + len(PULLED)])
    assert got == (*MARKS, *on_run_clock)
    assert trace[-1] == Message(role="assistant", text="42", t=1.5)
    scores = {s.grader_id: s for s in collected.result.scores}
    assert [s.grader_id for s in collected.result.scores] == ["tests", "steps", "cost", "answer"]
    assert isinstance(scores["steps"], Measured)
    assert scores["steps"].value == 1.0
    assert isinstance(scores["cost"], Measured)
    assert scores["cost"].value == 0.5
    assert isinstance(scores["answer"], Measured)
    assert scores["answer"].passed is True


@pytest.mark.unit
def test_a_missing_secret_is_unmeasured_and_the_answer_still_shows() -> None:
    outcome = CollectOutcome(
        status="missing_secret",
        attempts=1,
        error="secret 'tok' is not set",
        missing_secret="tok",
        error_event=Error(message="trace not collected: secret 'tok' is not set"),
    )
    collected = complete(_executed(MARKS), outcome)
    scores = collected.result.scores
    assert [s.grader_id for s in scores] == ["tests", "steps", "cost", "answer"]
    for score in scores[1:]:
        assert isinstance(score, Unmeasured)
        assert score.reason == "missing_secret"
    kinds = [type(e).__name__ for e in collected.result.trace[len(MARKS) :]]
    assert kinds == ["Error", "Message"]


# ---------------------------------------------------------------- job mode, the real puller


class _Quiet:
    async def log(self, stream: OutputStream, text: str) -> None:
        return None

    async def trace(self, events: Sequence[TraceEvent]) -> None:
        return None

    async def infra(self, marks: Sequence[Infra]) -> None:
        return None

    async def placement(self, sample: PlacementSample) -> None:
        return None


@pytest.fixture
async def platform_requests() -> AsyncIterator[tuple[str, list[str]]]:
    """A loopback HTTP server standing for the platform: it answers 404 and records every request."""
    seen: list[str] = []

    async def any_request(request: web.Request) -> web.Response:
        seen.append(f"{request.method} {request.rel_url}")
        return web.Response(status=404)

    app = web.Application()
    app.router.add_route("*", "/{tail:.*}", any_request)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    yield f"http://127.0.0.1:{runner.addresses[0][1]}", seen
    await runner.cleanup()


@pytest.mark.integration
async def test_job_mode_missing_secret_is_unmeasured_not_a_failure(
    platform_requests: tuple[str, list[str]], tmp_path: Path
) -> None:
    endpoint, seen = platform_requests
    secrets = SecretStore(environ={})
    puller = PlatformTracePuller(secrets)
    await puller.start()
    ref = TraceRef(kind="phoenix", endpoint=endpoint, run_id="evb-b-c", project="p", auth_secret="phoenix-key")
    try:
        with pytest.raises(MissingSecretError):
            await puller.pull(ref)
        agent = tmp_path / "agent.py"
        agent.write_text("print('42')\n")
        trace = TraceSpec(kind="phoenix", endpoint=endpoint, project="p", auth_secret="phoenix-key")
        req = CaseRequested(
            batch_id="b",
            case_id="c",
            run_id="evb-b-c",
            case=CaseSpec(id="c", input="What is 6*7?", expected="42", graders=GRADERS),
            harness=CommandHarness(id="h", command=(sys.executable, str(agent)), trace=trace),
            plan=CasePlan(),
        )
        backend = LocalBackend(slots=1, root=tmp_path, secrets=secrets, environ={}, kill_grace_s=0.5, drain_s=0.5)
        executed = await execute_case(req, backend, live=_Quiet(), on_release=lambda: None, trace_puller=puller)
    finally:
        await puller.close()

    assert seen == []  # never an unauthenticated pull
    assert (executed.status, executed.result.failure) == ("succeeded", None)
    scores = {s.grader_id: s for s in executed.result.scores}
    assert isinstance(scores["tests"], Measured)
    assert scores["tests"].passed is True
    for grader_id in ("steps", "cost", "answer"):
        score = scores[grader_id]
        assert isinstance(score, Unmeasured)
        assert score.reason == "missing_secret"
        assert score.detail is not None
        assert "phoenix-key" in score.detail
    errors = [e for e in executed.result.trace if isinstance(e, Error)]
    assert len(errors) == 1
    assert "phoenix-key" in errors[0].message
    assert executed.result.trace_ref == TraceRef(
        kind="phoenix", endpoint=endpoint, run_id="evb-b-c", project="p", auth_secret="phoenix-key"
    )
    assert [m.text for m in executed.result.trace if isinstance(m, Message) and m.role == "assistant"] == ["42"]
