"""`GET /v1/compare` and `GET|PUT /v1/suites/{suite_id}/baseline` against a real nats-server and
PostgreSQL: batches are driven through the bus as the other services would publish them (the
gateway records and finalizes them with its real aggregate), then compared over HTTP — a designed
regression is significant with its cases listed, trials are pooled per case, disjoint cases are
only on one side; access is the batch audience rule (404), an unfinalized batch is 409, a baseline
is an event in CASES that the recorder stores and `compare` defaults to, and only a batch of the
suite that succeeded can be one. Bad gates in a spec are refused with their field."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Mapping, Sequence
from typing import Any

import aiohttp
import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from evalbus_api.client import ApiRequestError, GatewayClient
from evalbus_api.models import ErrorBody
from evalbus_contracts import (
    AnswerMatchGrader,
    BatchCancelled,
    BatchPolicy,
    BatchRequested,
    BatchSpec,
    CaseExecuted,
    CaseExported,
    CaseJudged,
    CasePlan,
    CaseRequested,
    CaseResult,
    CaseSpec,
    EventBase,
    Measured,
    RegressionGate,
    SuiteSpec,
    batch_run_id,
    to_builtins,
)
from evalbus_gateway.store import get_batch
from evalbus_gateway.testing import HARNESS, RunningGateway, batch_spec, member, running_gateway
from evalbus_grading.compare import VERDICTS
from evalbus_runtime import Publisher

pytestmark = pytest.mark.integration

ALICE, BOB = "tok-alice", "tok-bob"


@pytest.fixture
async def gateway(gw_nats: str, database_url: str) -> AsyncIterator[RunningGateway]:
    async with running_gateway(gw_nats, database_url, tokens={ALICE: member("alice"), BOB: member("bob")}) as gw:
        yield gw


@pytest.fixture
async def alice(gateway: RunningGateway) -> AsyncIterator[GatewayClient]:
    async with GatewayClient(gateway.base_url, ALICE) as client:
        yield client


def new_id() -> str:
    return "b" + uuid.uuid4().hex[:12]


def suite_spec(suite: str, cases: Sequence[str], trials: int = 1) -> BatchSpec:
    return BatchSpec(
        suite=SuiteSpec(
            id=suite,
            cases=tuple(
                CaseSpec(id=c, input=f"task {c}", expected="right", graders=(AnswerMatchGrader(id="answer"),))
                for c in cases
            ),
        ),
        harness=HARNESS,
        policy=BatchPolicy(trials=trials),
    )


Answers = Mapping[tuple[str, int | None], str]
"""What each run (case, trial) answered: 'right' passes."""


def batch_events(batch_id: str, spec: BatchSpec, answers: Answers, *, by: str = "alice") -> list[EventBase]:
    """Every event of a batch whose runs answered `answers`."""
    plan = CasePlan(suite_id=spec.suite.id, submitted_by=by, trials=spec.policy.trials)
    events: list[EventBase] = [BatchRequested(batch_id=batch_id, spec=spec, submitted_by=by)]
    cases = {c.id: c for c in spec.suite.cases}
    for (case_id, trial), answer in answers.items():
        run_id = batch_run_id(batch_id, case_id, trial)
        ok = answer == "right"
        result = CaseResult(
            case_id=case_id,
            run_id=run_id,
            harness="echo@1",
            trial=trial,
            answer=answer,
            scores=(
                Measured(grader_id="answer", metric="answer_match", value=float(ok), passed=ok),
                Measured(grader_id="cost", metric="cost_usd", value=0.01 if ok else 0.02),
            ),
        )
        ids: dict[str, Any] = {"batch_id": batch_id, "case_id": case_id, "run_id": run_id}
        events += [
            CaseRequested(**ids, trial=trial, case=cases[case_id], harness=spec.harness, plan=plan),
            CaseExecuted(**ids, status="succeeded", result=result, plan=plan, case=cases[case_id]),
            CaseJudged(**ids, status="judged", result=result, plan=plan),
            CaseExported(**ids, status="skipped"),
        ]
    return events


async def eventually_finalized(gw: RunningGateway, *batch_ids: str, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    for batch_id in batch_ids:
        while True:
            view = await get_batch(gw.state.pool, batch_id)
            if view is not None and view.finalized_at is not None:
                break
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out waiting for {batch_id} to be finalized")
            await asyncio.sleep(0.02)


async def drive(
    gw: RunningGateway,
    pub: Publisher,
    spec: BatchSpec,
    answers: Answers,
    *,
    by: str = "alice",
) -> str:
    batch_id = new_id()
    await pub.publish_events(batch_events(batch_id, spec, answers, by=by))
    await eventually_finalized(gw, batch_id)
    return batch_id


CASES = [f"c{i:02d}" for i in range(12)]


async def api_error(http: aiohttp.ClientSession, method: str, url: str, token: str, **kw: Any) -> tuple[int, Any]:
    async with http.request(method, url, headers={"Authorization": f"Bearer {token}"}, **kw) as resp:
        body = await resp.read()
        return resp.status, msgspec.json.decode(body, type=ErrorBody).error


# ---------------------------------------------------------------- compare


async def test_a_designed_regression_is_significant_with_its_cases(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher], alice: GatewayClient
) -> None:
    _, pub = bus
    suite = f"s-{uuid.uuid4().hex[:6]}"
    spec = suite_spec(suite, CASES)
    base = await drive(gateway, pub, spec, {(c, None): "right" for c in CASES})
    candidate = await drive(gateway, pub, spec, {(c, None): "wrong" if i < 8 else "right" for i, c in enumerate(CASES)})

    result = await alice.compare(candidate, base)
    assert (result.base, result.candidate, result.base_suite, result.candidate_suite) == (base, candidate, suite, suite)
    assert result.baseline is False
    assert [m.metric for m in result.metrics] == [VERDICTS, "answer_match", "cost_usd"]
    verdicts = result.metric(VERDICTS)
    assert verdicts is not None
    assert (verdicts.n, verdicts.test, verdicts.base_only, verdicts.candidate_only) == (12, "mcnemar", 8, 0)
    assert verdicts.base == 1.0
    assert verdicts.delta == pytest.approx(-8 / 12)
    assert verdicts.significant
    assert verdicts.change == "regressed"
    cost = result.metric("cost_usd")
    assert cost is not None
    assert (cost.direction, cost.test, cost.change) == ("lower", "wilcoxon", "regressed")  # wrong answers cost more

    assert [c.case_id for c in result.cases.regressed] == CASES[:8]
    assert [c.case_id for c in result.cases.unchanged] == CASES[8:]
    case = result.cases.regressed[0]
    assert case.base is not None
    assert case.candidate is not None
    assert (case.base.runs[0].answer, case.candidate.runs[0].answer) == ("right", "wrong")
    assert case.candidate.runs[0].run_id == batch_run_id(candidate, CASES[0])
    assert [s.metric for s in case.candidate.runs[0].scores] == ["answer_match", "cost_usd"]

    # The JSON carries every field the issue names, nulls included.
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"{gateway.base_url}/v1/compare",
            params={"base": base, "candidate": candidate},
            headers={"Authorization": f"Bearer {ALICE}"},
        ) as resp,
    ):
        assert resp.status == 200
        doc = await resp.json()
    assert set(doc["cases"]) >= {"regressed", "improved", "unchanged", "only_in_base", "only_in_candidate"}
    for row in doc["metrics"]:
        assert {
            "metric",
            "base",
            "candidate",
            "delta",
            "ci_low",
            "ci_high",
            "p_value",
            "q_value",
            "significant",
        } <= set(row)

    # The same batch against itself: nothing significant.
    same = await alice.compare(base, base)
    assert not any(m.significant for m in same.metrics)
    assert len(same.cases.unchanged) == len(CASES)


async def test_the_answer_carries_the_candidates_gates_decided(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    _, pub = bus
    suite = f"s-{uuid.uuid4().hex[:6]}"
    spec = suite_spec(suite, CASES)
    base = await drive(gateway, pub, spec, {(c, None): "right" for c in CASES})
    other = await drive(gateway, pub, spec, {(c, None): "wrong" for c in CASES})
    gates = (
        "verdicts.pass_rate >= 0.8",
        "metric.answer_match.count == 12",
        "metric.tokens.mean <= 100",
        RegressionGate(no_significant_regression=("verdicts",), baseline=base),
        RegressionGate(no_significant_regression=("answer_match",), baseline=other),
        "no_significant_regression: verdicts",
    )
    gated = msgspec.structs.replace(spec, gates=gates)
    candidate = await drive(
        gateway, pub, gated, {(c, None): "wrong" if i < 8 else "right" for i, c in enumerate(CASES)}
    )

    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"{gateway.base_url}/v1/compare",
            params={"base": base, "candidate": candidate},
            headers={"Authorization": f"Bearer {ALICE}"},
        ) as resp,
    ):
        assert resp.status == 200
        doc = await resp.json()
    decided = {g["gate"]: g for g in doc["gates"]}
    assert [g["gate"] for g in doc["gates"]] == [
        "verdicts.pass_rate >= 0.8",
        "metric.answer_match.count == 12",
        "metric.tokens.mean <= 100",
        f"no_significant_regression: verdicts against {base}",
        f"no_significant_regression: answer_match against {other}",
        "no_significant_regression: verdicts",
    ]
    assert (decided["verdicts.pass_rate >= 0.8"]["passed"], decided["verdicts.pass_rate >= 0.8"]["measured"]) == (
        False,
        pytest.approx(4 / 12),
    )
    assert decided["metric.answer_match.count == 12"]["passed"] is True
    assert decided["metric.tokens.mean <= 100"]["passed"] is False  # never measured: fails, never vacuous
    assert decided[f"no_significant_regression: verdicts against {base}"]["passed"] is False
    # against a batch that answered everything wrong, the candidate improved: nothing regressed
    assert decided[f"no_significant_regression: answer_match against {other}"]["passed"] is True
    assert decided["no_significant_regression: verdicts"] == {
        "gate": "no_significant_regression: verdicts",
        "passed": False,
        "measured": None,
        "detail": f"suite {suite} has no baseline to compare with (evalbus baseline set {suite} BATCH)",
    }
    # a batch without gates answers none
    async with (
        aiohttp.ClientSession() as http,
        http.get(
            f"{gateway.base_url}/v1/compare",
            params={"base": candidate, "candidate": base},
            headers={"Authorization": f"Bearer {ALICE}"},
        ) as resp,
    ):
        assert (await resp.json())["gates"] == []


async def test_trials_are_pooled_and_disjoint_cases_are_on_one_side(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher], alice: GatewayClient
) -> None:
    _, pub = bus
    suite = f"s-{uuid.uuid4().hex[:6]}"
    base_spec = suite_spec(suite, ["a", "b", "c", "old"], trials=2)
    candidate_spec = suite_spec(suite, ["a", "b", "c", "new"], trials=2)
    base_answers: dict[tuple[str, int | None], str] = {("old", 1): "right", ("old", 2): "right"}
    base_answers |= {(c, t): "right" if t == 1 else "wrong" for c in "abc" for t in (1, 2)}
    base = await drive(gateway, pub, base_spec, base_answers)
    candidate_answers: dict[tuple[str, int | None], str] = {(c, t): "right" for c in [*"abc", "new"] for t in (1, 2)}
    candidate = await drive(gateway, pub, candidate_spec, candidate_answers)
    result = await alice.compare(candidate, base)
    answer = result.metric("answer_match")
    assert answer is not None
    assert (answer.n, answer.test, answer.base_cases, answer.candidate_cases) == (3, "wilcoxon", 4, 4)
    assert (answer.base, answer.candidate) == (0.5, 1.0)
    assert [c.case_id for c in result.cases.improved] == ["a", "b", "c"]
    assert [c.case_id for c in result.cases.only_in_base] == ["old"]
    assert [c.case_id for c in result.cases.only_in_candidate] == ["new"]
    improved = result.cases.improved[0]
    assert improved.base is not None
    assert [(r.trial, r.answer) for r in improved.base.runs] == [(1, "right"), (2, "wrong")]


async def test_compare_access_and_state_errors(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher], alice: GatewayClient
) -> None:
    _, pub = bus
    suite = f"s-{uuid.uuid4().hex[:6]}"
    spec = suite_spec(suite, ["a", "b"])
    base = await drive(gateway, pub, spec, {("a", None): "right", ("b", None): "right"})
    running = new_id()
    await pub.publish_events(batch_events(running, spec, {})[:1])  # requested, nothing ran
    url = f"{gateway.base_url}/v1/compare"
    async with aiohttp.ClientSession() as http:
        status, error = await api_error(http, "GET", url, BOB, params={"base": base, "candidate": base})
        assert (status, error.code, error.field) == (404, "not_found", "candidate")  # bob cannot see alice's
        status, error = await api_error(http, "GET", url, ALICE, params={"base": "bnope", "candidate": base})
        assert (status, error.code, error.field) == (404, "not_found", "base")
        status, error = await api_error(http, "GET", url, ALICE, params={"base": base})
        assert (status, error.code, error.field) == (400, "invalid", "candidate")
        status, error = await api_error(http, "GET", url, ALICE, params={"base": base, "candidate": running})
        assert (status, error.code, error.field) == (409, "conflict", "candidate")
        status, error = await api_error(http, "GET", url, ALICE, params={"candidate": base})
        assert (status, error.code, error.field) == (404, "not_found", "base")
        assert "has no baseline" in error.message
        status, error = await api_error(http, "GET", url, ALICE, params={"candidate": base, "base": "b" * 300})
        assert (status, error.code, error.field) == (400, "invalid", "base")
        status, error = await api_error(http, "GET", url, ALICE, params={"candidate": " "})
        assert (status, error.code, error.field) == (400, "invalid", "candidate")
        baseline_url = f"{gateway.base_url}/v1/suites/{suite}/baseline"
        status, error = await api_error(http, "PUT", baseline_url, ALICE, json={"batch_id": ""})
        assert (status, error.code, error.field) == (400, "invalid", "$.batch_id")


# ---------------------------------------------------------------- baselines


async def test_a_baseline_is_a_recorded_event_that_compare_defaults_to(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher], alice: GatewayClient
) -> None:
    _, pub = bus
    suite = f"s-{uuid.uuid4().hex[:6]}"
    spec = suite_spec(suite, ["a", "b"])
    base = await drive(gateway, pub, spec, {("a", None): "right", ("b", None): "right"})
    candidate = await drive(gateway, pub, spec, {("a", None): "wrong", ("b", None): "right"})

    with pytest.raises(ApiRequestError) as missing:
        await alice.baseline(suite)
    assert (missing.value.status, missing.value.field) == (404, "suite_id")

    view = await alice.set_baseline(suite, base)
    assert (view.suite_id, view.batch_id, view.set_by) == (suite, base, "alice")
    assert await alice.baseline(suite) == view

    defaulted = await alice.compare(candidate)
    assert (defaulted.base, defaulted.baseline) == (base, True)
    assert [c.case_id for c in defaulted.cases.regressed] == ["a"]

    # The recorder stores the event like every CASES event.
    async def stored() -> bool:
        n = await gateway.state.pool.fetchval(
            "SELECT count(*) FROM events WHERE type = 'suite.baseline.set' AND body->>'suite_id' = $1", suite
        )
        return bool(n)

    deadline = time.monotonic() + 20
    while not await stored():
        assert time.monotonic() < deadline, "the baseline event was not recorded"
        await asyncio.sleep(0.02)

    # The last one set holds.
    assert (await alice.set_baseline(suite, candidate)).batch_id == candidate
    assert (await alice.baseline(suite)).batch_id == candidate


async def test_only_a_succeeded_batch_of_the_suite_can_be_a_baseline(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher], alice: GatewayClient
) -> None:
    _, pub = bus
    suite = f"s-{uuid.uuid4().hex[:6]}"
    spec = suite_spec(suite, ["a", "b"])
    good = await drive(gateway, pub, spec, {("a", None): "right", ("b", None): "right"})
    other = await drive(gateway, pub, suite_spec("another-suite", ["a"]), {("a", None): "right"})
    cancelled = new_id()
    events = batch_events(cancelled, spec, {("a", None): "right"})
    events.insert(1, BatchCancelled(batch_id=cancelled, reason="superseded", by=good, superseded_by=good))
    events += [  # b was cancelled before it started (the dispatcher answers its request so)
        CaseRequested(
            batch_id=cancelled,
            case_id="b",
            run_id=batch_run_id(cancelled, "b"),
            case=spec.suite.cases[1],
            harness=spec.harness,
            plan=CasePlan(suite_id=suite, submitted_by="alice"),
        ),
        CaseExecuted(
            batch_id=cancelled,
            case_id="b",
            run_id=batch_run_id(cancelled, "b"),
            status="cancelled",
            result=CaseResult(case_id="b", run_id=batch_run_id(cancelled, "b"), harness="echo@1"),
            plan=CasePlan(suite_id=suite, submitted_by="alice"),
            case=spec.suite.cases[1],
        ),
        CaseJudged(
            batch_id=cancelled,
            case_id="b",
            run_id=batch_run_id(cancelled, "b"),
            status="skipped",
            result=CaseResult(case_id="b", run_id=batch_run_id(cancelled, "b"), harness="echo@1"),
            plan=CasePlan(suite_id=suite, submitted_by="alice"),
        ),
        CaseExported(batch_id=cancelled, case_id="b", run_id=batch_run_id(cancelled, "b"), status="skipped"),
    ]
    await pub.publish_events(events)
    await eventually_finalized(gateway, cancelled)
    running = new_id()
    await pub.publish_events(batch_events(running, spec, {})[:1])

    url = f"{gateway.base_url}/v1/suites/{suite}/baseline"
    async with aiohttp.ClientSession() as http:
        for batch_id, status, words in [
            (other, 409, "is of suite 'another-suite'"),
            (cancelled, 409, "finalized superseded: only a batch that succeeded can be a baseline"),
            (running, 409, "is not finalized yet"),
            ("bnope", 404, "no batch"),
        ]:
            got, error = await api_error(http, "PUT", url, ALICE, json={"batch_id": batch_id})
            assert (got, error.field) == (status, "$.batch_id"), error
            assert words in error.message
        got, error = await api_error(http, "PUT", url, BOB, json={"batch_id": good})
        assert (got, error.code) == (404, "not_found")  # bob cannot see alice's batch
        got, error = await api_error(http, "PUT", url, ALICE, json={"batch": good})
        assert (got, error.code, error.field) == (400, "invalid", "$.batch")
    with pytest.raises(ApiRequestError):
        await alice.baseline(suite)  # nothing was set
    assert (await alice.set_baseline(suite, good)).batch_id == good


async def test_a_bad_gate_in_a_spec_is_refused_with_its_field(gateway: RunningGateway) -> None:
    doc: dict[str, Any] = to_builtins(batch_spec())
    doc["gates"] = ["verdicts.pass_rate >= 0.8", {"no_significant_regression": ["answer_match"]}, "coverage > 1"]
    async with aiohttp.ClientSession() as http:
        status, error = await api_error(http, "POST", f"{gateway.base_url}/v1/batches", ALICE, json=doc)
    assert (status, error.code, error.field) == (400, "invalid", "$.gates[2]")
    assert "unknown path 'coverage'" in error.message
