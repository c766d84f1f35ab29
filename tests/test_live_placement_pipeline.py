"""Placement and failure evidence end to end: the five services as real processes (one dispatcher
replica with one compute slot, sampling every 0.1 s) plus a second gateway replica.

- A running run's placement names its dispatcher, its process group and what it uses (the pid the
  harness itself reports), while the run behind it is queued for the one busy slot — the same
  answer on both gateway replicas; the queued run's wait is sealed as a `waiting` mark.
- A harness that fails after printing: once its sandbox is gone (the workdir it reported no longer
  exists), the sealed trajectory still holds the end of its output (stderr first), its marks up
  to the exit, and its exit sample — and the seal verifies.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import pytest

from evalbus.testing.pipeline import REPO_ROOT, Pipeline, eventually, open_pipeline, wait_path
from evalbus_api.client import ApiRequestError, GatewayClient
from evalbus_api.live import RunPlacement
from evalbus_contracts import BatchSpec, CaseExecuted, CaseSpec, CommandHarness, Infra, Log, SuiteSpec, decode_event
from evalbus_gateway.testing import RunningGateway, running_gateway

pytestmark = pytest.mark.e2e

AGENT = REPO_ROOT / "tests" / "harnesses" / "live_agent.py"


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    workdir = tmp_path_factory.mktemp("live-placement")
    env = {"DISPATCHER_SLOTS": "1", "DISPATCHER_SAMPLE_INTERVAL_S": "0.1", "DISPATCHER_REPLICA_ID": "d-1"}
    async with open_pipeline(pg_admin_url, workdir, service_env={"dispatcher": env}) as p:
        yield p


@pytest.fixture
async def replica(pipeline: Pipeline) -> AsyncIterator[GatewayClient]:
    """A client of a second gateway replica, on the pipeline's bus and database."""
    gateway: RunningGateway
    async with (
        running_gateway(pipeline.nats.url, pipeline.database_url, admin_token=pipeline.stack.admin_token) as gateway,
        GatewayClient(gateway.base_url, gateway.admin_token) as client,
    ):
        yield client


def agent(**task: object) -> str:
    return msgspec.json.encode(task).decode()


def harness() -> CommandHarness:
    return CommandHarness(id="live-agent", command=(sys.executable, str(AGENT)), timeout_s=60)


async def same_on_both(pipeline: Pipeline, replica: GatewayClient, run_id: str) -> RunPlacement:
    one = await pipeline.gw.placement(run_id)
    two = await replica.placement(run_id)
    # Both read the same bus; a sample published between the two reads may differ, nothing else.
    assert msgspec.structs.replace(one, used=None) == msgspec.structs.replace(two, used=None)
    return one


async def executed_of(pipeline: Pipeline, run_id: str) -> CaseExecuted:
    trajectory = await pipeline.gw.trajectory(run_id)
    bodies = [decode_event(bytes(e.body)) for e in trajectory.events if e.type == "case.executed"]
    assert len(bodies) == 1
    executed = bodies[0]
    assert isinstance(executed, CaseExecuted)
    assert trajectory.seal is not None
    return executed


