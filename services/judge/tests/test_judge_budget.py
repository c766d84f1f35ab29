"""Judge cost accounting and online suites' daily budgets.

- `read_usage` turns a response's `usage` into tokens and a cost: from the spec's price, else the
  provider's reported cost, else unmeasured (None, never 0).
- The spend ledger on a real nats-server's key-value store: additions racing from two "replicas"
  add up exactly, days and suites are counted apart.
- `judge_ready` against the local chat-completions server (which reports usage) and a real ledger:
  an observation's model judges are called while the suite's spend is under its budget, then not
  at all; its rule judges still run; a suite of model judges only is not judged; an unpriced call
  counts nothing; batches have no budget.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pytest

from evalbus.testing.chat_server import ChatCompletionsServer
from evalbus_contracts import (
    CaseExecuted,
    CaseObserved,
    CasePlan,
    CaseResult,
    CaseSpec,
    JudgeSpec,
    JudgeUsage,
    Measured,
    Message,
    ModelJudge,
    ModelPrice,
    RegexJudge,
    Unmeasured,
)
from evalbus_judge import ChatClient, JudgeRegistry, ModelDefaults, RetryPolicy
from evalbus_judge.apply import judge_ready
from evalbus_judge.budget import SpendLedger, day_key
from evalbus_judge.model import read_usage
from evalbus_runtime import connect

PRICE = ModelPrice(input_per_mtok=100.0, output_per_mtok=100.0)
"""The local server reports 10 prompt + 5 completion tokens per call: $0.0015 a call at this price."""
CALL_USD = 0.0015


# ---------------------------------------------------------------- usage


@pytest.mark.unit
def test_usage_is_priced_from_the_spec_else_the_provider_else_unmeasured() -> None:
    body: dict[str, Any] = {"usage": {"prompt_tokens": 1000, "completion_tokens": 200, "cost": 0.5}}
    priced = read_usage(body, model="m", price=ModelPrice(input_per_mtok=2.5, output_per_mtok=10.0))
    assert priced == JudgeUsage(model="m", input_tokens=1000, output_tokens=200, cost_usd=0.0045, cost_source="price")
    reported = read_usage(body, model="m", price=None)
    assert (reported.cost_usd, reported.cost_source) == (0.5, "provider")
    unpriced = read_usage({"usage": {"prompt_tokens": 7, "completion_tokens": 3}}, model="m", price=None)
    assert (unpriced.input_tokens, unpriced.output_tokens, unpriced.cost_usd, unpriced.cost_source) == (
        7,
        3,
        None,
        None,
    )
    # no usage at all, or nonsense in it: tokens and cost unknown, never a made-up 0
    for weird in ({}, {"usage": None}, {"usage": {"prompt_tokens": -1, "completion_tokens": True, "cost": "1"}}):
        usage = read_usage(weird, model="m", price=PRICE)
        assert (usage.input_tokens, usage.output_tokens, usage.cost_usd) == (None, None, None), weird


# ---------------------------------------------------------------- the ledger


@pytest.mark.integration
async def test_spend_added_by_racing_replicas_adds_up_per_suite_and_day(nats_url: str) -> None:
    a_nc, b_nc = await connect(nats_url, "spend-a"), await connect(nats_url, "spend-b")
    try:
        a, b = SpendLedger(), SpendLedger()
        await a.start(a_nc.jetstream())
        await b.start(b_nc.jetstream())
        suite = f"s-{uuid.uuid4().hex[:8]}"
        noon = 1_800_000_000.0  # a fixed moment, so the test does not straddle a real midnight
        await asyncio.gather(*(ledger.add(suite, 0.0015, now_s=noon) for ledger in (a, b) for _ in range(20)))
        assert await a.spent(suite, now_s=noon) == pytest.approx(0.06, abs=1e-9)
        assert await b.spent(suite, now_s=noon + 86_400) == 0.0  # the next UTC day starts afresh
        assert await b.spent(f"{suite}-other", now_s=noon) == 0.0  # suites are counted apart
        assert day_key(suite, noon) != day_key(suite, noon + 86_400)
    finally:
        await a_nc.close()
        await b_nc.close()


# ---------------------------------------------------------------- budgets in judge_ready


@pytest.fixture
async def provider() -> AsyncIterator[ChatCompletionsServer]:
    server = ChatCompletionsServer()
    await server.start()
    yield server
    await server.stop()


@pytest.fixture
async def chat() -> AsyncIterator[ChatClient]:
    client = ChatClient(RetryPolicy(base_delay_s=0.01, max_delay_s=0.05, max_total_wait_s=5.0))
    await client.start()
    yield client
    await client.close()


@pytest.fixture
async def ledger(nats_url: str) -> AsyncIterator[SpendLedger]:
    nc = await connect(nats_url, "spend")
    spend = SpendLedger()
    await spend.start(nc.jetstream())
    yield spend
    await nc.close()


def model_judge(provider: ChatCompletionsServer, *, price: ModelPrice | None = PRICE) -> ModelJudge:
    return ModelJudge(id="quality", base_url=f"{provider.root}/v1", rubric="polite", price=price, timeout_s=5.0)


POLITE = RegexJudge(id="polite", pattern="(?i)thank")


def observed(suite_id: str, n: int, judges: tuple[JudgeSpec, ...], budget: float | None) -> CaseObserved:
    run_id = f"obs-{suite_id}-o{n}"
    trace = (Message(role="user", text="where is my order?"), Message(role="assistant", text="Thank you, today."))
    return CaseObserved(
        suite_id=suite_id,
        observation_id=f"o{n}",
        run_id=run_id,
        result=CaseResult(case_id=f"o{n}", run_id=run_id, harness="online@1", answer="Thank you, today.", trace=trace),
        plan=CasePlan(judges=judges, suite_id=suite_id),
        budget_usd_per_day=budget,
    )


@pytest.mark.integration
async def test_model_judges_stop_at_the_budget_and_rule_judges_go_on(
    provider: ChatCompletionsServer, chat: ChatClient, ledger: SpendLedger
) -> None:
    registry = JudgeRegistry(chat=chat, model_defaults=ModelDefaults())
    suite = f"mixed-{uuid.uuid4().hex[:6]}"
    judges: tuple[JudgeSpec, ...] = (POLITE, model_judge(provider))
    outcomes = [await judge_ready(observed(suite, i, judges, 3 * CALL_USD), registry, spend=ledger) for i in range(5)]
    assert len(provider.requests) == 3  # $0.0045 spent: the budget, then no call at all
    assert await ledger.spent(suite) == pytest.approx(3 * CALL_USD, abs=1e-9)
    for i, outcome in enumerate(outcomes):
        assert outcome.judged is not None
        assert outcome.judged.status == "judged"
        polite, quality = outcome.judged.result.scores
        assert isinstance(polite, Measured)
        assert polite.passed is True  # the rule judge always ran
        if i < 3:
            assert outcome.fates == ()
            assert isinstance(quality, Measured)
            assert quality.usage == JudgeUsage(
                model="gpt-4o-mini", input_tokens=10, output_tokens=5, cost_usd=CALL_USD, cost_source="price"
            )
        else:
            [fate] = outcome.fates
            assert (fate.suite_id, fate.observation_id, fate.fate, fate.reason) == (
                suite,
                f"o{i}",
                "skipped",
                "over_budget",
            )
            assert fate.detail is not None
            assert "quality" in fate.detail
            assert "the others ran" in fate.detail
            assert isinstance(quality, Unmeasured)
            assert (quality.reason, quality.usage) == ("policy_skip", None)


@pytest.mark.integration
async def test_a_suite_of_model_judges_only_is_not_judged_over_its_budget(
    provider: ChatCompletionsServer, chat: ChatClient, ledger: SpendLedger
) -> None:
    registry = JudgeRegistry(chat=chat, model_defaults=ModelDefaults())
    suite = f"model-{uuid.uuid4().hex[:6]}"
    await ledger.add(suite, 0.01)  # another replica already spent today's budget
    outcome = await judge_ready(observed(suite, 1, (model_judge(provider),), 0.01), registry, spend=ledger)
    assert outcome.judged is None
    [fate] = outcome.fates
    assert (fate.fate, fate.reason) == ("skipped", "over_budget")
    assert provider.requests == []


@pytest.mark.integration
async def test_unpriced_calls_count_nothing_and_batches_have_no_budget(
    provider: ChatCompletionsServer, chat: ChatClient, ledger: SpendLedger
) -> None:
    registry = JudgeRegistry(chat=chat, model_defaults=ModelDefaults())
    suite = f"unpriced-{uuid.uuid4().hex[:6]}"
    unpriced = await judge_ready(
        observed(suite, 1, (model_judge(provider, price=None),), 0.001), registry, spend=ledger
    )
    assert unpriced.judged is not None
    [score] = unpriced.judged.result.scores
    assert score.usage is not None
    assert (score.usage.input_tokens, score.usage.cost_usd) == (10, None)
    assert await ledger.spent(suite) == 0.0
    # a batch's case is never held to a budget, and counts nothing against any suite
    case = CaseExecuted(
        batch_id=f"b-{uuid.uuid4().hex[:6]}",
        case_id="c1",
        run_id="evb-x-c1",
        status="succeeded",
        result=CaseResult(case_id="c1", run_id="evb-x-c1", harness="h@1", answer="Thank you"),
        plan=CasePlan(judges=(model_judge(provider),)),
        case=CaseSpec(id="c1", input="q"),
    )
    batch = await judge_ready(case, registry, spend=ledger)
    assert batch.fates == ()
    assert batch.judged is not None
    assert isinstance(batch.judged.result.scores[0], Measured)
    assert len(provider.requests) == 2
