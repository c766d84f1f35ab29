"""Adaptive provider concurrency: the AIMD decisions (pure), each replica's share of the limit, the
quota headers, and two limiters sharing one provider's limit on a real nats-server while a local
chat-completions server refuses past its rate."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from evalbus.testing.chat_server import ChatCompletionsServer, RateLimit
from evalbus_contracts import CaseResult, Measured, Message, ModelJudge
from evalbus_judge import ChatClient, ChatModelJudge, JudgeContext, RetryPolicy
from evalbus_judge.limits import (
    COOLDOWN_S,
    LIMITED_FACTOR,
    LOW_FACTOR,
    REPLICA_TTL_S,
    SLOW_START_EXIT,
    ProviderLimits,
    ProviderState,
    limited,
    provider_name,
    quota_left,
    share,
    succeeded,
)
from evalbus_runtime import connect
from evalbus_runtime.secrets import SecretStore


@pytest.mark.unit
def test_slow_start_doubles_per_round_then_grows_by_a_step_per_round() -> None:
    state = ProviderState(limit=2.0)
    for _ in range(2):  # one round of two successes
        state = succeeded(state, "r1", 100.0, ceiling=64)
    assert state.limit == 4.0
    assert state.slow_start
    # the provider's quota filling up scales the doubling down, then ends it without a decrease
    state = succeeded(state, "r1", 100.0, ceiling=64, remaining=0.5)
    assert state.limit == 4.5
    state = succeeded(state, "r1", 100.0, ceiling=64, remaining=0.3)
    assert (state.limit, state.slow_start) == (4.5, False)
    for _ in range(9):  # two rounds at ~4.5 in flight: about +0.5 each
        state = succeeded(state, "r1", 100.0, ceiling=64)
    assert 5.4 < state.limit < 5.6
    # never past the ceiling
    capped = ProviderState(limit=8.0)
    for _ in range(20):
        capped = succeeded(capped, "r1", 100.0, ceiling=10)
    assert capped.limit == 10.0


@pytest.mark.unit
def test_refusals_and_a_spent_quota_decrease_it_once_per_cooldown() -> None:
    starting = ProviderState(limit=20.0)
    after = limited(starting, "r1", 100.0, ceiling=64, retry_after_s=0.4)
    assert after.limit == pytest.approx(20.0 * SLOW_START_EXIT)  # the first refusal ends the start
    assert (after.slow_start, after.paused_until, after.decreased_at) == (False, 100.4, 100.0)
    again = limited(after, "r1", 100.2, ceiling=64, retry_after_s=1.0)  # same burst: paused longer, no cut
    assert (again.limit, again.paused_until) == (after.limit, 101.2)
    later = limited(again, "r1", 100.0 + COOLDOWN_S, ceiling=64, retry_after_s=None)
    assert later.limit == pytest.approx(after.limit * LIMITED_FACTOR)
    assert later.paused_until == 101.2
    low = succeeded(later, "r1", 100.0 + 2 * COOLDOWN_S, ceiling=64, remaining=0.0)
    assert low.limit == pytest.approx(later.limit * LOW_FACTOR)
    floor = ProviderState(limit=1.0, slow_start=False)
    assert limited(floor, "r1", 100.0, ceiling=64, retry_after_s=None).limit == 1.0


@pytest.mark.unit
def test_live_replicas_split_the_limit_and_each_gets_one_at_least() -> None:
    state = ProviderState(limit=11.7, replicas={"a": 100.0, "b": 99.0, "gone": 100.0 - REPLICA_TTL_S - 1})
    assert [share(state, r, 100.0, ceiling=64) for r in ("a", "b")] == [6, 5]  # 11 in all; "gone" is out
    assert share(state, "c", 100.0, ceiling=64) == 3  # a third replica joins: 4 + 4 + 3
    assert share(state, "a", 100.0, ceiling=8) == 4  # the ceiling bounds the sum
    assert share(ProviderState(limit=1.0, replicas={"a": 100.0}), "b", 100.0, ceiling=64) == 1


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
    assert quota_left({"x-ratelimit-remaining-requests": "1", "x-ratelimit-limit-requests": "20"}) == 0.0
    assert quota_left({"x-ratelimit-remaining-requests": "n/a", "x-ratelimit-limit-requests": "20"}) is None
    assert quota_left({}) is None
    assert provider_name("https://user:pw@api.example.com:8443/v1/", "m") == "https://api.example.com:8443/v1 m"


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
        for nc in connections:
            await nc.close()
        await server.stop()
