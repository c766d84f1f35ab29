"""Python work done while PostgreSQL executes a statement.

The recorder spends about as much time in Python (body digests, the read-model fold) as the
server spends on its statements; done one after the other the two add up, although they run in
two processes that can use two cores. `Overlap` holds the Python work as iterators, each `next()`
a slice of a millisecond or so, and `during(statement)` runs slices while the statement is in
flight, handing the event loop back between slices so the connection's I/O keeps moving. Work
that is needed before a statement can be sent is forced with `run_until`; `finish` does the rest.
"""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import Awaitable, Callable, Iterator
from typing import TypeVar

T = TypeVar("T")


class Overlap:
    """A queue of Python work, done in slices while statements run (first in, first done)."""

    def __init__(self) -> None:
        self._work: deque[Iterator[None]] = deque()

    def add(self, work: Iterator[None]) -> None:
        """Queue work: each `next()` does one slice."""
        self._work.append(work)

    def _step(self) -> bool:
        """Do one slice; False when nothing is left."""
        while self._work:
            try:
                next(self._work[0])
            except StopIteration:
                self._work.popleft()
            else:
                return True
        return False

    def run_until(self, done: Callable[[], bool]) -> None:
        """Do slices now until `done()` holds (or nothing is left)."""
        while not done() and self._step():
            pass

    def finish(self) -> None:
        """Do everything left now."""
        while self._step():
            pass

    async def during(self, statement: Awaitable[T]) -> T:
        """Await `statement`, doing slices of the queued work until it completes.

        An exception from the work is raised once the statement is over (the connection is then
        free for the rollback); cancelling cancels the statement too."""
        task = asyncio.ensure_future(statement)
        try:
            while True:
                await asyncio.sleep(0)  # let the statement be sent, or its answer be read
                if task.done() or not self._step():
                    break
        except asyncio.CancelledError:
            task.cancel()
            raise
        except BaseException:
            await asyncio.wait([task])
            if not task.cancelled():
                task.exception()  # retrieved: the work's exception is the one that matters
            raise
        return await task
