"""Trace assembly: span batches (`obs.spans.<service>.<trace>`) are held, unacknowledged, until
their trace is whole — and the trace is assembled from the *stream's* view of it, so any collector
replica assembles the whole trace, whichever replicas received its batches.

Why this design. With several replicas behind one address, the batches of one trace exported in
several requests land on different replicas. Rather than route a trace to one replica (a lease, a
hash ring: state to fence and rebalance), the stream itself is the index: the receiver publishes
each batch on the trace's own subject, and a replica deciding its trace may be whole reads every
batch stored on that subject (`TraceStore.batches`: the batches not yet acknowledged, in stream
order, with the times JetStream stored them) — after counting them (`TraceStore.count`), since
usually the batches it holds itself are all there are.

The cut. Assembly is a pure function of that ordered, server-timestamped log (`cut`): walking it in
stream order, a batch belongs to the trace unless it came after the trace was already whole — its
root span had ended and no batch came for `settle_s`, or it came `max_wait_s` after the first
batch; that batch and every one after it are late. Every replica reading the same log computes the
same cut and so the same observation; its dedup id (`obs.received:<target>:<trace id>`) keeps it
once when two replicas publish it. The trace is whole (`Cut.due_ns`) when the bus's clock (`now`,
JetStream's time, not a replica's: `BusClock`) has passed that moment; until then the replica
waits again. Timestamps come from one clock, the server's, so the replicas' own clocks do not
matter.

The record. A batch is deleted from the work-queue stream once acknowledged, so a replica that
reads the trace after another replica assembled it (and acknowledged its batches) sees only what
is left. The replica that assembles therefore records, before any batch is acknowledged, the last
stream sequence its observation includes (`ONLINE_TRACES` key-value bucket, one key per trace, kept
as long as the observation's dedup window): a batch up to it is part of the stored observation
(acknowledged silently), a batch after it is late (counted `late`, not judged again). A replica
that dies before recording leaves every batch unacknowledged: they are redelivered and assembled
again into the same observation.

The ticker (`run_ticker`) wakes a trace's owner handler — the first handler on this replica holding
one of its batches — when the trace may be whole; the owner reads the stream, decides, and the
other local handlers of the trace return with its outcome. The rules are tested without time
passing (the clock is injected).
"""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from evalbus_contracts import ObservationSpans, SpanData

NsClock = Callable[[], int]
"""Now, Unix nanoseconds (the bus's time)."""
NS = 1_000_000_000


@dataclass(frozen=True, slots=True)
class StoredBatch:
    """A span batch as the stream holds it."""

    seq: int
    """Its stream sequence."""
    stored_ns: int
    """When JetStream stored it, Unix nanoseconds (microsecond precision, as every reader sees it)."""
    batch: ObservationSpans


def _root_ended(spans: Iterable[SpanData]) -> bool:
    return any(s.parent_id is None and s.end_ns is not None for s in spans)


@dataclass(frozen=True, slots=True)
class Cut:
    """A trace's stored batches split into the observation's and the late ones."""

    included: tuple[StoredBatch, ...]
    """The batches the observation is assembled from, in stream order."""
    late: tuple[StoredBatch, ...]
    """Batches stored after the trace was already whole."""
    root_ended: bool
    """Whether a root span of the included batches has ended."""
    due_ns: int
    """When the included batches are the whole trace (bus time)."""

    @property
    def last_seq(self) -> int:
        """The stream sequence of the last included batch (0: none)."""
        return self.included[-1].seq if self.included else 0

    def spans(self) -> list[SpanData]:
        """The included spans, one per span id (a later batch's copy wins)."""
        by_id: dict[str, SpanData] = {}
        for stored in self.included:
            for span in stored.batch.spans:
                by_id[span.span_id] = span
        return list(by_id.values())

    def resource(self) -> dict[str, str]:
        """The included batches' resource attributes (a later batch's value wins)."""
        out: dict[str, str] = {}
        for stored in self.included:
            out.update(stored.batch.resource)
        return out


def cut(batches: Iterable[StoredBatch], *, settle_ns: int, max_wait_ns: int) -> Cut:
    """The deterministic assembly of a trace's stored batches: the same log gives every replica the
    same observation."""
    ordered = sorted({b.seq: b for b in batches}.values(), key=lambda b: b.seq)
    included: list[StoredBatch] = []
    root = False
    first = last = 0
    late: tuple[StoredBatch, ...] = ()
    for i, stored in enumerate(ordered):
        if included and ((root and stored.stored_ns - last >= settle_ns) or stored.stored_ns - first >= max_wait_ns):
            late = tuple(ordered[i:])
            break
        if not included:
            first = stored.stored_ns
        last = max(last, stored.stored_ns)
        root = root or _root_ended(stored.batch.spans)
        included.append(stored)
    due = first + max_wait_ns
    if root:
        due = min(due, last + settle_ns)
    return Cut(included=tuple(included), late=late, root_ended=root, due_ns=due)


