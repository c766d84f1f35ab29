"""A replica's compute slots: one pool shared by every lane it serves, and on a cluster backend
sized from the cluster's room.

- **One pool.** `DISPATCHER_SLOTS` is what the replica holds at once, whichever lanes the cases
  come from (`evalbus_runtime.slots`): a GPU box serving `gpu,default` with one slot runs one case,
  not one per lane.
- **The cluster's room.** On Kubernetes, Nomad and Docker the pool is `min(DISPATCHER_SLOTS, held +
  room)`, re-read every `DISPATCHER_ROOM_INTERVAL_S`: `room` is how many more cases of the default
  compute fit on the schedulable nodes now (less what every other workload holds), so a replica pulls
  only cases the cluster can start and a full cluster leaves them on the bus for replicas of other
  lanes or clusters, instead of queueing them as unschedulable units. A case larger than the default
  still waits in the orchestrator as `blocked`; one no node can ever fit fails at once
  (`unschedulable`). When the room cannot be read (the API down, no permission to list nodes), the
  pool keeps its size — `DISPATCHER_SLOTS` until a first read succeeds — and the replica says so
  once in its log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from evalbus_contracts.specs import ComputeSpec
from evalbus_runtime import SlotPool
from evalbus_runtime.tasks import cancel_and_wait

log = logging.getLogger("evalbus.dispatcher.capacity")

ROOM_INTERVAL_S = 5.0
"""Seconds between two reads of the cluster's room."""


@runtime_checkable
class HasRoom(Protocol):
    """A backend that can say how many more cases fit its cluster now."""

    async def room(self, compute: ComputeSpec | None = None) -> int:
        """Cases of this size (default: the default compute) that fit now."""
        ...


class ClusterRoom:
    """Keeps `pool` at `min(most, held + room)`."""

    def __init__(
        self,
        backend: HasRoom,
        pool: SlotPool,
        *,
        most: int,
        interval_s: float = ROOM_INTERVAL_S,
        on_size: Callable[[int], None] = lambda _: None,
    ) -> None:
        self._backend = backend
        self._pool = pool
        self._most = most
        self._interval_s = interval_s
        self._on_size = on_size
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    async def refresh(self) -> int:
        """Read the room once and resize the pool; the pool's size (kept when the read fails)."""
        try:
            room = await self._backend.room()
        except Exception as e:  # any backend's API error: the slots stay as they are
            if not self._failing:
                log.warning("cannot read the cluster's room; keeping %d slots: %s", self._pool.size, e)
            self._failing = True
            return self._pool.size
        if self._failing:
            log.info("the cluster's room can be read again: %d more cases fit", room)
        self._failing = False
        size = max(0, min(self._most, self._pool.held + room))
        if size != self._pool.size:
            log.info("slots %d → %d (%d held, room for %d more)", self._pool.size, size, self._pool.held, room)
        self._pool.resize(size)
        self._on_size(size)
        return size

    async def start(self) -> None:
        """Size the pool now (before the lanes pull) and keep it sized."""
        await self.refresh()
        self._task = asyncio.create_task(self._loop(), name="dispatcher-room")

    async def stop(self) -> None:
        """Stop reading the room."""
        if self._task is not None:
            task, self._task = self._task, None
            await cancel_and_wait(task)

    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self._interval_s)
            await self.refresh()
