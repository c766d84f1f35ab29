"""Adaptive provider concurrency: the AIMD decisions (pure), each replica's share of the limit, the
quota headers, and two limiters sharing one provider's limit on a real nats-server while a local
chat-completions server refuses past its rate."""

from __future__ import annotations

import asyncio
import heapq
import math
import random
import uuid
from dataclasses import dataclass, field

import pytest

from evalbus.testing.chat_server import ChatCompletionsServer, RateLimit
from evalbus.testing.pipeline import eventually
from evalbus_contracts import CaseResult, Measured, Message, ModelJudge
from evalbus_judge import ChatClient, ChatModelJudge, JudgeContext, RetryPolicy
from evalbus_judge.limits import (
    BURST_FLOOR,
    COOLDOWN_S,
    HOLD_S,
    INITIAL_LIMIT,
    REFRESH_S,
    REPLICA_TTL_S,
    ProviderLimits,
    ProviderState,
    joined,
    limited,
    listed,
    provider_name,
    quota_left,
    share,
    succeeded,
    window_requests,
)
from evalbus_runtime import connect
from evalbus_runtime.secrets import SecretStore


@pytest.mark.unit
def test_slow_start_triples_per_round_while_the_window_is_empty_then_grows_by_a_step_per_round() -> None:
    state = ProviderState(limit=2.0)
    for _ in range(2):  # one round of two successes, no quota headers
        state = succeeded(state, "r1", 100.0, ceiling=64)
    assert state.limit == 6.0
    assert state.slow_start
    # the provider's quota filling up scales the growth down, then ends it without a decrease
    state = succeeded(state, "r1", 100.0, ceiling=64, remaining=0.5)
    assert state.limit == 7.0
    state = succeeded(state, "r1", 100.0, ceiling=64, remaining=0.3)
    assert (state.limit, state.slow_start) == (7.0, False)
    for _ in range(14):  # two rounds at ~7 in flight: about +0.5 each
        state = succeeded(state, "r1", 100.0, ceiling=64, remaining=0.6)
    assert 7.9 < state.limit < 8.1
    # nor, while starting, past the requests the provider's window admits
    windowed = ProviderState(limit=18.0)
    for _ in range(4):
        windowed = succeeded(windowed, "r1", 100.0, ceiling=64, remaining=0.9, window=20.0)
    assert (windowed.limit, windowed.slow_start) == (20.0, True)
    above = succeeded(ProviderState(limit=25.0), "r1", 100.0, ceiling=64, remaining=0.9, window=20.0)
    assert above.limit == 25.0  # the cap never lowers it: refusals do
    # never past the ceiling
    capped = ProviderState(limit=8.0)
    for _ in range(20):
        capped = succeeded(capped, "r1", 100.0, ceiling=10)
    assert capped.limit == 10.0


@pytest.mark.unit
def test_a_spent_quota_holds_the_limit_until_a_while_without_one() -> None:
    state = ProviderState(limit=20.0)
    spent = succeeded(state, "r1", 100.0, ceiling=64, remaining=0.0)  # the window's last call
    assert (spent.limit, spent.slow_start, spent.spent_at) == (20.0, False, 100.0)
    held = spent
    for i in range(40):  # two rounds of successes with quota left, within HOLD_S of the spent one
        held = succeeded(held, "r1", 100.0 + i * (HOLD_S - 0.1) / 40, ceiling=64, remaining=0.5)
    assert held.limit == 20.0
    grown = succeeded(held, "r1", 100.0 + HOLD_S, ceiling=64, remaining=0.5)
    assert grown.limit == pytest.approx(20.0 + 0.5 / 20.0)
    # one left of twenty is not spent yet (the window still has room for a call)
    assert succeeded(grown, "r1", 100.0 + HOLD_S, ceiling=64, remaining=0.05).spent_at == 100.0


