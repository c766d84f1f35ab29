"""A replica's compute slots: one pool for every lane it serves, sized on a cluster backend from the
cluster's room — the room read from each backend's protocol-level fake (Nomad, Kubernetes, Docker;
not real clusters), the pool following it (`capacity.py`)."""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s

from evalbus.testing.fake_docker import FakeDocker
from evalbus.testing.fake_kubernetes import DEFAULT_IMAGE, FakeKubernetes
from evalbus.testing.fake_nomad import FakeNomad
from evalbus.testing.pipeline import eventually
from evalbus_contracts import CasePlan, CaseRequested, CaseSpec, CommandHarness, ComputeSpec, batch_run_id
from evalbus_dispatcher import execute_case
from evalbus_dispatcher.backends.base import Interactive, SandboxHandle
from evalbus_dispatcher.backends.docker import DockerTemplate, connect_docker
from evalbus_dispatcher.backends.kubernetes import JobTemplate, KubernetesBackend
from evalbus_dispatcher.backends.nomad import NomadTemplate, connect_nomad, nomad_room
from evalbus_dispatcher.capacity import ClusterRoom, HasRoom
from evalbus_dispatcher.execute import MarkFn
from evalbus_dispatcher.screen import Declared
from evalbus_dispatcher.service import CLUSTER_SLOTS, DispatcherSettings, build_dispatcher, kubernetes_backend
from evalbus_runtime import Service, SlotPool
from evalbus_runtime.secrets import SecretStore
from evalbus_runtime.settings import load_settings

from .conftest import _RecordingLive

pytestmark = pytest.mark.integration

HOLD = """
import os, time
print("holding", flush=True)
while not os.path.exists("go"):
    time.sleep(0.02)
print('EVALBUS_RESULT {"answer": "done"}')
"""


# ---------------------------------------------------------------- arithmetic


def test_nomad_room_is_each_nodes_resources_less_what_its_live_allocations_hold() -> None:
    nodes = [("n1", "node-1", 4000, 4096), ("n2", "node-2", 2500, 1024)]

    def alloc(node: str, status: str, cpu: int, mem: int) -> dict[str, Any]:
        tasks = {"task": {"Cpu": {"CpuShares": cpu}, "Memory": {"MemoryMB": mem}}}
        return {"NodeID": node, "ClientStatus": status, "AllocatedResources": {"Tasks": tasks}}

    assert nomad_room(nodes, [], cpu_mhz=1000, memory_mb=1024) == 4 + 1
    held = [alloc("n1", "running", 2000, 1024), alloc("n1", "pending", 500, 512), alloc("n2", "complete", 2500, 1024)]
    # node-1: 1500 MHz and 2560 MiB left → 1; node-2's finished allocation holds nothing → 1.
    assert nomad_room(nodes, held, cpu_mhz=1000, memory_mb=1024) == 2
    assert nomad_room(nodes, [alloc("n2", "running", 100, 1000)], cpu_mhz=1000, memory_mb=1024) == 4


def test_slots_default_to_the_cpu_count_locally_and_a_cap_on_a_cluster() -> None:
    local = load_settings(DispatcherSettings, "dispatcher", {})
    assert local.slot_count() == (os.cpu_count() or 2)
    cluster = load_settings(DispatcherSettings, "dispatcher", {"DISPATCHER_BACKEND": "nomad"})
    assert cluster.slot_count() == CLUSTER_SLOTS
    fixed = load_settings(DispatcherSettings, "dispatcher", {"DISPATCHER_BACKEND": "nomad", "DISPATCHER_SLOTS": "3"})
    assert fixed.slot_count() == 3
    with pytest.raises(ValueError, match="DISPATCHER_SLOTS"):
        DispatcherSettings(service="dispatcher", slots=0)


# ---------------------------------------------------------------- the pool follows the room


class Room:
    """A backend whose room the test sets (or breaks) — the sizing logic alone."""

    def __init__(self, room: int) -> None:
        self.value: int | Exception = room

    async def room(self, compute: ComputeSpec | None = None) -> int:
        if isinstance(self.value, Exception):
            raise self.value
        return self.value


async def test_the_pool_is_the_room_plus_what_it_holds_capped_by_the_setting(caplog: pytest.LogCaptureFixture) -> None:
    backend = Room(3)
    assert isinstance(backend, HasRoom)
    pool = SlotPool(8)
    sizes: list[int] = []
    room = ClusterRoom(backend, pool, most=8, on_size=sizes.append)
    assert await room.refresh() == 3
    assert pool.try_take()
    assert pool.try_take()
    backend.value = 1  # two of the three now hold this replica's cases
    assert await room.refresh() == 3
    backend.value = 20
    assert await room.refresh() == 8  # never above DISPATCHER_SLOTS
    backend.value = 0
    assert await room.refresh() == 2  # a full cluster: what it holds, nothing more
    assert pool.held == 2
    with caplog.at_level(logging.WARNING, logger="evalbus.dispatcher.capacity"):
        backend.value = RuntimeError("403 Forbidden: nodes is forbidden")
        assert await room.refresh() == 2
        assert await room.refresh() == 2
    warnings = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1
    assert "keeping 2 slots" in warnings[0]
    assert "403" in warnings[0]
    assert sizes == [3, 3, 8, 2]


# ---------------------------------------------------------------- each backend's room, live


