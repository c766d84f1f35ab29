"""The runner's own live view: the harness's log chunks and trace events published straight to NATS
(`RunnerJob.live`), as the dispatcher would publish them from the job log — same `LiveLog` /
`LiveTrace` payloads, subjects, execution id, byte offsets and batching (`evalbus_dispatcher.live`).

Best effort, as the LIVE stream is: core NATS publishes without `Nats-Msg-Id` and without waiting for
an acknowledgement; one that fails is dropped. The record lines on stdout stay the result's channel.
Nothing here prints: the runner's stdout and stderr are the job log.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
from collections import deque
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from evalbus_contracts import Error, LiveLog, LiveTrace, TraceEvent, encode
from evalbus_contracts.live_text import MAX_LOG_CHUNK_BYTES, chunks, utf8_len
from evalbus_contracts.runner import RunnerJob, RunnerLive

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient

FLUSH_INTERVAL_S = 0.25
"""At most one publish of buffered output per interval (as the dispatcher's live tee)."""
MAX_PENDING_BYTES = 1024 * 1024
"""Most output buffered per stream between two publishes; the oldest lines give way to a note."""
MAX_EVENT_BYTES = 4 * 1024
"""Largest trace event (its JSON) published; a larger one is dropped and counted in an `error` event."""
CLOSE_TIMEOUT_S = 2.0
"""Longest the runner waits at its end for what it published to leave."""

Stream = Literal["stdout", "stderr"]

_CONTROL = re.compile(r"^\s*(EVALBUS_EVENT|EVALBUS_RESULT|EVALBUS_CDP|EVALBUS_DISPLAY)(?:\s+(.*))?$", re.DOTALL)
_event_decoder: msgspec.json.Decoder[TraceEvent] = msgspec.json.Decoder(TraceEvent)


def classify(line: str) -> TraceEvent | bool:
    """A harness line as the live view takes it (pure): the trace event it carries, True for plain
    text (the live log), False for any other control line, valid or torn (neither) — as
    `evalbus_dispatcher.harness_output.parse_line` reads it."""
    m = _CONTROL.match(line)
    if m is None:
        return True
    if m.group(1) != "EVALBUS_EVENT":
        return False
    try:
        return _event_decoder.decode((m.group(2) or "").strip())
    except msgspec.DecodeError:
        return False


class _Pending:
    """One stream's lines waiting for the next publish, at most `MAX_PENDING_BYTES` (oldest dropped)."""

    def __init__(self) -> None:
        self.lines: deque[str] = deque()
        self.size = 0
        self.dropped = 0

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.size += utf8_len(line) + 1
        while self.size > MAX_PENDING_BYTES and len(self.lines) > 1:
            gone = utf8_len(self.lines.popleft()) + 1
            self.size -= gone
            self.dropped += gone

    def take(self) -> list[str]:
        lines = list(self.lines)
        if self.dropped:
            lines.insert(0, f"[evalbus: {self.dropped} bytes of output were left out of the live log]")
        self.lines.clear()
        self.size = self.dropped = 0
        return lines


class LivePublisher:
    """Publishes one execution's live log and trace on a connected NATS client; `line` takes each
    harness line (secrets already masked), `close` publishes what is left and disconnects."""

    def __init__(self, nc: NatsClient, job: RunnerJob, live: RunnerLive) -> None:
        self._nc = nc
        self._job = job
        self._live = live
        self._offset = live.offset
        self._seq = {"stdout": 0, "stderr": 0, "trace": 0}
        self._pending: dict[Stream, _Pending] = {"stdout": _Pending(), "stderr": _Pending()}
        self._events: list[TraceEvent] = []
        self._oversized = 0
        self._oversized_total = 0
        self._dirty = asyncio.Event()
        self._closing = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Begin the periodic publishing."""
        self._task = asyncio.create_task(self._pump())

    def line(self, stream: Stream, text: str) -> None:
        """One harness line: an `EVALBUS_EVENT` on stdout to the trace, plain text to the log, any
        other control line (or an event on stderr) to neither — as the dispatcher's live tee."""
        found = classify(text)
        if isinstance(found, bool):
            if found:
                self._pending[stream].add(text)
                self._dirty.set()
            return
        if stream != "stdout":
            return
        event = found if self._live.t_offset == 0 else msgspec.structs.replace(found, t=found.t + self._live.t_offset)
        if len(encode(event)) > MAX_EVENT_BYTES:
            self._oversized += 1
            self._oversized_total += 1
        else:
            self._events.append(event)
        self._dirty.set()

    async def close(self) -> None:
        """Publish what is buffered, then flush and close the connection (bounded: a server gone
        costs `CLOSE_TIMEOUT_S`, never the job)."""
        self._closing.set()
        self._dirty.set()
        if self._task is not None:
            with contextlib.suppress(Exception):
                await self._task
        await self._publish_pending()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._nc.flush(), CLOSE_TIMEOUT_S)
        with contextlib.suppress(Exception):
            await asyncio.wait_for(self._nc.close(), CLOSE_TIMEOUT_S)

    async def _pump(self) -> None:
        while not self._closing.is_set():
            await self._dirty.wait()
            self._dirty.clear()
            await self._publish_pending()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._closing.wait(), FLUSH_INTERVAL_S)

    async def _publish_pending(self) -> None:
        if self._oversized:
            t = self._events[-1].t if self._events else self._live.t_offset
            self._events.append(
                Error(
                    message=f"{self._oversized} trace event(s) over {MAX_EVENT_BYTES} bytes left out of the live "
                    f"trace ({self._oversized_total} so far); the sealed trajectory keeps them",
                    t=t,
                )
            )
            self._oversized = 0
        events, self._events = self._events, []
        for event in events:
            self._seq["trace"] += 1
            await self._send(self._trace(event))
        for stream in ("stdout", "stderr"):
            pending = self._pending[stream]
            if not pending.lines and not pending.dropped:
                continue
            for text in chunks(pending.take(), MAX_LOG_CHUNK_BYTES):
                self._seq[stream] += 1
                chunk = self._log(stream, text)
                self._offset += utf8_len(text)
                await self._send(chunk)

    def _log(self, stream: Stream, text: str) -> LiveLog:
        job = self._job
        return LiveLog(
            batch_id=job.batch_id, case_id=job.case_id, run_id=job.run_id, attempt=job.attempt,
            execution=self._live.execution, seq=self._seq[stream], stream=stream, text=text, offset=self._offset,
        )  # fmt: skip

    def _trace(self, event: TraceEvent) -> LiveTrace:
        job = self._job
        return LiveTrace(
            batch_id=job.batch_id, case_id=job.case_id, run_id=job.run_id, attempt=job.attempt,
            execution=self._live.execution, seq=self._seq["trace"], events=(event,),
        )  # fmt: skip

    async def _send(self, event: LiveLog | LiveTrace) -> None:
        headers = {"Evalbus-Type": event.type, "Evalbus-Version": str(event.v)}
        with contextlib.suppress(Exception):  # best effort: a publish that fails is a live line lost
            await self._nc.publish(event.subject(), encode(event), headers=headers)


