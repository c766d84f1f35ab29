"""The in-process recorder: an application offers its production observations with `record()`,
a background forwarder publishes them to `obs.received.<target>` for the collector to sample.

    recorder = Recorder("nats://127.0.0.1:4222", target="support-bot",
                        metadata={"deployment.environment": "prod"}, sample_ratio=0.1)
    recorder.start()
    recorder.record(trace_id=span.get_span_context().trace_id, input=question, output=answer)
    ...
    recorder.close(timeout_s=10)    # or: with Recorder(...) as recorder: ...

**The request path.** `record()` checks its arguments' types, makes the sampling decision and
appends a tuple of its arguments to a bounded queue under a lock held for a few hundred
nanoseconds. It encodes nothing, does no I/O, makes no cross-thread call while the forwarder is
busy (only the first observation after it went idle wakes it), and never raises: every refusal is
an `Outcome` and a count with its reason in `stats()`.

**Sampling.** The decision is `evalbus_contracts.sampling`'s, the same as OpenTelemetry's
`TraceIdRatioBased` (the low 64 bits of the trace id; for an observation without a trace id, of
the SHA-256 of its observation id, as the collector does). So what the recorder forwards at ratio r
contains what any online suite at a ratio r' ≤ r samples; the collector still applies each suite's
own ratio (and target, filters) to what arrives. Keep `sample_ratio` at 1.0 (the default) unless
every suite of the target samples at most that.

**The forwarder** is a thread of its own with its own asyncio loop and NATS connection, whatever
the application runs on. Using the application's loop when there is one was considered and not
chosen: a synchronous application (Flask, Django, a script) has none; an application's loop that
a CPU-bound handler stalls would stall publishing too (and the queue would fill); `asyncio.run`
ending cancels tasks that hold accepted observations; and a recorder owning its loop behaves the
same in every application, which is what its tests and benchmark measure. The cost is one thread
(sharing the GIL with the application, as the encoding work would anyway) and one connection.

**Nothing lost silently.** An accepted observation ends published (acknowledged by JetStream,
exactly once on the stream: its `Nats-Msg-Id` is the event's `msg_id()`) or counted as lost with
its reason (`LostReason`); a refused one is counted as dropped with its reason (`DropReason`). While NATS is down the forwarder retries with backoff and the queue
(bounded in items and bytes) absorbs the backlog; past its bound `record()` drops with
`queue_full`. `close()` drains within its timeout and counts what it could not send as `unsent`.
The queue is in memory: a process that crashes loses what it held (`close()` at exit is
registered, so an orderly exit drains, waiting up to its default 10 s). A process forked after
`start()` (a pre-forking server) has no forwarder thread in the child: start the recorder in each
worker, after the fork.
"""

from __future__ import annotations

import asyncio
import atexit
import os
import threading
import time
from collections.abc import Iterable, Mapping
from types import TracebackType
from typing import Any

from evalbus.online.forwarder import Forwarder
from evalbus.online.ledger import Item, Ledger, Outcome, RecorderStats
from evalbus_contracts.sampling import TRACE_ID_LIMIT, observation_key, ratio_bound, valid_trace_id
from evalbus_contracts.trace import TraceEvent

DEFAULT_MAX_BYTES = 900_000
"""Largest observation forwarded (encoded JSON bytes): the collector's own limit for an assembled
trace, under NATS's default 1 MiB payload."""
TRACE_EVENT_BYTES = 256
"""What one trace event is estimated to weigh in the queue's byte bound (the request path does
not encode it)."""
ITEM_BYTES = 256
"""What an observation's ids and fields are estimated to weigh besides its text and trace."""

_ALL = TRACE_ID_LIMIT + 1


