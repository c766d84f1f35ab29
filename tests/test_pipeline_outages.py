"""Outages of what the pipeline depends on, mid-batch.

PostgreSQL unavailable for 10 s in the middle of a batch (the pipeline's database refuses every
connection and its sessions are terminated; the server is shared, so it is not stopped). The bus
carries on — cases keep executing, being judged and exported — while the gateway's recorder holds
what it cannot store; once the database is back the recorder catches up, the batch finalizes
`succeeded`, every run exactly once per stage in the stream and the store, sealed. Meanwhile the
API answers a clear 503, never a 500.

A sink's endpoint that is down (nothing listens on its port): every case is still judged and
exported exactly once, each failed export visible with its error, in the run and in the batch's
export summary, while the batch's other sink gets every case."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from tests.test_online_outages import database_refusing

from evalbus.infra.ports import free_port
from evalbus.testing.pipeline import Pipeline, agent_harness, eventually, open_pipeline, task
from evalbus.testing.reliability import lost_and_duplicated, report, row
from evalbus_contracts import (
    AnswerMatchGrader,
    BatchSpec,
    CaseSpec,
    ExactJudge,
    JsonlSink,
    PlatformSink,
    SuiteSpec,
    batch_run_id,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

N_CASES = 40
OUTAGE_S = 10.0
STAGES = ("case.requested", "case.executed", "case.judged", "case.exported")


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    async with open_pipeline(pg_admin_url, tmp_path_factory.mktemp("db-outage")) as p:
        yield p


def suite() -> BatchSpec:
    graders = (AnswerMatchGrader(id="answer"),)
    cases = tuple(
        CaseSpec(id=f"c{i:02d}", input=task(answer=f"a{i}", sleep_s=0.3), expected=f"a{i}", graders=graders)
        for i in range(N_CASES)
    )
    return BatchSpec(
        suite=SuiteSpec(id="db-outage", cases=cases), harness=agent_harness(), judges=(ExactJudge(id="exact"),)
    )


async def test_a_database_outage_mid_batch_loses_and_doubles_nothing(pipeline: Pipeline, pg_admin_url: str) -> None:
    p = pipeline
    batch = await p.submit(suite())

    async def some_recorded() -> bool:
        n = await p.pool.fetchval("SELECT count(*) FROM events WHERE batch_id = $1 AND type = 'case.exported'", batch)
        return int(n or 0) >= 3

    await eventually(some_recorded, timeout_s=60, what="the batch under way")
    exported_on_bus: set[str] = set()

    async def on_exported(msg: object) -> None:
        exported_on_bus.add(getattr(msg, "subject", ""))

    sub = await p.nc.subscribe(f"case.exported.{batch}.*", cb=on_exported)
    statuses: list[int] = []
    async with database_refusing(pg_admin_url, p.database_url) as terminated:
        assert terminated > 0  # the gateway's sessions were cut
        async with aiohttp.ClientSession() as http:
            loop = asyncio.get_running_loop()
            ends = loop.time() + OUTAGE_S  # the fault's length, not a synchronisation
            while loop.time() < ends:
                async with http.get(
                    f"{p.stack.gateway_url}/v1/batches/{batch}",
                    headers={"Authorization": f"Bearer {p.stack.admin_token}"},
                ) as resp:
                    statuses.append(resp.status)
                    if resp.status >= 500:
                        body = await resp.json()
                        assert body["error"]["code"] == "unavailable", body
                await asyncio.sleep(0.5)
    await sub.unsubscribe()
    assert 500 not in statuses, statuses
    assert 503 in statuses, statuses  # the database really was away for the API
    assert exported_on_bus, "the pipeline carried on without the database"

    restored_at = time.monotonic()
    view = await p.finalized(batch, timeout_s=180)
    await p.quiescent(timeout_s=120)
    caught_up_s = time.monotonic() - restored_at
    runs = {batch_run_id(batch, c.id) for c in suite().suite.cases}
    want: Counter[tuple[str | None, str]] = Counter({(r, s): 1 for r in runs for s in STAGES})
    kinds = set(STAGES)
    store = Counter({k: n for k, n in (await p.store_counts(batch)).items() if k[1] in kinds})
    stream = Counter({k: n for k, n in (await p.stream_counts(batch)).items() if k[1] in kinds})
    lost, duplicated = lost_and_duplicated(want, store, stream)
    report(  # bench/reliability.py's row (stall: database back → every consumer idle)
        row(
            f"PostgreSQL refusing connections {OUTAGE_S:g} s mid-batch",
            load=f"{N_CASES} cases",
            faults=1,
            lost=lost,
            duplicated=duplicated,
            stall_s=caught_up_s,
            passed=view.status == "succeeded" and store == want and stream == want,
        )
    )
    assert view.status == "succeeded", view
    assert store == want, f"event store per (run, type): {store - want} extra, {want - store} missing"
    assert stream == want, f"CASES per (run, type): {stream - want} extra, {want - stream} missing"
    assert await p.rejections(batch) == []
    verified = await p.verify(batch)
    assert verified.ok, verified
    assert verified.ok_count == N_CASES


async def test_a_sink_endpoint_that_is_down_fails_visibly_and_loses_nothing(pipeline: Pipeline) -> None:
    p = pipeline
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    spec = msgspec.structs.replace(
        suite(),
        sinks=(JsonlSink(path="outage-{batch}.jsonl"), PlatformSink(platform="otel", endpoint=dead)),
    )
    small = msgspec.structs.replace(spec, suite=msgspec.structs.replace(spec.suite, cases=spec.suite.cases[:6]))
    batch = await p.submit(small)
    view = await p.finalized(batch, timeout_s=180)
    assert view.status == "succeeded", view
    assert view.export is not None
    assert (view.export.status, view.export.exported, view.export.failed) == ("partial", 0, 6), view.export
    runs = await p.gw.all_cases(batch)
    assert len(runs) == 6
    for run in runs:
        assert run.exported_status == "partial", run
        by_sink = {o.sink: o for o in run.export_outcomes}
        assert sorted(o.status for o in by_sink.values()) == ["failed", "ok"], by_sink
        failed = next(o for o in by_sink.values() if o.status == "failed")
        assert failed.error, failed  # the reason a user reads
    runs_ids = {batch_run_id(batch, c.id) for c in small.suite.cases}
    want: Counter[tuple[str | None, str]] = Counter({(r, s): 1 for r in runs_ids for s in STAGES})
    store = Counter({k: n for k, n in (await p.store_counts(batch)).items() if k[1] in set(STAGES)})
    lost, duplicated = lost_and_duplicated(want, store)
    report(
        row(
            "a sink's endpoint down for a whole batch (the other sink up): every export failed visibly",
            load="6 cases, 2 sinks",
            faults=6,
            lost=lost,
            duplicated=duplicated,
            passed=store == want,
        )
    )
    assert store == want, f"event store per (run, type): {store - want} extra, {want - store} missing"
