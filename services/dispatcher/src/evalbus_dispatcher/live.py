"""The live tee: harness output and trace events, batched, to whatever publishes the LIVE stream.

Live views are best effort: a sink that fails is logged and never fails the case, and a slow
sink never stalls the harness's pipes (lines are buffered and flushed at most every interval).
Infra marks go out at once, after whatever was buffered before them, so order is kept.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Awaitable, Callable, Sequence
from types import TracebackType
from typing import Protocol

import msgspec

from evalbus_contracts import Infra, TraceEvent
from evalbus_dispatcher.backends.base import OutputStream
from evalbus_dispatcher.harness_output import parse_line

log = logging.getLogger(__name__)

FLUSH_INTERVAL_S = 0.25
"""At most one flush of buffered output per interval."""
MAX_LOG_CHUNK = 32 * 1024
"""Largest log text handed to the sink in one call (split on line boundaries)."""
SINK_TIMEOUT_S = 10.0
"""A sink call that takes longer is abandoned (and logged): a stalled bus never holds a case."""


class LiveSink(Protocol):
    """Where a running case's live output goes (the LIVE stream, in the service)."""

    async def log(self, stream: OutputStream, text: str) -> None:
        """A chunk of output (whole lines, control lines removed)."""
        ...

    async def trace(self, events: Sequence[TraceEvent]) -> None:
        """Trace events the harness printed, in order."""
        ...

    async def infra(self, mark: Infra) -> None:
        """An infrastructure mark (accepted, started, released)."""
        ...


class LiveTee:
    """Buffers a run's output for a `LiveSink`; use as `async with LiveTee(sink) as tee`."""

    def __init__(self, sink: LiveSink, *, interval_s: float = FLUSH_INTERVAL_S) -> None:
        self._sink = sink
        self._interval = interval_s
        self._logs: dict[OutputStream, list[str]] = {"stdout": [], "stderr": []}
        self._events: list[TraceEvent] = []
        self._dirty = asyncio.Event()
        self._closing = asyncio.Event()
        self._lock = asyncio.Lock()
        self._task: asyncio.Task[None] | None = None
        self.t_offset = 0.0
        """Added to the `t` of printed events, to put them on the run's clock."""

    async def __aenter__(self) -> LiveTee:
        self._task = asyncio.create_task(self._pump())
        return self

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def on_output(self, stream: OutputStream, line: str) -> None:
        """Take one line of harness output (the backend's `OnOutput`)."""
        if stream == "stdout":
            parsed = parse_line(line)
            if parsed.kind == "event" and parsed.event is not None:
                self._events.append(shift(parsed.event, self.t_offset))
                self._dirty.set()
                return
            if parsed.kind != "text":
                return
        elif parse_line(line).kind != "text":
            return
        self._logs[stream].append(line)
        self._dirty.set()

    async def mark(self, mark: Infra) -> None:
        """Publish an infra mark now, after everything buffered before it."""
        async with self._lock:
            await self._flush_locked()
            await _best_effort("infra", self._sink.infra, mark)

    async def close(self) -> None:
        """Stop the periodic flush and flush what is left."""
        self._closing.set()
        self._dirty.set()
        if self._task is not None:
            task, self._task = self._task, None
            with contextlib.suppress(asyncio.CancelledError):
                await task
        async with self._lock:
            await self._flush_locked()

    async def _pump(self) -> None:
        while not self._closing.is_set():
            await self._dirty.wait()
            self._dirty.clear()
            async with self._lock:
                await self._flush_locked()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), self._interval)

    async def _flush_locked(self) -> None:
        if self._events:
            events, self._events = self._events, []
            await _best_effort("trace", self._sink.trace, events)
        for stream in ("stdout", "stderr"):
            lines = self._logs[stream]
            if not lines:
                continue
            self._logs[stream] = []
            for chunk in _chunks(lines, MAX_LOG_CHUNK):
                await _best_effort("log", self._sink.log, stream, chunk)


def shift(event: TraceEvent, offset: float) -> TraceEvent:
    """The event with `offset` seconds added to its `t`."""
    return event if offset == 0.0 else msgspec.structs.replace(event, t=event.t + offset)


def _chunks(lines: list[str], limit: int) -> list[str]:
    chunks: list[str] = []
    current: list[str] = []
    size = 0
    for line in lines:
        if current and size + len(line) + 1 > limit:
            chunks.append("\n".join(current) + "\n")
            current, size = [], 0
        current.append(line)
        size += len(line) + 1
    if current:
        chunks.append("\n".join(current) + "\n")
    return chunks


async def _best_effort(what: str, call: Callable[..., Awaitable[None]], *args: object) -> None:
    try:
        async with asyncio.timeout(SINK_TIMEOUT_S):
            await call(*args)
    except Exception:
        log.warning("live %s publish failed; the case goes on", what, exc_info=True)
