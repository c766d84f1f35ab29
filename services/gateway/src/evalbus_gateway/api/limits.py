"""Request limits beyond the body size: event streams one principal may hold open, and commands
one run's sandbox may be asked to run per minute.

Both are counted by the replica that serves the request (in memory, nothing shared): a stream lives
on the replica that opened it, so its count is exact; the exec rate is per replica, so N replicas
let a run take up to N times the rate (each is still bounded, and the dispatcher holding the run
runs one command at a time per request it answers). Past a limit the answer is 429
`too_many_requests` with `Retry-After`, naming `Authorization` (the principal holding the streams)
or `run_id` (the run asked too often).
"""

from __future__ import annotations

import math
import time
from collections import Counter, deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from evalbus_gateway.api.errors import ApiError

EXEC_WINDOW_S = 60.0
"""The exec rate's window."""


class StreamSlots:
    """Open event streams per principal."""

    def __init__(self) -> None:
        self._open: Counter[str] = Counter()

    def open_for(self, principal: str) -> int:
        """How many streams `principal` holds open now."""
        return self._open[principal]

    @contextmanager
    def hold(self, principal: str, limit: int) -> Iterator[None]:
        """One stream of `principal` for the duration of the block; 429 when it already holds
        `limit` (0: no limit)."""
        if limit and self._open[principal] >= limit:
            raise ApiError(
                429,
                "too_many_requests",
                f"{principal!r} already holds {self._open[principal]} open event stream(s), the most one principal "
                f"may (GATEWAY_SSE_MAX_PER_PRINCIPAL = {limit}); close one first",
                "Authorization",
                headers={"Retry-After": "1"},
            )
        self._open[principal] += 1
        try:
            yield
        finally:
            self._open[principal] -= 1
            if not self._open[principal]:
                del self._open[principal]


class RunRate:
    """Requests per run in a sliding window (the exec rate)."""

    def __init__(self, window_s: float = EXEC_WINDOW_S, clock: Callable[[], float] = time.monotonic) -> None:
        self._window_s = window_s
        self._clock = clock
        self._times: dict[str, deque[float]] = {}

    def take(self, run_id: str, limit: int) -> None:
        """Count one request for `run_id`; 429 (with when to retry) when it had `limit` in the
        window already (0: no limit)."""
        if not limit:
            return
        now = self._clock()
        self._forget_before(now - self._window_s)
        times = self._times.setdefault(run_id, deque())
        if len(times) >= limit:
            retry = max(1, math.ceil(times[0] + self._window_s - now))
            raise ApiError(
                429,
                "too_many_requests",
                f"run {run_id} was asked {len(times)} times in the last {self._window_s:g} s, the most its sandbox "
                f"takes (GATEWAY_EXEC_PER_RUN_PER_MINUTE = {limit}); retry in {retry} s",
                "run_id",
                headers={"Retry-After": str(retry)},
            )
        times.append(now)

    def _forget_before(self, horizon: float) -> None:
        for run_id in list(self._times):
            times = self._times[run_id]
            while times and times[0] <= horizon:
                times.popleft()
            if not times:
                del self._times[run_id]