async def test_a_running_run_and_the_one_queued_behind_it(
    pipeline: Pipeline, replica: GatewayClient, tmp_path: Path
) -> None:
    ready, go = tmp_path / "ready", tmp_path / "go"
    spec = BatchSpec(
        suite=SuiteSpec(
            id="placement",
            cases=(
                CaseSpec(id="c1", input=agent(phases=[{"stdout": ["working"], "ready": str(ready), "go": str(go)}])),
                CaseSpec(id="c2", input=agent(answer="second")),
            ),
        ),
        harness=harness(),
    )
    batch_id = await pipeline.submit(spec)
    first, second = f"evb-{batch_id}-c1", f"evb-{batch_id}-c2"
    await wait_path(ready)
    pid = int(ready.read_text())

    async def sampled() -> bool:
        view = await pipeline.gw.placement(first)
        return view.phase == "running" and view.used is not None and view.used.age_s >= 1.2

    # Held for over a second (so the run behind it waits that long for the slot), sampled meanwhile.
    await eventually(sampled, timeout_s=30, what="c1 running and sampled", diagnostics=pipeline.diagnostics)
    running = await same_on_both(pipeline, replica, first)
    assert (running.status, running.phase, running.dispatcher, running.unit) == (
        "running",
        "running",
        "d-1",
        f"pgid:{pid}",
    )
    assert running.used is not None
    assert (running.used.pid, running.used.state) == (pid, "running")
    assert running.used.rss_bytes is not None
    assert running.used.rss_bytes > 0
    assert running.node is not None
    assert running.asked.timeout_s == 60.0
    assert [e.event for e in running.events] == ["accepted", "started", "placed"]

    queued = await same_on_both(pipeline, replica, second)
    assert (queued.status, queued.phase) == ("queued", "queued")

    async def phases() -> list[tuple[str, str | None]]:
        return [
            ((v := await client.run(run)).stage, v.phase)
            for client in (pipeline.gw, replica)
            for run in (first, second)
        ]

    async def recorded() -> bool:  # the recorder writes the runs a moment after their requests
        try:
            await phases()
        except ApiRequestError:
            return False
        return True

    await eventually(recorded, timeout_s=30, what="both runs recorded")
    # the run's own view says where it is, on every replica, while its stage still reads "requested"
    assert await phases() == [("requested", "running"), ("requested", "queued")] * 2
    assert (
        queued.reason
        == "waiting for a compute slot: 0 ahead of it; all 1 slot(s) of 1 dispatcher(s) are busy (d-1: 1/1)"
    )

    go.touch()
    await pipeline.finalized(batch_id)
    done = await same_on_both(pipeline, replica, first)
    assert (done.status, done.phase, done.oom) == ("succeeded", "dead", False)

    async def exported() -> bool:
        return (await replica.run(first)).phase == "exported"

    await eventually(exported, timeout_s=30, what="c1's phase exported")
    assert done.reason is not None
    assert done.reason.startswith("the run settled (succeeded); the harness exited with 0 after ")

    # The wait for the slot is sealed into the queued run's trajectory, ahead of its acceptance.
    sealed = await executed_of(pipeline, second)
    marks = [e for e in sealed.result.trace if isinstance(e, Infra)]
    assert [m.event for m in marks][:2] == ["waiting", "accepted"]
    assert marks[0].message.startswith("waited ")
    assert marks[0].message.endswith("s in the queue for a compute slot")
    assert marks[1].message == "accepted by dispatcher d-1"


async def test_failure_evidence_outlives_the_sandbox(pipeline: Pipeline, tmp_path: Path) -> None:
    cwd_file = tmp_path / "cwd"
    lines = [f"step {i}: ok" for i in range(50)]
    task = agent(cwd_file=str(cwd_file), phases=[{"stdout": lines, "stderr": ["error: the tool crashed"]}], exit_code=3)
    spec = BatchSpec(suite=SuiteSpec(id="evidence", cases=(CaseSpec(id="c1", input=task),)), harness=harness())
    batch_id = await pipeline.submit(spec)
    await pipeline.finalized(batch_id)
    run_id = f"evb-{batch_id}-c1"

    workdir = Path(cwd_file.read_text())
    assert not await asyncio.to_thread(workdir.exists), "the sandbox should be gone once the run settled"

    executed = await executed_of(pipeline, run_id)
    failure = executed.result.failure
    assert failure is not None
    assert (failure.code, failure.failure_class) == ("exit_nonzero", "agent")
    assert failure.log_tail is not None
    assert failure.log_tail.startswith("[stderr]\nerror: the tool crashed\n[stdout]\n")
    assert failure.log_tail.endswith("step 49: ok")
    assert failure.placement is not None
    assert failure.placement.dispatcher == "d-1"
    assert [m.event for m in failure.placement.events] == ["accepted", "started", "placed", "exited"]
    assert failure.placement.events[-1].message.startswith("exited with 3 after ")
    sample = failure.placement.resources
    assert sample is not None
    assert (sample.state, sample.exit_code, sample.oom, sample.dispatcher) == ("exited", 3, False, "d-1")
    assert failure.placement.unit == f"pgid:{sample.pid}"
    # A harness without a platform trace also keeps its stderr in the trace itself.
    assert any(isinstance(e, Log) and "the tool crashed" in e.text for e in executed.result.trace)

    verified = await pipeline.verify(batch_id)
    assert (verified.ok_count, verified.mismatched, verified.not_sealed) == (1, 0, 0)
    # The run view shows the same evidence.
    view = await pipeline.gw.run(run_id)
    assert view.failure is not None
    assert view.failure.log_tail == failure.log_tail
