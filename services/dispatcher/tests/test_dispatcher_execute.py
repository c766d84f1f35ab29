"""execute_case end to end on the real local backend with Python harnesses written to tmp."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import pytest

from evalbus_contracts import (
    AnswerMatchGrader,
    CaseExecuted,
    CaseRequested,
    CostGrader,
    Error,
    Infra,
    LatencyGrader,
    LlmCall,
    Log,
    Measured,
    Message,
    PromptSnapshot,
    ScriptScoreGrader,
    Snapshot,
    StepsGrader,
    TestsPassGrader,
    TextMetricGrader,
    ToolCall,
    TraceEvent,
    TraceRef,
    TraceSpec,
    Unmeasured,
    decode_event,
    encode,
)
from evalbus_dispatcher import (
    LiveSink,
    LocalBackend,
    LocalSandbox,
    OnOutput,
    execute_case,
    should_retry,
)
from evalbus_dispatcher.backends.base import Capacity, HarnessRun, OnSpawn, UnitUsage
from evalbus_grading import ExecResult

pytestmark = pytest.mark.integration

SECRET_VALUE = "s3cr3t-VALUE-9f2c7e1d"

Script = Callable[[str], tuple[str, ...]]
MakeRequest = Callable[..., CaseRequested]
LiveRecord = tuple[str, Any]


def listing(path: Path) -> list[Path]:
    """The entries of a directory (sync: a test's check, not I/O on the loop's hot path)."""
    return list(path.iterdir())


def exists(path: Path) -> bool:
    """Whether a path exists."""
    return path.exists()


class RecordingHandle:
    """The real local sandbox, with every call written to a shared log."""

    def __init__(self, inner: LocalSandbox, log: list[str]) -> None:
        self.inner = inner
        self.log = log

    @property
    def unit(self) -> str | None:
        return self.inner.unit

    @property
    def node(self) -> str | None:
        return self.inner.node

    async def run_harness(self, on_output: OnOutput, on_spawn: OnSpawn | None = None) -> HarnessRun:
        self.log.append("run_harness")
        return await self.inner.run_harness(on_output, on_spawn)

    def usage(self) -> UnitUsage | None:
        return self.inner.usage()

    async def exec(self, command: str, timeout_s: float) -> ExecResult:
        self.log.append(f"exec:{command}")
        return await self.inner.exec(command, timeout_s)

    async def snapshot(self, answer: str) -> Snapshot:
        self.log.append("snapshot")
        return await self.inner.snapshot(answer)

    async def release(self) -> None:
        self.log.append("release")
        await self.inner.release()


class RecordingBackend:
    """The real local backend, logging what happens to its sandboxes."""

    def __init__(self, inner: LocalBackend, log: list[str]) -> None:
        self.inner = inner
        self.log = log
        self.handles: list[RecordingHandle] = []

    async def provision(self, job: CaseRequested) -> RecordingHandle:
        self.log.append("provision")
        handle = RecordingHandle(await self.inner.provision(job), self.log)
        self.handles.append(handle)
        return handle

    def capacity(self) -> Capacity:
        return self.inner.capacity()


class RecordingPuller:
    """A trace source stand-in (the platform adapters live in evalbus_traces) that logs its pulls."""

    def __init__(self, log: list[str], events: list[TraceEvent] | Exception) -> None:
        self.log = log
        self.events = events
        self.refs: list[TraceRef] = []

    async def pull(self, ref: TraceRef) -> list[TraceEvent]:
        self.log.append("pull")
        self.refs.append(ref)
        if isinstance(self.events, Exception):
            raise self.events
        return list(self.events)


AGENT = """
import json, os, sys
task = sys.stdin.read()
def event(**e):
    print("EVALBUS_EVENT " + json.dumps(e), flush=True)
