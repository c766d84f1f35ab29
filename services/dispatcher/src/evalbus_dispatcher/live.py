"""The live tee: harness output and trace events, batched, to whatever publishes the LIVE stream.

Live views are best effort: a sink that fails is logged and never fails the case, and a slow
sink never stalls the harness's pipes (lines are buffered and flushed at most every interval).
Infra marks go out at once, after whatever was buffered before them, so order is kept — except in
a run's first `HOLD_S`: what happens then after its first mark (marks, trace events, output) is
held and goes out together when the hold ends or the run does, runs of marks and of trace events
each as one call. A run over in a few milliseconds then costs four or five LIVE messages, not one
per mark and event (ten for a short agent); a user watching a longer run sees its first mark at
once (live reads know a run not yet recorded by it) and the next ones up to 0.1 s late.

What reaches the sink is bounded: a log chunk is at most `MAX_LOG_CHUNK_BYTES` of UTF-8 (a longer
line is split, never inside a character), the output buffered while the sink is slow is at most
`MAX_PENDING_BYTES` per stream (the oldest lines give way to a note saying how much was left
out), and a trace event whose JSON is over `MAX_EVENT_BYTES` is dropped whole — never cut — and
counted in an `error` event of the live trace. None of this touches the buffered result: the
sealed trace and the answer are parsed from the backend's own capture of stdout.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from types import TracebackType
from typing import Protocol

import msgspec

from evalbus_contracts import Error, Infra, PlacementSample, TraceEvent
from evalbus_contracts.live_text import MAX_LOG_CHUNK_BYTES, chunks, utf8_len
from evalbus_dispatcher.backends.base import OutputStream
from evalbus_dispatcher.harness_output import TAIL_BYTES, log_tail, parse_line

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.25
"""At most one flush of buffered output per interval, and at least one while output flows."""
MAX_PENDING_BYTES = 1024 * 1024
"""Most output buffered per stream between flushes (a stalled sink costs lines, not memory)."""
MAX_EVENT_BYTES = 4 * 1024
"""Largest trace event (its JSON) sent live; a larger one is dropped and counted."""
HOLD_S = 0.1
"""How long a run's first live messages are held, to go out together."""
MAX_TRACE_BATCH_BYTES = 64 * 1024
"""Most trace-event JSON handed to the sink in one `trace` call (one LIVE message)."""
SINK_TIMEOUT_S = 10.0
"""A sink call that takes longer is abandoned (and logged): a stalled bus never holds a case."""

_encoder = msgspec.json.Encoder()


class LiveSink(Protocol):
    """Where a running case's live output goes (the LIVE stream, in the service)."""

    async def log(self, stream: OutputStream, text: str) -> None:
        """A chunk of output (control lines removed, at most `MAX_LOG_CHUNK_BYTES`)."""
        ...

    async def trace(self, events: Sequence[TraceEvent]) -> None:
        """Trace events the harness printed, in order (each at most `MAX_EVENT_BYTES`)."""
        ...

    async def infra(self, marks: Sequence[Infra]) -> None:
        """Infrastructure marks (accepted, waiting, started, placed, exited, released), in order
        (one or more)."""
        ...

    async def placement(self, sample: PlacementSample) -> None:
        """A resource sample of the running harness (and its exit sample)."""
        ...


