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

A run that runs again when its purge is due is left alone: one this replica holds, or one whose
last mark on the stream is another execution's (a replica that took the run over while this one
still ran it, or a cancelled duplicate that settled first). Purges are best effort: one that fails
is counted and not retried, and a run whose `case.executed` was stored without this replica
learning it (a lost PubAck, then a redelivery settled by the stream) is not scheduled; the max age
removes both.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from collections.abc import Callable

import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Counter

from evalbus_contracts import DecodeError, InfraMark, decode_event
from evalbus_contracts.streams import LIVE
from evalbus_contracts.subjects import live_filter, live_subject
from evalbus_runtime.tasks import cancel_and_wait

log = logging.getLogger("evalbus.dispatcher.live_purge")


def purge_counter(registry: CollectorRegistry | None) -> Counter:
    """`evalbus_live_purges_total{result}` in `registry` (made once per service)."""
    return Counter(
        "evalbus_live_purges_total",
        "Settled runs whose output was purged from the LIVE stream, by result (purged; held: the run "
        "runs again, on this replica or another; failed)",
        ["result"],
        registry=registry,
    )


class LivePurger:
    """Purges the LIVE output of settled runs, each `keep_s` after `settled(run_id, execution)` was
    called, in the order they settled (one purge at a time: two JetStream API requests each, the
    run's last mark and the purge)."""

    def __init__(
        self,
        js: JetStreamContext,
        *,
        keep_s: float,
        holds: Callable[[str], bool],
        purges: Counter,
    ) -> None:
        self._js = js
        self._keep_s = keep_s
        self._holds = holds
        self._due: collections.deque[tuple[float, str, str | None]] = collections.deque()
        self._wake = asyncio.Event()
        self._task: asyncio.Task[None] | None = None
        self.purges = purges

    @property
    def pending(self) -> int:
        """Runs whose purge is not due yet."""
        return len(self._due)

    def settled(self, run_id: str, execution: str | None) -> None:
        """`run_id`'s `case.executed` is on the stream, from this replica's `execution` of it (None:
        it executed nothing, a cancelled run): purge its output in `keep_s`."""
        self._due.append((time.monotonic() + self._keep_s, run_id, execution))
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
            due, run_id, execution = self._due[0]
            delay = due - time.monotonic()
            if delay > 0:
                # every later entry is due later (one keep for all, appended in order): nothing
                # can come due sooner than the head
                await asyncio.sleep(delay)
                continue
            self._due.popleft()
            try:
                await self.purge(run_id, execution)
            except Exception:  # never the end of the loop: the next run's purge still comes
                self.purges.labels("failed").inc()
                log.exception("purging the live output of %s failed", run_id)

    async def purge(self, run_id: str, execution: str | None) -> None:
        """Purge `run_id`'s output now, unless it runs again: this replica holds it, or its last
        mark on the stream is not `execution`'s (with None: any mark)."""
        try:
            if self._holds(run_id) or await self._last_execution(run_id) not in (execution, None):
                self.purges.labels("held").inc()
                return
            await self._js.purge_stream(LIVE.name, subject=live_filter(run_id))
        except (OSError, TimeoutError, nats.errors.Error) as e:
            self.purges.labels("failed").inc()
            log.warning("purging the live output of %s failed (the stream's max age removes it): %s", run_id, e)
            return
        self.purges.labels("purged").inc()

    async def _last_execution(self, run_id: str) -> str | None:
        """The execution of the run's last mark on the stream (None: no mark, or one without it)."""
        try:
            raw = await self._js.get_last_msg(LIVE.name, live_subject(run_id, "infra"))
        except nats.js.errors.NotFoundError:
            return None
        try:
            event = decode_event(raw.data or b"")
        except (DecodeError, ValueError):
            return None
        return event.execution if isinstance(event, InfraMark) else None
