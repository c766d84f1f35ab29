"""Adaptive concurrency per model provider (base URL + model), shared by every judge replica.

A provider's rate limit is a property of the provider, not of one replica, so its concurrency
limit lives in one place every replica reads and writes: a key per provider in the JetStream
key-value bucket `JUDGE_LIMITS`, holding the limit, a pause (`Retry-After`) and the replicas that
use it. The limit moves by AIMD, decided by pure functions (`succeeded`, `limited`):

- **additive increase** while calls succeed: the limit doubles every round of calls while starting
  (slow start: +1 per success, scaled by the fraction of the provider's quota left, until a 429 —
  which halves it — or a quota left under `NEAR_REMAINING`), then +`ADDITIVE_STEP` per round;
- **multiplicative decrease** on a 429 or 503 (× `LIMITED_FACTOR`), or gently (× `LOW_FACTOR`)
  when a success says the provider's `x-ratelimit-remaining-requests` (or `-tokens`) is nearly
  spent — the signal that lets it hold just under the provider's limit without being refused; at
  most once per `COOLDOWN_S`, so one burst of refusals counts once;
- a 429 / 503 with `Retry-After` (or `retry-after-ms`) **pauses** the provider for every replica
  until then;
- always within [1, `JUDGE_GLOBAL_LIMIT`].

Each replica runs at most its share of the limit at once: the replicas seen in the last
`REPLICA_TTL_S` (each refreshes itself in the key when it writes) split it, the first ones (by id)
taking the remainder — so together they hold the limit (never less than one call per replica).
Every outcome is written by compare-and-set (create, else update from the revision read, retried
on a conflict); a replica that cannot reach the bucket keeps going on the state it last saw.

The limit guards providers only: a case whose judges are all rules never waits here.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable, Mapping
from contextlib import asynccontextmanager, suppress
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.kv import KeyValue
from prometheus_client import CollectorRegistry, Gauge

from evalbus_contracts.streams import KvDef
from evalbus_runtime.bus import open_bucket

log = logging.getLogger("evalbus.judge.limits")

BUCKET = "JUDGE_LIMITS"
"""The key-value bucket of the providers' shared limits."""
TTL_S = 3600.0
"""A provider unused for an hour starts again from `INITIAL_LIMIT`."""
INITIAL_LIMIT = 2.0
"""Calls in flight a provider starts with (slow start grows it quickly)."""
SLOW_START_STEP = 1.0
"""Increase per success while starting: the limit doubles every round of calls."""
ADDITIVE_STEP = 0.5
"""Increase per round of calls (limit successes) after the start."""
SLOW_START_EXIT = 0.7
"""The limit after a 429 / 503 while starting: the refusal arrives a round late, when the limit is
about twice the one that caused it."""
LIMITED_FACTOR = 0.8
"""The limit after a 429 / 503, as a fraction of the limit before."""
LOW_FACTOR = 0.95
"""The limit after a success that reported the provider's remaining quota nearly spent."""
LOW_REMAINING = 0.05
"""`x-ratelimit-remaining-*` at or below this fraction of `x-ratelimit-limit-*` (or 1 left) is low."""
NEAR_REMAINING = 0.35
"""While starting, a remaining quota at or below this fraction ends the doubling (without a
decrease): the next doubling would overshoot."""
COOLDOWN_S = 1.0
"""At most one decrease per this long: a burst of refusals from one overshoot counts once."""
REPLICA_TTL_S = 10.0
"""A replica that has written nothing for this long no longer takes a share."""
REFRESH_S = 0.5
"""How old the state a replica admits calls by may be before it reads it again."""
CAS_ATTEMPTS = 20
"""Compare-and-set retries before an outcome is applied locally only."""

Outcome = Literal["ok", "limited", "other"]
"""What one call told about the provider: it succeeded, it was refused (429/503), or neither."""


