"""Publishing events to JetStream with deduplication and acknowledgement.

A core publish with a reply inbox, and one wildcard subscription collecting every PubAck, is
several times faster than `js.publish` (see the bus notes). Every event goes out with
`Nats-Msg-Id = event.msg_id()`, its type and schema version, and the W3C `traceparent` of the
current span. A publish that times out is retried with the same id: if the first attempt was in
fact stored, the retry comes back `duplicate`, which is success.

JetStream drops a repeated id only inside the stream's duplicate window (CASES: 2 minutes), and
keeps each id in RAM for that long. Beyond it, `stored` finds an event's copy by reading its
subject (one direct read of the subject's last message; a few more on a subject several runs share,
a case's trials), and `publish_missing` publishes only what is not stored: the consumer loop uses
it for every redelivered message, so a stage that comes back an hour after a crash still does not
publish its output twice.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js.errors import NotFoundError

from evalbus_contracts import encode
from evalbus_contracts.events import CaseRequested, EventBase, EventKey
from evalbus_contracts.streams import stream_of
from evalbus_runtime.errors import PayloadTooLargeError, PublishFailedError
from evalbus_runtime.tracing import inject_run_traceparent, inject_traceparent

log = logging.getLogger("evalbus.publisher")


@dataclass(frozen=True, slots=True)
class PubAck:
    """JetStream's answer to one publish."""

    stream: str
    seq: int
    duplicate: bool


def _parse_ack(data: bytes) -> PubAck | str:
    try:
        doc = msgspec.json.decode(data)
    except msgspec.DecodeError:
        return f"unreadable PubAck {data[:200]!r}"
    if not isinstance(doc, dict):
        return f"unexpected PubAck {data[:200]!r}"
    if "error" in doc:
        err = doc["error"]
        return str(err.get("description", err)) if isinstance(err, dict) else str(err)
    return PubAck(stream=str(doc.get("stream", "")), seq=int(doc.get("seq", 0)), duplicate=bool(doc.get("duplicate")))


def event_headers(event: EventBase, extra: Mapping[str, str] | None = None) -> dict[str, str]:
    """The headers every event goes out with: its dedup id, type, schema version, `traceparent`
    (a `case.requested` starts its run's own trace, linked to the current span)."""
    headers = {"Nats-Msg-Id": event.msg_id(), "Evalbus-Type": event.type, "Evalbus-Version": str(event.v)}
    if extra:
        headers.update(extra)
    if isinstance(event, CaseRequested) and event.run_id:
        attributes = {"evalbus.batch_id": event.batch_id or "", "evalbus.case_id": event.case_id or ""}
        inject_run_traceparent(headers, event.run_id, {**attributes, "evalbus.attempt": str(event.attempt)})
    else:
        inject_traceparent(headers)
    return headers


SCAN_MAX = 64
"""Messages of one subject `stored` reads before it gives up (a case's trials and attempts share
its subjects; more than this many is no subject evalbus writes)."""
LOOKUPS_AT_ONCE = 64
"""Reads `publish_missing` has in flight at once (a redelivered fan-out checks every case)."""


def _expire(fut: asyncio.Future[PubAck | str]) -> None:
    if not fut.done():
        fut.set_exception(TimeoutError())


