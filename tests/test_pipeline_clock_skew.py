"""Replicas whose clocks disagree by minutes (libfaketime moves a process's wall clock, its
monotonic clock kept): the dispatcher five minutes behind the gateway, the judge and the exporter
five minutes ahead, the collector five minutes behind. Nothing in the pipeline's delivery may
depend on their clocks agreeing: the batch succeeds with every run exactly once per stage, the
scores are those of the same suite on agreeing clocks, and no duration a user reads is negative
or minutes long."""

from __future__ import annotations

import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from evalbus.testing.faketime import skewed
from evalbus.testing.pipeline import Pipeline, agent_harness, eventually, open_pipeline, read_stream, task
from evalbus.testing.reliability import lost_and_duplicated, report, row
from evalbus_contracts import (
    AnswerMatchGrader,
    BatchSpec,
    CaseObserved,
    CaseSpec,
    ExactJudge,
    LatencyGrader,
    LlmCall,
    SuiteSpec,
    batch_run_id,
    encode_token,
)

pytestmark = pytest.mark.e2e

SKEW_S = 300.0
CASES = tuple(f"c{i}" for i in range(1, 7))
STAGES = ("case.requested", "case.executed", "case.judged", "case.exported")


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    workdir = tmp_path_factory.mktemp("clock-skew")
    behind, ahead = skewed(-SKEW_S), skewed(SKEW_S)
    async with open_pipeline(
        pg_admin_url,
        workdir,
        service_env={"dispatcher": behind, "judge": ahead, "exporter": ahead, "collector": behind},
    ) as p:
        yield p


def suite() -> BatchSpec:
    graders = (AnswerMatchGrader(id="answer"), LatencyGrader(id="latency"))
    cases = tuple(
        CaseSpec(id=c, input=task(answer=c, tool_calls=2, sleep_s=0.2), expected=c, graders=graders) for c in CASES
    )
    return BatchSpec(suite=SuiteSpec(id="skew", cases=cases), harness=agent_harness(), judges=(ExactJudge(id="exact"),))


async def test_a_batch_through_replicas_with_skewed_clocks_is_exactly_once_and_scored_as_usual(
    pipeline: Pipeline,
) -> None:
    p = pipeline
    batch = await p.submit(suite())
    view = await p.finalized(batch, timeout_s=120)
    await p.quiescent()
    assert view.status == "succeeded", view
    runs = {batch_run_id(batch, c) for c in CASES}
    want: Counter[tuple[str | None, str]] = Counter({(r, s): 1 for r in runs for s in STAGES})
    kinds = set(STAGES)
    store = Counter({k: n for k, n in (await p.store_counts(batch)).items() if k[1] in kinds})
    stream = Counter({k: n for k, n in (await p.stream_counts(batch)).items() if k[1] in kinds})
    lost, duplicated = lost_and_duplicated(want, store, stream)
    report(
        row(
            "clocks skewed ±5 min between replicas (libfaketime)",
            load=f"{len(CASES)} cases",
            faults=1,
            lost=lost,
            duplicated=duplicated,
            passed=store == want and stream == want,
        )
    )
    assert store == want
    assert stream == want
    verified = await p.verify(batch)
    assert verified.ok, verified
    assert view.summary is not None
    means = {m.metric: m.mean for m in view.summary.metrics}
    assert means["answer_match"] == 1.0
    assert means["judge:exact"] == 1.0
    latency = means["latency_s"]
    assert latency is not None
    assert 0.0 <= latency < 30.0  # measured on one process's clock: the skew never reaches it


async def test_a_collector_minutes_behind_assembles_a_split_trace_on_the_bus_clock(pipeline: Pipeline) -> None:
    """The collector's wall clock is five minutes behind the server's: a trace exported in two
    requests is still assembled whole once it settled by JetStream's clock (not five minutes late,
    which the collector's own clock would say), and an online delay is neither skipped nor stretched
    by minutes."""
    p = pipeline
    suite_id = f"skew-{uuid.uuid4().hex[:6]}"
    headers = dict(p.stack.headers())
    suite = {
        "id": suite_id,
        "target": {"service": "skew-bot"},
        "delay_s": 1.0,
        "judges": [{"kind": "regex", "id": "polite", "pattern": "(?i)thank"}],
    }
    trace_id, root = uuid.uuid4().hex, uuid.uuid4().hex[:16]

    def request(span_id: str, parent: str | None) -> dict[str, Any]:
        span: dict[str, Any] = {
            "traceId": trace_id,
            "spanId": span_id,
            "name": "llm" if parent else "handle-request",
            "startTimeUnixNano": str(time.time_ns()),
            "endTimeUnixNano": str(time.time_ns() + 1_000_000),
            "attributes": [{"key": "gen_ai.request.model", "value": {"stringValue": "m-skew"}}]
            if parent
            else [
                {"key": "input.value", "value": {"stringValue": "where is it?"}},
                {"key": "output.value", "value": {"stringValue": "Thank you, it ships."}},
            ],
        }
        if parent:
            span["parentSpanId"] = parent
        resource = {"attributes": [{"key": "service.name", "value": {"stringValue": "skew-bot"}}]}
        return {"resourceSpans": [{"resource": resource, "scopeSpans": [{"spans": [span]}]}]}

    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.post(p.stack.gateway_url + "/v1/online/suites", json=suite) as resp:
            assert resp.status == 201, await resp.text()
        # the collector follows suites from the stream: a probe trace decided for the suite says it has it
        probe = request(uuid.uuid4().hex[:16], None)
        probe_id = probe["resourceSpans"][0]["scopeSpans"][0]["spans"][0]["traceId"] = uuid.uuid4().hex
        async with http.post(f"{p.stack.otlp_url}/v1/traces", json=probe) as resp:
            assert resp.status == 200, await resp.text()

        async def known() -> bool:
            async with http.get(f"{p.stack.gateway_url}/v1/online/observations/{probe_id}") as resp:
                answer = await resp.json()
            return any(f["suite_id"] == suite_id for f in answer["fates"])

        await eventually(known, timeout_s=60, what="the collector to know the suite", diagnostics=p.diagnostics)
        for body in (request(uuid.uuid4().hex[:16], root), request(root, None)):
            async with http.post(f"{p.stack.otlp_url}/v1/traces", json=body) as resp:
                assert resp.status == 200, await resp.text()
        sent = time.monotonic()

        async def judged() -> bool:
            status = await p.pool.fetchval(
                "SELECT judged_status FROM runs WHERE run_id = $1", f"obs-{suite_id}-{trace_id}"
            )
            return status is not None

        await eventually(judged, timeout_s=60, what="the split trace judged", diagnostics=p.diagnostics)
        waited = time.monotonic() - sent
    # settle (5 s) and the delay (1 s) by the bus's clock: not minutes
    assert 5.0 <= waited < 60.0, waited
    [observed] = [
        m.event() for m in await read_stream(p.nc, "CASES", (f"case.observed.{encode_token(suite_id)}.{trace_id}",))
    ]
    assert isinstance(observed, CaseObserved)
    assert [e.model for e in observed.result.trace if isinstance(e, LlmCall)] == ["m-skew"]
