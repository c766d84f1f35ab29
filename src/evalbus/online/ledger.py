"""The recorder's bounded queue and its counts, shared by the application's threads (which offer
observations) and the forwarder thread (which takes, publishes and resolves them).

One `threading.Lock` guards the counts and the bound; it is held for a few hundred nanoseconds (a
comparison, two additions and a `deque.append`), never across I/O or encoding. Every observation
offered ends in exactly one count: `sampled_out`, a drop reason, or `accepted` — and every accepted
one later in exactly one of `published` or a `lost` reason (`pending` until then):

    offered  == accepted + sampled_out + sum(dropped.values())
    accepted == published + pending + sum(lost.values())
"""

from __future__ import annotations

import enum
import threading
from collections import Counter, deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal, TypeAlias

from evalbus_contracts.trace import TraceEvent

DropReason = Literal["not_started", "closed", "invalid", "invalid_trace_id", "too_large", "queue_full"]
"""Why `record()` refused an observation: `not_started` (before `start()`), `closed` (after
`close()`), `invalid` (an argument of the wrong type, an empty target), `invalid_trace_id` (not 32
hex digits, or all zero), `too_large` (its text alone is over the size limit), `queue_full` (the
queue holds its item or byte limit: the bus is slow or unreachable)."""

LostReason = Literal["too_large", "invalid", "rejected", "unsent"]
"""Why the forwarder did not publish an observation `record()` had accepted: `too_large` (the
encoded observation is over the limit), `invalid` (it does not encode, or would not decode as an
`ObservationReceived`, e.g. a trace event with a field of the wrong type or a metadata value that is
not text), `rejected` (JetStream refused it for good, e.g. over the stream's message size),
`unsent` (not acknowledged when `close()`'s timeout ran out: lost, or stored with its
acknowledgement unseen — an upper bound of the loss)."""


class Outcome(enum.Enum):
    """What `record()` did with an observation. Truthy only for `ACCEPTED`, so
    `if not recorder.record(...)` reads as "it will not be forwarded"."""

    ACCEPTED = "accepted"
    """Queued: the forwarder will publish it (or count why it could not)."""
    SAMPLED_OUT = "sampled_out"
    """Outside the recorder's sample ratio: no suite at a ratio at most the recorder's samples it."""
    NOT_STARTED = "not_started"
    """Dropped: the recorder was not started."""
    CLOSED = "closed"
    """Dropped: the recorder is closed."""
    INVALID = "invalid"
    """Dropped: an argument has the wrong type, or the target is empty."""
    INVALID_TRACE_ID = "invalid_trace_id"
    """Dropped: the trace id is not a W3C trace id."""
    TOO_LARGE = "too_large"
    """Dropped: its text alone is over the observation size limit."""
    QUEUE_FULL = "queue_full"
    """Dropped: the queue is full (the bus is slow or unreachable)."""

    def __bool__(self) -> bool:
        return self is Outcome.ACCEPTED


@dataclass(frozen=True, slots=True)
class RecorderStats:
    """A snapshot of a recorder's counts."""

    accepted: int
    """Observations `record()` queued."""
    sampled_out: int
    """Observations outside the recorder's sample ratio (not forwarded, not a loss)."""
    published: int
    """Accepted observations JetStream acknowledged (duplicates included)."""
    duplicates: int
    """Of `published`, those JetStream already held (the same target and observation id)."""
    pending: int
    """Accepted observations neither published nor dropped yet."""
    dropped: Mapping[str, int] = field(default_factory=dict)
    """Observations `record()` refused, by `DropReason` (only reasons that occurred)."""
    lost: Mapping[str, int] = field(default_factory=dict)
    """Accepted observations the forwarder could not publish, by `LostReason`."""
    connected: bool = False
    """Whether the forwarder is connected to NATS now."""
    last_error: str | None = None
    """The forwarder's last publish or connection error, if any."""

    @property
    def offered(self) -> int:
        """Calls of `record()`: `accepted + sampled_out + sum(dropped.values())`."""
        return self.accepted + self.sampled_out + sum(self.dropped.values())

    @property
    def not_forwarded(self) -> int:
        """Observations offered that did not reach the bus for a reason other than sampling:
        `sum(dropped.values()) + sum(lost.values())`."""
        return sum(self.dropped.values()) + sum(self.lost.values())