class ProviderState(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A provider's shared limit, as stored in its key."""

    limit: float = INITIAL_LIMIT
    """Calls in flight allowed across every replica."""
    slow_start: bool = True
    """Growing by one per success until the first decrease."""
    paused_until: float = 0.0
    """No call before this time (epoch seconds): the provider's `Retry-After`."""
    decreased_at: float = 0.0
    """When the limit last went down (epoch seconds)."""
    replicas: dict[str, float] = msgspec.field(default_factory=dict)
    """Replica id → when it last wrote (epoch seconds)."""


# ---------------------------------------------------------------- the decisions (pure)


def _seen(state: ProviderState, replica: str, now: float) -> dict[str, float]:
    live = {r: t for r, t in state.replicas.items() if now - t < REPLICA_TTL_S}
    live[replica] = now
    return live


def succeeded(
    state: ProviderState, replica: str, now: float, *, ceiling: int, remaining: float | None = None
) -> ProviderState:
    """The state after a call that succeeded (`remaining`: the fraction of its quota the provider
    said is left, from its `x-ratelimit-*` headers; None when it sent none)."""
    replicas = _seen(state, replica, now)
    if state.slow_start and remaining is not None and remaining <= NEAR_REMAINING:
        return msgspec.structs.replace(state, slow_start=False, replicas=replicas)
    if remaining is not None and remaining <= LOW_REMAINING:
        if now - state.decreased_at < COOLDOWN_S:
            return msgspec.structs.replace(state, replicas=replicas)
        return msgspec.structs.replace(
            state,
            limit=max(1.0, min(float(ceiling), state.limit) * LOW_FACTOR),
            slow_start=False,
            decreased_at=now,
            replicas=replicas,
        )
    if state.slow_start:
        # the quota left scales the doubling down as the provider's window fills, so the round
        # that reaches its limit does not overshoot it twice over
        step = SLOW_START_STEP * (1.0 if remaining is None else remaining)
    else:
        step = ADDITIVE_STEP / max(1.0, state.limit)
    return msgspec.structs.replace(state, limit=min(float(ceiling), state.limit + step), replicas=replicas)


def limited(
    state: ProviderState, replica: str, now: float, *, ceiling: int, retry_after_s: float | None
) -> ProviderState:
    """The state after a 429 / 503: a decrease (once per cooldown) and the provider paused until its `Retry-After`."""
    replicas = _seen(state, replica, now)
    paused = max(state.paused_until, now + retry_after_s) if retry_after_s else state.paused_until
    if now - state.decreased_at < COOLDOWN_S:
        return msgspec.structs.replace(state, paused_until=paused, replicas=replicas)
    factor = SLOW_START_EXIT if state.slow_start else LIMITED_FACTOR
    return msgspec.structs.replace(
        state,
        limit=max(1.0, min(float(ceiling), state.limit) * factor),
        slow_start=False,
        paused_until=paused,
        decreased_at=now,
        replicas=replicas,
    )


def share(state: ProviderState, replica: str, now: float, *, ceiling: int) -> int:
    """Calls this replica may have in flight: its part of the limit among the live replicas (at least 1)."""
    live = sorted(_seen(state, replica, now))
    total = max(1, math.floor(min(float(ceiling), state.limit)))
    base, extra = divmod(total, len(live))
    return max(1, base + (1 if live.index(replica) < extra else 0))


def quota_left(headers: Mapping[str, str]) -> float | None:
    """The fraction of its quota a provider says is left: the lowest `x-ratelimit-remaining-*` ÷
    `x-ratelimit-limit-*` of requests and tokens (one left counts as none); None without them."""
    fractions = []
    for kind in ("requests", "tokens"):
        try:
            remaining = float(headers[f"x-ratelimit-remaining-{kind}"])
            limit = float(headers[f"x-ratelimit-limit-{kind}"])
        except (KeyError, ValueError):
            continue
        if limit > 0 and math.isfinite(remaining) and math.isfinite(limit):
            fractions.append(0.0 if remaining <= 1 else remaining / limit)
    return min(fractions) if fractions else None


def provider_name(base_url: str, model: str) -> str:
    """A provider as the limit and the metrics name it: the base URL without credentials, and the model."""
    parts = urlsplit(base_url.rstrip("/"))
    netloc = parts.hostname or ""
    if parts.port is not None:
        netloc += f":{parts.port}"
    return f"{urlunsplit((parts.scheme, netloc, parts.path, '', ''))} {model}"


# ---------------------------------------------------------------- the shared state (I/O)

_STATE = msgspec.json.Decoder(ProviderState)


class ProviderLimits:
    """Every provider's limiter on this replica, over the shared bucket."""

    def __init__(
        self,
        *,
        ceiling: int,
        registry: CollectorRegistry | None = None,
        replica_id: str | None = None,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.ceiling = max(1, ceiling)
        self.replica_id = replica_id or uuid.uuid4().hex[:12]
        self.clock = clock
        self._kv: KeyValue | None = None
        self._limiters: dict[str, ProviderLimiter] = {}
        self.limit_gauge = Gauge(
            "evalbus_judge_provider_limit",
            "A model provider's adaptive concurrency limit across judge replicas (as this replica last saw it)",
            ["provider"],
            registry=registry,
        )
        self.share_gauge = Gauge(
            "evalbus_judge_provider_share",
            "Model calls this replica may have in flight to a provider (its share of the limit)",
            ["provider"],
            registry=registry,
        )
        self.in_flight_gauge = Gauge(
            "evalbus_judge_provider_in_flight", "Model calls in flight to a provider", ["provider"], registry=registry
        )

    async def start(self, js: JetStreamContext, replicas: int = 1) -> None:
        """Open the bucket, creating it with `replicas` replicas (the service's `STREAM_REPLICAS`)
        when missing."""
        self._kv = await open_bucket(js, KvDef(bucket=BUCKET, ttl_s=TTL_S, history=1), replicas)

    def limiter(self, base_url: str, model: str) -> ProviderLimiter:
        """The limiter of one provider (made on first use)."""
        name = provider_name(base_url, model)
        found = self._limiters.get(name)
        if found is None:
            found = self._limiters[name] = ProviderLimiter(self, name)
        return found


class ProviderLimiter:
    """One provider's slots on this replica: at most its share of the shared limit in flight, none while paused."""

    def __init__(self, limits: ProviderLimits, name: str) -> None:
        self._limits = limits
        self.name = name
        self.key = hashlib.sha256(name.encode()).hexdigest()[:32]
        self.state = ProviderState()
        self._read_at = -math.inf
        self.in_flight = 0
        self._changed = asyncio.Condition()
        self._publish_gauges()

    def _share(self) -> int:
        limits = self._limits
        return share(self.state, limits.replica_id, limits.clock(), ceiling=limits.ceiling)

    def _publish_gauges(self) -> None:
        limits = self._limits
        limits.limit_gauge.labels(self.name).set(min(float(limits.ceiling), self.state.limit))
        limits.share_gauge.labels(self.name).set(self._share())
        limits.in_flight_gauge.labels(self.name).set(self.in_flight)

    @asynccontextmanager
    async def slot(self) -> AsyncIterator[None]:
        """Hold one call slot for the duration of the block."""
        await self._acquire()
        try:
            yield
        finally:
            async with self._changed:
                self.in_flight -= 1
                self._publish_gauges()
                self._changed.notify_all()

    async def _acquire(self) -> None:
        async with self._changed:
            while True:
                now = self._limits.clock()
                if now - self._read_at > REFRESH_S:
                    await self._read()
                    now = self._limits.clock()
                pause = self.state.paused_until - now
                if pause > 0:
                    await _wait(self._changed, pause)
                    continue
                if self.in_flight < self._share():
                    self.in_flight += 1
                    self._publish_gauges()
                    return
                await _wait(self._changed, REFRESH_S)

    async def record(
        self, outcome: Outcome, *, retry_after_s: float | None = None, remaining: float | None = None
    ) -> None:
        """Fold one call's outcome into the shared state (compare-and-set) and wake waiting calls."""
        if outcome == "other":
            return
        limits = self._limits

        def apply(state: ProviderState) -> ProviderState:
            now = limits.clock()
            if outcome == "limited":
                return limited(state, limits.replica_id, now, ceiling=limits.ceiling, retry_after_s=retry_after_s)
            return succeeded(state, limits.replica_id, now, ceiling=limits.ceiling, remaining=remaining)

        self.state = await self._update(apply)
        self._read_at = limits.clock()
        async with self._changed:
            self._publish_gauges()
            self._changed.notify_all()

    async def _read(self) -> None:
        kv = self._limits._kv
        if kv is None:
            self._read_at = self._limits.clock()
            return
        try:
            entry = await kv.get(self.key)
            self.state = _STATE.decode(entry.value or b"{}")
        except KeyNotFoundError:
            pass
        except Exception as e:  # the bucket is unreachable: go on with the state last seen
            log.warning("reading the limit of %s: %s", self.name, e)
        self._read_at = self._limits.clock()
        self._publish_gauges()

    async def _update(self, apply: Callable[[ProviderState], ProviderState]) -> ProviderState:
        kv = self._limits._kv
        if kv is None:
            return apply(self.state)
        try:
            for _ in range(CAS_ATTEMPTS):
                try:
                    entry = await kv.get(self.key)
                except KeyNotFoundError:
                    new = apply(ProviderState())
                    try:
                        await kv.create(self.key, msgspec.json.encode(new))
                    except KeyWrongLastSequenceError:
                        continue
                    return new
                new = apply(_STATE.decode(entry.value or b"{}"))
                try:
                    await kv.update(self.key, msgspec.json.encode(new), last=entry.revision)
                except KeyWrongLastSequenceError:
                    continue
                return new
        except Exception as e:
            log.warning("writing the limit of %s: %s", self.name, e)
        return apply(self.state)


async def _wait(changed: asyncio.Condition, timeout_s: float) -> None:
    """Wait (holding `changed` again afterwards) until notified or `timeout_s` passed."""
    with suppress(TimeoutError):
        await asyncio.wait_for(changed.wait(), timeout=max(0.001, timeout_s))