async def _quiet(*_: Any) -> None:
    """The client's callbacks: nothing is printed (the runner's output is the job log)."""


async def connect_live(job: RunnerJob) -> LivePublisher | None:
    """A publisher on the job's NATS server (`job.live`), connected within its timeout; None when the
    job asks for none, `nats-py` is not in the image, or the server cannot be reached or refuses."""
    live = job.live
    if live is None or not live.nats_url:
        return None
    try:
        from nats.aio.client import Client  # the image may have only evalbus-contracts and the runner
    except ImportError:
        return None
    options: dict[str, Any] = {"token": live.token} if live.token else {}
    timeout = max(0.1, live.connect_timeout_s)
    nc = Client()
    try:
        await asyncio.wait_for(
            nc.connect(
                live.nats_url, name=f"evalbus-runner {job.run_id}", connect_timeout=max(1, int(timeout)),
                allow_reconnect=True, max_reconnect_attempts=3, reconnect_time_wait=1,
                error_cb=_quiet, disconnected_cb=_quiet, reconnected_cb=_quiet, closed_cb=_quiet, **options,
            ),
            timeout,
        )  # fmt: skip
        if not nc.is_connected:  # nats-py may return from a refusal the server is slow to send
            raise ConnectionError("not connected")
    except Exception:  # unreachable, refused, timed out: the job log carries the live view
        with contextlib.suppress(Exception):
            await asyncio.wait_for(nc.close(), CLOSE_TIMEOUT_S)
        return None
    publisher = LivePublisher(nc, job, live)
    publisher.start()
    return publisher
