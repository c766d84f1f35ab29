"""The live reads of a run against a real nats-server and PostgreSQL, with the LIVE messages
published as the dispatcher publishes them: the log tail (64 KiB, found by offset), the live trace,
their event streams (tail first, heartbeats, `end` once `case.executed` is on the stream, exact
resume with `Last-Event-ID` — on another replica too), the `live_trace` deep link while a run is
running, and the same audience rule as every run read."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any, Literal

import aiohttp
import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.testing.pipeline import eventually
from evalbus_api.client import SseEvent, SseParser
from evalbus_api.live import LiveTraceView, LogChunk, LogTail, RunStreamEnd
from evalbus_api.models import ErrorBody
from evalbus_api.views import RunView
from evalbus_contracts import (
    BatchSpec,
    CommandHarness,
    Error,
    EventBase,
    Infra,
    InfraMark,
    LiveLog,
    LiveTrace,
    SuiteSpec,
    ToolCall,
    TraceEvent,
    TraceSpec,
    batch_run_id,
    decode,
)
from evalbus_gateway.store.projection import ONLINE_BATCH_PREFIX
from evalbus_gateway.testing import BatchScript, RunningGateway, batch_spec, member, running_gateway
from evalbus_runtime import Publisher

pytestmark = pytest.mark.integration

ALICE, BOB = "tok-alice", "tok-bob"
HEARTBEAT_S = 0.2
TAIL = 64 * 1024


@pytest.fixture
async def gateways(gw_nats: str, database_url: str) -> AsyncIterator[tuple[RunningGateway, RunningGateway]]:
    """Two gateway replicas on the same bus and database."""
    tokens = {ALICE: member("alice"), BOB: member("bob")}
    async with (
        running_gateway(gw_nats, database_url, tokens=tokens, sse_heartbeat_s=HEARTBEAT_S) as one,
        running_gateway(gw_nats, database_url, tokens=tokens, sse_heartbeat_s=HEARTBEAT_S) as two,
    ):
        yield one, two


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def auth(token: str = ALICE) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


class ScriptedRun:
    """A run's events as the dispatcher (LIVE) and the CASES stages would publish them."""

    def __init__(self, pub: Publisher, script: BatchScript, case_id: str = "c1", *, trial: int | None = None) -> None:
        self.pub = pub
        self.script = script
        self.case_id = case_id
        self.trial = trial
        self.run_id = batch_run_id(script.batch_id, case_id, trial)
        self.offset = 0
        self.seqs: dict[str, int] = {"stdout": 0, "stderr": 0, "trace": 0, "infra": 0}
        self.execution = uuid.uuid4().hex[:16]
        self.text = ""
        """Every log chunk published, in order."""
        self.log_seqs: list[int] = []
        """Their LIVE stream sequences."""

    def _ids(self) -> dict[str, Any]:
        return {
            "batch_id": self.script.batch_id,
            "case_id": self.case_id,
            "run_id": self.run_id,
            "execution": self.execution,
        }

    async def publish(self, event: EventBase) -> int:
        return (await self.pub.publish_event(event)).seq

    async def requested(self) -> int:
        req = self.script.case_requested(self.case_id)
        return await self.publish(msgspec.structs.replace(req, run_id=self.run_id, trial=self.trial))

    async def executed(self, status: Literal["succeeded", "failed", "cancelled"] = "succeeded") -> int:
        ex = self.script.executed(self.case_id, status=status)
        result = msgspec.structs.replace(ex.result, run_id=self.run_id, trial=self.trial)
        return await self.publish(msgspec.structs.replace(ex, run_id=self.run_id, result=result))

    async def mark(self, event: str, message: str = "") -> int:
        self.seqs["infra"] += 1
        mark = Infra(scope="placement", event=event, message=message)
        return await self.publish(InfraMark(mark=mark, seq=self.seqs["infra"], **self._ids()))

    async def log(self, text: str, stream: Literal["stdout", "stderr"] = "stdout") -> int:
        self.seqs[stream] += 1
        chunk = LiveLog(seq=self.seqs[stream], stream=stream, text=text, offset=self.offset, **self._ids())
        self.offset += len(text.encode("utf-8"))
        self.text += text
        seq = await self.publish(chunk)
        self.log_seqs.append(seq)
        return seq

    async def event(self, event: TraceEvent) -> int:
        self.seqs["trace"] += 1
        return await self.publish(LiveTrace(seq=self.seqs["trace"], events=(event,), **self._ids()))


