"""A settled run's output leaves the LIVE stream: `keep_s` after its `case.executed` is stored, the
replica that ran it purges `run.<run>.live.>`.

Why: nats-server holds about 1.2 KB of memory for every run whose subjects a stream keeps, however
few messages they hold (`bench/nats_memory.py --live`), so a ring that kept every run for its
15-minute max age cost memory in proportion to the rate of runs × 15 minutes, and that is what the
soak saw grow. The live views are for runs that are running or just ended: once a run is settled
its record is the event store (the sealed trajectory; the end of its output in `case.executed`,
which `GET /v1/runs/{id}/logs` answers from once the stream no longer holds it). The stream's max
age stays as the bound for what a purge misses (a replica that stopped before a run's purge was
due, a run nobody settled).

A run this replica holds again when its purge is due (a redelivery run here) is left alone. Purges
are best effort: one that fails is counted and not retried (the max age removes it).
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

import nats.errors
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Counter

from evalbus_contracts.streams import LIVE
from evalbus_contracts.subjects import live_filter
from evalbus_runtime.tasks import cancel_and_wait

log = logging.getLogger("evalbus.dispatcher.live_purge")


class LivePurger:
    """Purges the LIVE output of settled runs, each `keep_s` after `settled(run_id)` was called, in
    the order they settled (one purge at a time: a JetStream API request each)."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        keep_s: float,
        holds: Callable[[str], bool],
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._js = js
        self._keep_s = keep_s
        self._holds = holds
        self._due: collections.deque[tuple[float, str]] = collections.deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.purges = Counter(
            "evalbus_live_purges_total",
            "Settled runs whose output was purged from the LIVE stream, by result (purged, held: the "
            "replica runs it again, failed)",
            ["result"],
            registry=registry,
        )

    @property
    def pending(self) -> int:
        """Runs whose purge is not due yet."""
        return len(self._due)

    def settled(self, run_id: str) -> None:
        """`run_id`'s `case.executed` is on the stream: purge its output in `keep_s`."""
        self._due.append((time.monotonic() + self._keep_s, run_id))
        self._wake.set()

    def start(self) -> None:
        """Run the purges in the background."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="live-purger")

    async def stop(self) -> None:
        """End the loop; the purges not due yet are left to the stream's max age."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def _loop(self) -> None:
        while True:
            if not self._due:
                self._wake.clear()
                await self._wake.wait()
                continue
            due, run_id = self._due[0]
            delay = due - time.monotonic()
            if delay > 0:
                # every later entry is due later (one keep for all, appended in order): nothing
                # can come due sooner than the head
                await asyncio.sleep(delay)
                continue
            self._due.popleft()
            await self.purge(run_id)

    async def purge(self, run_id: str) -> None:
        """Purge `run_id`'s output now, unless this replica holds the run again."""
        if self._holds(run_id):
            self.purges.labels("held").inc()
            return
        try:
            await self._js.purge_stream(LIVE.name, subject=live_filter(run_id))
        except (OSError, TimeoutError, nats.errors.Error) as e:
            self.purges.labels("failed").inc()
            log.warning("purging the live output of %s failed (the stream's max age removes it): %s", run_id, e)
            return
        self.purges.labels("purged").inc()