Item: TypeAlias = tuple[
    int,  # record time, Unix nanoseconds
    str,  # target
    str,  # observation id
    str | None,  # trace id (valid, lower-case)
    str | None,  # input
    str | None,  # output
    str | None,  # expected
    tuple[TraceEvent, ...],  # trace
    dict[str, str] | None,  # metadata (a copy)
    int,  # estimated size in bytes (counted against the queue's byte limit)
]
"""One accepted observation as `record()` queues it: its arguments, not yet an event (building
and encoding the event is the forwarder's work, off the request path)."""


class Ledger:
    """The queue and the counts."""

    def __init__(self, *, max_items: int, max_bytes: int) -> None:
        self.lock = threading.Lock()
        self.queue: deque[Item] = deque()
        self.max_items = max_items
        self.max_bytes = max_bytes
        self.running = False
        """Whether `offer` accepts (set under the lock, so nothing is queued after `close()`)."""
        self.closed = False
        self.pending = 0
        self.pending_bytes = 0
        self.accepted = 0
        self.sampled_out = 0
        self.published = 0
        self.duplicates = 0
        self.dropped: Counter[str] = Counter()
        self.lost: Counter[str] = Counter()
        self.connected = False
        self.last_error: str | None = None
        self.idle = False
        """Set by the forwarder before it waits for work; `offer` then calls `wake` (once: the first
        offer clears it), so a busy forwarder costs `record()` no cross-thread call."""
        self.wake: Callable[[], None] | None = None

    def offer(self, item: Item) -> Outcome:
        """Queue `item` unless the recorder is not running or the queue is full."""
        size = item[9]
        with self.lock:
            if not self.running:
                reason = Outcome.CLOSED if self.closed else Outcome.NOT_STARTED
                self.dropped[reason.value] += 1
                return reason
            if self.pending >= self.max_items or self.pending_bytes + size > self.max_bytes:
                self.dropped["queue_full"] += 1
                return Outcome.QUEUE_FULL
            self.pending += 1
            self.pending_bytes += size
            self.accepted += 1
            self.queue.append(item)
        if self.idle:
            self.idle = False
            wake = self.wake
            if wake is not None:
                wake()
        return Outcome.ACCEPTED

    def refuse(self, outcome: Outcome) -> Outcome:
        """Count an observation `record()` did not queue."""
        with self.lock:
            if outcome is Outcome.SAMPLED_OUT:
                self.sampled_out += 1
            else:
                self.dropped[outcome.value] += 1
        return outcome

    def take(self, limit: int) -> list[Item]:
        """Up to `limit` queued items, oldest first (the forwarder's thread only)."""
        queue = self.queue
        out: list[Item] = []
        while queue and len(out) < limit:
            out.append(queue.popleft())
        return out

    def resolve(
        self, items: int, size: int, *, published: int = 0, duplicates: int = 0, reason: LostReason = "unsent"
    ) -> None:
        """`items` taken items (of `size` estimated bytes) are done: `published` of them
        acknowledged (`duplicates` of those as already stored), the rest lost for `reason`."""
        with self.lock:
            self.pending -= items
            self.pending_bytes -= size
            self.published += published
            self.duplicates += duplicates
            if items > published:
                self.lost[reason] += items - published

    def stop(self) -> None:
        """Accept nothing more."""
        with self.lock:
            self.running = False
            self.closed = True

    def snapshot(self) -> RecorderStats:
        """The counts now."""
        with self.lock:
            return RecorderStats(
                accepted=self.accepted,
                sampled_out=self.sampled_out,
                published=self.published,
                duplicates=self.duplicates,
                pending=self.pending,
                dropped={k: v for k, v in sorted(self.dropped.items()) if v},
                lost={k: v for k, v in sorted(self.lost.items()) if v},
                connected=self.connected,
                last_error=self.last_error,
            )
