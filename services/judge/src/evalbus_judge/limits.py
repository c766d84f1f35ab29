"""Adaptive concurrency per model provider (base URL + model), shared by every judge replica.

A provider's rate limit is a property of the provider, not of one replica, so its concurrency
limit lives in one place every replica reads and writes: a key per provider in the JetStream
key-value bucket `JUDGE_LIMITS`, holding the limit, a pause (`Retry-After`) and the replicas that
use it. The limit moves by AIMD, decided by pure functions (`succeeded`, `limited`):

- **slow start**: from `INITIAL_LIMIT`, +`SLOW_START_STEP` per success scaled by the fraction of
  the provider's quota its `x-ratelimit-remaining-requests` (or `-tokens`) says is left — the
  limit triples every round of calls while the provider's window is empty, less as it fills, and
  never passes the requests one window admits (`x-ratelimit-limit-requests`) — until a refusal, a
  quota left under `NEAR_REMAINING`, or a spent one;
- **additive increase** afterwards: +`ADDITIVE_STEP` per round of calls, except within `HOLD_S` of
  a success that said the quota is **spent** (under `SPENT_REMAINING` left): the provider's window
  is full at this limit, so it holds there instead of probing past it;
- **decrease** on a 429 or 503: one call less per refusal (each is a call the provider had no
  room for in its window), at most halving the limit in one burst of refusals (`COOLDOWN_S`);
- a 429 / 503 with `Retry-After` (or `retry-after-ms`) **pauses** the provider for every replica
  until then;
- always within [1, `JUDGE_GLOBAL_LIMIT`].

The state is kept for `TTL_S` after its last write, so a new run against a provider used within
the hour starts from the limit already learnt rather than from a new start.

Each replica runs at most its share of the limit at once: the replicas seen in the last
`REPLICA_TTL_S` (each refreshes itself in the key when it writes, and writes itself in before its
first call when the key does not list it) split it, the first ones (by id) taking the remainder —
so together they hold the limit (never less than one call per replica).
Every outcome is written by compare-and-set (create, else update from the revision read, retried
on a conflict). Every replica watches the key, so a write (a replica joining, a pause, a new
limit) reaches the others at once; a read every `REFRESH_S` backs the watch up, and a replica that
cannot reach the bucket keeps going on the state it last saw.

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
from evalbus_runtime.tasks import cancel_and_wait

log = logging.getLogger("evalbus.judge.limits")

BUCKET = "JUDGE_LIMITS"
"""The key-value bucket of the providers' shared limits."""
TTL_S = 3600.0
"""A provider unused for an hour starts again from `INITIAL_LIMIT`."""
INITIAL_LIMIT = 4.0
"""Calls in flight a provider starts with (slow start grows it quickly)."""
SLOW_START_STEP = 2.0
"""Increase per success while starting (scaled by the quota left): the limit triples every round
of calls while the provider's window is empty, less as it fills."""
ADDITIVE_STEP = 0.5
"""Increase per round of calls (limit successes) after the start, while the quota is not spent."""
REFUSAL_STEP = 1.0
"""Decrease per 429 / 503: each refusal is one call more in flight than the provider had room for."""
BURST_FLOOR = 0.5
"""The lowest fraction of the limit one burst of refusals (one `COOLDOWN_S`) can bring it to."""
SPENT_REMAINING = 0.05
"""`x-ratelimit-remaining-*` below this fraction of `x-ratelimit-limit-*` is a spent quota: the
limit is the provider's, so it holds there (no increase) instead of probing past it."""
NEAR_REMAINING = 0.35
"""While starting, a remaining quota at or below this fraction ends the tripling (without a
decrease): the next round would overshoot."""
HOLD_S = 2.0
"""How long a spent quota holds the limit: it grows again only after this long without one."""
COOLDOWN_S = 1.0
"""How long a burst of refusals lasts: the ones within this long of its first at most halve the limit."""
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
    """When the last burst of refusals began (epoch seconds)."""
    burst_floor: float = 0.0
    """The lowest limit the current burst of refusals may bring it to (half the limit at its start)."""
    spent_at: float = 0.0
    """When a success last reported the provider's quota spent (epoch seconds): the limit holds until `HOLD_S` after."""
    replicas: dict[str, float] = msgspec.field(default_factory=dict)
    """Replica id → when it last wrote (epoch seconds)."""


# ---------------------------------------------------------------- the decisions (pure)


