"""Placement samples of a running harness: what its unit uses (pid, processes, resident memory, CPU
time, age), read from the backend every few seconds while it runs and once when it exits, and
published to the live sink (`run.<run>.live.placement`; the first half a second after the spawn,
so a short run publishes its exit sample only), so any gateway replica can say where a run is and
what it uses. The exit sample carries the exit code, the signal and the OOM verdict; it is
also the failure evidence a failed run seals (`CaseFailure.placement.resources`).

The words of the `exited` mark are built here too (pure)."""

from __future__ import annotations

import asyncio
import logging
import signal
import time
from collections.abc import Awaitable, Callable

import msgspec

from evalbus_contracts import PlacementSample, utcnow
from evalbus_dispatcher.backends.base import HarnessRun, UnitUsage
from evalbus_runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 2.0
"""Seconds between two samples of a running harness."""
FIRST_PUBLISH_S = 0.5
"""The first sample published comes this long after the spawn (or after one interval, when that is
shorter): a run that is over by then is said whole by its exit sample, so a short case costs the
live view one placement message, not two. The reading taken at the spawn is kept all the same (its
memory counts toward the peak, it is the evidence of a run that never exits)."""

Publish = Callable[[PlacementSample], Awaitable[None]]


class Sampler:
    """Samples one harness run: `start(pid)` once it spawned, `finish(run)` once it exited.

    `usage` may block (a cluster's API), so it is called in a thread; `quick`, when the backend
    has one, is tried first on the event loop (a thread hop per sample cost a warm-worker case
    more than reading its stat file)."""

    def __init__(
        self,
        usage: Callable[[], UnitUsage | None],
        publish: Publish,
        *,
        dispatcher: str | None,
        node: str | None,
        timeout_s: float | None,
        interval_s: float = SAMPLE_INTERVAL_S,
        quick: Callable[[], UnitUsage | None] | None = None,
    ) -> None:
        self._usage = usage
        self._quick = quick
        self._publish = publish
        self._dispatcher = dispatcher
        self._node = node
        self._timeout_s = timeout_s
        self._interval_s = interval_s
        self._spawned: float | None = None
        self._pid: int | None = None
        self._task: asyncio.Task[None] | None = None
        self._peak: int | None = None
        self.last: PlacementSample | None = None
        """The latest sample taken."""

    def _sample(self, used: UnitUsage | None) -> PlacementSample:
        if used is not None and used.rss_bytes is not None:
            self._peak = max(self._peak or 0, used.rss_bytes)
        last = self.last
        sample = PlacementSample(
            at=utcnow(),
            dispatcher=self._dispatcher,
            node=self._node,
            unit=None if self._pid is None else f"pgid:{self._pid}",
            pid=self._pid,
            processes=used.processes if used is not None else 0,
            rss_bytes=used.rss_bytes if used is not None else None,
            peak_rss_bytes=self._peak,
            # Once the unit is gone its CPU time cannot be read any more: the last reading stands.
            cpu_seconds=used.cpu_seconds if used is not None else (last.cpu_seconds if last is not None else None),
            age_s=0.0 if self._spawned is None else time.monotonic() - self._spawned,
            timeout_s=self._timeout_s,
        )
        self.last = sample
        return sample

    async def _read(self) -> UnitUsage | None:
        try:
            if self._quick is not None:  # on the loop when the backend can tell at once
                found = self._quick()
                if found is not None:
                    return found if found.processes else None  # none of it left
            return await asyncio.to_thread(self._usage)
        except Exception:
            log.warning("reading the sandbox's usage failed", exc_info=True)
            return None

    async def start(self, pid: int) -> None:
        """The harness spawned as `pid`: read its usage now, publish a sample after `FIRST_PUBLISH_S`
        and then every interval until `finish`."""
        self._spawned = time.monotonic()
        self._pid = pid
        self._sample(await self._read())
        self._task = asyncio.create_task(self._loop())

    async def _loop(self) -> None:
        wait = min(FIRST_PUBLISH_S, self._interval_s)
        while True:
            await asyncio.sleep(wait)
            used = await self._read()
            await self._publish(self._sample(used))
            wait = self._interval_s

    async def finish(self, run: HarnessRun | None) -> PlacementSample | None:
        """Stop sampling and publish the exit sample; None when the harness never spawned, the last
        sample when it did not end normally (`run` None: an error or a cancellation)."""
        if self._task is not None:
            task, self._task = self._task, None
            await cancel_and_wait(task)
        if self._spawned is None or run is None:
            return self.last
        sample = msgspec.structs.replace(
            self._sample(None),
            state="exited",
            age_s=run.duration_s,  # the age of an exited harness is how long it ran
            exit_code=run.exit_code,
            signal=run.signal,
            timed_out=run.timed_out,
            oom=run.oom,
        )
        self.last = sample
        await self._publish(sample)
        return sample


def signal_name(sig: int) -> str:
    """`SIGKILL` for 9 (the number when the platform has no name for it)."""
    try:
        return signal.Signals(sig).name
    except ValueError:
        return f"signal {sig}"


def _mib(n: int) -> str:
    return f"{n / (1024 * 1024):.1f} MiB"


def exit_message(run: HarnessRun, sample: PlacementSample | None, timeout_s: float | None) -> str:
    """What the `exited` mark says: how the harness ended, after how long, with what it used."""
    limit = f"{timeout_s:g}s" if timeout_s is not None else "its"
    if run.timed_out:
        head = f"killed after running past its {limit} limit (exit {run.exit_code})"
    elif run.signal is not None:
        head = f"killed by {signal_name(run.signal)} (exit {run.exit_code}) after {run.duration_s:.2f}s"
        if run.oom is True:
            head += ": the out-of-memory killer ended it"
    else:
        head = f"exited with {run.exit_code} after {run.duration_s:.2f}s"
    used = []
    if sample is not None and sample.peak_rss_bytes is not None:
        used.append(f"peak {_mib(sample.peak_rss_bytes)} resident")
    if sample is not None and sample.cpu_seconds is not None:
        used.append(f"{sample.cpu_seconds:.2f}s CPU")
    return head + (f" ({', '.join(used)})" if used else "")