@pytest.mark.unit
def test_each_refusal_takes_one_call_off_at_most_halving_it_per_burst() -> None:
    state = ProviderState(limit=28.0)
    first = limited(state, "r1", 100.0, ceiling=64, retry_after_s=0.4)
    assert (first.limit, first.slow_start, first.paused_until, first.decreased_at) == (27.0, False, 100.4, 100.0)
    burst = first
    for i in range(7):  # the same window refused seven more: eight too many were in flight
        burst = limited(burst, "r1", 100.0 + i * 0.01, ceiling=64, retry_after_s=0.4)
    assert burst.limit == 20.0
    assert burst.paused_until == pytest.approx(100.46)  # paused until the latest Retry-After
    for _ in range(20):  # a long burst: no lower than half the limit it began at
        burst = limited(burst, "r1", 100.5, ceiling=64, retry_after_s=None)
    assert burst.limit == 28.0 * BURST_FLOOR
    later = limited(burst, "r1", 100.0 + COOLDOWN_S, ceiling=64, retry_after_s=None)  # a new burst
    assert (later.limit, later.decreased_at) == (13.0, 100.0 + COOLDOWN_S)
    floor = ProviderState(limit=1.0, slow_start=False)
    assert limited(floor, "r1", 100.0, ceiling=64, retry_after_s=None).limit == 1.0
    assert limited(ProviderState(limit=50.0), "r1", 100.0, ceiling=32, retry_after_s=None).limit == 31.0


@pytest.mark.unit
def test_live_replicas_split_the_limit_and_each_gets_one_at_least() -> None:
    state = ProviderState(limit=11.7, replicas={"a": 100.0, "b": 99.0, "gone": 100.0 - REPLICA_TTL_S - 1})
    assert [share(state, r, 100.0, ceiling=64) for r in ("a", "b")] == [6, 5]  # 11 in all; "gone" is out
    assert share(state, "c", 100.0, ceiling=64) == 3  # a third replica joins: 4 + 4 + 3
    assert share(state, "a", 100.0, ceiling=8) == 4  # the ceiling bounds the sum
    assert share(ProviderState(limit=1.0, replicas={"a": 100.0}), "b", 100.0, ceiling=64) == 1
    # a replica the key does not list (or listed long ago) writes itself in before its first call
    assert not listed(state, "c", 100.0)
    assert not listed(state, "b", 99.0 + REPLICA_TTL_S / 2)
    assert listed(joined(state, "c", 100.0), "c", 100.0)
    assert share(joined(state, "c", 100.0), "a", 100.0, ceiling=64) == 4


@pytest.mark.unit
def test_quota_headers_and_provider_names() -> None:
    assert quota_left({"x-ratelimit-remaining-requests": "15", "x-ratelimit-limit-requests": "20"}) == 0.75
    both = {
        "x-ratelimit-remaining-requests": "15",
        "x-ratelimit-limit-requests": "20",
        "x-ratelimit-remaining-tokens": "1000",
        "x-ratelimit-limit-tokens": "10000",
    }
    assert quota_left(both) == 0.1  # the scarcer of the two
    assert quota_left({"x-ratelimit-remaining-requests": "0", "x-ratelimit-limit-requests": "20"}) == 0.0
    assert quota_left({"x-ratelimit-remaining-requests": "n/a", "x-ratelimit-limit-requests": "20"}) is None
    assert quota_left({}) is None
    assert window_requests({"x-ratelimit-limit-requests": "20", "x-ratelimit-remaining-requests": "3"}) == 20.0
    assert window_requests({"x-ratelimit-limit-requests": "0"}) is None
    assert window_requests({"x-ratelimit-limit-tokens": "1000"}) is None
    assert provider_name("https://user:pw@api.example.com:8443/v1/", "m") == "https://api.example.com:8443/v1 m"


@dataclass
class Replica:
    """A judge replica as `ProviderLimiter` admits calls: by its own view of the shared state,
    replaced by the result of each of its own writes, by every write it watches, and read again when
    older than `REFRESH_S`."""

    name: str
    view: ProviderState = field(default_factory=ProviderState)
    read_at: float = -math.inf
    in_flight: int = 0


@dataclass
class Run:
    """What a simulated run measured."""

    accepted_each_s: list[int]
    refused_each_s: list[int]
    limit_each_s: list[float]
    final: ProviderState

    @property
    def refused(self) -> int:
        return sum(self.refused_each_s)

    @property
    def accepted(self) -> int:
        return sum(self.accepted_each_s)


