"""Server-sent events of one batch, straight from the CASES stream.

Each connection reads the batch's subjects (`subjects.batch_filter`) through an ordered,
ephemeral JetStream consumer, so every gateway replica serves the same stream with no state of
its own. Frames:

- `id:` the stream sequence, `event:` the event type, `data:` the event JSON as published;
- `Last-Event-ID: n` resumes exactly after sequence n (`opt_start_seq = n + 1`);
- a `: heartbeat` comment after every quiet `heartbeat_s`;
- after the batch's `batch.finalized`, `event: end` with `{"batch_id", "status"}`, then the
  stream closes. A client resuming after the `batch.finalized` frame gets `end` at once.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from typing import Any

import msgspec
import nats.errors
from aiohttp import web
from nats.js import JetStreamContext
from nats.js import api as jsapi

from evalbus_contracts import encode, subjects
from evalbus_contracts.streams import CASES
from evalbus_gateway.api.models import StreamEnd
from evalbus_gateway.api.reads import finalized_on_stream
from evalbus_gateway.errors import NotReadyError
from evalbus_gateway.store.queries import BatchStatus

log = logging.getLogger("evalbus.gateway.sse")

END_EVENT = "end"
"""The last event of a stream: the batch is finalized."""
_IDLE_HEARTBEAT_S = 5.0
"""JetStream's idle heartbeat on the ordered consumer (how it notices a lost consumer)."""


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


async def stream_batch_events(
    request: web.Request,
    js: JetStreamContext,
    batch_id: str,
    *,
    last_event_id: int | None,
    heartbeat_s: float,
    streams: EventStreams,
) -> web.StreamResponse:
    """Serve the batch's events as SSE until its `batch.finalized` (or the client leaves)."""
    if streams.closing():
        raise NotReadyError("the gateway is stopping; reconnect to another replica")
    finalized = await finalized_on_stream(js, batch_id) if last_event_id is not None else None
    sub = None
    if finalized is None or last_event_id is None or finalized[0] > last_event_id:
        filters = subjects.batch_filter(batch_id)
        config = jsapi.ConsumerConfig(filter_subjects=filters)
        if last_event_id is not None:
            config.deliver_policy = jsapi.DeliverPolicy.BY_START_SEQUENCE
            config.opt_start_seq = last_event_id + 1
        sub = await js.subscribe(
            filters[0], stream=CASES.name, ordered_consumer=True, config=config, idle_heartbeat=_IDLE_HEARTBEAT_S
        )
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        },
    )
    streams.enter()
    try:
        await response.prepare(request)
        await response.write(b": evalbus batch events\n\n")
        if sub is None and finalized is not None:
            await response.write(end_frame(batch_id, finalized[1].status))
            return response
        await _pump(response, sub, batch_id, heartbeat_s)
    except ConnectionResetError:
        pass  # the client left
    except asyncio.CancelledError:
        if not streams.closing():
            raise
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()  # closed by shutdown: end the response; the client resumes elsewhere
    except nats.errors.Error as e:
        log.info("event stream of %s ended: %s", batch_id, e)
    finally:
        streams.leave()
        if sub is not None:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
    return response


async def _pump(response: web.StreamResponse, sub: Any, batch_id: str, heartbeat_s: float) -> None:
    while True:
        try:
            msg = await sub.next_msg(timeout=heartbeat_s)
        except nats.errors.TimeoutError:
            await response.write(b": heartbeat\n\n")
            continue
        kind = event_type(msg.headers, msg.data)
        await response.write(frame(msg.data, event=kind, event_id=int(msg.metadata.sequence.stream)))
        if kind == "batch.finalized":
            await response.write(end_frame(batch_id, final_status(msg.data)))
            return


class _Status(msgspec.Struct):
    status: BatchStatus = "succeeded"


_status = msgspec.json.Decoder(_Status)


def final_status(data: bytes) -> BatchStatus:
    """The status a `batch.finalized` payload carries."""
    try:
        return _status.decode(data).status
    except msgspec.DecodeError:
        return "failed"
