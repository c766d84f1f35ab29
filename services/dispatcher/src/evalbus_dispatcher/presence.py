"""A dispatcher replica's presence in the `dispatchers` bucket: its id, node, compute slots, the
runs holding them and the lanes it serves, written every few seconds and soon after a slot is
taken or freed (changes within `MIN_GAP_S` of a write go out together in the next), deleted when the replica stops (a replica that died ages out, and readers drop a status older than three
intervals). The gateway reads the bucket to say why a queued run is not running yet."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import re
from collections import Counter
from datetime import datetime

import nats.errors
from nats.js import JetStreamContext
from nats.js.kv import KeyValue

from evalbus_contracts import DEFAULT_LANE, DispatcherStatus, encode, utcnow
from evalbus_contracts.streams import DISPATCHERS
from evalbus_runtime.tasks import cancel_and_wait

log = logging.getLogger(__name__)

STATUS_INTERVAL_S = 2.0
"""Seconds between two writes of a replica's status when nothing changes."""
MIN_GAP_S = 0.05
"""Least seconds between two writes: at hundreds of cases a second every slot change was a write
(a bucket put and its reply per case); a reader sees a change at most this much later."""

_KEY_UNSAFE = re.compile(r"[^-_=.a-zA-Z0-9]")


def default_replica_id() -> str:
    """`<node>-<pid>`: unique among the replicas of a deployment."""
    return f"{platform.node() or 'dispatcher'}-{os.getpid()}"


def status_key(replica_id: str) -> str:
    """The bucket key of a replica (its id with the characters keys cannot hold replaced)."""
    return _KEY_UNSAFE.sub("_", replica_id) or "_"


class Presence:
    """What this replica holds, kept in the `dispatchers` bucket while it runs."""

    def __init__(
        self,
        replica_id: str,
        *,
        slots: int,
        node: str | None = None,
        interval_s: float = STATUS_INTERVAL_S,
        min_gap_s: float = MIN_GAP_S,
        lanes: tuple[str, ...] = (DEFAULT_LANE,),
    ) -> None:
        self.id = replica_id
        """This replica's id."""
        self._node = node if node is not None else (platform.node() or None)
        self._slots = slots
        self._interval_s = interval_s
        self._min_gap_s = min_gap_s
        self._lanes = lanes
        self._runs: Counter[str] = Counter()
        self._changed = asyncio.Event()
        self._started_at: datetime = utcnow()
        self._kv: KeyValue | None = None
        self._task: asyncio.Task[None] | None = None

    def resize(self, slots: int) -> None:
        """The replica now offers `slots` (its pool was sized from the cluster's room)."""
        if slots != self._slots:
            self._slots = slots
            self._changed.set()

    def hold(self, run_id: str) -> None:
        """`run_id` took a slot."""
        self._runs[run_id] += 1
        self._changed.set()

    def free(self, run_id: str) -> None:
        """`run_id` gave a slot back (call once per `hold`)."""
        if self._runs.get(run_id, 0) > 0:
            self._runs[run_id] -= 1
            if self._runs[run_id] == 0:
                del self._runs[run_id]
            self._changed.set()

    def holds(self, run_id: str) -> bool:
        """Whether `run_id` holds a slot now."""
        return run_id in self._runs

    @property
    def runs(self) -> tuple[str, ...]:
        """Runs holding a slot now."""
        return tuple(sorted(self._runs))

    def status(self) -> DispatcherStatus:
        """The status as written."""
        runs = self.runs
        return DispatcherStatus(
            dispatcher=self.id,
            node=self._node,
            slots=self._slots,
            used=sum(self._runs.values()),
            runs=runs,
            started_at=self._started_at,
            updated_at=utcnow(),
            interval_s=self._interval_s,
            lanes=self._lanes,
        )

    async def start(self, js: JetStreamContext) -> None:
        """Write the status now and keep it fresh."""
        self._kv = await js.key_value(DISPATCHERS.bucket)
        await self._write()
        self._task = asyncio.create_task(self._loop(), name="dispatcher-presence")

    async def stop(self) -> None:
        """Stop writing and delete the status (the replica is gone at once, not after it ages out)."""
        if self._task is not None:
            task, self._task = self._task, None
            await cancel_and_wait(task)
        if self._kv is not None:
            with contextlib.suppress(nats.errors.Error):
                await self._kv.delete(status_key(self.id))

    async def _write(self) -> None:
        assert self._kv is not None
        try:
            await self._kv.put(status_key(self.id), encode(self.status()))
        except nats.errors.Error as e:
            log.warning("dispatcher status not written: %s", e)

    async def _loop(self) -> None:
        while True:
            # `asyncio.timeout`, not `wait_for`: on Python 3.11 a `wait_for` cancelled just as its
            # event is set returns instead of raising, and `stop()` then waited for ever.
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(self._interval_s):
                    await self._changed.wait()
            self._changed.clear()
            await self._write()
            if self._min_gap_s > 0:
                # Changes made meanwhile keep `_changed` set: they go out together right after.
                await asyncio.sleep(self._min_gap_s)
