"""The in-process recorder end to end: an application records its requests with
`evalbus.online.Recorder`, the collector samples what arrives for an online suite applied through
the gateway's API (`POST /v1/online/suites`, as `evalbus online apply` does), the judge scores the
sampled observations, and the gateway answers every observation's fate.

The recorder samples at 0.75 and the suite at 0.5: the suite's sample is inside what the recorder
forwards (both decide on the trace id, as OpenTelemetry's sampler), what the recorder kept out is
`unknown` to evalbus. The services are real processes on a real nats-server and PostgreSQL.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import pytest

from evalbus.online import Outcome, Recorder
from evalbus.testing.pipeline import Pipeline, eventually, open_pipeline
from evalbus_contracts import sampled_by_trace_id

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RECORDER_RATIO = 0.75
SUITE_RATIO = 0.5
REQUESTS = 40


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    async with open_pipeline(
        pg_admin_url,
        tmp_path_factory.mktemp("online-recorder"),
        service_env={"collector": {"COLLECTOR_SETTLE_S": "0.2"}},
    ) as p:
        yield p


async def api(p: Pipeline, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(headers=dict(p.stack.headers())) as session,
        session.request(method, p.stack.gateway_url + path, json=body) as resp,
    ):
        return resp.status, await resp.json()


async def fates(p: Pipeline, trace_id: str, suite_id: str) -> list[tuple[str, str]]:
    status, answer = await api(p, "GET", f"/v1/online/observations/{trace_id}")
    assert status == 200, answer
    return sorted((f["fate"], f["reason"]) for f in answer["fates"] if f["suite_id"] == suite_id)


async def wait_for_suite(p: Pipeline, recorder: Recorder, suite_id: str) -> None:
    """Offer probe observations of another service until the collector decides one for the suite
    (`not_target` for it): from then on it samples for the suite."""
    probes: list[str] = []

    async def known() -> bool:
        for probe in probes:
            if await fates(p, probe, suite_id):
                return True
        probe = os.urandom(16).hex()
        while not sampled_by_trace_id(probe, recorder.sample_ratio):
            probe = os.urandom(16).hex()
        assert recorder.record(trace_id=probe, target="probe-service", output="pong")
        probes.append(probe)
        return False

    await eventually(known, timeout_s=60, what="the collector to know the suite", diagnostics=p.diagnostics)


async def test_recorded_observations_are_sampled_judged_and_accounted_for(pipeline: Pipeline) -> None:
    p = pipeline
    suite_id = f"recorded-{uuid.uuid4().hex[:6]}"
    status, applied = await api(
        p,
        "POST",
        "/v1/online/suites",
        {
            "id": suite_id,
            "target": {"service": "support-bot", "attributes": {"deployment.environment": "prod"}},
            "sample_ratio": SUITE_RATIO,
            "judges": [{"kind": "regex", "id": "polite", "pattern": "(?i)thank"}],
        },
    )
    assert status == 201, applied

    recorder = Recorder(
        p.stack.nats_url,
        target="support-bot",
        metadata={"deployment.environment": "prod"},
        sample_ratio=RECORDER_RATIO,
    )
    async with recorder:
        await wait_for_suite(p, recorder, suite_id)
        answers: dict[str, str] = {}
        outcomes: dict[str, Outcome] = {}
        for i in range(REQUESTS):
            trace_id = os.urandom(16).hex()
            answers[trace_id] = f"Thank you, order {i} ships today." if i % 3 else f"Order {i} ships today."
            outcomes[trace_id] = recorder.record(
                trace_id=trace_id, input=f"Where is order {i}?", output=answers[trace_id]
            )
        staging = os.urandom(16).hex()
        while not sampled_by_trace_id(staging, SUITE_RATIO):
            staging = os.urandom(16).hex()
        assert recorder.record(trace_id=staging, output="Thanks", metadata={"deployment.environment": "staging"})
    stats = recorder.stats()

    forwarded = {t for t in answers if sampled_by_trace_id(t, RECORDER_RATIO)}
    sampled = {t for t in answers if sampled_by_trace_id(t, SUITE_RATIO)}
    assert sampled <= forwarded
    assert 0 < len(sampled) < len(forwarded) < REQUESTS  # both ratios really split the requests
    assert {t for t, o in outcomes.items() if o is Outcome.ACCEPTED} == forwarded
    assert {t for t, o in outcomes.items() if o is Outcome.SAMPLED_OUT} == set(answers) - forwarded
    assert (stats.published, stats.pending, dict(stats.dropped), dict(stats.lost)) == (stats.accepted, 0, {}, {})

    batch_id = f"online-{suite_id}"

    async def judged_runs() -> dict[str, Any]:
        rows = await p.pool.fetch(
            "SELECT case_id, answer, scores FROM runs WHERE batch_id = $1 AND judged_status IS NOT NULL", batch_id
        )
        return {str(r["case_id"]): r for r in rows}

    async def all_judged() -> bool:
        return len(await judged_runs()) >= len(sampled)

    await eventually(all_judged, timeout_s=90, what="every sampled observation judged", diagnostics=p.diagnostics)
    await p.quiescent(timeout_s=60)
    runs = await judged_runs()
    assert set(runs) == sampled
    for trace_id, run in runs.items():
        assert run["answer"] == answers[trace_id]

    # every observation's fate, with its reason
    for trace_id in answers:
        mine = await fates(p, trace_id, suite_id)
        if trace_id in sampled:
            assert mine == [("judged", "judged"), ("sampled", "sampled")], trace_id
        elif trace_id in forwarded:
            assert mine == [("skipped", "not_sampled")], trace_id
        else:  # the recorder kept it out: it never reached evalbus
            status, unknown = await api(p, "GET", f"/v1/online/observations/{trace_id}")
            assert (status, unknown["status"], unknown["fates"]) == (200, "unknown", []), trace_id
    assert await fates(p, staging, suite_id) == [("skipped", "filtered")]

    # the regex judge passes exactly the polite answers
    status, detail = await api(p, "GET", f"/v1/online/suites/{suite_id}")
    assert status == 200, detail
    recent = {r["observation_id"]: r for r in detail["recent"]}
    assert recent
    assert set(recent) <= sampled
    for trace_id, run in recent.items():
        [score] = [s for s in run["scores"] if s["metric"] == "judge:polite"]
        assert score["pass"] is ("thank" in answers[trace_id].lower()), trace_id
