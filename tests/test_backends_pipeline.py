"""The dispatcher on the Kubernetes backend, end to end: the five services as real processes, the
dispatcher with `DISPATCHER_BACKEND=kubernetes` and a kubeconfig pointing at the protocol-level fake
(`evalbus.testing.fake_kubernetes`, served by this test process; its kubelet runs the real in-job
runner). One case succeeds with its compute grader; one names an image that cannot be pulled: it
fails at once, and its sealed trajectory keeps the cluster's events after the Job is deleted. The
dispatcher's slots follow the cluster's room: another team's workload filling the node leaves a
case waiting on the bus, and it runs once the room is back.
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest

from evalbus.testing.fake_kubernetes import DEFAULT_IMAGE, FakeKubernetes
from evalbus.testing.pipeline import Pipeline, eventually, open_pipeline
from evalbus_api.client import ApiRequestError
from evalbus_contracts import (
    BatchSpec,
    CaseExecuted,
    CaseSpec,
    CommandHarness,
    ComputeSpec,
    Infra,
    Measured,
    SuiteSpec,
    TestsPassGrader,
    decode_event,
)
from evalbus_contracts.placement import DispatcherStatus
from evalbus_contracts.streams import DISPATCHERS
from evalbus_dispatcher.presence import status_key

pytestmark = pytest.mark.e2e

AGENT = """\
import sys
open("answer.txt", "w").write(sys.stdin.read())
print('EVALBUS_RESULT {"answer": "42"}')
"""


@pytest.fixture(scope="module")
async def cluster() -> AsyncIterator[FakeKubernetes]:
    async with FakeKubernetes() as fake:
        fake.add_node("node-a", cpu=4, memory="4Gi")
        yield fake


@pytest.fixture(scope="module")
async def pipeline(
    pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory, cluster: FakeKubernetes
) -> AsyncIterator[Pipeline]:
    workdir = tmp_path_factory.mktemp("backends-pipeline")
    kubeconfig = workdir / "kubeconfig"
    kubeconfig.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
        f"clusters: [{{name: fake, cluster: {{server: '{cluster.url}'}}}}]\n"
        "users: [{name: me, user: {}}]\n"
        "contexts: [{name: fake, context: {cluster: fake, user: me}}]\n"
    )
    env = {
        "DISPATCHER_BACKEND": "kubernetes",
        "DISPATCHER_KUBECONFIG": str(kubeconfig),
        "DISPATCHER_IMAGE": DEFAULT_IMAGE,
        "DISPATCHER_CLUSTER_POLL_S": "0.1",
        "DISPATCHER_SLOTS": "2",
        "DISPATCHER_REPLICA_ID": "d-k8s",
        "DISPATCHER_ROOM_INTERVAL_S": "0.2",
        "DISPATCHER_STATUS_INTERVAL_S": "0.5",
    }
    async with open_pipeline(pg_admin_url, workdir, service_env={"dispatcher": env}) as p:
        yield p


async def executed_of(pipeline: Pipeline, run_id: str) -> CaseExecuted:
    trajectory = await pipeline.gw.trajectory(run_id)
    bodies = [decode_event(bytes(e.body)) for e in trajectory.events if e.type == "case.executed"]
    assert len(bodies) == 1
    assert isinstance(bodies[0], CaseExecuted)
    return bodies[0]


async def test_cases_run_as_jobs_and_failure_evidence_is_sealed(pipeline: Pipeline, cluster: FakeKubernetes) -> None:
    grader = TestsPassGrader(id="wrote", command="grep -q 'x 7' answer.txt")
    spec = BatchSpec(
        suite=SuiteSpec(
            id="on-kubernetes",
            cases=(CaseSpec(id="ok", input="6 x 7?", graders=(grader,)),),
        ),
        harness=CommandHarness(
            id="agent",
            command=(sys.executable, "agent.py"),
            files={"agent.py": AGENT},
            compute=ComputeSpec(cpu=0.5, memory_mb=256),
        ),
    )
    batch_id = await pipeline.submit(spec)
    await pipeline.finalized(batch_id)

    ok = await executed_of(pipeline, f"evb-{batch_id}-ok")
    assert ok.status == "succeeded", ok.result.failure
    assert ok.result.answer == "42"
    assert isinstance(ok.result.scores[0], Measured)
    assert ok.result.scores[0].passed
    events = [m.event for m in ok.result.trace if isinstance(m, Infra)]
    assert events[:4] == ["accepted", "started", "submitted", "pod"]
    assert {"scheduled", "placed", "exited", "released"} <= set(events)

    verified = await pipeline.verify(batch_id)
    assert (verified.mismatched, verified.not_sealed) == (0, 0)
    assert not cluster.jobs  # every Job deleted on release
    assert cluster.violations == []


async def test_an_image_pull_failure_is_sealed_with_the_clusters_events(
    pipeline: Pipeline, cluster: FakeKubernetes
) -> None:
    spec = BatchSpec(
        suite=SuiteSpec(id="pull-fails", cases=(CaseSpec(id="c1", input="x"),)),
        harness=CommandHarness(
            id="agent",
            command=(sys.executable, "agent.py"),
            files={"agent.py": AGENT},
            compute=ComputeSpec(image="registry.invalid/missing:1", cpu=0.5, memory_mb=256),
        ),
    )
    batch_id = await pipeline.submit(spec)
    await pipeline.finalized(batch_id)
    executed = await executed_of(pipeline, f"evb-{batch_id}-c1")
    failure = executed.result.failure
    assert failure is not None
    assert failure.code == "spawn_failed"
    assert failure.placement is not None
    assert failure.placement.node == "node-a"
    evidence = [m.message for m in failure.placement.events if m.event == "pod"]
    assert any("Failed to pull image" in m and "registry.invalid/missing:1" in m for m in evidence)
    assert not cluster.jobs
    view = await pipeline.gw.run(f"evb-{batch_id}-c1")
    assert view.failure is not None
    assert view.failure.code == "spawn_failed"


HOG = "hog-of-another-team"


async def dispatcher_slots(pipeline: Pipeline) -> int:
    """The slots the dispatcher offers, as its presence in the `dispatchers` bucket says."""
    kv = await pipeline.nc.jetstream().key_value(DISPATCHERS.bucket)
    entry = await kv.get(status_key("d-k8s"))
    assert entry.value is not None
    return msgspec.json.decode(entry.value, type=DispatcherStatus).slots


async def test_the_slots_follow_the_clusters_room(pipeline: Pipeline, cluster: FakeKubernetes) -> None:
    async def slots_are(n: int) -> bool:
        return await dispatcher_slots(pipeline) == n

    # node-a has 4 CPUs: room for 4 cases of the default compute, capped by DISPATCHER_SLOTS=2.
    await eventually(lambda: slots_are(2), timeout_s=20, what="2 slots (DISPATCHER_SLOTS caps a room of 4)")
    hog = {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": HOG, "labels": {"team": "other"}},
        "spec": {
            "template": {
                "metadata": {"labels": {"team": "other"}},
                "spec": {
                    "restartPolicy": "Never",
                    "containers": [
                        {
                            "name": "hog",
                            "image": DEFAULT_IMAGE,
                            "command": [sys.executable, "-c", "import time; time.sleep(300)"],
                            "resources": {"requests": {"cpu": "3500m", "memory": "256Mi"}},
                        }
                    ],
                },
            }
        },
    }
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{cluster.url}/apis/batch/v1/namespaces/evalbus/jobs", json=hog) as created:
            assert created.status == 201, await created.text()
        await eventually(lambda: slots_are(0), timeout_s=20, what="no slot while the hog leaves half a CPU")

        spec = BatchSpec(
            suite=SuiteSpec(id="waits-for-room", cases=(CaseSpec(id="c1", input="6 x 7?"),)),
            harness=CommandHarness(id="agent", command=(sys.executable, "agent.py"), files={"agent.py": AGENT}),
        )
        batch_id = await pipeline.submit(spec)
        run_id = f"evb-{batch_id}-c1"

        async def waiting_for_room() -> bool:
            try:
                view = await pipeline.gw.placement(run_id)
            except ApiRequestError as e:  # its request not recorded yet
                if e.status != 404:
                    raise
                return False
            return view.phase == "queued" and "waiting for room in the cluster" in (view.reason or "")

        await eventually(waiting_for_room, timeout_s=20, what="the case to wait on the bus for room")
        assert [name for _, name in cluster.jobs] == [HOG]  # nothing of the case was submitted (same namespace)
        async with http.delete(f"{cluster.url}/apis/batch/v1/namespaces/evalbus/jobs/{HOG}") as deleted:
            assert deleted.status == 200, await deleted.text()
    await pipeline.finalized(batch_id)
    executed = await executed_of(pipeline, run_id)
    assert executed.status == "succeeded", executed.result.failure
    await eventually(lambda: slots_are(2), timeout_s=20, what="the slots back at 2")
    assert cluster.violations == []
