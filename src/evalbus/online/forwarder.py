"""The recorder's forwarder: a thread of its own with its own asyncio loop and NATS connection,
draining the ledger's queue to `obs.received.<target>` with `Nats-Msg-Id = event.msg_id()`.

It takes up to `batch_size` observations at a time, builds and encodes their events (off the
request path), checks each decodes as an `ObservationReceived` (so nothing it publishes is a dead
letter at the collector) and is under the size limit, then publishes the whole window at once:
core publishes with a reply inbox each, one wildcard subscription collecting the PubAcks, one timer
for the window (no task, future or timer per message). Observations not acknowledged — NATS down,
no stream yet (503), a PubAck timeout — are published again after a backoff with jitter (50 ms
doubling to 1 s), with the same message id, so JetStream stores each exactly once. While NATS is
unreachable nothing is published (the client's reconnect buffer is not filled with copies): the
window waits for the connection, and `record()` keeps filling the bounded queue, never blocked.

`close()` gives it a deadline: it drains everything queued, every wait bounded by the deadline,
and counts what was not acknowledged by then as `unsent`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import random
import threading
import time
from collections.abc import Callable, Mapping
from datetime import UTC, datetime
from typing import Any

import msgspec
import nats
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from evalbus.online.ledger import Item, Ledger
from evalbus_contracts import ObservationReceived, encode

log = logging.getLogger("evalbus.online.recorder")

BACKOFF_FIRST_S = 0.05
"""First pause before a window's unacknowledged observations are published again."""
BACKOFF_MAX_S = 1.0
"""Longest pause (so a recovered NATS is used within about a second)."""

_decoder = msgspec.json.Decoder(ObservationReceived)


class _AckError(msgspec.Struct, frozen=True):
    code: int = 0
    description: str = ""


class _Ack(msgspec.Struct, frozen=True):
    stream: str = ""
    seq: int = 0
    duplicate: bool = False
    error: _AckError | None = None


_ack_decoder = msgspec.json.Decoder(_Ack)

_OK = 0
_DUPLICATE = 1
_RETRY = 2
_REJECTED = 3


def _text(value: object) -> str:
    if isinstance(value, str):
        return value
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return str(value)
    raise TypeError(f"metadata value of type {type(value).__name__}")


def build_event(item: Item, defaults: Mapping[str, str]) -> ObservationReceived:
    """The event of one queued observation (its metadata over the recorder's defaults; numbers
    and booleans in metadata become text)."""
    ts_ns, target, observation_id, trace_id, inp, out, expected, trace, metadata, _ = item
    merged = dict(defaults)
    if metadata:
        for key, value in metadata.items():
            if not isinstance(key, str):
                raise TypeError(f"metadata key of type {type(key).__name__}")
            merged[key] = _text(value)
    return ObservationReceived(
        ts=datetime.fromtimestamp(ts_ns / 1e9, UTC),
        target=target,
        observation_id=observation_id,
        trace_id=trace_id,
        input=inp,
        output=out,
        expected=expected,
        trace=trace,
        metadata=merged,
    )


class _Window:
    """One publish window: the PubAck answer per message (None: none yet)."""

    __slots__ = ("answers", "broken", "id", "left")

    def __init__(self, window_id: int, size: int) -> None:
        self.id = window_id
        self.answers: list[int | None] = [None] * size
        self.left = size
        self.broken = False
        """The connection dropped while it waited: its missing PubAcks will not come."""


class _Outgoing:
    """An encoded observation waiting for its PubAck."""

    __slots__ = ("headers", "payload", "size", "subject")

    def __init__(self, subject: str, payload: bytes, headers: dict[str, str], size: int) -> None:
        self.subject = subject
        self.payload = payload
        self.headers = headers
        self.size = size


