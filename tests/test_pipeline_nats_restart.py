"""The bus itself dies mid-batch: nats-server is SIGKILLed while two agents run (their sandboxes
held, their outputs not yet published) and the rest of the batch waits on the bus, and started again on the same port and data folder. Every service rides it
out on its own (reconnect, the durable consumers and streams read back from JetStream's files): the
batch finalizes `succeeded`, every run exactly once per stage in the stream and the event store,
every trajectory sealed — the same result as an undisturbed batch of the same suite."""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from evalbus.infra.nats import start_nats
from evalbus.testing.pipeline import Pipeline, agent_harness, eventually, open_pipeline, task
from evalbus.testing.reliability import lost_and_duplicated, report, row
from evalbus_contracts import AnswerMatchGrader, BatchSpec, CaseSpec, ContainsJudge, SuiteSpec, batch_run_id

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CASES = tuple(f"c{i:02d}" for i in range(1, 9))
STAGES = ("case.requested", "case.executed", "case.judged", "case.exported")


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    workdir = tmp_path_factory.mktemp("nats-restart")
    async with open_pipeline(pg_admin_url, workdir, service_env={"dispatcher": {"DISPATCHER_SLOTS": "2"}}) as p:
        original = p.nats
        yield p
        restarted = p.nats
    if restarted is not original:  # stopped after the services, as the original would have been
        restarted.stop()


def suite(root: Path, tag: str) -> BatchSpec:
    """Eight cases that each wait for the gate file (two run at a time), answering their own id."""
    graders = (AnswerMatchGrader(id="answer"),)
    cases = tuple(
        CaseSpec(
            id=c,
            input=task(
                answer=c,
                touch=[str(root / f"{tag}-{c}.started")],
                wait_file=str(root / f"{tag}.gate"),
                wait_timeout_s=120,
            ),
            expected=c,
            graders=graders,
        )
        for c in CASES
    )
    return BatchSpec(
        suite=SuiteSpec(id=f"nats-restart-{tag}", cases=cases),
        harness=agent_harness(),
        judges=(ContainsJudge(id="names-itself"),),
    )


def started(root: Path, tag: str) -> list[str]:
    return [c for c in CASES if (root / f"{tag}-{c}.started").exists()]


async def test_a_batch_survives_nats_server_being_killed_and_restarted_mid_batch(pipeline: Pipeline) -> None:
    p = pipeline
    root = p.workdir / "gates"
    root.mkdir(exist_ok=True)

    # undisturbed, for the result to compare with
    (root / "calm.gate").touch()
    calm = await p.finalized(await p.submit(suite(root, "calm")))

    batch = await p.submit(suite(root, "kill"))
    # both compute slots hold an agent at the gate, the rest of the batch is queued on the bus
    await eventually(lambda: len(started(root, "kill")) == 2, timeout_s=60, what="two agents at the gate")
    old = p.nats
    killed_at = time.monotonic()
    old.kill()
    assert old.process.poll() is not None
    p.nats = await asyncio.to_thread(start_nats, old.data_dir, old.port, name=old.name, monitor_port=old.monitor_port)
    (root / "kill.gate").touch()
    view = await p.finalized(batch, timeout_s=180)
    await p.quiescent(timeout_s=120)
    stall_s = time.monotonic() - killed_at
    runs = {batch_run_id(batch, c) for c in CASES}
    want: Counter[tuple[str | None, str]] = Counter({(r, s): 1 for r in runs for s in STAGES})
    want[(None, "batch.requested")] = 1
    want[(None, "batch.finalized")] = 1
    stream = Counter(
        {
            (r if r in runs else None, k): n
            for (r, k), n in (await p.stream_counts(batch)).items()
            if k in {*STAGES, "batch.requested", "batch.finalized"}
        }
    )
    store = Counter(
        {
            (r if r in runs else None, k): n
            for (r, k), n in (await p.store_counts(batch)).items()
            if k in {*STAGES, "batch.requested", "batch.finalized"}
        }
    )
    lost, duplicated = lost_and_duplicated(want, store, stream)
    report(  # bench/reliability.py's row (stall: the kill → every consumer idle)
        row(
            "SIGKILL nats-server (single node), restarted on the same data",
            load=f"{len(CASES)} cases, 2 running",
            faults=1,
            lost=lost,
            duplicated=duplicated,
            stall_s=stall_s,
            passed=view.status == "succeeded" and store == want and stream == want,
        )
    )
    assert view.status == "succeeded", view
    assert stream == want, f"CASES per (run, type): {stream - want} extra, {want - stream} missing"
    assert store == want, f"event store per (run, type): {store - want} extra, {want - store} missing"
    assert await p.rejections(batch) == []
    verified = await p.verify(batch)
    assert verified.ok, verified
    assert verified.ok_count == len(CASES)
    assert view.summary is not None
    assert calm.summary is not None
    passed = {m.metric: m.mean for m in view.summary.metrics if m.metric in {"answer_match", "judge:names-itself"}}
    assert passed == {
        m.metric: m.mean for m in calm.summary.metrics if m.metric in {"answer_match", "judge:names-itself"}
    }
    assert passed == {"answer_match": 1.0, "judge:names-itself": 1.0}