class _Pending:
    """The lines of one stream waiting for the next flush, bounded in bytes (oldest dropped)."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._lines: deque[str] = deque()
        self._size = 0
        self._dropped = 0

    def __bool__(self) -> bool:
        return bool(self._lines) or self._dropped > 0

    def add(self, line: str) -> None:
        size = utf8_len(line) + 1
        self._lines.append(line)
        self._size += size
        while self._size > self._cap and len(self._lines) > 1:
            gone = self._lines.popleft()
            self._size -= utf8_len(gone) + 1
            self._dropped += utf8_len(gone) + 1

    def take(self) -> list[str]:
        lines = list(self._lines)
        if self._dropped:
            lines.insert(0, f"[evalbus: {self._dropped} bytes of output were left out of the live log]")
        self._lines.clear()
        self._size = self._dropped = 0
        return lines


class _Recent:
    """The last lines of one stream, at most `cap` bytes: failure evidence when the backend's own
    capture is lost with an error."""

    def __init__(self, cap: int) -> None:
        self._cap = cap
        self._lines: deque[str] = deque()
        self._size = 0

    def add(self, line: str) -> None:
        self._lines.append(line)
        self._size += utf8_len(line) + 1
        while self._size > self._cap and len(self._lines) > 1:
            self._size -= utf8_len(self._lines.popleft()) + 1

    def text(self) -> str:
        return "\n".join(self._lines)


class LiveTee:
    """Buffers a run's output for a `LiveSink`; use as `async with LiveTee(sink) as tee`."""

    def __init__(
        self,
        sink: LiveSink,
        *,
        interval_s: float = FLUSH_INTERVAL_S,
        chunk_bytes: int = MAX_LOG_CHUNK_BYTES,
        pending_bytes: int = MAX_PENDING_BYTES,
        event_bytes: int = MAX_EVENT_BYTES,
        hold_s: float = HOLD_S,
        trace_batch_bytes: int = MAX_TRACE_BATCH_BYTES,
    ) -> None:
        self._sink = sink
        self._interval = interval_s
        self._chunk_bytes = chunk_bytes
        self._event_bytes = event_bytes
        self._logs: dict[OutputStream, _Pending] = {
            "stdout": _Pending(pending_bytes),
            "stderr": _Pending(pending_bytes),
        }
        self._recent: dict[OutputStream, _Recent] = {"stdout": _Recent(TAIL_BYTES), "stderr": _Recent(TAIL_BYTES)}
        self._events: list[TraceEvent] = []
        self._event_sizes: list[int] = []
        self._queued: list[_Segment] = []
        """Marks and the output before each, in order, for the next flush (they gather here
        during the hold)."""
        self._hold_s = hold_s
        self._holding = hold_s > 0
        self._announced = False
        self._trace_batch_bytes = trace_batch_bytes
        self._dropped_now = 0
        self.dropped_events = 0
        """Trace events left out of the live trace so far for being over the size limit."""
        self._dirty = asyncio.Event()
        self._closing = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.t_offset = 0.0
        """Added to the `t` of printed events, to put them on the run's clock."""
        self.on_cdp: Callable[[str], None] | None = None
        """Told the DevTools endpoint a harness declares (`EVALBUS_CDP <url>` on stdout)."""
        self.on_display: Callable[[str], None] | None = None
        """Told the X display a harness declares (`EVALBUS_DISPLAY :<n>` on stdout)."""

    async def __aenter__(self) -> LiveTee:
        self._task = asyncio.create_task(self._pump())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def on_output(self, stream: OutputStream, line: str) -> None:
        """Take one line of harness output (the backend's `OnOutput`)."""
        parsed = parse_line(line)
        if stream == "stdout" and parsed.kind == "event" and parsed.event is not None:
            event = shift(parsed.event, self.t_offset)
            size = len(_encoder.encode(event))
            if size > self._event_bytes:
                self._dropped_now += 1
                self.dropped_events += 1
            else:
                self._events.append(event)
                self._event_sizes.append(size)
            self._dirty.set()
            return
        if stream == "stdout" and parsed.kind == "cdp" and parsed.cdp is not None and self.on_cdp is not None:
            self.on_cdp(parsed.cdp)
        if stream == "stdout" and parsed.kind == "display" and parsed.display and self.on_display is not None:
            self.on_display(parsed.display)
        if parsed.kind != "text":
            return  # control lines (valid or torn) are not user log, on either stream
        self._logs[stream].add(line)
        self._recent[stream].add(line)
        self._dirty.set()

    def recent_tail(self) -> str | None:
        """The end of the output seen so far, as failure evidence (`harness_output.log_tail`)."""
        return log_tail(self._recent["stdout"].text(), self._recent["stderr"].text())

    async def sample(self, sample: PlacementSample) -> None:
        """Publish a placement sample now (best effort, unordered with the output)."""
        await _best_effort("placement", self._sink.placement, sample)

    async def mark(self, mark: Infra) -> None:
        """Publish an infra mark now, after everything buffered before it (while the hold lasts:
        queue it, in order, for the hold's end)."""
        async with self._lock:
            buffered = self._take_output()
            if not buffered.output() and self._queued:
                self._queued[-1].marks.append(mark)  # right after the last: one message
            else:
                buffered.marks.append(mark)
                self._queued.append(buffered)
            if not self._announced:  # the first mark at once: it makes the run known to live reads
                self._announced = True
                await self._flush_locked(hold=False)
            else:
                await self._flush_locked()

    async def close(self) -> None:
        """Stop the periodic flush and flush what is left (the hold ends)."""
        self._closing.set()
        self._dirty.set()
        if self._task is not None:
            task, self._task = self._task, None
            with contextlib.suppress(asyncio.CancelledError):
                await task
        async with self._lock:
            self._holding = False
            await self._flush_locked()

    async def _pump(self) -> None:
        if self._holding:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._hold_s):
                    await self._closing.wait()
            async with self._lock:
                self._holding = False
                await self._flush_locked()
        while not self._closing.is_set():
            await self._dirty.wait()
            self._dirty.clear()
            async with self._lock:
                await self._flush_locked()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self._interval)

    def _take_output(self) -> _Segment:
        """The trace events (and the note of those dropped) and output buffered so far."""
        self._note_dropped()
        taken = _Segment(events=self._events, sizes=self._event_sizes)
        self._events, self._event_sizes = [], []
        for stream in ("stdout", "stderr"):
            pending = self._logs[stream]
            if pending:
                taken.logs.append((stream, pending.take()))
        return taken

    def _note_dropped(self) -> None:
        if not self._dropped_now:
            return
        t = self._events[-1].t if self._events else self.t_offset
        note = Error(
            message=f"{self._dropped_now} trace event(s) over {self._event_bytes} bytes left out of the live "
            f"trace ({self.dropped_events} so far); the sealed trajectory keeps them",
            t=t,
        )
        self._events.append(note)
        self._event_sizes.append(len(_encoder.encode(note)))
        self._dropped_now = 0

    async def _flush_locked(self, *, hold: bool = True) -> None:
        if self._holding and hold:
            return  # the hold's end (or the close) sends it all
        segments, self._queued = [*self._queued, self._take_output()], []
        for segment in segments:
            for batch in segment.event_batches(self._trace_batch_bytes):
                await _best_effort("trace", self._sink.trace, batch)
            for stream, lines in segment.logs:
                for chunk in chunks(lines, self._chunk_bytes):
                    await _best_effort("log", self._sink.log, stream, chunk)
            if segment.marks:
                await _best_effort("infra", self._sink.infra, segment.marks)


@dataclass
class _Segment:
    """Output buffered before the marks that follow it, sent in that order."""

    events: list[TraceEvent] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    """Each event's JSON bytes."""
    logs: list[tuple[OutputStream, list[str]]] = field(default_factory=list)
    marks: list[Infra] = field(default_factory=list)

    def output(self) -> bool:
        return bool(self.events or self.logs)

    def event_batches(self, limit: int) -> list[list[TraceEvent]]:
        """The events in order, cut where a batch's JSON would pass `limit` bytes."""
        out: list[list[TraceEvent]] = []
        size = 0
        for event, n in zip(self.events, self.sizes, strict=True):
            if not out or size + n > limit:
                out.append([])
                size = 0
            out[-1].append(event)
            size += n
        return out


def shift(event: TraceEvent, offset: float) -> TraceEvent:
    """The event with `offset` seconds added to its `t`."""
    return event if offset == 0.0 else msgspec.structs.replace(event, t=event.t + offset)


async def _best_effort(what: str, call: Callable[..., Awaitable[None]], *args: object) -> None:
    try:
        async with asyncio.timeout(SINK_TIMEOUT_S):
            await call(*args)
    except Exception:
        log.warning("live %s publish failed; the case goes on", what, exc_info=True)