print("reading task", file=sys.stderr, flush=True)
event(kind="message", role="user", text=task, t=0.0)
event(kind="tool_call", id="1", name="calc", args={"expr": "6*7"}, t=0.1)
event(kind="tool_result", id="1", output="42", t=0.2)
event(kind="llm_call", model="tiny", cost_usd=0.25, t=0.3)
event(kind="tool_call", id="2", name="write", t=0.4)
print("EVALBUS_EVENT {\\"kind\\": \\"tool_call\\", \\"id\\": \\"3\\", \\"na", flush=True)
open("out.txt", "w").write("42\\n")
print("done, writing answer", file=sys.stderr, flush=True)
print("The answer is 42 (confidence=0.9)")
sys.exit(int(os.environ.get("EXIT_CODE", "0")))
"""

GRADERS = (
    StepsGrader(id="steps", max_steps=5),
    TestsPassGrader(id="tests", command="grep -q 42 out.txt"),
    AnswerMatchGrader(id="answer", mode="contains"),
    ScriptScoreGrader(id="script", command="echo SCORE=0.8"),
    CostGrader(id="cost"),
    LatencyGrader(id="latency"),
    TextMetricGrader(id="confidence", pattern=r"confidence=([\d.]+)", metric="confidence"),
)


def score_map(executed: CaseExecuted) -> dict[str, Any]:
    return {s.grader_id: s for s in executed.result.scores}


def kind_of(event: TraceEvent) -> str:
    return str(type(event).__struct_config__.tag)


def marks(trace: tuple[TraceEvent, ...]) -> list[str | None]:
    return [e.event for e in trace if isinstance(e, Infra)]


async def test_end_to_end_without_platform_trace(
    backend: LocalBackend, script: Script, make_request: MakeRequest, live: LiveSink, live_records: list[LiveRecord]
) -> None:
    log: list[str] = []
    recording = RecordingBackend(backend, log)
    req = make_request(script(AGENT), expected="42", graders=GRADERS)
    executed = await execute_case(req, recording, live=live, on_release=lambda: log.append("on_release"))

    # The sandbox was held for the harness, the snapshot and the compute graders only.
    assert log == [
        "provision",
        "run_harness",
        "snapshot",
        "exec:grep -q 42 out.txt",
        "exec:echo SCORE=0.8",
        "release",
        "on_release",
    ]
    assert not recording.handles[0].inner.workdir.exists()
    assert backend.capacity().used == 0

    assert executed.status == "succeeded"
    assert (executed.batch_id, executed.case_id, executed.run_id, executed.attempt) == (
        req.batch_id, "c1", req.run_id, 1,
    )  # fmt: skip
    assert executed.plan == req.plan
    assert executed.case == req.case
    assert executed.trace_complete is True
    assert executed.deferred_graders == ()
    result = executed.result
    assert result.failure is None
    assert result.exit_code == 0
    assert result.answer == "The answer is 42 (confidence=0.9)"
    assert result.harness == "agent@7"
    assert result.snapshot == PromptSnapshot(output="The answer is 42 (confidence=0.9)")
    assert result.trace_ref is None

    # Scores in grader order, across both phases.
    assert [s.grader_id for s in result.scores] == [g.id for g in GRADERS]
    scores = score_map(executed)
    assert (scores["steps"].value, scores["steps"].passed) == (2.0, True)  # the torn third call is skipped
    assert (scores["tests"].value, scores["tests"].passed) == (1.0, True)
    assert scores["answer"].passed is True
    assert (scores["script"].value, scores["script"].passed) == (0.8, True)
    assert scores["cost"].value == 0.25
    assert scores["latency"].value > 0
    assert scores["confidence"].value == 0.9
    assert all(isinstance(s, Measured) for s in result.scores)

    # The trace: infra marks in order around the harness's events, stderr tail as a log event,
    # the answer as the final assistant message, and the torn line reported.
    trace = result.trace
    assert marks(trace) == ["accepted", "started", "placed", "exited", "released"]
    assert kind_of(trace[0]) == "infra"
    assert trace[1] == next(e for e in trace if isinstance(e, Infra) and e.event == "started")
    released_at = next(i for i, e in enumerate(trace) if isinstance(e, Infra) and e.event == "released")
    assert all(e.t <= trace[released_at].t for e in trace[:released_at])
    assert Message(role="assistant", text="The answer is 42 (confidence=0.9)", t=trace[-2].t) in trace
    logs = [e for e in trace if isinstance(e, Log)]
    assert len(logs) == 1
    assert logs[0].stream == "stderr"
    assert logs[0].text == "reading task\ndone, writing answer"
    assert any(isinstance(e, Error) and "torn" in e.message for e in trace)
    started = next(e for e in trace if isinstance(e, Infra) and e.event == "started")
    first_call = next(e for e in trace if isinstance(e, ToolCall))
    assert first_call.t == pytest.approx(started.t + 0.1)  # printed t is moved onto the run's clock

    # Timings.
    t = result.timings
    assert t.queued_at is not None
    assert t.started_at is not None
    assert t.released_at is not None
    assert t.executed_at is not None
    assert t.queued_at <= t.started_at <= t.released_at <= t.executed_at
    assert 0 < t.harness_seconds <= t.sandbox_seconds

    # Live: marks in order, log without control lines, printed events as trace batches.
    live_marks = [rec[1].event for rec in live_records if rec[0] == "infra"]
    assert live_marks == ["accepted", "started", "placed", "exited", "released"]
    live_text = "".join(rec[1][1] for rec in live_records if rec[0] == "log")
    assert "EVALBUS_EVENT" not in live_text
    assert "reading task" in live_text
    assert "The answer is 42" in live_text
    live_events = [e for rec in live_records if rec[0] == "trace" for e in rec[1]]
    assert [kind_of(e) for e in live_events] == ["message", "tool_call", "tool_result", "llm_call", "tool_call"]
    released_index = next(i for i, rec in enumerate(live_records) if rec[0] == "infra" and rec[1].event == "released")
    assert all(rec[0] == "infra" or i < released_index for i, rec in enumerate(live_records))

    # The event survives the wire.
    assert decode_event(encode(executed)) == executed


async def test_job_mode_pulls_after_release_and_grades_observations_on_the_pulled_trace(
    backend: LocalBackend, script: Script, make_request: MakeRequest, live: LiveSink
) -> None:
    log: list[str] = []
    pulled: list[TraceEvent] = [
        ToolCall(id="a", name="search", t=1.0),
        ToolCall(id="b", name="search", t=2.0),
        ToolCall(id="c", name="open", t=3.0),
        LlmCall(model="m", cost_usd=1.5, t=4.0),
        Message(role="assistant", text="pulled answer", t=5.0),
    ]
    puller = RecordingPuller(log, pulled)
    trace = TraceSpec(kind="otel", endpoint="http://127.0.0.1:4318", collect="job", service="agent")
    graders = (
        TestsPassGrader(id="tests", command="test -f out.txt"),
        StepsGrader(id="steps"),
        CostGrader(id="cost"),
    )
    req = make_request(script("open('out.txt', 'w').write('x'); print('stdout answer')"), graders=graders, trace=trace)

    executed = await execute_case(
        req, RecordingBackend(backend, log), live=live, on_release=lambda: log.append("on_release"), trace_puller=puller
    )

    # The compute grader ran before release, on_release came right after it, the pull after that.
    assert log == ["provision", "run_harness", "snapshot", "exec:test -f out.txt", "release", "on_release", "pull"]
    # ... and the observation graders ran after the pull: they counted the pulled events.
    scores = score_map(executed)
    assert scores["tests"].passed is True
    assert scores["steps"].value == 3.0
    assert scores["cost"].value == 1.5
    assert [s.grader_id for s in executed.result.scores] == ["tests", "steps", "cost"]
    assert executed.status == "succeeded"
    assert executed.trace_complete is True
    ref = executed.result.trace_ref
    assert ref is not None
    assert (ref.kind, ref.endpoint, ref.run_id, ref.service) == ("otel", "http://127.0.0.1:4318", req.run_id, "agent")
    assert puller.refs == [ref]
    assert executed.result.answer == "stdout answer"
    assert not any(isinstance(e, Log) for e in executed.result.trace)  # a platform trace: no stderr log event
    messages = [e for e in executed.result.trace if isinstance(e, Message)]
    assert [(m.role, m.text) for m in messages] == [("assistant", "pulled answer")]
    started = next(e.t for e in executed.result.trace if isinstance(e, Infra) and e.event == "started")
    assert messages[0].t == pytest.approx(5.0 + started)  # on the run's clock, from the harness start


async def test_job_mode_pull_failure_keeps_trace_ref_and_scores(
    backend: LocalBackend, script: Script, make_request: MakeRequest, live: LiveSink
) -> None:
    log: list[str] = []
    puller = RecordingPuller(log, ConnectionRefusedError("platform down"))
    trace = TraceSpec(kind="mlflow", endpoint="http://127.0.0.1:5000", collect="job", experiment="7")
    graders = (StepsGrader(id="steps"), TestsPassGrader(id="tests", command="true"), LatencyGrader(id="lat"))
    req = make_request(script("print('42')"), graders=graders, trace=trace)

    executed = await execute_case(
        req, backend, live=live, on_release=lambda: log.append("on_release"), trace_puller=puller
    )

    assert log == ["on_release", "pull"]
    failure = executed.result.failure
    assert failure is not None
    assert (failure.stage, failure.failure_class, failure.code, failure.retryable) == (
        "collect", "infra", "collect_failed", True,
    )  # fmt: skip
    assert "platform down" in failure.message
    assert executed.status == "failed"
    assert executed.result.trace_ref is not None
    assert executed.result.trace_ref.experiment == "7"
    scores = executed.result.scores
    assert [s.grader_id for s in scores] == ["steps", "tests", "lat"]
    assert isinstance(scores[1], Measured)
    assert scores[1].passed is True
    for placeholder in (scores[0], scores[2]):
        assert isinstance(placeholder, Unmeasured)
        assert placeholder.reason == "missing_evidence"
    # Re-executing would throw the ground truth away: the trace is re-pulled instead.
    assert should_retry(executed, attempt=1, retries=3) is False


async def test_job_mode_without_a_puller_is_a_collect_failure(
    backend: LocalBackend, script: Script, make_request: MakeRequest, live: LiveSink
) -> None:
    trace = TraceSpec(kind="phoenix", endpoint="http://127.0.0.1:6006", project="p")
    req = make_request(script("print('x')"), graders=(StepsGrader(id="s"),), trace=trace)
    executed = await execute_case(req, backend, live=live, on_release=lambda: None)
    assert executed.result.failure is not None
    assert executed.result.failure.stage == "collect"
    assert isinstance(executed.result.scores[0], Unmeasured)


async def test_control_plane_mode_defers_observation_graders(
    backend: LocalBackend, script: Script, make_request: MakeRequest, live: LiveSink
) -> None:
    trace = TraceSpec(kind="langfuse", endpoint="http://127.0.0.1:3000", collect="control-plane", correlate="tag")
    graders = (
        StepsGrader(id="steps"),
        TestsPassGrader(id="tests", command="test -f out.txt"),
        AnswerMatchGrader(id="answer"),
    )
    req = make_request(script("open('out.txt','w').write('1'); print('hello')"), graders=graders, trace=trace)
    released: list[int] = []
    executed = await execute_case(req, backend, live=live, on_release=lambda: released.append(1))

    assert released == [1]
    assert executed.status == "succeeded"
    assert executed.trace_complete is False
    assert executed.deferred_graders == ("steps", "answer")
    assert [s.grader_id for s in executed.result.scores] == ["tests"]
    ref = executed.result.trace_ref
    assert ref is not None
    assert (ref.kind, ref.run_id, ref.correlate) == ("langfuse", req.run_id, "tag")
    assert executed.result.answer == "hello"


async def test_nonzero_exit_is_an_agent_failure_that_is_still_graded(
    backend: LocalBackend, script: Script, make_request: MakeRequest, live: LiveSink
) -> None:
    req = make_request(script(AGENT), env={"EXIT_CODE": "3"}, expected="42", graders=GRADERS)
    executed = await execute_case(req, backend, live=live, on_release=lambda: None)
    failure = executed.result.failure
    assert failure is not None
    assert (failure.stage, failure.failure_class, failure.code) == ("run", "agent", "exit_nonzero")
    assert executed.result.exit_code == 3
    assert failure.log_tail is not None
    assert "done, writing answer" in failure.log_tail
    assert "EVALBUS_EVENT" not in failure.log_tail
    assert failure.placement is not None
    assert [m.event for m in failure.placement.events] == ["accepted", "started", "placed", "exited"]
    exited = failure.placement.events[-1]
    assert exited.message.startswith("exited with 3 after ")
    assert exited.unit == failure.placement.unit == f"pgid:{failure.placement.resources.pid}"  # type: ignore[union-attr]
    sample = failure.placement.resources
    assert sample is not None
    assert (sample.state, sample.exit_code, sample.signal, sample.oom) == ("exited", 3, None, False)
    assert sample.age_s == executed.result.timings.harness_seconds
    scores = score_map(executed)
    assert scores["tests"].passed is True  # tests-pass is still measured
    assert scores["steps"].value == 2.0
    assert executed.status == "failed"
    assert should_retry(executed, attempt=1, retries=1) is False


async def test_timeout_is_an_agent_failure_with_exit_124(
    backend: LocalBackend, script: Script, make_request: MakeRequest, live: LiveSink
) -> None:
    argv = script("import time; open('partial.txt','w').write('p'); print('working', flush=True); time.sleep(300)")
    graders = (TestsPassGrader(id="partial", command="test -f partial.txt"),)
    req = make_request(argv, timeout_s=0.5, graders=graders)
    executed = await execute_case(req, backend, live=live, on_release=lambda: None)
    failure = executed.result.failure
    assert failure is not None
    assert (failure.stage, failure.failure_class, failure.code) == ("run", "agent", "timeout")
    assert executed.result.exit_code == 124
    assert failure.log_tail == "working"
    assert isinstance(executed.result.scores[0], Measured)
    assert executed.result.scores[0].passed is True


async def test_spawn_failure_is_a_config_failure(
    backend: LocalBackend, make_request: MakeRequest, live: LiveSink, sandbox_root: Path
) -> None:
    released: list[int] = []
    req = make_request(("/no/such/agent",), graders=(TestsPassGrader(id="t", command="true"),))
    executed = await execute_case(req, backend, live=live, on_release=lambda: released.append(1))
    failure = executed.result.failure
    assert failure is not None
    assert (failure.stage, failure.failure_class, failure.code) == ("run", "config", "spawn_failed")
    assert executed.result.scores == ()
    assert executed.result.exit_code is None
    assert released == [1]
    assert listing(sandbox_root) == []
    assert should_retry(executed, attempt=1, retries=1) is False


async def test_provision_failures(
    backend: LocalBackend, script: Script, make_request: MakeRequest, live: LiveSink, tmp_path: Path
) -> None:
    released: list[int] = []
    missing = make_request(script("print(1)"), secret_env={"K": "not-there"})
    executed = await execute_case(missing, backend, live=live, on_release=lambda: released.append(1))
    failure = executed.result.failure
    assert failure is not None
    assert (failure.stage, failure.failure_class, failure.code, failure.retryable) == (
        "dispatch", "config", "missing_secret", False,
    )  # fmt: skip
    assert should_retry(executed, attempt=1, retries=1) is False

    not_a_dir = tmp_path / "plain-file"
    not_a_dir.write_text("")
    broken = LocalBackend(root=not_a_dir, environ={})
    executed = await execute_case(
        make_request(script("print(1)")), broken, live=live, on_release=lambda: released.append(1)
    )
    failure = executed.result.failure
    assert failure is not None
    assert (failure.stage, failure.failure_class, failure.retryable) == ("dispatch", "infra", True)
    assert executed.status == "failed"
    assert should_retry(executed, attempt=1, retries=1) is True
    assert should_retry(executed, attempt=2, retries=1) is False
    assert released == [1, 1]  # once per case, even without a sandbox
    assert marks(executed.result.trace) == ["accepted"]


async def test_secrets_never_appear_in_what_is_produced(
    backend: LocalBackend,
    script: Script,
    make_request: MakeRequest,
    live: LiveSink,
    live_records: list[LiveRecord],
) -> None:
    argv = script(
        """
        import json, os, sys
        key = os.environ["API_KEY"]
        print("using key " + key, file=sys.stderr)
        print("EVALBUS_EVENT " + json.dumps({"kind": "tool_call", "id": "1", "name": "auth", "args": {"key": key}}))
        print("EVALBUS_EVENT " + json.dumps({"kind": "message", "role": "assistant", "text": "key is " + key}))
        print("the key was " + key)
        sys.exit(1)
        """
    )
    graders = (TestsPassGrader(id="t", command='echo "$API_KEY"; printenv'),)
    req = make_request(argv, secret_env={"API_KEY": "api-key"}, graders=graders)
    executed = await execute_case(req, backend, live=live, on_release=lambda: None)
    assert executed.result.failure is not None  # exit 1: the log tail is captured too
    wire = encode(executed)
    assert SECRET_VALUE.encode() not in wire
    assert b"[redacted]" in wire
    assert SECRET_VALUE not in json.dumps([repr(rec) for rec in live_records])
    assert "api-key" in req.harness.secret_env.values()  # the name, not the value, is what travels


async def test_live_output_is_batched(
    backend: LocalBackend, script: Script, make_request: MakeRequest, live: LiveSink, live_records: list[LiveRecord]
) -> None:
    argv = script("for i in range(2000): print(f'line {i}')")
    executed = await execute_case(make_request(argv), backend, live=live, on_release=lambda: None)
    assert executed.status == "succeeded"
    chunks = [rec[1][1] for rec in live_records if rec[0] == "log"]
    assert "".join(chunks) == "".join(f"line {i}\n" for i in range(2000))
    assert len(chunks) < 200


async def test_cancellation_still_releases_the_sandbox(
    backend: LocalBackend, script: Script, make_request: MakeRequest, sandbox_root: Path
) -> None:
    argv = script("import time; print('running', flush=True); time.sleep(300)")
    running = asyncio.Event()
    released: list[int] = []

    class Live:
        async def log(self, stream: str, text: str) -> None:
            if "running" in text:
                running.set()

        async def trace(self, events: object) -> None:
            return None

        async def infra(self, marks: Sequence[Infra]) -> None:
            return None

        async def placement(self, sample: object) -> None:
            return None

    task = asyncio.create_task(
        execute_case(make_request(argv), backend, live=Live(), on_release=lambda: released.append(1))
    )
    await asyncio.wait_for(running.wait(), 20)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert released == [1]
    assert listing(sandbox_root) == []
    assert backend.capacity().used == 0


async def test_a_failing_live_sink_never_fails_the_case(
    backend: LocalBackend, script: Script, make_request: MakeRequest
) -> None:
    calls: list[str] = []

    class BrokenLive:
        async def log(self, stream: str, text: str) -> None:
            calls.append("log")
            raise ConnectionError("bus down")

        async def trace(self, events: object) -> None:
            calls.append("trace")
            raise ConnectionError("bus down")

        async def infra(self, marks: Sequence[Infra]) -> None:
            calls.append("infra")
            raise ConnectionError("bus down")

        async def placement(self, sample: object) -> None:
            calls.append("placement")
            raise ConnectionError("bus down")

    argv = script('print(\'EVALBUS_EVENT {"kind": "tool_call", "id": "1", "name": "x"}\'); print(\'ok\')')
    req = make_request(argv, graders=(StepsGrader(id="s"),))
    executed = await execute_case(req, backend, live=BrokenLive(), on_release=lambda: None)
    assert executed.status == "succeeded"
    assert executed.result.answer == "ok"
    assert {"log", "trace", "infra", "placement"} <= set(calls)
    assert isinstance(executed.result.scores[0], Measured)
    assert executed.result.scores[0].value == 1.0
