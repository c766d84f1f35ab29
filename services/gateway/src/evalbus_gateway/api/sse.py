"""Server-sent events of one batch, straight from the CASES stream.

Every connection to a batch in a process follows one shared feed of the batch's subjects
(`subjects.batch_filter`, `live.fanout`): the first opens it, each message is framed once, the
last one closes it. A connection first replays the stream from its resume point on a consumer of
its own, then joins the feed with no gap and no duplicate. Nothing is kept beyond the open
connections, so every gateway replica serves the same stream. Frames:

- `id:` the stream sequence, `event:` the event type, `data:` the event JSON as published — or,
  for the events of a compacted batch that left the stream (`compactor`), as the event store keeps
  it (the same JSON value; PostgreSQL's spacing and key order);
- `Last-Event-ID: n` resumes exactly after sequence n;
- a `: heartbeat` comment after every quiet `heartbeat_s`;
- after the batch's `batch.finalized`, `event: end` with `{"batch_id", "status"}`, then the
  stream closes. A client resuming after the `batch.finalized` frame gets `end` at once;
- a client that falls `GATEWAY_SSE_CLIENT_BUFFER` events behind gets a `: lagging` comment and
  the stream closes (no `end`): it resumes with `Last-Event-ID`, as after any disconnect.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import nats.errors
from aiohttp import web
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from evalbus_api.models import StreamEnd
from evalbus_api.views import BatchStatus
from evalbus_contracts import encode, subjects
from evalbus_contracts.streams import CASES
from evalbus_gateway.api.reads import finalized_on_stream
from evalbus_gateway.errors import NotReadyError
from evalbus_gateway.live.fanout import LAGGING, AbortOnLag, Fanout, FeedSpec, Lagged, Watcher, catch_up
from evalbus_gateway.store.compaction import compacted, finalized_body, recorded_events

if TYPE_CHECKING:
    from evalbus_gateway.store.connections import Database

log = logging.getLogger("evalbus.gateway.sse")

END_EVENT = "end"
"""The last event of a stream: the batch is finalized."""


class _Typed(msgspec.Struct):
    type: str = "message"


_typed = msgspec.json.Decoder(_Typed)


def frame(data: bytes, *, event: str | None = None, event_id: int | None = None) -> bytes:
    """One SSE frame (data split into `data:` lines, so any payload is safe)."""
    lines: list[bytes] = []
    if event_id is not None:
        lines.append(b"id: %d" % event_id)
    if event:
        lines.append(b"event: " + event.replace("\n", " ").replace("\r", " ").encode("utf-8"))
    lines.extend(b"data: " + line for line in (data.splitlines() or [b""]))
    return b"\n".join(lines) + b"\n\n"


def event_type(headers: dict[str, str] | None, data: bytes) -> str:
    """A message's event type: its `Evalbus-Type` header, else the payload's `type`."""
    if headers:
        declared = headers.get("Evalbus-Type")
        if declared:
            return declared
    try:
        return _typed.decode(data).type
    except msgspec.DecodeError:
        return "message"


def end_frame(batch_id: str, status: BatchStatus) -> bytes:
    """The `end` frame."""
    return frame(encode(StreamEnd(batch_id=batch_id, status=status)), event=END_EVENT)


class EventStreams:
    """The open SSE connections of a process, so shutdown can close them instead of waiting."""

    def __init__(self) -> None:
        self._tasks: set[asyncio.Task[object]] = set()
        self._closing = False

    def __len__(self) -> int:
        return len(self._tasks)

    def closing(self) -> bool:
        """Whether the process is shutting down (cancelled streams then end normally)."""
        return self._closing

    def enter(self) -> None:
        """Register the current request task."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.add(task)

    def leave(self) -> None:
        """Forget the current request task."""
        task = asyncio.current_task()
        if task is not None:
            self._tasks.discard(task)

    async def close_all(self, timeout_s: float = 5.0) -> None:
        """Cancel every open stream (clients reconnect elsewhere with `Last-Event-ID`)."""
        self._closing = True
        tasks = list(self._tasks)
        for task in tasks:
            task.cancel()
        if tasks:
            await asyncio.wait(tasks, timeout=timeout_s)


@dataclass(frozen=True, slots=True)
class BatchFrame:
    """One event of a batch's stream, framed once for every client of the process."""

    seq: int
    """Its CASES stream sequence (the SSE id)."""
    data: bytes
    """The SSE frame."""
    final: BatchStatus | None
    """The batch's status when this is its `batch.finalized`."""


def batch_frame(msg: Msg) -> BatchFrame:
    """The frame of a CASES message of a batch."""
    seq = int(msg.metadata.sequence.stream)
    kind = event_type(msg.headers, msg.data)
    final = final_status(msg.data) if kind == "batch.finalized" else None
    return BatchFrame(seq=seq, data=frame(msg.data, event=kind, event_id=seq), final=final)


def batch_feed(batch_id: str) -> FeedSpec[BatchFrame]:
    """The shared feed of a batch's events."""
    return FeedSpec("batch", CASES.name, tuple(subjects.batch_filter(batch_id)), batch_frame)


