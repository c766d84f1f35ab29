"""Scale-out, proven on loopback: three replicas of every service against a 3-node JetStream
cluster with R3 streams run a batch while (a) the CASES stream's leader node is SIGKILLed, (b) one
replica of each service is SIGKILLed, and (c) a replica of the dispatcher and of the judge is added
— all mid-batch. The batch finalizes `succeeded` with every run exactly once per stage (in the
stream and the event store), every trajectory sealed, and the scorecard of an undisturbed run of
the same suite on the same cluster.

`SCALEOUT_CASES` sets the batch size (default 1,000, the issue's figure); `bench/scaleout.py`
measures what replicas buy.
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import AsyncIterator

import pytest

from evalbus.testing.pipeline import (
    Pipeline,
    differences,
    eventually,
    once_each,
    open_pipeline,
    without_metrics,
)
from evalbus.testing.reliability import lost_and_duplicated, report, row
from evalbus.testing.stack import SERVICES
from evalbus_contracts import (
    AnswerMatchGrader,
    BatchSpec,
    CaseSpec,
    CommandHarness,
    ContainsJudge,
    SuiteSpec,
    batch_run_id,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

N_CASES = int(os.environ.get("SCALEOUT_CASES", "1000"))
STAGES = ("case.requested", "case.executed", "case.judged", "case.exported")
TIMING_METRICS = ("latency",)
MEAN_REL_TOL = 1e-9


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    workdir = tmp_path_factory.mktemp("scaleout")
    async with open_pipeline(
        pg_admin_url,
        workdir,
        cluster=3,
        env={"LOG_LEVEL": "WARNING"},
        service_env={"dispatcher": {"DISPATCHER_SLOTS": "4"}},
    ) as p:
        extra = [f"{s}@{k}" for s in SERVICES for k in (2, 3)]
        await asyncio.to_thread(p.stack.start_all, extra)
        yield p


def suite(tag: str) -> BatchSpec:
    """`N_CASES` cases answered by `cat` (the input is the expected answer): cheap to run, so
    the test measures the bus and the services, not process start-up."""
    graders = (AnswerMatchGrader(id="answer"),)
    cases = tuple(
        CaseSpec(id=f"c{i:04d}", input=f"a{i:04d}", expected=f"a{i:04d}", graders=graders) for i in range(N_CASES)
    )
    return BatchSpec(
        suite=SuiteSpec(id=f"scaleout-{tag}", cases=cases),
        harness=CommandHarness(id="cat", command=("cat",)),
        judges=(ContainsJudge(id="echoes"),),
    )


async def exported(p: Pipeline, batch_id: str) -> int:
    row = await p.pool.fetchval("SELECT count(*) FROM events WHERE batch_id = $1 AND type = 'case.exported'", batch_id)
    return int(row or 0)


async def test_a_batch_rides_out_a_leader_kill_replica_kills_and_a_scale_up(pipeline: Pipeline) -> None:
    p = pipeline
    began = time.monotonic()
    calm = await p.finalized(await p.submit(suite("calm")), timeout_s=600)
    calm_s = time.monotonic() - began

    batch = await p.submit(suite("storm"))
    await eventually(lambda: _at_least(p, batch, N_CASES // 5), timeout_s=300, what="a fifth of the batch exported")

    # (a) the node leading CASES dies (not restarted: the cluster goes on with two of three)
    info = await p.nc.jetstream().stream_info("CASES")
    assert info.cluster is not None
    assert info.config.num_replicas == 3
    leader = next(node for node in p.cluster if node.name == info.cluster.leader)
    leader.kill()
    # (b) one replica of every service dies mid-message
    for service in SERVICES:
        await asyncio.to_thread(p.stack.kill, f"{service}@2")
    await eventually(lambda: _at_least(p, batch, N_CASES // 2), timeout_s=300, what="half of the batch exported")
    # (c) replicas are added while it runs
    await asyncio.to_thread(p.stack.start_all, ["dispatcher@4", "judge@4"])

    view = await p.finalized(batch, timeout_s=600)
    await p.quiescent(timeout_s=180)
    assert view.status == "succeeded", view

    runs = {batch_run_id(batch, c.id) for c in suite("storm").suite.cases}
    want = once_each(runs, stages=STAGES)
    lost, duplicated = lost_and_duplicated(want, await p.store_counts(batch), await p.stream_counts(batch))
    report(
        row(
            "3-node cluster: the CASES leader SIGKILLed (not restarted), a replica of every service "
            "SIGKILLed, two replicas added",
            load=f"{N_CASES} cases, 3 replicas of each service",
            faults=1 + len(SERVICES),
            lost=lost,
            duplicated=duplicated,
            passed=view.status == "succeeded" and lost == 0 and duplicated == 0,
        )
    )
    problems = await p.once_per_stage_problems(batch, want)
    assert problems == [], "\n".join([*problems, await cluster_state(p)])
    assert await p.rejections(batch) == []
    verified = await p.verify(batch)
    assert verified.ok, verified
    assert verified.ok_count == N_CASES

    assert view.summary is not None
    assert calm.summary is not None
    assert view.summary.verdicts.passed == N_CASES
    assert (
        differences(
            without_metrics(view.summary, TIMING_METRICS),
            without_metrics(calm.summary, TIMING_METRICS),
            rel_tol=MEAN_REL_TOL,
        )
        == []
    )
    print(f"\nscale-out: {N_CASES} cases; undisturbed batch {calm_s:.1f} s")


async def _at_least(p: Pipeline, batch_id: str, n: int) -> bool:
    return await exported(p, batch_id) >= n


async def cluster_state(p: Pipeline) -> str:
    """CASES as its leader reports it (messages, replicas and their lag), for a failure message."""
    try:
        info = await p.nc.jetstream().stream_info("CASES")
    except Exception as e:  # noqa: BLE001 - diagnostics only
        return f"CASES info unavailable: {e!r}"
    cluster = info.cluster
    replicas = [(r.name, r.current, r.lag) for r in (cluster.replicas or [])] if cluster else []
    leader = cluster.leader if cluster else None
    return f"CASES: {info.state.messages} messages, leader {leader}, replicas (name, current, lag) {replicas}"
