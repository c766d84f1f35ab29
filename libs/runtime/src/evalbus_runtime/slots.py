"""Slots shared by several stages of one replica: a dispatcher serving two lanes has one pool of
compute, not one per lane, and a cluster backend sizes it from the cluster's room.

A `ConsumerLoop` whose `Stage` names a pool asks JetStream for no more messages than the pool has
free (less what is already waiting for a slot, less its own outstanding requests). Loops do not
reserve their requests against each other — a lane with nothing to do would otherwise keep the
others from pulling for a whole pull-request lifetime — so when two loops' messages arrive for the
last free slot, the later one waits on this replica, kept in progress, for the next slot given back
(first come, first served across the loops). Overbooking is bounded: at most `(loops − 1) × free`
messages wait at once, and none is pulled while one waits.

Resizing (`resize`) never takes a slot away from a holder: a smaller pool lends no new slot until
enough are given back.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Callable


class SlotPool:
    """A resizable count of slots, taken and given back by the stages that share it."""

    def __init__(self, size: int, *, name: str = "slots") -> None:
        if size < 0:
            raise ValueError(f"a slot pool's size is at least 0, not {size}")
        self.name = name
        """What the slots are (logs, metrics)."""
        self._size = size
        self._held = 0
        self._waiters: deque[asyncio.Future[None]] = deque()
        self._listeners: list[Callable[[], None]] = []

    @property
    def size(self) -> int:
        """Slots the pool lends at most."""
        return self._size

    @property
    def held(self) -> int:
        """Slots taken and not given back."""
        return self._held

    @property
    def waiting(self) -> int:
        """Takers waiting for a slot."""
        return sum(1 for w in self._waiters if not w.done())

    def available(self) -> int:
        """Slots a stage may pull messages for now: free, less those already promised to waiters."""
        return max(0, self._size - self._held - self.waiting)

    def on_change(self, listener: Callable[[], None]) -> None:
        """Call `listener` (no arguments, on the event loop) whenever slots may have become available."""
        self._listeners.append(listener)

    def try_take(self) -> bool:
        """Take a slot when one is free and nobody waits for it; False otherwise."""
        if self._held < self._size and not self._waiters:
            self._held += 1
            return True
        return False

    async def take(self) -> None:
        """Take a slot, waiting (first come, first served) until one is given back or the pool grows.
        Cancelled while waiting: no slot is taken."""
        if self.try_take():
            return
        waiter: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiters.append(waiter)
        try:
            await waiter
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self._give_back_one()  # handed a slot in the same tick it was cancelled
            raise
        finally:
            if waiter in self._waiters:
                self._waiters.remove(waiter)

    def give_back(self) -> None:
        """Return a taken slot: to the oldest waiter, else to the pool (and tell the listeners)."""
        self._give_back_one()

    def resize(self, size: int) -> None:
        """Lend at most `size` slots from now on (holders keep theirs); waiters get the new room."""
        if size < 0:
            raise ValueError(f"a slot pool's size is at least 0, not {size}")
        if size == self._size:
            return
        self._size = size
        self._wake()
        self._notify()

    def _give_back_one(self) -> None:
        if self._held <= 0:
            raise RuntimeError(f"{self.name}: a slot given back that was never taken")
        self._held -= 1
        self._wake()
        self._notify()

    def _wake(self) -> None:
        while self._waiters and self._held < self._size:
            waiter = self._waiters.popleft()
            if waiter.done():
                continue
            self._held += 1
            waiter.set_result(None)

    def _notify(self) -> None:
        if self.available() > 0:
            for listener in self._listeners:
                listener()
