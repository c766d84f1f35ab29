"""Publishing events to JetStream with deduplication and acknowledgement.

A core publish with a reply inbox, and one wildcard subscription collecting every PubAck, is
several times faster than `js.publish` (see the bus notes). Every event goes out with
`Nats-Msg-Id = event.msg_id()`, its type and schema version, and the W3C `traceparent` of the
current span. A publish that times out is retried with the same id: if the first attempt was in
fact stored, the retry comes back `duplicate`, which is success.
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

from evalbus_contracts import encode
from evalbus_contracts.events import CaseRequested, EventBase
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