def new_script(spec: BatchSpec | None = None, cases: tuple[str, ...] = ("c1",)) -> BatchScript:
    return BatchScript("b" + uuid.uuid4().hex[:12], spec or batch_spec(cases), submitted_by="alice")


async def started_run(pub: Publisher, script: BatchScript | None = None, case_id: str = "c1") -> ScriptedRun:
    """A run of alice's that a dispatcher accepted and started."""
    script = script or new_script()
    await pub.publish_event(script.requested())
    run = ScriptedRun(pub, script, case_id)
    await run.requested()
    await run.mark("accepted", "accepted by a dispatcher")
    await run.mark("started", "harness starting")
    return run


async def get(http: aiohttp.ClientSession, gw: RunningGateway, path: str, token: str = ALICE) -> tuple[int, bytes]:
    async with http.get(f"{gw.base_url}{path}", headers=auth(token)) as resp:
        return resp.status, await resp.read()


async def logs(http: aiohttp.ClientSession, gw: RunningGateway, run_id: str) -> LogTail:
    status, body = await get(http, gw, f"/v1/runs/{run_id}/logs")
    assert status == 200, body
    return decode(body, LogTail)


async def live_trace(http: aiohttp.ClientSession, gw: RunningGateway, run_id: str) -> LiveTraceView:
    status, body = await get(http, gw, f"/v1/runs/{run_id}/trajectory/live")
    assert status == 200, body
    return decode(body, LiveTraceView)


def utf8_tail(text: str, limit: int) -> str:
    data = text.encode("utf-8")
    return data[-limit:].decode("utf-8", errors="ignore") if len(data) > limit else text


