"""The consumer side of the recorder: the `gateway-recorder` stage and its write batcher.

Every handler hands its message (stream sequence, subject, the raw payload and the decoded event)
to one `WriteBatcher`, which writes what has gathered — at most `max_batch` messages, at most
`max_delay_s` after the oldest arrived — with ONE `store.record` transaction. Writes run one at a
time, so a replica records in the order it received (what the store's seals expect), and while a
write is in flight the next batch gathers (group commit). A handler returns only after its batch
committed, so the chassis acks only what PostgreSQL holds: a crash before the commit redelivers
the message, a crash after it makes `record` skip the redelivery.

When the database cannot be reached or refuses sessions (`DATABASE_UNAVAILABLE`: connection
refused or lost, shutting down, not accepting connections, too many connections), the batcher
writes the same batch again with a capped backoff until it goes through, its messages held
unacknowledged (the chassis keeps their leases alive): an outage costs no delivery attempt, so a
store outage longer than `max_deliver` naks could not dead-letter what JetStream holds. Any other
failure fails the batch's messages with `Retry` (nak, then the DLQ after `max_deliver`).

For every batch the commit found complete the handler then waits for its `batch.finalized` to be
published (single-flight per process, `finalize.Finalizer`); if that fails the message is retried,
and its redelivery reports the batch complete again, so a finalisation cannot be lost.

Payloads are decoded by the stage's `decode` into `RecordedPayload` (raw bytes + event): the store
keeps the bytes as published, no re-encoding. Undecodable payloads are poison (chassis: DLQ).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import asyncpg
from prometheus_client import CollectorRegistry, Counter, Histogram

from evalbus_contracts import Event, decode_event
from evalbus_contracts.streams import GATEWAY_RECORDER
from evalbus_gateway.finalize import Finalizer, Resources
from evalbus_gateway.store import RecordedMessage, RecordOutcome, record
from evalbus_runtime import Delivery, Retry, Stage
from evalbus_runtime.consumer import check_subject

if TYPE_CHECKING:
    from evalbus_gateway.store.connections import Database

log = logging.getLogger("evalbus.gateway.recorder")

Write = Callable[[Sequence[RecordedMessage]], Awaitable[RecordOutcome]]
"""Writes one batch of messages in one transaction."""
RecordWith = Callable[["Database", Sequence[RecordedMessage]], Awaitable[RecordOutcome]]
"""How the stage records into a database: `store.record` (tests may wrap it)."""
DATABASE_UNAVAILABLE: tuple[type[BaseException], ...] = (
    OSError,
    TimeoutError,
    asyncpg.PostgresConnectionError,
    asyncpg.exceptions.AdminShutdownError,
    asyncpg.exceptions.CrashShutdownError,
    asyncpg.exceptions.CannotConnectNowError,
    asyncpg.exceptions.TooManyConnectionsError,
    asyncpg.exceptions.ObjectNotInPrerequisiteStateError,
)
"""Failures that say the database is out of reach or takes no session now (not that the batch is
wrong); `ObjectNotInPrerequisiteState` is `ALLOW_CONNECTIONS false` and lock timeouts."""
UNAVAILABLE_RETRY_S = (0.05, 0.5)
"""First and longest wait before writing a batch again while the database is unavailable (a try
every half second at most: the backlog is written within that of the database coming back)."""


@dataclass(frozen=True, slots=True)
class RecordedPayload:
    """A CASES payload as the recorder needs it: the bytes as published and the event they hold."""

    data: bytes
    """The raw payload."""
    event: Event
    """The payload decoded."""

    @property
    def type(self) -> str:
        """The event's type (the chassis matches fault points on it)."""
        return self.event.type

    @property
    def run_id(self) -> str | None:
        """The event's run id (the chassis puts it in the log context)."""
        return self.event.run_id

    @property
    def batch_id(self) -> str | None:
        """The event's batch id (the chassis puts it in the log context)."""
        return self.event.batch_id


def decode_recorded(data: bytes) -> RecordedPayload:
    """The stage's decoder: keep the raw bytes next to the decoded event (raises on poison)."""
    raw = bytes(data)
    return RecordedPayload(data=raw, event=decode_event(raw))


