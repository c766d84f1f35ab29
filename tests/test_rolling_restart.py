"""A rolling upgrade under traffic: every service runs two replicas, batches keep arriving (one a
second) and flowing, and one service after another has each of its replicas replaced — a new process started, then the old one stopped
with SIGTERM (it finishes or gives back what it holds) — as Kubernetes' `maxUnavailable: 0` and
Nomad's `max_parallel = 1` roll a Deployment. Every batch finishes `succeeded`, every run exactly
once per stage in the stream and the event store, sealed, scored as an undisturbed batch.

The replacement is a new process of the same build: what a newer build changes on the wire is a
schema version, covered where events are decoded (`tests/test_event_fixtures.py`, the upcasts, and
`libs/runtime/tests/test_schema_versions.py`, a newer version dead-lettered with its reason).
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import uuid
from collections import Counter
from collections.abc import AsyncIterator

import pytest

from evalbus.testing.pipeline import (
    Pipeline,
    agent_harness,
    differences,
    open_pipeline,
    task,
    without_metrics,
)
from evalbus.testing.stack import SERVICES
from evalbus_api.client import ApiRequestError, GatewayClient
from evalbus_contracts import AnswerMatchGrader, BatchSpec, CaseSpec, ExactJudge, SuiteSpec, batch_run_id

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

N_CASES = 8
STAGES = ("case.requested", "case.executed", "case.judged", "case.exported")


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    workdir = tmp_path_factory.mktemp("rolling")
    async with open_pipeline(pg_admin_url, workdir, service_env={"dispatcher": {"DISPATCHER_SLOTS": "2"}}) as p:
        await asyncio.to_thread(p.stack.start_all, [f"{s}@2" for s in SERVICES])
        yield p


def suite() -> BatchSpec:
    """A small batch of cases of half a second of agent time each."""
    graders = (AnswerMatchGrader(id="answer"),)
    cases = tuple(
        CaseSpec(id=f"c{i:02d}", input=task(answer=f"a{i}", sleep_s=0.5), expected=f"a{i}", graders=graders)
        for i in range(N_CASES)
    )
    return BatchSpec(
        suite=SuiteSpec(id="rolling", cases=cases), harness=agent_harness(), judges=(ExactJudge(id="exact"),)
    )


async def replace(p: Pipeline, old: str, new: str) -> None:
    """Start `new` (a new process, also for a name that ran before), wait until it is ready, then
    stop `old` gracefully (SIGTERM)."""
    await asyncio.to_thread(p.stack.start, new)
    await asyncio.to_thread(p.stack.kill, old, signal.SIGTERM)


async def submit_anywhere(p: Pipeline, spec: BatchSpec) -> str:
    """Submit through whichever gateway replica answers (one may be stopping), with one
    idempotency key for every try: a batch a stopping replica took but could not confirm is not
    submitted twice."""
    key = uuid.uuid4().hex
    last: Exception | None = None
    for _ in range(3):
        for name in ("gateway", "gateway@2", "gateway@3", "gateway@4"):
            proc = p.stack.procs.get(name)
            if proc is None or proc.process.poll() is not None:
                continue
            async with GatewayClient(proc.url, p.stack.admin_token, timeout_s=10) as gw:
                try:
                    return (await gw.submit(spec, idempotency_key=key)).batch_id
                except ApiRequestError as e:
                    if e.status not in (0, 502, 503):  # only "not there" or "stopping" is tried elsewhere
                        raise
                    last = e
    raise AssertionError(f"no gateway replica took the batch: {last}")


@pytest.mark.timeout(900)  # ten replacements, each a service's start: 25 s alone, past 300 s on a loaded CI run
async def test_traffic_flows_while_every_service_is_rolled_one_replica_at_a_time(pipeline: Pipeline) -> None:
    p = pipeline
    calm = await p.finalized(await p.submit(suite()), timeout_s=120)

    batches: list[str] = []
    rolled_out = asyncio.Event()

    async def traffic() -> None:
        """A new batch every second for as long as the rollout runs: work is in flight at every
        replacement, whatever the replacements take on this machine."""
        while not rolled_out.is_set():
            batches.append(await submit_anywhere(p, suite()))
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(rolled_out.wait(), 1.0)

    sender = asyncio.create_task(traffic())
    rolled = 0
    try:
        for service in ("gateway", "exporter", "judge", "collector", "dispatcher"):  # readers before writers
            await replace(p, f"{service}@2", f"{service}@3")
            if service == "gateway":  # back on its own port (the test's API client talks to it), a
                await replace(p, service, "gateway@4")  # stand-in holding its place meanwhile
                await replace(p, "gateway@4", service)
            else:
                await replace(p, service, f"{service}@4")
            rolled += 2
    finally:
        rolled_out.set()
        await sender
    assert rolled == 10
    assert len(batches) >= 5, batches

    kinds = set(STAGES)
    for batch in batches:
        view = await p.finalized(batch, timeout_s=300)
        assert view.status == "succeeded", view
        runs = {batch_run_id(batch, c.id) for c in suite().suite.cases}
        want: Counter[tuple[str | None, str]] = Counter({(r, s): 1 for r in runs for s in STAGES})
        store = Counter({k: n for k, n in (await p.store_counts(batch)).items() if k[1] in kinds})
        assert store == want, f"{batch}: event store per (run, type): {store - want} extra, {want - store} missing"
    await p.quiescent(timeout_s=120)
    for batch in batches:
        view = await p.finalized(batch)
        runs = {batch_run_id(batch, c.id) for c in suite().suite.cases}
        want = Counter({(r, s): 1 for r in runs for s in STAGES})
        stream = Counter({k: n for k, n in (await p.stream_counts(batch)).items() if k[1] in kinds})
        assert stream == want, f"{batch}: CASES per (run, type): {stream - want} extra, {want - stream} missing"
        assert await p.rejections(batch) == []
        verified = await p.verify(batch)
        assert verified.ok, verified
        assert verified.ok_count == N_CASES
        assert view.summary is not None
        assert calm.summary is not None
        assert (
            differences(
                without_metrics(view.summary, ("latency",)), without_metrics(calm.summary, ("latency",)), rel_tol=1e-9
            )
            == []
        )