WRITE_BYTES = 64 * 1024
"""Frames of a replay are written in chunks of about this size."""


async def stream_batch_events(
    request: web.Request,
    js: JetStreamContext,
    batch_id: str,
    *,
    last_event_id: int | None,
    heartbeat_s: float,
    streams: EventStreams,
    fanout: Fanout,
    buffer: int,
    db: Database | None = None,
) -> web.StreamResponse:
    """Serve the batch's events as SSE until its `batch.finalized` (or the client leaves). With
    `db`, the events of a compacted batch that left the stream (`compactor`) are read from the
    event store, in the same order and with the same ids (their stream sequences)."""
    if streams.closing():
        raise NotReadyError("the gateway is stopping; reconnect to another replica")
    finalized = await finalized_on_stream(js, batch_id) if last_event_id is not None else None
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        },
    )
    spec = batch_feed(batch_id)
    abort = AbortOnLag(request.transport)
    watcher: Watcher[BatchFrame] = Watcher(buffer, on_lag=abort)
    streams.enter()
    try:
        await response.prepare(request)
        await response.write(b": evalbus batch events\n\n")
        if finalized is not None and last_event_id is not None and finalized[0] <= last_event_id:
            await response.write(end_frame(batch_id, finalized[1].status))
            return response
        after = last_event_id or 0
        if db is not None:
            after, final = await _from_store(response, db, batch_id, after)
            if final is not None:
                await response.write(end_frame(batch_id, final))
                return response
        await _pump(response, js, fanout, spec, watcher, batch_id, after, heartbeat_s)
    except ConnectionResetError:
        pass  # the client left
    except Lagged:
        response.force_close()  # no keep-alive: the client reconnects afresh
        log.info("event stream of %s cut: the client fell %d events behind", batch_id, buffer)
        with contextlib.suppress(ConnectionResetError):
            await response.write(LAGGING)
    except asyncio.CancelledError:
        if not streams.closing():
            raise
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()  # closed by shutdown: end the response; the client resumes elsewhere
    except nats.errors.Error as e:
        log.info("event stream of %s ended: %s", batch_id, e)
    finally:
        abort.cancel()
        streams.leave()
        await fanout.leave(spec, watcher)
    return response


async def _from_store(
    response: web.StreamResponse, db: Database, batch_id: str, after: int
) -> tuple[int, BatchStatus | None]:
    """Write the events of a compacted batch — the stream no longer holds them — after sequence
    `after`, from the store; the sequence the stream's replay goes on from, and the batch's final
    status when it is known (a compacted batch is finalized: its end comes from the store too)."""
    done = await compacted(db, batch_id)
    if done is None:
        return after, None
    out: list[bytes] = []
    size = 0
    for seq, kind, body in await recorded_events(db, batch_id, after=after, before=done.purged_below):
        out.append(frame(body, event=kind, event_id=seq))
        size += len(out[-1])
        if kind == subjects.BATCH_FINALIZED:
            await response.write(b"".join(out))
            return seq, final_status(body)
        if size >= WRITE_BYTES:
            await response.write(b"".join(out))
            out, size = [], 0
    if out:
        await response.write(b"".join(out))
    finalized = await finalized_body(db, batch_id)  # before `after`: a client resuming past it
    return max(after, done.purged_below - 1), None if finalized is None else final_status(finalized)


async def _pump(
    response: web.StreamResponse,
    js: JetStreamContext,
    fanout: Fanout,
    spec: FeedSpec[BatchFrame],
    watcher: Watcher[BatchFrame],
    batch_id: str,
    after: int,
    heartbeat_s: float,
) -> None:
    seen = after
    out: list[bytes] = []
    size = 0
    async for item in catch_up(js, fanout, spec, watcher, after=after):
        out.append(item.data)
        size += len(item.data)
        seen = item.seq
        if item.final is not None:
            out.append(end_frame(batch_id, item.final))
            await watcher.write(response, b"".join(out))
            return
        if size >= WRITE_BYTES:
            await watcher.write(response, b"".join(out))
            out, size = [], 0
    if out:
        await watcher.write(response, b"".join(out))
    while True:
        items = await watcher.take(heartbeat_s)
        if not items:
            await watcher.write(response, b": heartbeat\n\n")
            continue
        out = []
        for item in items:
            if item.seq <= seen:
                continue  # the replay sent it
            seen = item.seq
            out.append(item.data)
            if item.final is not None:
                out.append(end_frame(batch_id, item.final))
                await watcher.write(response, b"".join(out))
                return
        if out:
            await watcher.write(response, b"".join(out))


class _Status(msgspec.Struct):
    status: BatchStatus = "succeeded"


_status = msgspec.json.Decoder(_Status)


def final_status(data: bytes) -> BatchStatus:
    """The status a `batch.finalized` payload carries."""
    try:
        return _status.decode(data).status
    except msgspec.DecodeError:
        return "failed"