def _seen(state: ProviderState, replica: str, now: float) -> dict[str, float]:
    live = {r: t for r, t in state.replicas.items() if now - t < REPLICA_TTL_S}
    live[replica] = now
    return live


def listed(state: ProviderState, replica: str, now: float) -> bool:
    """Whether the others count `replica` in the split for a while yet (it wrote within half of
    `REPLICA_TTL_S`): one that is not writes itself in before its first call, so it never takes
    the share of a replica the others already count."""
    seen = state.replicas.get(replica)
    return seen is not None and now - seen < REPLICA_TTL_S / 2


def joined(state: ProviderState, replica: str, now: float) -> ProviderState:
    """The state with `replica` counted among the provider's live replicas."""
    return msgspec.structs.replace(state, replicas=_seen(state, replica, now))


def succeeded(
    state: ProviderState,
    replica: str,
    now: float,
    *,
    ceiling: int,
    remaining: float | None = None,
    window: float | None = None,
) -> ProviderState:
    """The state after a call that succeeded (`remaining`: the fraction of its quota the provider
    said is left, from its `x-ratelimit-*` headers; `window`: the requests its quota allows per
    window, `x-ratelimit-limit-requests`; None when it sent none)."""
    replicas = _seen(state, replica, now)
    if remaining is not None and remaining < SPENT_REMAINING:
        # the provider's window is full at this limit: hold it (a start ends here)
        return msgspec.structs.replace(state, slow_start=False, spent_at=now, replicas=replicas)
    if state.slow_start:
        if remaining is not None and remaining <= NEAR_REMAINING:
            return msgspec.structs.replace(state, slow_start=False, replicas=replicas)
        # the quota left scales the growth down as the provider's window fills, so the round
        # that reaches its limit does not overshoot it by far; and more calls at once than the
        # window admits cannot all succeed (the additive increase may still pass it, for a
        # provider whose window is shorter than a call)
        step = SLOW_START_STEP * (1.0 if remaining is None else remaining)
        top = min(float(ceiling), window) if window is not None and window >= 1 else float(ceiling)
        return msgspec.structs.replace(state, limit=max(state.limit, min(top, state.limit + step)), replicas=replicas)
    if now - state.spent_at < HOLD_S:
        return msgspec.structs.replace(state, replicas=replicas)
    step = ADDITIVE_STEP / max(1.0, state.limit)
    return msgspec.structs.replace(state, limit=min(float(ceiling), state.limit + step), replicas=replicas)


