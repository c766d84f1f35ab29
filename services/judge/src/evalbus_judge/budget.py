"""Daily cost budgets of online suites: the dollars a suite's model judges spent per UTC day,
counted across every judge replica in a JetStream key-value bucket (`ONLINE_SPEND`, one key per
suite and day, in micro-dollars, kept two days).

The judge is where the spend is known (each billed call's tokens and price) and where it can be
stopped (before the call), so both the check and the count are here, not in the collector: a
backlog sampled while the budget still had room is not judged past it.

- Before an observation's model judges are called, the suite's spend today is read; at or over its
  `budget_usd_per_day` they are not called.
- After they ran, what their calls cost is added by compare-and-set (create the day's key, else
  update it from the revision read, retried on a conflict), so replicas adding at once never lose an
  addition.

The check and the addition are two steps: observations judged at the same moment on several
replicas may each pass the check, so a day can end over its budget by what those in-flight calls
cost (at most the judge's global limit × one observation's model calls). A budget bounds spend; it
is not a prepaid balance. A call whose cost is unknown (no price, none reported) adds nothing.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Protocol

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from evalbus_contracts.streams import KvDef
from evalbus_judge.errors import JudgeServiceError
from evalbus_runtime.bus import open_bucket

log = logging.getLogger("evalbus.judge.budget")

BUCKET = "ONLINE_SPEND"
"""The key-value bucket of the daily spend counters."""
TTL_S = 2 * 86_400.0
"""How long a day's counter is kept (the day, and the next for late readers)."""
CAS_ATTEMPTS = 50
"""Compare-and-set retries before an addition is given up as contended (it is then logged, not lost silently)."""
MICRO = 1_000_000
"""Counters hold integer micro-dollars, so concurrent additions add exactly."""


class BudgetUnavailableError(JudgeServiceError):
    """The spend counter could not be read (the observation is judged again later)."""


class Spend(Protocol):
    """Where a suite's daily spend is read and added to."""

    async def spent(self, suite_id: str) -> float:
        """Dollars the suite's model judges spent today (UTC)."""
        ...

    async def add(self, suite_id: str, usd: float) -> None:
        """Count `usd` more against the suite's day."""
        ...


def day_key(suite_id: str, now_s: float) -> str:
    """The counter of a suite's UTC day: key-value keys allow few characters, so the suite is
    named by a digest of its id."""
    day = datetime.fromtimestamp(now_s, UTC).strftime("%Y%m%d")
    return f"{hashlib.sha256(suite_id.encode()).hexdigest()[:32]}.{day}"


class SpendLedger:
    """Daily spend per suite in the `ONLINE_SPEND` bucket, shared by every judge replica."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._kv: KeyValue | None = None

    async def start(self, js: JetStreamContext, replicas: int = 1) -> None:
        """Open the bucket, creating it with `replicas` replicas (the service's `STREAM_REPLICAS`)
        when missing."""
        self._kv = await open_bucket(js, KvDef(bucket=BUCKET, ttl_s=TTL_S, history=1), replicas)

    def _open(self) -> KeyValue:
        if self._kv is None:
            raise BudgetUnavailableError("the spend counters are not open")
        return self._kv

    async def spent(self, suite_id: str, now_s: float | None = None) -> float:
        """Dollars counted against the suite's UTC day."""
        kv = self._open()
        key = day_key(suite_id, now_s if now_s is not None else self._clock())
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            return 0.0
        except Exception as e:
            raise BudgetUnavailableError(f"reading {key}: {e}") from e
        return int(entry.value or b"0") / MICRO

    async def add(self, suite_id: str, usd: float, now_s: float | None = None) -> None:
        """Add `usd` (rounded up to a micro-dollar) to the suite's UTC day."""
        micros = -(-round(usd * MICRO * 1000) // 1000)  # ceil, tolerant of float noise
        if micros <= 0:
            return
        kv = self._open()
        key = day_key(suite_id, now_s if now_s is not None else self._clock())
        for _ in range(CAS_ATTEMPTS):
            try:
                entry = await kv.get(key)
            except KeyNotFoundError:
                try:
                    await kv.create(key, str(micros).encode())
                except KeyWrongLastSequenceError:
                    continue  # another replica created it first
                return
            total = int(entry.value or b"0") + micros
            try:
                await kv.update(key, str(total).encode(), last=entry.revision)
            except KeyWrongLastSequenceError:
                continue
            return
        log.warning("spend counter %s stayed contended; %.6f USD were not counted", key, usd)