class Sse:
    """An open event stream, read frame by frame with deadlines (raw bytes kept for comments)."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.parser = SseParser()
        self.raw = b""
        self.ready: list[SseEvent] = []

    @classmethod
    async def open(
        cls, http: aiohttp.ClientSession, gw: RunningGateway, path: str, last_event_id: int | None = None
    ) -> Sse:
        headers = auth()
        if last_event_id is not None:
            headers["Last-Event-ID"] = str(last_event_id)
        resp = await http.get(f"{gw.base_url}{path}", headers=headers)
        assert resp.status == 200, await resp.text()
        assert resp.headers["Content-Type"].startswith("text/event-stream")
        return cls(resp)

    async def _more(self, timeout_s: float) -> bool:
        chunk = await asyncio.wait_for(self.resp.content.readany(), timeout_s)
        if not chunk:
            return False
        self.raw += chunk
        self.ready.extend(self.parser.feed(chunk))
        return True

    async def next(self, timeout_s: float = 10.0) -> SseEvent:
        deadline = time.monotonic() + timeout_s
        while not self.ready:
            if not await self._more(max(0.01, deadline - time.monotonic())):
                raise AssertionError("stream closed")
        return self.ready.pop(0)

    async def take(self, n: int) -> list[SseEvent]:
        return [await self.next() for _ in range(n)]

    async def heartbeat(self, timeout_s: float = 10.0) -> None:
        seen = self.raw.count(b": heartbeat")
        deadline = time.monotonic() + timeout_s
        while self.raw.count(b": heartbeat") == seen:
            if not await self._more(max(0.01, deadline - time.monotonic())):
                raise AssertionError("stream closed")

    async def until_end(self, timeout_s: float = 20.0) -> list[SseEvent]:
        out: list[SseEvent] = []
        while True:
            event = await self.next(timeout_s)
            out.append(event)
            if event.event == "end":
                return out

    async def closed(self, timeout_s: float = 5.0) -> bool:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not await self._more(max(0.01, deadline - time.monotonic())):
                return True
        return False

    def close(self) -> None:
        self.resp.close()


def log_text(frames: list[SseEvent]) -> str:
    return "".join(decode(f.data, LogChunk).text for f in frames if f.event == "log")


async def view_of(http: aiohttp.ClientSession, gw: RunningGateway, run_id: str) -> RunView:
    """`GET /v1/runs/{run_id}` once the recorder wrote the run (a moment after its request)."""
    deadline = time.monotonic() + 20
    while True:
        status, body = await get(http, gw, f"/v1/runs/{run_id}")
        if status == 200:
            return decode(body, RunView)
        assert time.monotonic() < deadline, f"run {run_id} was never recorded"
        await asyncio.sleep(0.02)


# ---------------------------------------------------------------- snapshots


async def test_the_log_tail_is_the_last_64_kib_and_every_replica_answers_the_same(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher], http: aiohttp.ClientSession
) -> None:
    one, two = gateways
    _, pub = bus
    run = await started_run(pub)
    other = await started_run(pub)  # another run's chunks interleave on the stream
    for i in range(90):
        await run.log(f"{i:03d} héllo wörld 日本 " + "x" * 1000 + "\n", "stderr" if i % 7 == 0 else "stdout")
        await other.log(f"other {i}\n")
    tail = await logs(http, one, run.run_id)
    assert tail.status == "running"
    assert tail.found
    assert tail.truncated
    assert tail.text == utf8_tail(run.text, TAIL)
    assert len(tail.text.encode()) <= TAIL
    assert "other" not in tail.text
    assert tail.last_event_id == run.log_seqs[-1]
    assert await get(http, two, f"/v1/runs/{run.run_id}/logs") == (200, msgspec.json.encode(tail))

    short = await started_run(pub)
    await short.log("just this\n")
    small = await logs(http, two, short.run_id)
    assert (small.text, small.truncated, small.found) == ("just this\n", False, True)

    silent = await logs(http, one, (await started_run(pub)).run_id)
    assert (silent.found, silent.text, silent.status, silent.last_event_id) == (False, "", "running", None)


async def test_the_live_trace_is_marks_then_events_in_order_on_every_replica(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher], http: aiohttp.ClientSession
) -> None:
    one, two = gateways
    _, pub = bus
    script = new_script()
    await pub.publish_event(script.requested())
    run = ScriptedRun(pub, script)
    await run.requested()
    await view_of(http, one, run.run_id)  # queued: known once recorded (no dispatcher has marked it)
    before = await live_trace(http, one, run.run_id)
    assert (before.status, before.found, before.events) == ("queued", False, ())

    await run.mark("accepted", "accepted by a dispatcher")
    await run.mark("waiting", "attempt 2 waits 1s after a retryable failure")
    await run.mark("started", "harness starting")
    await run.event(ToolCall(id="1", name="search", t=0.1))
    await run.log("not a trace event\n")
    note = Error(message="1 trace event(s) over 4096 bytes left out of the live trace (1 so far)", t=0.2)
    last = await run.event(note)

    view = await live_trace(http, one, run.run_id)
    assert view.status == "running"
    assert [e.event if isinstance(e, Infra) else type(e).__name__ for e in view.events] == [
        "accepted",
        "waiting",
        "started",
        "ToolCall",
        "Error",
    ]
    assert view.last_event_id == last
    assert await get(http, two, f"/v1/runs/{run.run_id}/trajectory/live") == (200, msgspec.json.encode(view))

    await run.executed("failed")
    settled = await live_trace(http, two, run.run_id)
    assert settled.status == "failed"
    assert settled.events == view.events


async def test_a_trial_s_status_is_its_own_not_its_sibling_s(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher], http: aiohttp.ClientSession
) -> None:
    one, _ = gateways
    _, pub = bus
    script = new_script()
    await pub.publish_event(script.requested())
    first, second = ScriptedRun(pub, script, trial=1), ScriptedRun(pub, script, trial=2)
    for trial in (first, second):
        await trial.requested()
        await trial.mark("accepted")
    await first.executed("succeeded")  # the last case.executed of the case is trial 1's
    assert (await logs(http, one, second.run_id)).status == "running"
    assert (await logs(http, one, first.run_id)).status == "succeeded"
    await second.executed("failed")
    assert (await logs(http, one, second.run_id)).status == "failed"


# ---------------------------------------------------------------- access


async def test_live_reads_follow_the_run_audience_rule(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher], http: aiohttp.ClientSession
) -> None:
    one, _ = gateways
    _, pub = bus
    run = await started_run(pub)
    await run.log("secret sauce\n")
    paths = [
        f"/v1/runs/{run.run_id}/logs",
        f"/v1/runs/{run.run_id}/logs/stream",
        f"/v1/runs/{run.run_id}/trajectory/live",
        f"/v1/runs/{run.run_id}/trajectory/live/stream",
    ]
    for path in paths:
        async with http.get(f"{one.base_url}{path}") as resp:
            assert resp.status == 401, path
        for token, who in ((BOB, "another member"), (ALICE, "nobody")):
            target = path if who == "another member" else path.replace(run.run_id, "evb-nope-c1")
            status, body = await get(http, one, target, token)
            assert status == 404, (path, who)
            error = decode(body, ErrorBody).error
            assert (error.code, error.field) == ("not_found", "run_id"), body
            assert b"secret" not in body
    assert (await logs(http, one, run.run_id)).text == "secret sauce\n"
    assert (await get(http, one, f"/v1/runs/{run.run_id}/logs", one.admin_token))[0] == 200
    stream = await Sse.open(http, one, f"/v1/runs/{run.run_id}/logs/stream")
    assert log_text(await stream.take(1)) == "secret sauce\n"
    stream.close()


async def test_a_run_the_recorder_has_not_written_is_known_by_its_live_marks(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher], http: aiohttp.ClientSession
) -> None:
    one, _ = gateways
    _, pub = bus
    script = new_script()
    await pub.publish_event(script.requested())
    run = ScriptedRun(pub, script)  # no case.requested at all: only its LIVE messages name it
    await run.mark("accepted")
    await run.log("early\n")
    assert (await logs(http, one, run.run_id)).text == "early\n"
    assert (await get(http, one, f"/v1/runs/{run.run_id}/logs", BOB))[0] == 404
    assert (await get(http, one, f"/v1/runs/{run.run_id}"))[0] == 404  # the run read itself needs the record


# ---------------------------------------------------------------- event streams


async def test_the_log_stream_sends_the_tail_then_chunks_heartbeats_and_end(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher], http: aiohttp.ClientSession
) -> None:
    one, _ = gateways
    _, pub = bus
    run = await started_run(pub)
    for i in range(80):
        await run.log(f"{i:03d} " + "é" * 600 + "\n")
    stream = await Sse.open(http, one, f"/v1/runs/{run.run_id}/logs/stream")
    try:
        tail = utf8_tail(run.text, TAIL)
        frames: list[SseEvent] = []
        while log_text(frames) != tail:
            frames.append(await stream.next())
            assert len(log_text(frames)) <= len(tail)
        assert [f.id for f in frames] == run.log_seqs[-len(frames) :]
        assert {f.event for f in frames} == {"log"}

        await run.log("live line\n", "stderr")
        nxt = await stream.next()
        assert (nxt.id, decode(nxt.data, LogChunk)) == (
            run.log_seqs[-1],
            LogChunk(stream="stderr", text="live line\n", attempt=1),
        )
        await stream.heartbeat()

        await run.log("last words\n")
        await run.mark("released", "compute slot released")
        await run.executed("failed")
        rest = await stream.until_end()
        assert log_text(rest) == "last words\n"
        end = rest[-1]
        assert end.event == "end"
        assert b"event: end\ndata: " in stream.raw  # no id of its own: a resume repeats it, never skips it
        assert stream.raw.count(b"id: ") == stream.raw.count(b"event: log")
        assert decode(end.data, RunStreamEnd) == RunStreamEnd(run_id=run.run_id, status="failed")
        assert await stream.closed()
    finally:
        stream.close()

    # A settled run: its tail, then `end` at once; resumed past its last chunk, only `end`.
    again = await Sse.open(http, one, f"/v1/runs/{run.run_id}/logs/stream")
    frames = await again.until_end()
    assert log_text(frames) == utf8_tail(run.text, TAIL)
    again.close()
    resumed = await Sse.open(http, one, f"/v1/runs/{run.run_id}/logs/stream", last_event_id=run.log_seqs[-1])
    assert [f.event for f in await resumed.until_end()] == ["end"]
    resumed.close()


async def test_a_log_stream_resumed_on_another_replica_misses_and_repeats_nothing(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher], http: aiohttp.ClientSession
) -> None:
    one, two = gateways
    _, pub = bus
    run = await started_run(pub)
    await run.log("line 0\n")
    received: list[SseEvent] = []
    first = await Sse.open(http, one, f"/v1/runs/{run.run_id}/logs/stream")
    for i in range(1, 6):
        await run.log(f"line {i}\n")
    received += await first.take(3)
    first.close()  # the client drops; more output is written meanwhile
    for i in range(6, 12):
        await run.log(f"line {i}\n", "stderr" if i % 2 else "stdout")
    second = await Sse.open(http, two, f"/v1/runs/{run.run_id}/logs/stream", last_event_id=received[-1].id)
    received += await second.take(12 - 3)
    await run.executed()
    received += await second.until_end()
    second.close()
    chunks = [f for f in received if f.event == "log"]
    assert [f.id for f in chunks] == run.log_seqs
    assert log_text(chunks) == run.text == "".join(f"line {i}\n" for i in range(12))
    assert received[-1].event == "end"


async def test_the_live_trace_stream_resumes_on_another_replica_and_ends(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher], http: aiohttp.ClientSession
) -> None:
    one, two = gateways
    _, pub = bus
    script = new_script()
    await pub.publish_event(script.requested())
    run = ScriptedRun(pub, script)
    await run.requested()
    await view_of(http, one, run.run_id)
    path = f"/v1/runs/{run.run_id}/trajectory/live/stream"
    first = await Sse.open(http, one, path)  # queued: nothing yet, the stream waits
    await first.heartbeat()
    seqs = [await run.mark("accepted"), await run.mark("started")]
    await run.log("logs are not in the trace stream\n")
    seqs += [await run.event(ToolCall(id=str(i), name="t")) for i in range(4)]
    frames = await first.take(3)
    first.close()
    seqs.append(await run.mark("released"))
    second = await Sse.open(http, two, path, last_event_id=frames[-1].id)
    await run.executed("succeeded")
    frames += await second.until_end()
    second.close()
    trace = [f for f in frames if f.event == "trace"]
    assert [f.id for f in trace] == seqs
    kinds = [msgspec.json.decode(f.data)["kind"] for f in trace]
    assert kinds == ["infra", "infra", "tool_call", "tool_call", "tool_call", "tool_call", "infra"]
    assert decode(frames[-1].data, RunStreamEnd).status == "succeeded"
    view = await live_trace(http, two, run.run_id)
    assert [msgspec.json.encode(e) for e in view.events] == [f.data.encode() for f in trace]


async def test_a_run_s_watchers_share_one_subscription_per_stream_and_join_mid_stream_exactly(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher], http: aiohttp.ClientSession
) -> None:
    """Every log and trace stream of a run on a replica follows one LIVE subscription per subject
    set (and one of the case's `case.executed`); streams joining with `Last-Event-ID` while chunks
    are being written get exactly the chunks after it; the subscriptions close with the streams."""
    one, _ = gateways
    _, pub = bus
    run = await started_run(pub)
    logs_path, trace_path = f"/v1/runs/{run.run_id}/logs/stream", f"/v1/runs/{run.run_id}/trajectory/live/stream"
    watchers = [await Sse.open(http, one, logs_path) for _ in range(5)]
    tracers = [await Sse.open(http, one, trace_path) for _ in range(3)]
    fanout = one.state.fanout
    await eventually(lambda: fanout.watchers == 16, timeout_s=10, what="8 streams on their LIVE and executed feeds")
    assert fanout.subscriptions == 3  # the log subject, the trace subjects, the case's executed subject

    milestones: list[asyncio.Future[int]] = [asyncio.get_running_loop().create_future() for _ in range(3)]

    async def write() -> None:  # on at once past each milestone: the joins race the writes
        for i in range(200):
            seq = await run.log(f"line {i}\n")
            if i % 50 == 49 and i // 50 < len(milestones):
                milestones[i // 50].set_result(seq)

    writing = asyncio.ensure_future(write())
    joiners: list[tuple[int, Sse]] = []
    for milestone in milestones:
        resume = await asyncio.wait_for(milestone, 20)
        joiners.append((resume, await Sse.open(http, one, logs_path, last_event_id=resume)))
    await writing
    released = await run.mark("released")
    await run.executed()
    for stream in watchers:
        frames = await stream.until_end()
        assert [f.id for f in frames[:-1]] == run.log_seqs
        assert log_text(frames) == run.text
    for resume, stream in joiners:
        frames = await stream.until_end()
        assert [f.id for f in frames[:-1]] == run.log_seqs[run.log_seqs.index(resume) + 1 :], resume
    for stream in tracers:
        frames = await stream.until_end()
        assert [msgspec.json.decode(f.data)["event"] for f in frames[:-1]] == ["accepted", "started", "released"]
        assert frames[-2].id == released
    for stream in [*watchers, *tracers, *(s for _, s in joiners)]:
        stream.close()
    await eventually(lambda: fanout.subscriptions == fanout.watchers == 0, timeout_s=10, what="no subscription left")


async def test_a_bad_last_event_id_names_the_header(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher], http: aiohttp.ClientSession
) -> None:
    one, _ = gateways
    _, pub = bus
    run = await started_run(pub)
    headers = {**auth(), "Last-Event-ID": "yesterday"}
    async with http.get(f"{one.base_url}/v1/runs/{run.run_id}/logs/stream", headers=headers) as resp:
        assert resp.status == 400
        error = decode(await resp.read(), ErrorBody).error
    assert (error.code, error.field) == ("invalid", "Last-Event-ID")


# ---------------------------------------------------------------- deep link


async def test_the_live_trace_link_is_there_while_the_run_runs_and_gone_once_it_settles(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher], http: aiohttp.ClientSession
) -> None:
    one, two = gateways
    _, pub = bus
    harness = CommandHarness(
        id="otel-agent", command=("agent",), trace=TraceSpec(kind="otel", endpoint="http://jaeger:16686")
    )
    spec = BatchSpec(suite=SuiteSpec(id="s", cases=batch_spec(("c1",)).suite.cases), harness=harness)
    script = new_script(spec)
    await pub.publish_event(script.requested())
    run = ScriptedRun(pub, script)
    await run.requested()

    for gw in (one, two):
        link = (await view_of(http, gw, run.run_id)).live_trace
        assert link is not None
        assert (link.kind, link.endpoint, link.run_id) == ("otel", "http://jaeger:16686", run.run_id)
    await run.executed()
    assert (
        await view_of(http, one, run.run_id)
    ).live_trace is None  # the stream says settled, even before it is recorded
    body = (await get(http, two, f"/v1/runs/{run.run_id}"))[1]
    assert b"live_trace" not in body

    plain = await started_run(pub)  # a harness without a trace platform: no link
    assert (await view_of(http, one, plain.run_id)).live_trace is None


async def test_stopping_a_gateway_closes_its_open_live_streams_promptly(
    gw_nats: str, database_url: str, bus: tuple[NatsClient, Publisher], http: aiohttp.ClientSession
) -> None:
    _, pub = bus
    run = await started_run(pub)
    await run.log("still running\n")
    gateway = running_gateway(gw_nats, database_url, tokens={ALICE: member("alice")})
    gw = await gateway.__aenter__()
    try:
        streams = [
            await Sse.open(http, gw, f"/v1/runs/{run.run_id}/logs/stream"),
            await Sse.open(http, gw, f"/v1/runs/{run.run_id}/trajectory/live/stream"),
        ]
        assert log_text(await streams[0].take(1)) == "still running\n"
        assert len(await streams[1].take(2)) == 2
        left = await Sse.open(http, gw, f"/v1/runs/{run.run_id}/logs/stream")  # a client that went away
        assert log_text(await left.take(1)) == "still running\n"
        left.close()
        await run.log("written after it left\n")
        assert log_text(await streams[0].take(1)) == "written after it left\n"
    finally:
        started = time.monotonic()
        async with asyncio.timeout(45):  # aiohttp waits 60 s for a handler that does not end
            await gateway.__aexit__(None, None, None)
        stopped_in = time.monotonic() - started
    for stream in streams:
        assert await stream.closed()
        assert b"event: end" not in stream.raw  # not settled: the client resumes elsewhere
        stream.close()
    assert stopped_in < 15, stopped_in


# ---------------------------------------------------------------- live actions: unknown runs


async def test_a_member_may_see_but_not_act_in_an_online_suites_run(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher], http: aiohttp.ClientSession
) -> None:
    """An online suite's run belongs to the deployment: every member sees it, so acting in it is
    refused as 403 naming `Authorization` — not the 404 of another member's run, which they cannot see."""
    one, _ = gateways
    _, pub = bus
    script = BatchScript(f"{ONLINE_BATCH_PREFIX}{uuid.uuid4().hex[:8]}", batch_spec(("c1",)))
    run = ScriptedRun(pub, script, "c1")
    await run.mark("accepted", "accepted by a dispatcher")
    async with http.post(
        f"{one.base_url}/v1/runs/{run.run_id}/exec", headers=auth(BOB), json={"command": "id"}
    ) as resp:
        assert resp.status == 403, await resp.text()
        assert decode(await resp.read(), ErrorBody).error.field == "Authorization"


async def test_live_actions_on_a_run_nobody_has_seen_are_404_naming_the_run(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher], http: aiohttp.ClientSession
) -> None:
    """Exec, a terminal ticket and the screen of a run that does not exist answer 404 `not_found`
    naming `run_id`, to the creator of a batch of that name, another member and an admin alike;
    another member's run that exists is 404 too (its id cannot be probed)."""
    one, _ = gateways
    _, pub = bus
    run = await started_run(pub)
    await view_of(http, one, run.run_id)
    actions = (("POST", "exec", {"command": "id"}), ("POST", "terminal-ticket", None), ("GET", "screen", None))
    unknown = (f"evb-{run.script.batch_id}-nope", "evb-run-nope", f"{run.run_id}-t7")
    for run_id in unknown:
        for token in (ALICE, BOB, one.admin_token):
            for method, action, body in actions:
                async with http.request(
                    method, f"{one.base_url}/v1/runs/{run_id}/{action}", headers=auth(token), json=body
                ) as resp:
                    status, payload = resp.status, await resp.read()
                assert status == 404, (run_id, action, token, payload)
                error = decode(payload, ErrorBody).error
                assert (error.code, error.field) == ("not_found", "run_id"), payload
    for method, action, body in actions:
        async with http.request(
            method, f"{one.base_url}/v1/runs/{run.run_id}/{action}", headers=auth(BOB), json=body
        ) as resp:
            assert resp.status == 404, action
            assert decode(await resp.read(), ErrorBody).error.field == "run_id"