def limited(
    state: ProviderState, replica: str, now: float, *, ceiling: int, retry_after_s: float | None
) -> ProviderState:
    """The state after a 429 / 503: one call less than were in flight (a refusal is a call the
    provider had no room for), at most halving the limit per `COOLDOWN_S`, and the provider paused
    until its `Retry-After`."""
    replicas = _seen(state, replica, now)
    paused = max(state.paused_until, now + retry_after_s) if retry_after_s else state.paused_until
    limit = min(float(ceiling), state.limit)
    if now - state.decreased_at >= COOLDOWN_S:  # the first refusal of a burst
        floor, decreased_at = limit * BURST_FLOOR, now
    else:
        floor, decreased_at = state.burst_floor, state.decreased_at
    return msgspec.structs.replace(
        state,
        limit=max(1.0, floor, limit - REFUSAL_STEP),
        slow_start=False,
        paused_until=paused,
        decreased_at=decreased_at,
        burst_floor=floor,
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
    `x-ratelimit-limit-*` of requests and tokens; None without them."""
    fractions = []
    for kind in ("requests", "tokens"):
        try:
            remaining = float(headers[f"x-ratelimit-remaining-{kind}"])
            limit = float(headers[f"x-ratelimit-limit-{kind}"])
        except (KeyError, ValueError):
            continue
        if limit > 0 and math.isfinite(remaining) and math.isfinite(limit):
            fractions.append(max(0.0, remaining) / limit)
    return min(fractions) if fractions else None


def window_requests(headers: Mapping[str, str]) -> float | None:
    """The requests a provider's quota allows per window (`x-ratelimit-limit-requests`); None without it."""
    try:
        limit = float(headers["x-ratelimit-limit-requests"])
    except (KeyError, ValueError):
        return None
    return limit if math.isfinite(limit) and limit > 0 else None


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

    async def close(self) -> None:
        """Stop following the providers' keys."""
        for limiter in self._limiters.values():
            await limiter.close()

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
        self._revision = 0  # of the key's entry `state` was read from (0: none yet)
        self._read_at = -math.inf
        self.in_flight = 0
        self._changed = asyncio.Condition()
        self._watch: KeyValue.KeyWatcher | None = None
        self._follower: asyncio.Task[None] | None = None
        self._publish_gauges()

    def _adopt(self, state: ProviderState, revision: int) -> bool:
        """Take `state` as the provider's unless a later revision of its key was seen already."""
        if revision <= self._revision:
            return False
        self.state, self._revision = state, revision
        self._read_at = self._limits.clock()
        return True

    def _start_following(self) -> None:
        if self._follower is None and self._limits._kv is not None:
            self._follower = asyncio.create_task(self._follow(self._limits._kv), name=f"limits-watch-{self.key}")

    async def _follow(self, kv: KeyValue) -> None:
        """Take every replica's writes to the key as they happen (a watch), waking waiting calls: a
        change of the limit, a pause or a replica joining reaches every replica at once instead of
        at its next read."""
        try:
            self._watch = await kv.watch(self.key)
            async for entry in self._watch:
                if entry is None or not entry.value:  # the end of the initial values, or a deletion
                    continue
                state = _STATE.decode(entry.value)
                async with self._changed:
                    if self._adopt(state, entry.revision or 0):
                        self._publish_gauges()
                        self._changed.notify_all()
        except asyncio.CancelledError:
            raise
        except Exception as e:  # the periodic reads carry on without it
            log.warning("watching the limit of %s: %s", self.name, e)

    async def close(self) -> None:
        """Stop following the key."""
        if self._watch is not None:
            with suppress(Exception):
                await self._watch.stop()  # type: ignore[no-untyped-call]
        if self._follower is not None:
            await cancel_and_wait(self._follower)

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
        self._start_following()
        async with self._changed:
            while True:
                now = self._limits.clock()
                if now - self._read_at > REFRESH_S:
                    await self._read()
                    now = self._limits.clock()
                if self._limits._kv is not None and not listed(self.state, self._limits.replica_id, now):
                    await self._join()
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

    async def _join(self) -> None:
        """Write this replica into the provider's key, so the others count it before its first call."""
        limits = self._limits
        await self._update(lambda state: joined(state, limits.replica_id, limits.clock()))

    async def record(
        self,
        outcome: Outcome,
        *,
        retry_after_s: float | None = None,
        remaining: float | None = None,
        window: float | None = None,
    ) -> None:
        """Fold one call's outcome into the shared state (compare-and-set) and wake waiting calls."""
        if outcome == "other":
            return
        limits = self._limits

        def apply(state: ProviderState) -> ProviderState:
            now = limits.clock()
            if outcome == "limited":
                return limited(state, limits.replica_id, now, ceiling=limits.ceiling, retry_after_s=retry_after_s)
            return succeeded(state, limits.replica_id, now, ceiling=limits.ceiling, remaining=remaining, window=window)

        await self._update(apply)
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
            self._adopt(_STATE.decode(entry.value or b"{}"), entry.revision or 0)
        except KeyNotFoundError:
            pass
        except Exception as e:  # the bucket is unreachable: go on with the state last seen
            log.warning("reading the limit of %s: %s", self.name, e)
        self._read_at = self._limits.clock()
        self._publish_gauges()

    async def _update(self, apply: Callable[[ProviderState], ProviderState]) -> None:
        """Apply an outcome to the key by compare-and-set and take the result as the state."""
        kv = self._limits._kv
        if kv is not None:
            try:
                for _ in range(CAS_ATTEMPTS):
                    try:
                        entry = await kv.get(self.key)
                    except KeyNotFoundError:
                        new = apply(ProviderState())
                        try:
                            revision = await kv.create(self.key, msgspec.json.encode(new))
                        except KeyWrongLastSequenceError:
                            continue
                        self._adopt(new, revision)
                        return
                    new = apply(_STATE.decode(entry.value or b"{}"))
                    try:
                        revision = await kv.update(self.key, msgspec.json.encode(new), last=entry.revision)
                    except KeyWrongLastSequenceError:
                        continue
                    self._adopt(new, revision)
                    return
            except Exception as e:
                log.warning("writing the limit of %s: %s", self.name, e)
        self.state = apply(self.state)  # no bucket, or it could not be written: this replica's view only
        self._read_at = self._limits.clock()


async def _wait(changed: asyncio.Condition, timeout_s: float) -> None:
    """Wait (holding `changed` again afterwards) until notified or `timeout_s` passed."""
    with suppress(TimeoutError):
        await asyncio.wait_for(changed.wait(), timeout=max(0.001, timeout_s))