def drive(
    replicas: int,
    *,
    seconds: float = 60.0,
    per_s: int = 20,
    latency_s: float = 1.0,
    headers: bool = True,
    ceiling: int = 32,
    state: ProviderState | None = None,
    watch: bool = True,
    seed: int = 0,
) -> Run:
    """Replicas with unbounded work calling a provider that behaves like the bench's server (at most
    `per_s` calls counted in each clock second, a call counted when it completes, 429 past it with
    `Retry-After` until the next second, `x-ratelimit-*` headers unless `headers` is false), on a
    simulated clock: the AIMD decisions and the shares fed their real sequence of outcomes, the
    shared key updated atomically (as compare-and-set does) and seen at once by every replica when
    `watch` (else by the writer only, the others at their next read), admission checked every 10 ms."""
    rng = random.Random(seed)
    start = 1000.3
    shared = state or ProviderState(limit=INITIAL_LIMIT)
    group = [Replica(f"r{i}") for i in range(replicas)]
    for i, replica in enumerate(group):  # each writes itself in before its first call, one after another
        shared = joined(shared, replica.name, start + i * 0.001)
        for other in group if watch else [replica]:
            other.view, other.read_at = shared, start + i * 0.001
    completions: list[tuple[float, int, int]] = []  # (time, sequence, replica index)
    window, used, sequence = -1, 0, 0
    accepted_each_s, refused_each_s = [0] * math.ceil(seconds), [0] * math.ceil(seconds)
    limit_each_s: list[float] = []
    tick = start
    while tick < start + seconds:
        if completions and completions[0][0] <= tick:
            now, _, i = heapq.heappop(completions)
            replica = group[i]
            replica.in_flight -= 1
            if int(now) != window:
                window, used = int(now), 0
            if used >= per_s:
                refused_each_s[int(now - start)] += 1
                shared = limited(shared, replica.name, now, ceiling=ceiling, retry_after_s=window + 1 - now)
            else:
                used += 1
                accepted_each_s[int(now - start)] += 1
                remaining = quota_left(
                    {"x-ratelimit-limit-requests": str(per_s), "x-ratelimit-remaining-requests": str(per_s - used)}
                )
                shared = succeeded(
                    shared,
                    replica.name,
                    now,
                    ceiling=ceiling,
                    remaining=remaining if headers else None,
                    window=float(per_s) if headers else None,
                )
            for other in group if watch else [replica]:
                other.view, other.read_at = shared, now
            continue
        if tick >= start + len(limit_each_s):
            limit_each_s.append(round(shared.limit, 1))
        for i, replica in enumerate(group):
            if tick - replica.read_at > REFRESH_S:
                replica.view, replica.read_at = shared, tick
            if replica.view.paused_until > tick:
                continue
            while replica.in_flight < share(replica.view, replica.name, tick, ceiling=ceiling):
                replica.in_flight += 1
                sequence += 1
                done = tick + latency_s * (1 + 0.02 * rng.random()) + 0.005
                heapq.heappush(completions, (done, sequence, i))
        tick = round(tick + 0.01, 6)
    return Run(accepted_each_s=accepted_each_s, refused_each_s=refused_each_s, limit_each_s=limit_each_s, final=shared)


@pytest.mark.unit
@pytest.mark.parametrize("replicas", [1, 2, 3])
def test_from_a_cold_start_replicas_sharing_a_provider_hold_nine_tenths_of_its_limit_over_a_minute(
    replicas: int,
) -> None:
    for seed in range(3):
        run = drive(replicas, seed=seed)
        assert run.accepted >= 0.93 * 20 * 60, run.accepted_each_s  # the first second is lost to latency anyway
        assert run.refused <= 0.02 * (run.accepted + run.refused)
        assert sum(run.accepted_each_s[4:]) >= 0.97 * 20 * 56, run.accepted_each_s  # found in four rounds, then held
        assert 20.0 <= run.final.limit < 23.0


@pytest.mark.unit
def test_without_quota_headers_refusals_alone_find_the_limit() -> None:
    run = drive(2, headers=False)
    assert run.accepted >= 0.93 * 20 * 60, run.accepted_each_s
    assert run.refused <= 0.05 * (run.accepted + run.refused)  # probing past the limit is the only signal


@pytest.mark.unit
def test_a_limit_learnt_before_is_used_from_the_first_round() -> None:
    learnt = ProviderState(limit=20.4, slow_start=False)
    run = drive(2, seconds=10.0, state=learnt)
    assert run.accepted_each_s[1:] == [20] * 9
    assert run.refused == 0


