"""Trace assembly: span batches (`obs.spans.*`) are held, unacknowledged, until their trace is whole.

A trace is whole when its root span has ended and no span of it has arrived for `settle_s`, or
`max_wait_s` after its first span whatever else. Every handler holding a batch of the trace waits
for that moment; the first batch's handler (the trace's owner) then publishes the observation, and
the others return once that publish is acknowledged, so the chassis acks every batch only after the
observation is stored. If the publish fails, every batch of the trace is retried; if the replica
dies, every batch is redelivered (after `ack_wait`) and assembled again, and the observation's
dedup id (`obs.received:<target>:<trace id>`) keeps it once.

A batch for a trace this replica assembled recently is late: it is acknowledged and counted.

The clock is injected and the settle check is a plain method (`due`), so the rules are tested
without time passing; `run_ticker` drives it in the service.
"""

from __future__ import annotations

import asyncio
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field

from evalbus_contracts import ObservationSpans, SpanData

Clock = Callable[[], float]


@dataclass
class PendingTrace:
    """A trace being assembled."""

    trace_id: str
    target: str
    first_s: float
    last_s: float
    resource: dict[str, str] = field(default_factory=dict)
    spans: dict[str, SpanData] = field(default_factory=dict)
    batches: int = 0
    redelivered: bool = False
    """Some batch of it is a redelivery (its observation may have been published before)."""
    whole: asyncio.Event = field(default_factory=asyncio.Event)
    published: asyncio.Future[None] | None = None

    @property
    def root_ended(self) -> bool:
        """Whether a root span (no parent) has ended."""
        return any(s.parent_id is None and s.end_ns is not None for s in self.spans.values())


class TraceAssembler:
    """Pending traces of one replica."""

    def __init__(
        self, *, settle_s: float = 5.0, max_wait_s: float = 60.0, remember: int = 100_000, clock: Clock = time.monotonic
    ) -> None:
        self.settle_s = settle_s
        self.max_wait_s = max_wait_s
        self._remember = remember
        self._clock = clock
        self._pending: dict[tuple[str, str], PendingTrace] = {}
        self._done: OrderedDict[tuple[str, str], None] = OrderedDict()

    @property
    def pending(self) -> int:
        """Traces waiting to be whole."""
        return len(self._pending)

    def is_late(self, batch: ObservationSpans) -> bool:
        """Whether `batch` belongs to a trace this replica already assembled."""
        return (batch.target, batch.trace_id) in self._done

    def add(self, batch: ObservationSpans) -> tuple[PendingTrace, bool]:
        """Hold `batch`; its trace and whether this batch is the trace's owner (its first)."""
        key = (batch.target, batch.trace_id)
        now = self._clock()
        trace = self._pending.get(key)
        owner = trace is None
        if trace is None:
            trace = self._pending[key] = PendingTrace(
                trace_id=batch.trace_id, target=batch.target, first_s=now, last_s=now
            )
        trace.last_s = now
        trace.batches += 1
        trace.resource.update(batch.resource)
        for span in batch.spans:
            trace.spans[span.span_id] = span
        return trace, owner

    def due(self) -> list[PendingTrace]:
        """Mark whole (and return) every trace whose time has come."""
        now = self._clock()
        ready = [
            t
            for t in self._pending.values()
            if (t.root_ended and now - t.last_s >= self.settle_s) or now - t.first_s >= self.max_wait_s
        ]
        for trace in ready:
            trace.whole.set()
        return ready

    def finish(self, trace: PendingTrace) -> None:
        """Forget `trace` (published or given up) and remember it was assembled."""
        key = (trace.target, trace.trace_id)
        if self._pending.get(key) is trace:
            del self._pending[key]
        self._done[key] = None
        self._done.move_to_end(key)
        while len(self._done) > self._remember:
            self._done.popitem(last=False)

    def abandon(self, trace: PendingTrace) -> None:
        """Forget `trace` without remembering it (its publish failed: the batches come again)."""
        key = (trace.target, trace.trace_id)
        if self._pending.get(key) is trace:
            del self._pending[key]

    async def run_ticker(self) -> None:
        """Check for whole traces, several times per settle period (until cancelled)."""
        period = max(0.05, min(1.0, self.settle_s / 5))
        while True:
            await asyncio.sleep(period)
            self.due()