class Publisher:
    """Publishes events (or raw payloads) to JetStream and awaits their PubAcks."""

    def __init__(self, nc: NatsClient, *, timeout_s: float = 5.0, attempts: int = 5) -> None:
        self._nc = nc
        self._timeout_s = timeout_s
        self._attempts = attempts
        self._prefix = nc.new_inbox()
        self._ids = itertools.count(1)
        self._waiting: dict[str, asyncio.Future[PubAck | str]] = {}
        self._sub: Subscription | None = None

    async def start(self) -> None:
        """Subscribe to the PubAck inbox (once)."""
        if self._sub is None:
            self._sub = await self._nc.subscribe(
                f"{self._prefix}.*", cb=self._on_ack, pending_msgs_limit=1_000_000, pending_bytes_limit=-1
            )

    async def stop(self) -> None:
        """Stop collecting PubAcks; pending publishes fail."""
        if self._sub is not None:
            await self._sub.unsubscribe()
            self._sub = None
        for fut in self._waiting.values():
            if not fut.done():
                fut.set_result("publisher stopped")
        self._waiting.clear()

    async def _on_ack(self, msg: Msg) -> None:
        fut = self._waiting.pop(msg.subject, None)
        if fut is None or fut.done():
            return
        headers = msg.headers or {}
        status = headers.get("Status")
        if status is not None and not msg.data:
            fut.set_result(f"no stream answered (status {status})" if status == "503" else f"status {status}")
            return
        fut.set_result(_parse_ack(msg.data))

    async def publish_event(self, event: EventBase, *, headers: Mapping[str, str] | None = None) -> PubAck:
        """Publish one event on its subject with its dedup id; wait for the PubAck."""
        return await self.publish_raw(event.subject(), encode(event), event_headers(event, headers))

    async def publish_nowait(self, event: EventBase) -> None:
        """Publish one event without waiting for JetStream's acknowledgement: for best-effort data
        (the LIVE stream's log chunks and marks), where a lost message costs a live view a line,
        never a result, and an ack round trip per chunk would slow the run down.

        Without `Nats-Msg-Id`: such a publish is sent once and never retried, so there is nothing
        for JetStream to deduplicate, and each id would sit in the stream's duplicate table for
        its whole window (about ten per case, the largest part of nats-server's work per case)."""
        headers = event_headers(event)
        del headers["Nats-Msg-Id"]
        await self._nc.publish(event.subject(), encode(event), headers=headers)

    async def publish_events(self, events: Iterable[EventBase]) -> list[PubAck]:
        """Publish several events concurrently; all must be acknowledged."""
        batch = list(events)
        if not batch:
            return []
        if len(batch) == 1:
            return [await self.publish_event(batch[0])]
        return list(await asyncio.gather(*(self.publish_event(e) for e in batch)))

    async def stored(self, key: EventKey) -> PubAck | None:
        """The stored copy of the event with this subject and `Nats-Msg-Id` (its stream, its
        sequence, `duplicate` set), or None when its stream has none. A read that fails raises:
        the caller retries rather than publish what may be there."""
        subject, msg_id = key
        stream = stream_of(subject)
        if stream is None:
            return None
        js = self._nc.jetstream()
        try:
            last = await js.get_msg(stream.name, subject=subject)
        except NotFoundError:
            return None
        if (last.headers or {}).get("Nats-Msg-Id") == msg_id:
            return PubAck(stream=stream.name, seq=int(last.seq or 0), duplicate=True)
        seq = 1
        for _ in range(SCAN_MAX):
            try:
                msg = await js.get_msg(stream.name, seq=seq, subject=subject, next=True)
            except NotFoundError:
                return None
            found = int(msg.seq or 0)
            if found >= int(last.seq or 0):
                return None  # the last one, read above
            if (msg.headers or {}).get("Nats-Msg-Id") == msg_id:
                return PubAck(stream=stream.name, seq=found, duplicate=True)
            seq = found + 1
        log.warning("%s holds more than %d messages: %s not looked up further", subject, SCAN_MAX, msg_id)
        return None

    async def publish_missing(self, events: Iterable[EventBase]) -> list[PubAck]:
        """Publish those of `events` whose copy is not stored yet (`stored`); the acks of all, the
        ones found marked `duplicate`. For a redelivered message, whose first delivery may have
        published them longer ago than the duplicate window."""
        gate = asyncio.Semaphore(LOOKUPS_AT_ONCE)

        async def one(event: EventBase) -> PubAck:
            async with gate:
                found = await self.stored((event.subject(), event.msg_id()))
            if found is not None:
                log.info("%s %s is stored already (seq %d): not published again", event.type, event.msg_id(), found.seq)
                return found
            return await self.publish_event(event)

        return list(await asyncio.gather(*(one(e) for e in events)))

    async def publish_raw(self, subject: str, payload: bytes, headers: Mapping[str, str] | None = None) -> PubAck:
        """Publish bytes and wait for the PubAck, retrying timeouts with the same headers (same msg id).
        A payload over the server's `max_payload` raises `PayloadTooLargeError` at once."""
        await self.start()
        limit = int(getattr(self._nc, "max_payload", 0) or 0)
        if limit and len(payload) > limit:
            raise PayloadTooLargeError(
                f"publish to {subject}: the event is {len(payload)} bytes, more than the server's max_payload "
                f"({limit}); large payloads belong in the object store (`payload_inline_max_bytes`)"
            )
        last_error = "no attempt"
        delay = 0.05
        for attempt in range(1, self._attempts + 1):
            inbox = f"{self._prefix}.{next(self._ids)}"
            loop = asyncio.get_running_loop()
            fut: asyncio.Future[PubAck | str] = loop.create_future()
            self._waiting[inbox] = fut
            # A timer on the future is much cheaper than asyncio.wait_for (a task per publish).
            timer = loop.call_later(self._timeout_s, _expire, fut)
            try:
                await self._nc.publish(subject, payload, reply=inbox, headers=dict(headers) if headers else None)
                result = await fut
            except TimeoutError:
                last_error = f"no PubAck within {self._timeout_s}s"
            except Exception as e:
                last_error = f"{type(e).__name__}: {e}"
            else:
                if isinstance(result, PubAck):
                    return result
                last_error = result
            finally:
                timer.cancel()
                self._waiting.pop(inbox, None)
            if attempt < self._attempts:
                log.warning("publish to %s failed (attempt %d): %s", subject, attempt, last_error)
                await asyncio.sleep(delay)
                delay = min(delay * 4, 2.0)
        raise PublishFailedError(f"publish to {subject} failed: {last_error}")