def request(batch: str) -> CaseRequested:
    return CaseRequested(
        batch_id=batch,
        case_id="c1",
        run_id=batch_run_id(batch, "c1", None),
        case=CaseSpec(id="c1", input="x"),
        harness=CommandHarness(
            id="agent", command=(sys.executable, "hold.py"), files={"hold.py": HOLD}, compute=ComputeSpec()
        ),
        plan=CasePlan(suite_id="suite", submitted_by="alice"),
    )


RUNNER = (sys.executable, "-m", "evalbus.runner")


@pytest.fixture(params=["kubernetes", "nomad", "docker-fake"])
async def cluster(request: pytest.FixtureRequest) -> AsyncIterator[Any]:
    """A backend on a fake cluster with room for exactly two cases of the default compute (1 CPU, 1 GiB)."""
    if request.param == "kubernetes":
        async with FakeKubernetes() as fake:
            fake.add_node("node-a", cpu=2.5, memory="3Gi")
            config = k8s.Configuration()
            config.host = fake.url
            template = JobTemplate(namespace="evalbus", image=DEFAULT_IMAGE, runner_command=RUNNER, start_timeout_s=60)
            backend = KubernetesBackend(k8s.ApiClient(config), template, slots=4, poll_s=0.05)
            try:
                yield backend
            finally:
                await backend.close()
            assert fake.violations == []
    elif request.param == "nomad":
        async with FakeNomad() as agent:
            agent.add_node("node-a", cpu_mhz=2500, memory_mb=3072)
            nomad = NomadTemplate(image="evalbus/case:test", runner_command=RUNNER, start_timeout_s=60.0)
            nomad_backend = connect_nomad(nomad, address=agent.url, slots=4, poll_s=0.05)
            try:
                yield nomad_backend
            finally:
                await nomad_backend.close()
            assert agent.violations == []
    else:
        async with FakeDocker(ncpu=2, mem_total=3 * 1024**3) as engine:
            docker = DockerTemplate(image=DEFAULT_IMAGE, runner_command=RUNNER, start_timeout_s=60.0)
            docker_backend = connect_docker(docker, SecretStore({}), host=engine.host, slots=4)
            try:
                yield docker_backend
            finally:
                await docker_backend.close()
            assert engine.violations == []


async def test_a_running_case_takes_its_room_and_gives_it_back_when_released(cluster: Any) -> None:
    assert await cluster.room() == 2
    handles: list[SandboxHandle] = []

    async def on_sandbox(handle: SandboxHandle, _mark: MarkFn, _declared: Declared) -> Any:
        handles.append(handle)

        async def detach() -> None:
            return None

        return detach

    records: list[Any] = []
    running = asyncio.create_task(
        execute_case(
            request("room"),
            cluster,
            live=_RecordingLive(records),
            on_release=lambda: None,
            on_sandbox=on_sandbox,
            sample_interval_s=0.5,
        )
    )

    async def holding() -> bool:
        return any(k == "log" and "holding" in v[1] for k, v in records) and await cluster.room() == 1

    await eventually(holding, timeout_s=60, what=f"the running case to take one case's room ({records[-5:]})")
    pool = SlotPool(CLUSTER_SLOTS)
    assert pool.try_take()  # the dispatcher's slot for the running case
    assert await ClusterRoom(cluster, pool, most=CLUSTER_SLOTS).refresh() == 2  # held 1 + room 1
    [handle] = handles
    assert isinstance(handle, Interactive)
    await handle.exec_live("touch go", 30, cap_bytes=1024)
    done = await running
    assert done.status == "succeeded", done.result.failure

    async def given_back() -> bool:
        return bool(await cluster.room() == 2)

    await eventually(given_back, timeout_s=30, what="the released case's room back")


def test_a_replica_serving_two_lanes_shares_one_pool_of_its_slots() -> None:
    settings = load_settings(
        DispatcherSettings, "dispatcher", {"DISPATCHER_LANES": "default,gpu", "DISPATCHER_SLOTS": "1"}
    )
    service = Service(settings)
    build_dispatcher(service, settings)
    lanes = [s for s in service._stages if s.consumer.durable.startswith("dispatcher-cases")]
    assert [s.consumer.durable for s in lanes] == ["dispatcher-cases", "dispatcher-cases-gpu"]
    pools = {id(s.pool) for s in lanes}
    assert len(pools) == 1
    assert lanes[0].pool is not None
    assert lanes[0].pool.size == 1


async def test_the_kubernetes_artifact_hold_is_a_setting(tmp_path: Path) -> None:
    async with FakeKubernetes() as fake:
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters: [{{name: fake, cluster: {{server: '{fake.url}'}}}}]\n"
            "users: [{name: me, user: {}}]\n"
            "contexts: [{name: fake, context: {cluster: fake, user: me}}]\n"
        )
        environ = {
            "DISPATCHER_BACKEND": "kubernetes",
            "KUBECONFIG": str(kubeconfig),
            "DISPATCHER_ARTIFACT_HOLD_S": "15",
        }
        backend = kubernetes_backend(load_settings(DispatcherSettings, "dispatcher", environ))
        try:
            assert backend.template.artifact_hold_s == 15.0
        finally:
            await backend.close()
    with pytest.raises(ValueError, match="DISPATCHER_ARTIFACT_HOLD_S"):
        DispatcherSettings(service="dispatcher", artifact_hold_s=-1)