class Forwarder:
    """The background publisher of one recorder."""

    def __init__(
        self,
        ledger: Ledger,
        servers: list[str],
        *,
        name: str,
        batch_size: int,
        ack_timeout_s: float,
        max_bytes: int,
        metadata: Mapping[str, str],
        connect_options: Mapping[str, Any],
    ) -> None:
        self._ledger = ledger
        self._servers = servers
        self._name = name
        self._batch_size = batch_size
        self._ack_timeout_s = ack_timeout_s
        self._max_bytes = max_bytes
        self._defaults = dict(metadata)
        self._connect_options = dict(connect_options)
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._wake: asyncio.Event | None = None
        self._nudge: asyncio.Future[None] | None = None
        """Resolved when a wait should look at its condition again (a PubAck window completed, the
        connection changed, `close()` set the deadline)."""
        self._ready = threading.Event()
        self._drained = threading.Event()
        self._deadline: float | None = None
        """Set by `close()`: monotonic time by which to have drained."""
        self._nc: NatsClient | None = None
        self._connecting: asyncio.Task[NatsClient] | None = None
        self._inbox = ""
        self._window: _Window | None = None
        self._windows = 0

    # ------------------------------------------------------------ thread

    def start(self) -> None:
        """Start the thread and wait until its loop runs (not for NATS: it connects in the background)."""
        thread = threading.Thread(target=self._main, name=f"{self._name}-forwarder", daemon=True)
        self._thread = thread
        thread.start()
        self._ready.wait()

    def close(self, timeout_s: float) -> bool:
        """Drain within `timeout_s`; whether the counts are final (they are: every wait is bounded)."""
        thread, loop = self._thread, self._loop
        if thread is None or loop is None:
            return True
        self._deadline = time.monotonic() + max(0.0, timeout_s)
        with contextlib.suppress(RuntimeError):  # the loop already ended
            loop.call_soon_threadsafe(self._poke)
        # Every wait of the loop is bounded by the deadline: the counts are final right after it.
        # Closing the connection comes after (at most a second is waited for it here).
        drained = self._drained.wait(max(0.0, timeout_s) + 1.0)
        thread.join(1.0)
        return drained

    def _main(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._run())
        finally:
            try:
                _end_leftover_tasks(loop)
            finally:
                loop.close()

    def _poke(self) -> None:
        if self._wake is not None:
            self._wake.set()
        self._renudge()

    def _renudge(self) -> None:
        nudge = self._nudge
        if nudge is not None and not nudge.done():
            nudge.set_result(None)

    def _wake_from_any_thread(self) -> None:
        loop = self._loop
        if loop is not None:
            with contextlib.suppress(RuntimeError):  # closed: close() counts what is left
                loop.call_soon_threadsafe(self._poke)

    # ------------------------------------------------------------ loop

    def _remaining(self) -> float | None:
        return None if self._deadline is None else self._deadline - time.monotonic()

    def _expired(self) -> bool:
        left = self._remaining()
        return left is not None and left <= 0

    async def _run(self) -> None:
        ledger = self._ledger
        self._wake = asyncio.Event()
        ledger.wake = self._wake_from_any_thread
        self._connecting = asyncio.create_task(self._connect(), name="recorder-connect")
        self._ready.set()
        try:
            while True:
                if self._expired():
                    self._give_up()
                    break
                items = ledger.take(self._batch_size)
                if items:
                    await self._forward(items)
                    continue
                if self._deadline is not None:
                    break
                self._wake.clear()
                ledger.idle = True
                if ledger.queue or self._deadline is not None:
                    ledger.idle = False
                    continue
                await self._wake.wait()
                ledger.idle = False
        finally:
            ledger.wake = None
            self._drained.set()
            await self._disconnect()

    def _give_up(self) -> None:
        """The deadline passed: whatever is still queued is `unsent`."""
        ledger = self._ledger
        while True:
            items = ledger.take(10_000)
            if not items:
                return
            ledger.resolve(len(items), sum(i[9] for i in items), reason="unsent")

    async def _forward(self, items: list[Item]) -> None:
        """Encode, publish until acknowledged (or the deadline), resolve in the ledger."""
        ledger = self._ledger
        outgoing: list[_Outgoing] = []
        for item in items:
            size = item[9]
            try:
                event = build_event(item, self._defaults)
                payload = encode(event)
                if len(payload) <= self._max_bytes:
                    _decoder.decode(payload)
            except Exception as e:
                ledger.last_error = f"observation {item[2]!r} is invalid: {type(e).__name__}: {e}"
                ledger.resolve(1, size, reason="invalid")
                continue
            if len(payload) > self._max_bytes:
                ledger.resolve(1, size, reason="too_large")
                continue
            headers = {"Nats-Msg-Id": event.msg_id(), "Evalbus-Type": event.type, "Evalbus-Version": str(event.v)}
            outgoing.append(_Outgoing(event.subject(), payload, headers, size))
        backoff = BACKOFF_FIRST_S
        while outgoing:
            if self._expired():
                ledger.resolve(len(outgoing), sum(o.size for o in outgoing), reason="unsent")
                return
            nc = self._nc
            if nc is None or not nc.is_connected:
                await self._until_link_changes(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
                continue
            answers = await self._publish_window(nc, outgoing)
            retry: list[_Outgoing] = []
            published = duplicates = rejected = 0
            size_done = size_rejected = 0
            for o, answer in zip(outgoing, answers, strict=True):
                if answer in (_OK, _DUPLICATE):
                    published += 1
                    duplicates += answer == _DUPLICATE
                    size_done += o.size
                elif answer == _REJECTED:
                    rejected += 1
                    size_rejected += o.size
                else:
                    retry.append(o)
            if published:
                ledger.resolve(published, size_done, published=published, duplicates=duplicates)
            if rejected:
                ledger.resolve(rejected, size_rejected, reason="rejected")
            if retry and len(retry) == len(outgoing):
                await self._pause(backoff)
                backoff = min(backoff * 2, BACKOFF_MAX_S)
            elif retry:
                backoff = BACKOFF_FIRST_S
            outgoing = retry

    async def _wait(self, until: Callable[[], bool], seconds: float) -> None:
        """Wait until `until()` holds, `seconds` pass or the deadline does (looked at again on
        every nudge, so a deadline set meanwhile by `close()` counts)."""
        loop = asyncio.get_running_loop()
        end = loop.time() + seconds
        while not until():
            limit = end - loop.time()
            left = self._remaining()
            if left is not None:
                limit = min(limit, left)
            if limit <= 0:
                return
            nudge: asyncio.Future[None] = loop.create_future()
            self._nudge = nudge
            await asyncio.wait([nudge], timeout=limit)
            self._nudge = None

    async def _pause(self, seconds: float) -> None:
        """Sleep `seconds` (with jitter), never past the deadline."""
        await self._wait(lambda: False, seconds * random.uniform(0.5, 1.0))

    async def _until_link_changes(self, seconds: float) -> None:
        """Wait until the connection is (back) up or `seconds` pass, never past the deadline."""
        await self._wait(lambda: self._nc is not None and self._nc.is_connected, seconds)

    async def _publish_window(self, nc: NatsClient, outgoing: list[_Outgoing]) -> list[int | None]:
        """Publish every message of the window; wait for their PubAcks (or the timeout, the
        deadline, a disconnection); the answer per message (None: none came)."""
        self._windows += 1
        window = _Window(self._windows, len(outgoing))
        self._window = window
        prefix = f"{self._inbox}.{window.id}."
        try:
            for i, o in enumerate(outgoing):
                await nc.publish(o.subject, o.payload, reply=f"{prefix}{i}", headers=o.headers)
        except Exception as e:
            self._ledger.last_error = f"publish failed: {type(e).__name__}: {e}"
        else:
            await self._wait(lambda: window.left == 0 or window.broken, self._ack_timeout_s)
            if window.left and not window.broken:
                self._ledger.last_error = f"{window.left} of {len(outgoing)} PubAcks not received in time"
        finally:
            self._window = None
        return window.answers

    async def _on_ack(self, msg: Msg) -> None:
        window = self._window
        if window is None:
            return
        _, window_id, index = msg.subject.rsplit(".", 2)
        if int(window_id) != window.id:
            return  # the answer to a window already given up on: its retry gets `duplicate`
        i = int(index)
        if window.answers[i] is not None:
            return
        window.answers[i] = self._answer(msg)
        window.left -= 1
        if window.left == 0:
            self._renudge()

    def _answer(self, msg: Msg) -> int:
        headers = msg.headers or {}
        status = headers.get("Status")
        if status is not None and not msg.data:
            self._ledger.last_error = (
                "no stream answered (status 503): is the OBSERVATIONS stream defined?"
                if status == "503"
                else f"status {status}"
            )
            return _RETRY
        try:
            ack = _ack_decoder.decode(msg.data)
        except msgspec.DecodeError:
            self._ledger.last_error = f"unreadable PubAck {msg.data[:200]!r}"
            return _RETRY
        if ack.error is not None:
            self._ledger.last_error = f"JetStream error {ack.error.code}: {ack.error.description}"
            return _RETRY if ack.error.code >= 500 or ack.error.code == 0 else _REJECTED
        return _DUPLICATE if ack.duplicate else _OK

    # ------------------------------------------------------------ connection

    async def _connect(self) -> NatsClient:
        """Connect, retrying without end (the first connection too); the loop cancels it at close."""
        ledger = self._ledger

        async def error_cb(e: Exception) -> None:
            ledger.last_error = f"nats: {type(e).__name__}: {e}"
            log.debug("recorder nats error: %s", e)

        async def disconnected_cb() -> None:
            if ledger.connected:
                log.warning("evalbus recorder: disconnected from NATS; observations queue until it is back")
            ledger.connected = False
            window = self._window
            if window is not None:
                window.broken = True  # retry after reconnecting rather than wait for the timeout
            self._renudge()

        async def reconnected_cb() -> None:
            log.warning("evalbus recorder: reconnected to NATS")
            ledger.connected = True
            self._renudge()

        nc = await nats.connect(
            servers=self._servers,
            name=self._name,
            allow_reconnect=True,
            max_reconnect_attempts=-1,
            reconnect_time_wait=0.25,
            connect_timeout=2,
            error_cb=error_cb,
            disconnected_cb=disconnected_cb,
            reconnected_cb=reconnected_cb,
            **self._connect_options,
        )
        self._inbox = nc.new_inbox()
        await nc.subscribe(f"{self._inbox}.*.*", cb=self._on_ack, pending_msgs_limit=1_000_000, pending_bytes_limit=-1)
        self._nc = nc
        ledger.connected = True
        self._renudge()
        return nc

    async def _disconnect(self) -> None:
        task = self._connecting
        if task is not None:
            # nats-py's connect loop can swallow a cancellation (its `wait_for` on Python 3.11, its
            # own close swallowing CancelledError): cancel again until it ends, for at most 2 s.
            for _ in range(20):
                if task.done():
                    break
                task.cancel()
                await asyncio.wait([task], timeout=0.1)
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: a failed connect was already reported in last_error
        nc = self._nc
        self._nc = None
        self._ledger.connected = False
        if nc is not None:
            with contextlib.suppress(Exception):
                await asyncio.wait_for(nc.close(), 2.0)


def _end_leftover_tasks(loop: asyncio.AbstractEventLoop) -> None:
    """Cancel what the NATS client left running (its reconnect task, when it closed while
    disconnected), again while a cancellation is swallowed, for at most a second."""
    for _ in range(10):
        pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
        if not pending:
            return
        for task in pending:
            task.cancel()
        loop.run_until_complete(asyncio.wait(pending, timeout=0.1))
        for task in pending:
            if task.done() and not task.cancelled():
                task.exception()  # retrieved: the client's own teardown errors are of no interest
