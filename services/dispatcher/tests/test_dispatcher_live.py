"""The live tee and the LIVE stream publisher: chunks bounded in UTF-8 bytes and exactly the output,
flushed while output flows, control lines stripped, oversized trace events dropped whole and
counted, a bounded buffer behind a slow sink, `waiting` marks for a retry's backoff — and, on a
real nats-server, log offsets that run across attempts and executions whose messages are not
taken for duplicates of each other."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Callable, Mapping, Sequence

import pytest
from nats.aio.client import Client as NatsClient

from evalbus_contracts import (
    CasePlan,
    CaseRequested,
    CaseSpec,
    CommandHarness,
    Error,
    Infra,
    InfraMark,
    LiveLog,
    LiveTrace,
    PlacementSample,
    ToolCall,
    TraceEvent,
    decode_event,
)
from evalbus_contracts.live_text import chunks, split_utf8
from evalbus_contracts.subjects import live_filter
from evalbus_dispatcher import LiveSink, LocalBackend, OutputStream, execute_case
from evalbus_dispatcher.execute import Queued
from evalbus_dispatcher.live import LiveTee
from evalbus_dispatcher.live_bus import LiveBus
from evalbus_runtime import Publisher, connect, ensure_topology

from .conftest import LiveRecord

Script = Callable[[str], tuple[str, ...]]
MakeRequest = Callable[..., CaseRequested]


class Sink:
    """A live sink recording what it got, with an event per arrival so tests can wait on it."""

    def __init__(self, *, stall: asyncio.Event | None = None) -> None:
        self.logs: list[tuple[OutputStream, str]] = []
        self.events: list[TraceEvent] = []
        self.marks: list[Infra] = []
        self.samples: list[PlacementSample] = []
        self.calls: list[tuple[str, int]] = []
        """Each `infra` and `trace` call: which, and how many marks or events it carried."""
        self.arrived = asyncio.Event()
        self._stall = stall

    async def log(self, stream: OutputStream, text: str) -> None:
        if self._stall is not None:
            await self._stall.wait()
        self.logs.append((stream, text))
        self.arrived.set()

    async def trace(self, events: Sequence[TraceEvent]) -> None:
        self.events.extend(events)
        self.calls.append(("trace", len(events)))
        self.arrived.set()

    async def infra(self, marks: Sequence[Infra]) -> None:
        self.marks.extend(marks)
        self.calls.append(("infra", len(marks)))
        self.arrived.set()

    async def placement(self, sample: PlacementSample) -> None:
        self.samples.append(sample)

    def text(self, stream: OutputStream | None = None) -> str:
        return "".join(t for s, t in self.logs if stream is None or s == stream)

    async def wait_for(self, check: Callable[[], bool], timeout_s: float = 10.0) -> None:
        async with asyncio.timeout(timeout_s):
            while not check():
                self.arrived.clear()
                await self.arrived.wait()


def event_line(event: Mapping[str, object]) -> str:
    return "EVALBUS_EVENT " + json.dumps(event)


# ---------------------------------------------------------------- chunking (pure)


@pytest.mark.unit
@pytest.mark.parametrize("limit", [4, 7, 64, 1024])
def test_chunks_are_bounded_in_utf8_bytes_and_are_exactly_the_lines(limit: int) -> None:
    lines = ["plain", "é" * 50, "日本語のテキスト" * 9, "", "x" * 3000, "🙂 emoji 🙂"]
    out = chunks(lines, limit)
    assert "".join(out) == "".join(line + "\n" for line in lines)
    assert all(0 < len(c.encode("utf-8")) <= max(limit, 4) for c in out)


@pytest.mark.unit
def test_split_never_cuts_a_character() -> None:
    text = "aé日🙂" * 100
    for limit in (1, 2, 3, 5, 10):
        pieces = split_utf8(text, limit)
        assert "".join(pieces) == text
        assert all(len(p.encode("utf-8")) <= max(limit, 4) for p in pieces)
    assert split_utf8("short", 100) == ["short"]


# ---------------------------------------------------------------- the tee


@pytest.mark.unit
async def test_output_is_flushed_while_it_flows_not_only_at_close() -> None:
    sink = Sink()
    async with LiveTee(sink, interval_s=0.05) as tee:
        await tee.on_output("stdout", "first")
        await sink.wait_for(lambda: "first\n" in sink.text())
        await tee.on_output("stderr", "second")
        await sink.wait_for(lambda: "second\n" in sink.text())
        assert sink.text() == "first\nsecond\n"


@pytest.mark.unit
async def test_a_burst_is_flushed_in_few_bounded_chunks() -> None:
    sink = Sink()
    async with LiveTee(sink, interval_s=0.25, chunk_bytes=1024) as tee:
        for i in range(3000):
            await tee.on_output("stdout", f"line {i:05d}")
    assert sink.text() == "".join(f"line {i:05d}\n" for i in range(3000))
    assert all(len(t.encode()) <= 1024 for _, t in sink.logs)
    assert len(sink.logs) <= 3000 * 11 // 1024 + 4  # full chunks, not one call per line


@pytest.mark.unit
async def test_control_lines_are_stripped_from_both_streams() -> None:
    sink = Sink()
    async with LiveTee(sink) as tee:
        await tee.on_output("stdout", "visible")
        await tee.on_output("stdout", event_line({"kind": "tool_call", "id": "1", "name": "x"}))
        await tee.on_output("stdout", 'EVALBUS_RESULT {"answer": "42"}')
        await tee.on_output("stdout", "EVALBUS_EVENT {torn")
        await tee.on_output("stderr", event_line({"kind": "tool_call", "id": "2", "name": "y"}))
        await tee.on_output("stderr", "warning")
    assert sink.text() == "visible\nwarning\n"
    assert [e.id for e in sink.events if isinstance(e, ToolCall)] == ["1"]


@pytest.mark.unit
async def test_an_oversized_event_is_dropped_whole_and_counted() -> None:
    sink = Sink()
    async with LiveTee(sink, event_bytes=4096) as tee:
        tee.t_offset = 2.0
        await tee.on_output("stdout", event_line({"kind": "tool_call", "id": "small", "name": "x", "t": 0.5}))
        big = {"kind": "tool_result", "id": "big", "output": "z" * 5000}
        await tee.on_output("stdout", event_line(big))
        await tee.on_output("stdout", event_line(big))
        await tee.on_output("stdout", event_line({"kind": "tool_call", "id": "after", "name": "x", "t": 1.0}))
    kinds = [(type(e).__name__, getattr(e, "id", None)) for e in sink.events]
    assert kinds == [("ToolCall", "small"), ("ToolCall", "after"), ("Error", None)]
    note = sink.events[-1]
    assert isinstance(note, Error)
    assert note.message.startswith("2 trace event(s) over 4096 bytes")
    assert "(2 so far)" in note.message
    assert sink.events[0].t == 2.5  # put on the run's clock
    assert tee.dropped_events == 2


@pytest.mark.unit
async def test_a_stalled_sink_costs_old_lines_not_memory() -> None:
    stall = asyncio.Event()
    sink = Sink(stall=stall)
    async with LiveTee(sink, interval_s=0.01, pending_bytes=100, hold_s=0) as tee:
        await tee.on_output("stdout", "first")  # taken by the first flush, which stalls in the sink
        await asyncio.sleep(0)  # let the pump start that flush
        for i in range(200):
            await tee.on_output("stdout", f"line {i:03d}")  # buffered behind the stalled flush
        stall.set()
    text = sink.text()
    assert text.startswith("first\n")
    assert "bytes of output were left out of the live log" in text
    assert text.endswith("line 199\n")
    assert "line 000" not in text
    assert len(text.encode()) < 300


def mark(event: str) -> Infra:
    return Infra(scope="placement", event=event)


@pytest.mark.unit
async def test_a_runs_first_moments_go_out_together_in_order() -> None:
    """The first mark goes out at once; after it, within the hold, nothing reaches the sink; at its
    end (here: the close) the marks and the trace events go out as runs, one call each, in the
    order they happened."""
    sink = Sink()
    async with LiveTee(sink, hold_s=3600) as tee:
        for event in ("accepted", "started", "placed"):
            await tee.mark(mark(event))
        await tee.on_output("stdout", event_line({"kind": "tool_call", "id": "1", "name": "x"}))
        await tee.on_output("stdout", "a line")
        await tee.on_output("stdout", event_line({"kind": "tool_result", "id": "1", "output": "4"}))
        await tee.mark(mark("exited"))
        await tee.mark(mark("released"))
        assert sink.calls == [("infra", 1)]
        assert sink.logs == []  # held
    assert sink.calls == [("infra", 1), ("infra", 2), ("trace", 2), ("infra", 2)]
    assert [m.event for m in sink.marks] == ["accepted", "started", "placed", "exited", "released"]
    assert [getattr(e, "id", None) for e in sink.events] == ["1", "1"]
    assert sink.text() == "a line\n"


@pytest.mark.unit
async def test_after_the_hold_a_mark_goes_out_at_once() -> None:
    sink = Sink()
    async with LiveTee(sink, hold_s=0.05) as tee:
        await tee.mark(mark("accepted"))
        await tee.mark(mark("started"))
        await sink.wait_for(lambda: len(sink.marks) == 2)  # the hold's end sent the second
        await tee.on_output("stdout", event_line({"kind": "tool_call", "id": "1", "name": "x"}))
        await tee.mark(mark("exited"))
        # sent within the call, after the event buffered before it
        assert sink.calls == [("infra", 1), ("infra", 1), ("trace", 1), ("infra", 1)]


@pytest.mark.unit
async def test_a_held_trace_is_cut_into_bounded_calls() -> None:
    sink = Sink()
    line = event_line({"kind": "tool_result", "id": "r", "output": "y" * 900})
    async with LiveTee(sink, hold_s=3600, trace_batch_bytes=4096) as tee:
        for _ in range(20):
            await tee.on_output("stdout", line)
    sizes = [n for kind, n in sink.calls if kind == "trace"]
    assert sum(sizes) == 20
    assert len(sizes) > 1
    assert max(sizes) * 900 <= 4096


# ---------------------------------------------------------------- execution


async def test_the_sealed_trace_keeps_what_the_live_trace_drops(
    backend: LocalBackend, script: Script, make_request: MakeRequest, live: LiveSink, live_records: list[LiveRecord]
) -> None:
    big = json.dumps({"kind": "tool_result", "id": "big", "output": "z" * 6000})
    argv = script(
        f"""
        print('EVALBUS_EVENT ' + {big!r}, flush=True)
        print('plain output', flush=True)
        print('EVALBUS_RESULT {{"answer": "done"}}', flush=True)
        """
    )
    executed = await execute_case(make_request(argv), backend, live=live, on_release=lambda: None)
    assert executed.result.answer == "done"
    sealed = [e for e in executed.result.trace if getattr(e, "id", None) == "big"]
    assert len(sealed) == 1
    live_events = [e for kind, batch in live_records if kind == "trace" for e in batch]
    assert not [e for e in live_events if getattr(e, "id", None) == "big"]
    assert any(isinstance(e, Error) and "left out of the live trace" in e.message for e in live_events)
    logs = "".join(rec[1][1] for rec in live_records if rec[0] == "log")
    assert logs == "plain output\n"


async def test_a_retry_that_waited_its_backoff_on_the_bus_is_sealed_with_a_waiting_mark(
    backend: LocalBackend, script: Script, make_request: MakeRequest, live: LiveSink, live_records: list[LiveRecord]
) -> None:
    req = make_request(script("print('again')"), attempt=2)
    queued = Queued(waited_s=1.3, delivery=2, attempt=2, backoff_s=1.0)  # delivery 1 was put back
    executed = await execute_case(req, backend, live=live, on_release=lambda: None, queued=queued)
    sealed = [e.event for e in executed.result.trace if isinstance(e, Infra)]
    assert sealed == ["waiting", "accepted", "started", "placed", "exited", "released"]
    waiting = next(e for e in executed.result.trace if isinstance(e, Infra) and e.event == "waiting")
    assert waiting.message.startswith("attempt 2 waited 1s after a retryable failure (stored 1.3s ago")
    assert [rec[1].event for rec in live_records if rec[0] == "infra"] == sealed


# ---------------------------------------------------------------- the LIVE stream (real nats-server)


@pytest.fixture
async def publisher(nats_url: str) -> AsyncIterator[tuple[NatsClient, Publisher]]:
    nc = await connect(nats_url, "dispatcher-live-test")
    await ensure_topology(nc.jetstream())
    pub = Publisher(nc)
    await pub.start()
    yield nc, pub
    await pub.stop()
    await nc.close()


def request(run: str, attempt: int = 1) -> CaseRequested:
    return CaseRequested(
        batch_id=run,
        case_id="c1",
        run_id=f"evb-{run}-c1",
        attempt=attempt,
        case=CaseSpec(id="c1", input="x"),
        harness=CommandHarness(id="h", command=("true",)),
        plan=CasePlan(),
    )


async def stored_count(nc: NatsClient, run_id: str, count: int) -> None:
    """Wait until the LIVE stream holds `count` messages of the run (they are published without acks)."""
    js = nc.jetstream()
    async with asyncio.timeout(10):
        while True:
            info = await js.stream_info("LIVE", subjects_filter=live_filter(run_id))
            if sum((info.state.subjects or {}).values()) >= count:
                return
            await asyncio.sleep(0.01)


async def stored(nc: NatsClient, run_id: str, count: int) -> list[LiveLog | LiveTrace | InfraMark]:
    """The first `count` LIVE messages of the run, in stream order."""
    sub = await nc.jetstream().subscribe(live_filter(run_id), stream="LIVE", ordered_consumer=True)
    out: list[LiveLog | LiveTrace | InfraMark] = []
    try:
        for _ in range(count):
            event = decode_event((await sub.next_msg(timeout=10)).data)
            assert isinstance(event, LiveLog | LiveTrace | InfraMark)
            out.append(event)
    finally:
        await sub.unsubscribe()
    return out


@pytest.mark.integration
async def test_log_offsets_run_across_streams_attempts_and_redelivered_executions(
    publisher: tuple[NatsClient, Publisher],
) -> None:
    nc, pub = publisher
    run = "b" + uuid.uuid4().hex[:12]
    first = LiveBus(pub, request(run))
    await first.resume(nc.jetstream())  # nothing on the stream yet: offsets start at 0
    await first.infra([Infra(scope="placement", event="accepted")])
    await first.log("stdout", "héllo\n")
    await first.log("stderr", "oops\n")
    await first.trace([ToolCall(id="1", name="a"), ToolCall(id="2", name="b")])
    await first.infra([Infra(scope="placement", event="exited"), Infra(scope="placement", event="released")])
    await stored_count(nc, f"evb-{run}-c1", 5)

    # The same attempt again (a redelivery after a crash) and then attempt 2: same sequence numbers,
    # other executions — stored, not dropped as duplicates — and the offsets carry on.
    for n, again in enumerate((LiveBus(pub, request(run)), LiveBus(pub, request(run, attempt=2))), start=1):
        await again.resume(nc.jetstream())
        await again.infra([Infra(scope="placement", event="accepted")])
        await again.log("stdout", "more\n")
        await stored_count(nc, f"evb-{run}-c1", 5 + 2 * n)

    events = await stored(nc, f"evb-{run}-c1", 9)
    logs = [e for e in events if isinstance(e, LiveLog)]
    assert [(e.attempt, e.stream, e.seq, e.offset) for e in logs] == [
        (1, "stdout", 1, 0),
        (1, "stderr", 1, len("héllo\n".encode())),
        (1, "stdout", 1, len("héllo\n".encode()) + 5),
        (2, "stdout", 1, len("héllo\n".encode()) + 10),
    ]
    assert len({e.execution for e in logs}) == 3
    traces = [e for e in events if isinstance(e, LiveTrace)]
    assert [[getattr(t, "id", None) for t in e.events] for e in traces] == [["1", "2"]]  # one message per call
    assert [e.seq for e in traces] == [1]
    marks = [e for e in events if isinstance(e, InfraMark)]
    assert [[m.event for m in e.marks] for e in marks] == [
        ["accepted"],
        ["exited", "released"],
        ["accepted"],
        ["accepted"],
    ]
    assert [e.seq for e in marks[:2]] == [1, 2]