class Recorder:
    """Offers an application's observations to evalbus's online evaluation.

    `servers`: the NATS URL(s), comma-separated. `target`: the default target (the service name
    online suites select on) for `record()` calls that give none. `metadata`: key/values every
    observation carries under its own (like OpenTelemetry resource attributes: what suites filter
    on, e.g. `deployment.environment`). `sample_ratio`: forward only observations inside this
    ratio (see the module docstring). `max_queue` / `max_queue_bytes`: the queue's bound (items,
    estimated bytes). `max_bytes`: the largest observation forwarded. `batch_size`: observations
    per publish window. `ack_timeout_s`: how long a window waits for its PubAcks before publishing
    the missing ones again. `connect_options`: passed to `nats.connect` (credentials, TLS...).
    """

    def __init__(
        self,
        servers: str,
        *,
        target: str | None = None,
        metadata: Mapping[str, str] | None = None,
        sample_ratio: float = 1.0,
        max_queue: int = 10_000,
        max_queue_bytes: int = 64 * 1024 * 1024,
        max_bytes: int = DEFAULT_MAX_BYTES,
        batch_size: int = 512,
        ack_timeout_s: float = 5.0,
        name: str = "evalbus-recorder",
        connect_options: Mapping[str, Any] | None = None,
        close_at_exit: bool = True,
    ) -> None:
        if not 0.0 <= sample_ratio <= 1.0:
            raise ValueError(f"sample_ratio must be within [0, 1], not {sample_ratio}")
        if max_queue < 1 or max_queue_bytes < 1 or max_bytes < 1 or batch_size < 1:
            raise ValueError("max_queue, max_queue_bytes, max_bytes and batch_size must be positive")
        urls = [u.strip() for u in servers.split(",") if u.strip()]
        if not urls:
            raise ValueError("no NATS server URL given")
        self.target = target
        """The default target."""
        self.sample_ratio = sample_ratio
        """The recorder's sample ratio."""
        self._bound = ratio_bound(sample_ratio)
        self._max_bytes = max_bytes
        self._ledger = Ledger(max_items=max_queue, max_bytes=max_queue_bytes)
        self._forwarder = Forwarder(
            self._ledger,
            urls,
            name=name,
            batch_size=batch_size,
            ack_timeout_s=ack_timeout_s,
            max_bytes=max_bytes,
            metadata=dict(metadata or {}),
            connect_options=connect_options or {},
        )
        self._close_at_exit = close_at_exit
        self._state_lock = threading.Lock()
        self._started = False
        self._closed_stats: RecorderStats | None = None

    # ------------------------------------------------------------ lifecycle

    def start(self) -> Recorder:
        """Start the forwarder (it connects in the background: NATS need not be up yet). Idempotent;
        a closed recorder does not start again."""
        with self._state_lock:
            if self._started or self._closed_stats is not None:
                return self
            self._started = True
            self._forwarder.start()
            with self._ledger.lock:
                self._ledger.running = True
            if self._close_at_exit:
                atexit.register(self.close)
        return self

    def close(self, timeout_s: float = 10.0) -> RecorderStats:
        """Stop accepting, publish everything queued within `timeout_s` seconds (0: give up at
        once), count what was not acknowledged by then as `unsent`; the final counts. Blocks the
        calling thread (from a coroutine, use `aclose`). Idempotent."""
        with self._state_lock:
            if self._closed_stats is not None:
                return self._closed_stats
            self._ledger.stop()
            if self._started:
                if self._close_at_exit:
                    atexit.unregister(self.close)
                if not self._forwarder.close(timeout_s):
                    self._ledger.last_error = "the forwarder did not drain in time: its counts may still change"
            self._closed_stats = self._ledger.snapshot()
            return self._closed_stats

    async def aclose(self, timeout_s: float = 10.0) -> RecorderStats:
        """`close` from a coroutine, without blocking the event loop."""
        return await asyncio.to_thread(self.close, timeout_s)

    def stats(self) -> RecorderStats:
        """The counts now (see `RecorderStats`)."""
        return self._ledger.snapshot()

    def __enter__(self) -> Recorder:
        return self.start()

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()

    async def __aenter__(self) -> Recorder:
        return self.start()

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.aclose()

    # ------------------------------------------------------------ the request path

    def record(
        self,
        *,
        trace_id: str | int | None = None,
        observation_id: str | None = None,
        input: str | None = None,
        output: str | None = None,
        expected: str | None = None,
        trace: Iterable[TraceEvent] = (),
        metadata: Mapping[str, str] | None = None,
        target: str | None = None,
    ) -> Outcome:
        """Offer one observation; never raises, never blocks (a lock held for nanoseconds aside).

        `trace_id`: the OpenTelemetry trace id, 32 hex digits or the SDK's int
        (`span.get_span_context().trace_id`); the sampling key. `observation_id`: unique per
        target (default: the trace id; without either, a random id). `input` / `output` /
        `expected`: what the user asked, what the agent answered, a reference answer. `trace`:
        trace events (`evalbus_contracts.trace`). `metadata`: key/values over the recorder's
        (numbers and booleans become text). `target`: over the recorder's default.

        Returns `Outcome.ACCEPTED` (truthy) when queued for publishing; otherwise why not:
        `SAMPLED_OUT`, or a drop (`NOT_STARTED`, `CLOSED`, `INVALID`, `INVALID_TRACE_ID`,
        `TOO_LARGE`, `QUEUE_FULL`), each counted in `stats()`. The values passed are read later by
        the forwarder thread: the metadata mapping and the trace are copied (shallowly), trace
        events are frozen.
        """
        ledger = self._ledger
        try:
            if target is None:
                target = self.target
            if type(target) is not str or not target:
                return ledger.refuse(Outcome.INVALID)
            if trace_id is not None:
                if type(trace_id) is int:
                    if not 0 < trace_id <= 0xFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFFF:
                        return ledger.refuse(Outcome.INVALID_TRACE_ID)
                    trace_id = f"{trace_id:032x}"
                elif type(trace_id) is str:
                    if not valid_trace_id(trace_id):
                        trace_id = trace_id.lower()
                        if not valid_trace_id(trace_id):
                            return ledger.refuse(Outcome.INVALID_TRACE_ID)
                else:
                    return ledger.refuse(Outcome.INVALID_TRACE_ID)
                if observation_id is None:
                    observation_id = trace_id
            elif observation_id is None:
                observation_id = os.urandom(16).hex()
            if type(observation_id) is not str or not observation_id:
                return ledger.refuse(Outcome.INVALID)
            if self._bound < _ALL:
                key = trace_id if trace_id is not None else observation_key(observation_id)
                if int(key, 16) & TRACE_ID_LIMIT >= self._bound:
                    return ledger.refuse(Outcome.SAMPLED_OUT)
            size = 0
            for text in (input, output, expected):
                if text is not None:
                    if type(text) is not str:
                        return ledger.refuse(Outcome.INVALID)
                    size += len(text)
            if size > self._max_bytes:
                return ledger.refuse(Outcome.TOO_LARGE)
            if type(trace) is tuple:
                events = trace
            elif isinstance(trace, str | bytes | Mapping):
                return ledger.refuse(Outcome.INVALID)
            else:
                events = tuple(trace)
            meta = dict(metadata) if metadata else None
            size += ITEM_BYTES + TRACE_EVENT_BYTES * len(events)
            item: Item = (
                time.time_ns(),
                target,
                observation_id,
                trace_id,
                input,
                output,
                expected,
                events,
                meta,
                size,
            )
            return ledger.offer(item)
        except Exception:
            return ledger.refuse(Outcome.INVALID)
