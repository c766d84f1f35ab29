"""Per-suite rate caps: at most `rate_per_min` observations sampled per UTC clock minute, counted
across every collector replica in a JetStream key-value bucket (`ONLINE_RATES`, one key per suite
and minute, expiring after a few minutes).

Taking a slot is a compare-and-set on the minute's key (create at 1, else update from the revision
read), retried on a conflict, so two replicas never both take the last slot. A slot taken by a
collector that died before its `case.observed` was stored is not given back: the cap is then
reached one observation early for that minute — it never lets more through than the cap.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import Callable

from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue

from evalbus_contracts.streams import KvDef
from evalbus_runtime.bus import open_bucket

log = logging.getLogger("evalbus.collector.rates")

BUCKET = "ONLINE_RATES"
"""The key-value bucket of the counters."""
TTL_S = 300.0
"""How long a minute's counter is kept."""
CAS_ATTEMPTS = 50
"""Compare-and-set retries before a slot is given up as contended (it is then not taken)."""


class RateCapUnavailableError(RuntimeError):
    """The counter could not be read or written (the observation is retried)."""


class RateCaps:
    """Slots per suite and minute, shared by every replica."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self._clock = clock
        self._kv: KeyValue | None = None

    async def start(self, js: JetStreamContext, replicas: int = 1) -> None:
        """Open the bucket, creating it with `replicas` replicas (the service's `STREAM_REPLICAS`)
        when missing."""
        self._kv = await open_bucket(js, KvDef(bucket=BUCKET, ttl_s=TTL_S, history=1), replicas)

    async def take(self, suite_id: str, cap: int, now_s: float | None = None) -> bool:
        """Take one of the suite's `cap` slots of the current minute; False when they are all taken."""
        if self._kv is None:
            raise RateCapUnavailableError("the rate counters are not open")
        moment = now_s if now_s is not None else self._clock()
        # keys allow few characters: the suite is named by a digest of its id
        key = f"{hashlib.sha256(suite_id.encode()).hexdigest()[:32]}.{int(moment // 60)}"
        for _ in range(CAS_ATTEMPTS):
            try:
                entry = await self._kv.get(key)
            except KeyNotFoundError:
                try:
                    await self._kv.create(key, b"1")
                except KeyWrongLastSequenceError:
                    continue  # another replica created it first
                return cap >= 1
            except Exception as e:
                raise RateCapUnavailableError(f"reading {key}: {e}") from e
            taken = int(entry.value or b"0")
            if taken >= cap:
                return False
            try:
                await self._kv.update(key, str(taken + 1).encode(), last=entry.revision)
            except KeyWrongLastSequenceError:
                continue
            return True
        log.warning("rate counter %s stayed contended; the observation is not taken", key)
        return False