@pytest.mark.unit
def test_without_the_watch_a_replica_that_joined_first_overshoots_until_it_reads_again() -> None:
    # the case the watch is for: the first replica to join does not know of the second until its
    # next read, and takes the whole limit meanwhile
    learnt = ProviderState(limit=20.4, slow_start=False)
    run = drive(2, seconds=10.0, state=learnt, watch=False)
    assert run.refused >= 5
    assert sum(run.accepted_each_s) < sum(drive(2, seconds=10.0, state=learnt).accepted_each_s)


@pytest.mark.unit
@pytest.mark.parametrize(("per_s", "latency_s"), [(5, 1.0), (50, 0.5), (20, 0.5)])
def test_other_limits_and_latencies(per_s: int, latency_s: float) -> None:
    run = drive(2, per_s=per_s, latency_s=latency_s)
    assert run.accepted >= 0.9 * per_s * 60, run.accepted_each_s
    assert run.refused <= 0.05 * (run.accepted + run.refused)


@pytest.mark.integration
async def test_two_limiters_share_one_limit_and_a_refusal_waits_without_spending_retries(nats_url: str) -> None:
    server = ChatCompletionsServer()
    base_url = await server.start()
    server.rate_limit = RateLimit(per_s=5, latency_s=0.05)
    model = f"m-{uuid.uuid4().hex[:6]}"
    connections = [await connect(nats_url, f"limits-{i}") for i in range(2)]
    clients: list[ChatClient] = []
    try:
        replicas = [ProviderLimits(ceiling=8, replica_id=f"r{i}") for i in range(2)]
        for limits, nc in zip(replicas, connections, strict=True):
            await limits.start(nc.jetstream())
            client = ChatClient(RetryPolicy(max_total_wait_s=30.0), limits=limits)
            await client.start()
            clients.append(client)
        # no retries at all: every 429 must be waited out in the limiter, not spent
        spec = ModelJudge(id="q", base_url=base_url, model=model, rubric="r", timeout_s=10.0, max_retries=0)
        result = CaseResult(
            case_id="c", run_id="evb-b-c", harness="h@1", answer="a", trace=(Message(role="user", text="q"),)
        )
        ctx = JudgeContext.of(result, case_input="q", expected=None)
        judges = [
            ChatModelJudge(spec, chat=c, base_url=base_url, api_key_secret=None, secrets=SecretStore()) for c in clients
        ]
        scores = await asyncio.gather(*(judges[i % 2].judge(ctx) for i in range(24)))
        assert all(isinstance(s, Measured) for s in scores), scores
        assert server.statuses[200] == 24
        states = [limits.limiter(base_url, model).state for limits in replicas]
        assert {r for s in states for r in s.replicas} == {"r0", "r1"}  # one shared key, both replicas in it
        assert all(1.0 <= s.limit <= 8.0 for s in states)
    finally:
        for client in clients:
            await client.close()
        for limits in replicas:
            await limits.close()
        for nc in connections:
            await nc.close()
        await server.stop()


@pytest.mark.integration
async def test_a_joining_replica_is_counted_by_the_others_at_once_through_the_watch(nats_url: str) -> None:
    connections = [await connect(nats_url, f"limits-watch-{i}") for i in range(2)]
    replicas = [ProviderLimits(ceiling=32, replica_id=f"w{i}", registry=None) for i in range(2)]
    model = f"m-{uuid.uuid4().hex[:6]}"
    try:
        for limits, nc in zip(replicas, connections, strict=True):
            await limits.start(nc.jetstream())
        first, second = (limits.limiter("http://127.0.0.1:9/v1", model) for limits in replicas)
        async with first.slot():
            assert set(first.state.replicas) == {"w0"}  # it wrote itself in before its call
            assert first._share() == INITIAL_LIMIT
            async with second.slot():
                assert set(second.state.replicas) == {"w0", "w1"}
                # the first replica neither calls nor reads meanwhile: only the watch can tell it
                await eventually(lambda: set(first.state.replicas) == {"w0", "w1"}, timeout_s=30, what="the join seen")
                assert first._share() + second._share() == INITIAL_LIMIT
        await second.record("limited", retry_after_s=30.0)
        await eventually(lambda: first.state.paused_until > 0, timeout_s=30, what="the pause seen")
        assert first.state.limit == INITIAL_LIMIT - 1
    finally:
        for limits in replicas:
            await limits.close()
        for nc in connections:
            await nc.close()