class RecorderMetrics:
    """What the recorder did, in the service's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.messages = Counter(
            "evalbus_recorder_messages_total",
            "Messages recorded, by result (inserted, already_recorded, duplicate, sealed, invalid)",
            ["result"],
            registry=registry,
        )
        self.batch_size = Histogram(
            "evalbus_recorder_batch_messages",
            "Messages per recorder transaction",
            buckets=(1, 5, 10, 50, 100, 250, 500, 1000, 2500),
            registry=registry,
        )
        self.write_seconds = Histogram(
            "evalbus_recorder_write_seconds",
            "Time of one recorder transaction",
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5),
            registry=registry,
        )
        self.failures = Counter(
            "evalbus_recorder_write_failures_total", "Recorder transactions that failed", registry=registry
        )

    def observe(self, size: int, seconds: float, outcome: RecordOutcome) -> None:
        """Account for one committed transaction."""
        self.batch_size.observe(size)
        self.write_seconds.observe(seconds)
        for result, count in (
            ("inserted", outcome.inserted),
            ("already_recorded", outcome.already_recorded),
            ("duplicate", outcome.duplicates),
            ("sealed", outcome.rejected_sealed),
            ("invalid", outcome.invalid),
        ):
            if count:
                self.messages.labels(result).inc(count)


@dataclass(slots=True)
class _Waiting:
    message: RecordedMessage
    done: asyncio.Future[RecordOutcome]
    arrived: float


class WriteBatcher:
    """Group commit: gathers messages and writes them in batches, one transaction at a time."""

    def __init__(
        self,
        write: Write,
        *,
        max_batch: int = 1000,
        max_delay_s: float = 0.01,
        metrics: RecorderMetrics | None = None,
    ) -> None:
        if max_batch < 1:
            raise ValueError("max_batch must be at least 1")
        self._write = write
        self._max_batch = max_batch
        self._max_delay_s = max(0.0, max_delay_s)
        self._metrics = metrics
        self._pending: list[_Waiting] = []
        self._has_items = asyncio.Event()
        self._full = asyncio.Event()
        self._closing = False
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        """Start the writer task (idempotent)."""
        if self._task is None:
            self._closing = False
            self._task = asyncio.create_task(self._run(), name="recorder-writer")

    async def stop(self) -> None:
        """Write what is pending, then stop."""
        self._closing = True
        self._has_items.set()
        self._full.set()
        if self._task is not None:
            task, self._task = self._task, None
            await task

    @property
    def pending(self) -> int:
        """Messages waiting for a write."""
        return len(self._pending)

    async def submit(self, message: RecordedMessage) -> RecordOutcome:
        """Queue `message`; return the outcome of the transaction that committed it."""
        if self._closing or self._task is None:
            raise Retry("recorder is not running")
        loop = asyncio.get_running_loop()
        waiting = _Waiting(message=message, done=loop.create_future(), arrived=loop.time())
        self._pending.append(waiting)
        self._has_items.set()
        if len(self._pending) >= self._max_batch:
            self._full.set()
        return await waiting.done

    async def _run(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            await self._has_items.wait()
            if not self._pending:
                self._has_items.clear()
                if self._closing:
                    return
                continue
            delay = self._pending[0].arrived + self._max_delay_s - loop.time()
            if delay > 0 and len(self._pending) < self._max_batch and not self._closing:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._full.wait(), delay)
            batch = self._pending[: self._max_batch]
            del self._pending[: self._max_batch]
            if len(self._pending) < self._max_batch and not self._closing:
                self._full.clear()
            await self._flush(batch)

    async def _flush(self, batch: list[_Waiting]) -> None:
        started = time.monotonic()
        wait_s, longest_s = UNAVAILABLE_RETRY_S
        try:
            while True:
                try:
                    outcome = await self._write([w.message for w in batch])
                    break
                except DATABASE_UNAVAILABLE as e:
                    if self._closing:
                        raise
                    if self._metrics is not None:
                        self._metrics.failures.inc()
                    if wait_s == UNAVAILABLE_RETRY_S[0]:
                        log.warning(
                            "database unavailable (%s: %s); holding %d messages until it is back",
                            type(e).__name__,
                            e,
                            len(batch),
                        )
                    await asyncio.sleep(wait_s)
                    wait_s = min(wait_s * 2, longest_s)
        except Exception as e:
            if self._metrics is not None:
                self._metrics.failures.inc()
            log.warning("recording %d messages failed: %s: %s", len(batch), type(e).__name__, e)
            for w in batch:
                if not w.done.done():
                    w.done.set_exception(Retry(f"recording failed: {type(e).__name__}: {e}"))
            return
        if wait_s != UNAVAILABLE_RETRY_S[0]:
            log.warning("database back: %d held messages written after %.1f s", len(batch), time.monotonic() - started)
        if self._metrics is not None:
            self._metrics.observe(len(batch), time.monotonic() - started, outcome)
        for w in batch:
            if not w.done.done():
                w.done.set_result(outcome)


class RecorderStage:
    """The `gateway-recorder` consumer: record every CASES message, then finalize complete batches."""

    def __init__(
        self,
        resources: Resources,
        finalizer: Finalizer,
        *,
        max_batch: int = 1000,
        max_delay_s: float = 0.01,
        metrics: RecorderMetrics | None = None,
        record_with: RecordWith = record,
    ) -> None:
        self._resources = resources
        self._record_with = record_with
        self._finalizer = finalizer
        self.batcher = WriteBatcher(self._write, max_batch=max_batch, max_delay_s=max_delay_s, metrics=metrics)

    async def _write(self, messages: Sequence[RecordedMessage]) -> RecordOutcome:
        return await self._record_with(self._resources.pool, messages)

    async def handle(self, payload: RecordedPayload, delivery: Delivery) -> None:
        """Record one message; return (ack) once it is committed and its batch, if now complete,
        has its `batch.finalized` published."""
        check_subject(payload.event, delivery.subject)
        message = RecordedMessage(delivery.stream_seq, delivery.subject, payload.data, payload.event)
        outcome = await self.batcher.submit(message)
        batch_id = payload.event.batch_id
        if batch_id is not None and batch_id in outcome.complete_batches:
            try:
                await self._finalizer.finalize(batch_id)
            except Exception as e:
                raise Retry(f"finalizing {batch_id} failed: {type(e).__name__}: {e}") from e

    def stage(self, concurrency: int = 2048) -> Stage:
        """The chassis stage: any decodable CASES event, `concurrency` messages held at once."""
        return Stage(
            consumer=GATEWAY_RECORDER,
            handler=self.handle,
            decode=decode_recorded,
            concurrency=concurrency,
        )