@dataclass
class PendingTrace:
    """A trace this replica holds batches of."""

    trace_id: str
    target: str
    subject: str
    """The subject its batches are stored on."""
    trace_subject: bool
    """Whether that subject is the trace's own (else: the older per-service subject, where only
    the batches this replica holds are read)."""
    local: dict[int, StoredBatch] = field(default_factory=dict)
    """The batches this replica holds, by stream sequence."""
    check_ns: int = 0
    """When to look at the trace next (bus time)."""
    wake: asyncio.Event = field(default_factory=asyncio.Event)
    outcome: asyncio.Future[int] | None = None
    """The last stream sequence the trace's observation includes, once decided."""


class TraceAssembler:
    """Pending traces of one replica, and the traces it assembled recently."""

    def __init__(
        self, *, settle_s: float = 5.0, max_wait_s: float = 60.0, remember: int = 100_000, clock: NsClock
    ) -> None:
        self.settle_ns = int(settle_s * NS)
        self.max_wait_ns = int(max_wait_s * NS)
        self._remember = remember
        self._clock = clock
        self._pending: dict[tuple[str, str], PendingTrace] = {}
        self._done: OrderedDict[tuple[str, str], int] = OrderedDict()

    @property
    def pending(self) -> int:
        """Traces waiting to be whole."""
        return len(self._pending)

    def assembled(self, batch: ObservationSpans) -> int | None:
        """The last stream sequence of `batch`'s trace's observation, when this replica decided it
        recently (a batch after it is late, one up to it a redelivery of an included batch)."""
        return self._done.get((batch.target, batch.trace_id))

    def add(self, stored: StoredBatch, subject: str) -> tuple[PendingTrace, bool]:
        """Hold `stored`; its trace and whether this batch is the trace's owner (its first here)."""
        batch = stored.batch
        key = (batch.target, batch.trace_id)
        trace = self._pending.get(key)
        owner = trace is None
        if trace is None:
            trace = self._pending[key] = PendingTrace(
                trace_id=batch.trace_id, target=batch.target, subject=subject, trace_subject=batch.trace_subject
            )
        trace.local[stored.seq] = stored
        # the earliest the trace can be whole: no batch for settle_s after this one
        trace.check_ns = stored.stored_ns + self.settle_ns
        return trace, owner

    def cut(self, batches: Sequence[StoredBatch]) -> Cut:
        """`cut` with this assembler's settle and max-wait times."""
        return cut(batches, settle_ns=self.settle_ns, max_wait_ns=self.max_wait_ns)

    def schedule(self, trace: PendingTrace, view: Cut) -> None:
        """Look at `trace` again when its stream view `view` (not whole yet) may be: at its due time,
        and no later than one settle period from now while no root span has ended (a root held by
        another replica, or the trace assembled elsewhere)."""
        now = self._clock()
        trace.check_ns = view.due_ns if view.root_ended else min(view.due_ns, now + self.settle_ns)
        trace.wake.clear()

    def due(self) -> list[PendingTrace]:
        """Wake (and return) every trace whose time to be looked at has come."""
        now = self._clock()
        ready = [t for t in self._pending.values() if not t.wake.is_set() and now >= t.check_ns]
        for trace in ready:
            trace.wake.set()
        return ready

    def finish(self, trace: PendingTrace, last_seq: int) -> None:
        """Forget `trace` (decided) and remember the last sequence its observation includes."""
        key = (trace.target, trace.trace_id)
        if self._pending.get(key) is trace:
            del self._pending[key]
        self._done[key] = last_seq
        self._done.move_to_end(key)
        while len(self._done) > self._remember:
            self._done.popitem(last=False)

    def abandon(self, trace: PendingTrace) -> None:
        """Forget `trace` without remembering it (deciding it failed: the batches come again)."""
        key = (trace.target, trace.trace_id)
        if self._pending.get(key) is trace:
            del self._pending[key]

    async def run_ticker(self) -> None:
        """Check for traces to look at, several times per settle period (until cancelled)."""
        period = max(0.05, min(1.0, self.settle_ns / NS / 5))
        while True:
            await asyncio.sleep(period)
            self.due()
