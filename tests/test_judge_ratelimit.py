"""Adaptive judge concurrency end to end: two judge replicas (real processes) judge a batch whose
model judge's provider — the local chat-completions server — accepts 20 requests per wall-clock
second and answers the rest 429 with `Retry-After`, each request taking 0.5 s. The batch completes
with every model score measured (no judge error, nothing unmeasured); both replicas judged and
share one limit in the `JUDGE_LIMITS` bucket, which each of them reports as its gauge; the
limit stays within `JUDGE_GLOBAL_LIMIT`. A second batch of rule judges only is not held to the
provider at all (none of its cases waits for a provider slot: the provider sees no request)."""

from __future__ import annotations

import json
import re

import aiohttp
import msgspec
import pytest

from evalbus.testing.chat_server import ChatCompletionsServer, RateLimit
from evalbus.testing.stack import ServiceStack
from evalbus_contracts import BatchSpec, CaseSpec, CommandHarness, ExactJudge, Measured, ModelJudge, SuiteSpec
from evalbus_judge.limits import BUCKET, ProviderState, provider_name
from evalbus_runtime import connect

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CASES = 80
"""At 20 judged per second: about four seconds of a provider at its limit, after its start."""
CEILING = 16
"""`JUDGE_GLOBAL_LIMIT` for this test: above the 10 calls 20 req/s of 0.5 s allow, below the default."""


def batch(suite_id: str, judges: tuple[ModelJudge | ExactJudge, ...], n: int = CASES) -> BatchSpec:
    cases = tuple(CaseSpec(id=f"c{i:03d}", input="What is 17 * 23?", expected="391") for i in range(n))
    return BatchSpec(
        suite=SuiteSpec(id=suite_id, cases=cases),
        harness=CommandHarness(id="echo-agent", command=("sh", "-c", "cat >/dev/null; echo 391"), timeout_s=30),
        judges=judges,
    )


async def finish(stack: ServiceStack, batch_id: str) -> str:
    status = ""
    async with stack.client() as gw:
        async for event in gw.events(batch_id):
            if event.event == "end":
                status = json.loads(event.data)["status"]
    return status


async def metrics(stack: ServiceStack, name: str) -> str:
    async with aiohttp.ClientSession() as http, http.get(stack.procs[name].url + "/metrics") as resp:
        return await resp.text()


def gauge(text: str, metric: str, provider: str) -> float:
    [value] = [
        float(m.group(1)) for m in re.finditer(rf'^{metric}\{{provider="{re.escape(provider)}"\}} (\S+)$', text, re.M)
    ]
    return value


def judged(text: str) -> float:
    return sum(
        float(m.group(1))
        for m in re.finditer(r'^evalbus_messages_total\{consumer="judge-cases",outcome="ack"\} (\S+)$', text, re.M)
    )


async def test_two_replicas_share_a_providers_adaptive_limit(service_stack: ServiceStack) -> None:
    stack = service_stack
    stack.env = {**stack.env, "JUDGE_GLOBAL_LIMIT": str(CEILING)}
    stack.start_all()
    stack.start("judge@2")
    provider = ChatCompletionsServer()
    await provider.start()
    provider.rate_limit = RateLimit(per_s=20, latency_s=0.5)
    try:
        model = ModelJudge(id="quality", base_url=f"{provider.root}/v1", model="judge-rl", rubric="correct?")
        async with stack.client() as gw:
            batch_id = (await gw.submit(batch("ratelimit-model", (model,)))).batch_id
        assert await finish(stack, batch_id) == "succeeded"
        async with stack.client() as gw:
            view, runs = await gw.get(batch_id), await gw.all_cases(batch_id)
        assert view.error is None
        assert len(runs) == CASES
        for run in runs:
            assert run.judge_error is None
            [score] = [s for s in run.scores if s.metric == "judge:quality"]
            assert isinstance(score, Measured), score  # no call gave up, whatever the 429s
        assert provider.statuses[200] == CASES
        assert provider.statuses[429] < CASES  # the limit adapted (fixed at 32 it refuses about half)

        name = provider_name(f"{provider.root}/v1", "judge-rl")
        nc = await connect(stack.nats_url, "ratelimit-test")
        try:
            kv = await nc.jetstream().key_value(BUCKET)
            [key] = [k for k in await kv.keys() if k]
            state = msgspec.json.decode((await kv.get(key)).value or b"", type=ProviderState)
        finally:
            await nc.close()
        assert 1.0 <= state.limit <= CEILING
        assert len(state.replicas) == 2  # both replicas wrote to the one shared limit
        first, second = await metrics(stack, "judge"), await metrics(stack, "judge@2")
        assert judged(first) > 0
        assert judged(second) > 0
        for text in (first, second):
            assert 1.0 <= gauge(text, "evalbus_judge_provider_limit", name) <= CEILING
        # converged: each replica's view of the shared limit is within a step of the other's
        seen = [gauge(text, "evalbus_judge_provider_limit", name) for text in (first, second)]
        assert abs(seen[0] - seen[1]) <= 2.0, seen

        # rule judges are not held to any provider: nothing waits for a slot, the provider sees nothing
        before = len(provider.requests)
        async with stack.client() as gw:
            rules = (await gw.submit(batch("ratelimit-rules", (ExactJudge(id="exact"),), n=10))).batch_id
        assert await finish(stack, rules) == "succeeded"
        assert len(provider.requests) == before
    finally:
        await provider.stop()
