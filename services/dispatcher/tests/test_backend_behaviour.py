"""One behaviour suite for every backend, through `execute_case` (what the dispatcher runs).

- `local`: for real, on this machine.
- `kubernetes`: against `evalbus.testing.fake_kubernetes` — a **protocol-level** fake API server
  (every request checked against the documented API; its kubelet runs the pod's command, the real
  in-job runner, as a local process). Not a real cluster.
- `nomad`: against `evalbus.testing.fake_nomad` — a **protocol-level** fake Nomad agent (requests
  checked against the Nomad HTTP API docs; its client runs the task, the real runner, locally).
- `kubernetes-live`, `nomad-live`: a real cluster, only when `EVALBUS_TEST_KUBECONFIG` names a
  kubeconfig or `EVALBUS_TEST_NOMAD_ADDR` a Nomad agent (`just test-backends-live`,
  `just test-backends-live-nomad`; the image `EVALBUS_TEST_IMAGE` must hold the runner and Python).
- `docker-fake`: against `evalbus.testing.fake_docker` — a **protocol-level** fake Docker Engine
  API (requests checked against the documented Engine API shapes; its "containers" run their
  command, the real runner, as local processes). Not a Docker engine.
- `docker`: a real engine, when `EVALBUS_TEST_DOCKER_HOST` names one or `/var/run/docker.sock`
  answers (`just test-backends-live-docker`); skipped, saying why, otherwise.

Scenarios that need an orchestrator (images, memory limits, scheduling) run on the cluster
backends only; the local backend has none of these. Declared artifact files are stored in the
object store of a real nats-server on every backend.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import os
import re
import sys
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from kubernetes import client as k8s
from kubernetes import config as k8s_config

from evalbus.infra.nats import NatsServer
from evalbus.testing.fake_docker import FakeDocker
from evalbus.testing.fake_kubernetes import DEFAULT_IMAGE, FakeKubernetes
from evalbus.testing.fake_nomad import FakeNomad
from evalbus.testing.pipeline import eventually
from evalbus_contracts import (
    Artifact,
    CasePlan,
    CaseRequested,
    CaseSpec,
    CommandHarness,
    ComputeSpec,
    Error,
    Infra,
    Measured,
    ObjectRef,
    TestsPassGrader,
    batch_run_id,
)
from evalbus_dispatcher import LocalBackend, execute_case
from evalbus_dispatcher.artifacts import RunObjects
from evalbus_dispatcher.backends.base import Backend, Interactive, Observed, SandboxHandle
from evalbus_dispatcher.backends.docker import DockerTemplate, connect_docker
from evalbus_dispatcher.backends.docker_engine import DEFAULT_HOST, DockerEngine, EngineError, parse_host
from evalbus_dispatcher.backends.kubernetes import JobTemplate, KubernetesBackend
from evalbus_dispatcher.backends.nomad import NomadTemplate, connect_nomad
from evalbus_dispatcher.execute import MarkFn
from evalbus_dispatcher.screen import Declared
from evalbus_dispatcher.service import DispatcherSettings, docker_backend, kubernetes_backend, nomad_backend
from evalbus_runtime import connect, ensure_topology
from evalbus_runtime.objects import get_object
from evalbus_runtime.secrets import SecretStore
from evalbus_runtime.settings import SettingsError, load_settings

from .conftest import LiveRecord, _RecordingLive

pytestmark = pytest.mark.integration

SECRET = "k8s-canary-0d1f2e"
FAKE_NOMAD_IMAGE = "evalbus/case:test"

WAIT_FOR_GO = """
import os, sys, time
print("tick 1", flush=True)
print("progress", file=sys.stderr, flush=True)
while not os.path.exists("go"):
    time.sleep(0.02)
print("EVALBUS_RESULT {\\"answer\\": \\"went\\"}")
"""


async def _docker_host() -> str:
    """The real engine to test against; skips, saying why, when none answers."""
    host = os.environ.get("EVALBUS_TEST_DOCKER_HOST")
    if not host and not await asyncio.to_thread(os.path.exists, DEFAULT_HOST.removeprefix("unix://")):
        pytest.skip("no Docker engine: set EVALBUS_TEST_DOCKER_HOST or run one on /var/run/docker.sock "
                    "(just test-backends-live-docker)")  # fmt: skip
    host = host or DEFAULT_HOST
    engine = DockerEngine(parse_host(host))
    try:
        await engine.call("GET", "/_ping", timeout_s=5)
    except EngineError as e:
        pytest.skip(f"no Docker engine answers at {host}: {e}")
    finally:
        await engine.close()
    return host


@dataclass
class Target:
    """A backend under test and what its scenarios need from it."""

    name: str
    backend: Backend
    cluster: bool
    fake: FakeKubernetes | None = None
    add_node: Callable[[str, float, int, dict[str, str]], None] | None = None
    """Adds a node of (name, CPU cores, memory MiB, labels) — on a fake cluster only."""
    lose_node: Callable[[str], Awaitable[None]] | None = None
    """Takes a node away with what runs on it — on a fake cluster only."""
    docker: FakeDocker | None = None
    """The fake engine, on `docker-fake`."""
    nomad: FakeNomad | None = None
    """The fake agent, on `nomad`."""
    gone: Callable[[], Awaitable[bool]] | None = None
    """Whether nothing of the case is left on the backend."""
    handles: list[SandboxHandle] = field(default_factory=list)


def _kubernetes_backend(config: k8s.Configuration, namespace: str, image: str, poll_s: float) -> KubernetesBackend:
    api = k8s.ApiClient(config)
    runner = (sys.executable, "-m", "evalbus.runner") if image == DEFAULT_IMAGE else ("python", "-m", "evalbus.runner")
    template = JobTemplate(namespace=namespace, image=image, runner_command=runner, start_timeout_s=60.0)
    return KubernetesBackend(api, template, slots=4, poll_s=poll_s)


@contextlib.asynccontextmanager
async def open_target(name: str, tmp_path: Path) -> AsyncIterator[Target]:
    """The backend `name` ready for a scenario (skipped, saying why, when it cannot run here)."""
    if name == "local":
        environ = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "EVALBUS_SECRET_API_KEY": SECRET}
        local = LocalBackend(slots=4, root=tmp_path, secrets=SecretStore(environ), environ=environ, kill_grace_s=0.5)

        async def local_gone() -> bool:
            return not await asyncio.to_thread(lambda: any(tmp_path.iterdir()))

        yield Target("local", local, cluster=False, gone=local_gone)
    elif name == "kubernetes":
        async with FakeKubernetes() as fake:
            fake.add_node("node-a", cpu=2, memory="2Gi", labels={"zone": "a"})
            fake.add_secret("api-key", {"value": SECRET})
            config = k8s.Configuration()
            config.host = fake.url
            backend = _kubernetes_backend(config, "evalbus", DEFAULT_IMAGE, poll_s=0.05)

            async def fake_gone() -> bool:
                return not fake.jobs and not fake.pods

            try:
                yield Target(
                    "kubernetes",
                    backend,
                    cluster=True,
                    fake=fake,
                    gone=fake_gone,
                    add_node=lambda n, cpu, mb, labels: fake.add_node(n, cpu=cpu, memory=f"{mb}Mi", labels=labels),
                    lose_node=fake.lose_node,
                )
            finally:
                await backend.close()
            assert fake.violations == [], fake.violations
    elif name == "nomad":
        async with FakeNomad() as agent:
            agent.add_node("node-a", cpu_mhz=2000, memory_mb=2048, meta={"zone": "a"})
            agent.set_variable("evalbus/secrets/api-key", value=SECRET)
            template = NomadTemplate(image=FAKE_NOMAD_IMAGE, runner_command=(sys.executable, "-m", "evalbus.runner"),
                                     start_timeout_s=60.0)  # fmt: skip
            nomad_backend = connect_nomad(template, address=agent.url, slots=4, poll_s=0.05)

            async def nomad_gone() -> bool:
                return not agent.jobs and not agent.allocs

            try:
                yield Target(
                    "nomad",
                    nomad_backend,
                    cluster=True,
                    gone=nomad_gone,
                    add_node=lambda n, cpu, mb, meta: agent.add_node(
                        n, cpu_mhz=int(cpu * 1000), memory_mb=mb, meta=meta
                    ),
                    lose_node=agent.lose_node,
                    nomad=agent,
                )
            finally:
                await nomad_backend.close()
            assert agent.violations == [], agent.violations
    elif name == "nomad-live":
        address = os.environ.get("EVALBUS_TEST_NOMAD_ADDR")
        if not address:
            pytest.skip("no real Nomad: set EVALBUS_TEST_NOMAD_ADDR (just test-backends-live-nomad)")
        template = NomadTemplate(image=os.environ.get("EVALBUS_TEST_IMAGE", "evalbus/case:latest"))
        live_nomad = connect_nomad(template, address=address, token_value=os.environ.get("NOMAD_TOKEN"), poll_s=0.5)
        try:
            yield Target("nomad-live", live_nomad, cluster=True)
        finally:
            await live_nomad.close()
    elif name == "kubernetes-live":
        kubeconfig = os.environ.get("EVALBUS_TEST_KUBECONFIG")
        if not kubeconfig:
            pytest.skip("no real cluster: set EVALBUS_TEST_KUBECONFIG (just test-backends-live)")
        config = k8s.Configuration()
        k8s_config.load_kube_config(config_file=kubeconfig, client_configuration=config)  # type: ignore[no-untyped-call]
        image = os.environ.get("EVALBUS_TEST_IMAGE", "evalbus/case:latest")
        namespace = os.environ.get("EVALBUS_TEST_NAMESPACE", "default")
        backend = _kubernetes_backend(config, namespace, image, poll_s=0.5)
        try:
            yield Target("kubernetes-live", backend, cluster=True)
        finally:
            await backend.close()
    elif name == "docker-fake":
        async with FakeDocker(ncpu=2, mem_total=2 * 1024**3, labels=["zone=a"]) as engine:
            store = SecretStore({"EVALBUS_SECRET_API_KEY": SECRET})
            runner = (sys.executable, "-m", "evalbus.runner")
            docker_template = DockerTemplate(
                image=DEFAULT_IMAGE, runner_command=runner, start_timeout_s=60.0, stats_interval_s=0.2
            )
            docker = connect_docker(docker_template, store, host=engine.host, slots=4)

            async def docker_gone() -> bool:
                return not engine.containers

            async def containers_lost(_node: str) -> None:
                await engine.remove_all()

            try:
                yield Target(
                    "docker-fake", docker, cluster=True, docker=engine, gone=docker_gone, lose_node=containers_lost
                )
            finally:
                await docker.close()
            assert engine.violations == [], engine.violations
    else:
        host = await _docker_host()
        store = SecretStore({"EVALBUS_SECRET_API_KEY": SECRET})
        docker_template = DockerTemplate(image=os.environ.get("EVALBUS_TEST_IMAGE", "evalbus/case:latest"))
        docker = connect_docker(docker_template, store, host=host, slots=4)
        try:
            yield Target("docker", docker, cluster=True)
        finally:
            await docker.close()


BACKENDS = ["local", "kubernetes", "nomad", "docker-fake", "kubernetes-live", "nomad-live", "docker"]


@pytest.fixture(params=BACKENDS)
async def target(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Target]:
    """Every backend."""
    async with open_target(request.param, tmp_path) as found:
        yield found


@pytest.fixture(params=["kubernetes", "nomad", "docker-fake", "kubernetes-live", "nomad-live", "docker"])
async def cluster(request: pytest.FixtureRequest, tmp_path: Path) -> AsyncIterator[Target]:
    """The backends with an orchestrator (images, memory limits, scheduling)."""
    async with open_target(request.param, tmp_path) as found:
        yield found


@pytest.fixture
def make(request: pytest.FixtureRequest) -> Callable[..., CaseRequested]:
    batch = "bb-" + request.node.name.replace("[", "-").replace("]", "")[-40:]
    callspec = getattr(request.node, "callspec", None)
    on = set(callspec.params.values()) if callspec is not None else set()
    python = "python" if on & {"kubernetes-live", "nomad-live", "docker"} else sys.executable  # the image's own

    def build(code: str, **kw: Any) -> CaseRequested:
        case_id = kw.pop("case_id", "c1")
        return CaseRequested(
            batch_id=batch,
            case_id=case_id,
            run_id=batch_run_id(batch, case_id, None),
            case=CaseSpec(
                id=case_id, input="6 x 7?", graders=kw.pop("graders", ()), timeout_s=kw.pop("timeout_s", None)
            ),
            harness=CommandHarness(
                id="agent",
                command=(python, "harness.py"),
                files={"harness.py": code},
                secret_env=kw.pop("secret_env", {}),
                compute=kw.pop("compute", ComputeSpec(cpu=0.5, memory_mb=256)),
            ),
            plan=CasePlan(suite_id="suite", submitted_by="alice"),
        )

    return build


async def run(
    target: Target,
    req: CaseRequested,
    records: list[LiveRecord],
    *,
    during: Callable[[SandboxHandle, MarkFn], Coroutine[Any, Any, None]] | None = None,
    objects: RunObjects | None = None,
) -> Any:
    async def on_sandbox(handle: SandboxHandle, mark: MarkFn, _declared: Declared) -> Any:
        target.handles.append(handle)
        if isinstance(handle, Observed):
            handle.observe(mark)
        task = asyncio.create_task(during(handle, mark)) if during is not None else None

        async def detach() -> None:
            if task is not None:
                await task

        return detach

    return await execute_case(
        req, target.backend, live=_RecordingLive(records), on_release=lambda: None, on_sandbox=on_sandbox,
        sample_interval_s=0.5, objects=objects,
    )  # fmt: skip


def marks(records: list[LiveRecord]) -> list[Infra]:
    return [r[1] for r in records if r[0] == "infra"]


def log_text(records: list[LiveRecord]) -> str:
    return "\n".join(v[1] for k, v in records if k == "log")


async def test_success_grades_in_the_sandbox_and_releases(target: Target, make: Callable[..., CaseRequested]) -> None:
    code = f"""
import os, sys
print("run", os.environ["EVALBUS_RUN_ID"], "secret", os.environ.get("API_KEY") == {SECRET!r})
print("on stderr", file=sys.stderr)
open("answer.txt", "w").write(sys.stdin.read())
print('EVALBUS_RESULT {{"answer": "42"}}')
"""
    req = make(
        code, secret_env={"API_KEY": "api-key"}, graders=(TestsPassGrader(id="t", command="grep -q 7 answer.txt"),)
    )
    records: list[LiveRecord] = []
    done = await run(target, req, records)
    assert done.status == "succeeded", done.result.failure
    assert done.result.answer == "42"
    assert isinstance(done.result.scores[0], Measured)
    assert done.result.scores[0].passed
    text = log_text(records)
    assert f"run {req.run_id} secret True" in text
    assert "on stderr" in text
    assert SECRET not in text
    events = [m.event for m in marks(records)]
    assert events[0] == "accepted"
    assert events[-1] == "released"
    assert "placed" in events
    if target.cluster:
        placed = next(m for m in marks(records) if m.event == "placed")
        assert placed.node is not None
        assert placed.node in placed.message
        assert "scheduled" in events
        assert "submitted" in events
    assert target.gone is None or await target.gone()


async def test_nonzero_exit_fails_with_the_log_tail(target: Target, make: Callable[..., CaseRequested]) -> None:
    req = make("import sys\nprint('boom on stderr', file=sys.stderr)\nsys.exit(3)\n")
    done = await run(target, req, [])
    failure = done.result.failure
    assert failure is not None
    assert failure.code == "exit_nonzero"
    assert done.result.exit_code == 3
    assert "boom on stderr" in (failure.log_tail or "")


async def test_timeout_kills_the_harness(target: Target, make: Callable[..., CaseRequested]) -> None:
    req = make("import time\nprint('sleeping', flush=True)\ntime.sleep(60)\n", timeout_s=1.0)
    done = await run(target, req, [])
    failure = done.result.failure
    assert failure is not None
    assert failure.code == "timeout"
    assert done.result.exit_code == 124


async def test_logs_while_running_then_exec_and_shell(target: Target, make: Callable[..., CaseRequested]) -> None:
    records: list[LiveRecord] = []
    seen: dict[str, Any] = {}
    measures_memory = target.name in ("local", "nomad", "docker-fake")  # procfs, allocation stats, engine stats

    def samples() -> list[Any]:
        return [r[1] for r in records if r[0] == "placement"]

    async def during(handle: SandboxHandle, _mark: MarkFn) -> None:
        await eventually(lambda: "tick 1" in log_text(records), timeout_s=60, what="the live log while it runs")
        assert isinstance(handle, Interactive)
        seen["exec"] = await handle.exec_live("echo from-exec key=$API_KEY; ls harness.py", 30, cap_bytes=4096)
        out: list[bytes] = []

        async def collect(data: bytes) -> None:
            out.append(data)

        shell = await handle.open_shell(80, 24, collect)
        shell.write(b"KEPT=state-42\n")
        shell.write(b"echo kept:$KEPT\n")
        await eventually(lambda: b"kept:state-42" in b"".join(out), timeout_s=30, what="the shell keeps its state")
        if measures_memory:  # a sample of the running harness with its memory, before it may end
            await eventually(lambda: any(s.rss_bytes for s in samples()), timeout_s=30, what="a sample with RSS")
        shell.write(b"touch go; exit\n")
        seen["shell"] = await shell.wait()

    done = await run(target, make(WAIT_FOR_GO, secret_env={"API_KEY": "api-key"}), records, during=during)
    assert done.status == "succeeded", done.result.failure
    assert done.result.answer == "went"
    if measures_memory:
        assert any(s.rss_bytes for s in samples()), samples()
    live_exec = seen["exec"]
    assert live_exec.exit_code == 0
    assert "from-exec key=[redacted]" in live_exec.stdout  # the secret is there, and masked
    assert SECRET not in live_exec.stdout
    assert "harness.py" in live_exec.stdout


async def test_cancel_kills_and_releases(target: Target, make: Callable[..., CaseRequested]) -> None:
    records: list[LiveRecord] = []
    task = asyncio.create_task(run(target, make(WAIT_FOR_GO), records))
    await eventually(lambda: "tick 1" in log_text(records), timeout_s=60, what="the harness to run")
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert target.gone is None or await target.gone()
    if target.fake is not None:
        assert target.fake.deletions[-1][1] == "Background"
        assert target.fake.watches >= 1  # the pod is watched, not only polled
    if target.docker is not None:
        assert target.docker.removals[-1][1] is True  # removed with force, while it ran


async def test_network_none_cuts_the_case_off_or_is_refused(target: Target, make: Callable[..., CaseRequested]) -> None:
    offline = ComputeSpec(cpu=0.5, memory_mb=256, network="none")
    cases = [make('print(\'EVALBUS_RESULT {"answer": "offline"}\')', case_id=c, compute=offline) for c in ("n1", "n2")]
    if not target.cluster:  # a local process cannot be cut off: refused, never run with the network
        done = await run(target, cases[0], [])
        failure = done.result.failure
        assert failure is not None
        assert (failure.code, failure.failure_class, failure.retryable) == ("network_isolation_unsupported", "config",
                                                                            False)  # fmt: skip
        assert "docker, kubernetes or nomad" in failure.message
        assert target.gone is None or await target.gone()
        return
    finished = await asyncio.gather(*(run(target, req, []) for req in cases))  # provisioned together
    for done in finished:
        assert done.status == "succeeded", done.result.failure
        assert done.result.answer == "offline"
    if target.docker is not None:
        assert [body["HostConfig"]["NetworkMode"] for body in target.docker.created] == ["none", "none"]
    if target.nomad is not None:
        for job in target.nomad.registered:
            group = job["TaskGroups"][0]
            assert group["Networks"] == [{"Mode": "none"}]
            assert group["Tasks"][0]["Config"]["network_mode"] == "none"
    if target.fake is not None:
        labels = [job["spec"]["template"]["metadata"]["labels"] for job in target.fake.created_jobs]
        assert [pod.get("evalbus.dev/network") for pod in labels] == ["none", "none"]
        assert list(target.fake.network_policies) == [("evalbus", "evalbus-network-none")]
        policy = target.fake.network_policies[("evalbus", "evalbus-network-none")]["spec"]
        assert policy == {"podSelector": {"matchLabels": {"evalbus.dev/network": "none"}},
                          "policyTypes": ["Ingress", "Egress"]}  # fmt: skip
        created = [r for r in target.fake.requests if r[0] == "POST" and r[1].endswith("/networkpolicies")]
        assert created == [("POST", "/apis/networking.k8s.io/v1/namespaces/evalbus/networkpolicies")]  # once
    assert target.gone is None or await target.gone()


FILING_HARNESS = """
import json, os
os.makedirs("out/deep", exist_ok=True)
open("out/report.html", "w").write("<h1>report</h1>\\n")
open("out/big.bin", "wb").write(bytes(range(256)) * 6144)  # 1.5 MiB: several blocks on every path
open("out/huge.bin", "wb").write(b"x" * (3 * 1024 * 1024))  # over the cap the test sets
open("empty.txt", "w").close()
open("../outside.txt", "w").write("next to the workdir")
os.symlink("../outside.txt", "link.txt")
for name, ref in [("report", "out/report.html"), ("big", "./out//big.bin"), ("empty", "empty.txt"),
                  ("huge", "out/huge.bin"), ("gone", "out/missing.html"), ("folder", "out/deep"),
                  ("link", "link.txt"), ("escape", "../outside.txt")]:
    print("EVALBUS_EVENT " + json.dumps({"kind": "artifact", "name": name, "ref": ref}), flush=True)
print('EVALBUS_RESULT {"answer": "filed"}')
"""
FILED = {
    "report": ("out/report.html", b"<h1>report</h1>\n"),
    "big": ("out/big.bin", bytes(range(256)) * 6144),
    "empty": ("empty.txt", b""),
}
REFUSED = {
    "huge": "more than the 2097152 bytes a declared file may have",
    "gone": "no such file in the workdir",
    "folder": "not a regular file inside the workdir",
    "link": "not a regular file inside the workdir",
    "escape": "the path must be relative, stay inside the workdir",
}


@pytest.fixture
async def run_objects(nats_server: NatsServer) -> AsyncIterator[RunObjects]:
    """The `artifacts` bucket of the session's nats-server, files capped at 2 MiB."""
    nc = await connect(nats_server.url, "behaviour-artifacts")
    await ensure_topology(nc.jetstream())
    yield RunObjects(nc.jetstream(), max_file_bytes=2 * 1024 * 1024)
    await nc.close()


async def test_declared_files_are_stored_from_the_sandbox(
    target: Target, make: Callable[..., CaseRequested], run_objects: RunObjects
) -> None:
    req = make(FILING_HARNESS)
    done = await run(target, req, [], objects=run_objects)
    assert done.status == "succeeded", done.result.failure
    assert done.result.answer == "filed"
    trace = done.result.trace
    stored = {e.name: e for e in trace if isinstance(e, Artifact) and e.sha256 is not None}
    assert sorted(stored) == sorted(FILED)
    for name, (path, data) in FILED.items():
        event = stored[name]
        assert event.sha256 is not None
        assert event.ref == f"artifacts/runs/{req.run_id}/a1/files/{path}"
        assert (event.size, event.sha256) == (len(data), hashlib.sha256(data).hexdigest())
        ref = ObjectRef(bucket="artifacts", name=event.ref.partition("/")[2], size=len(data), sha256=event.sha256)
        assert await get_object(run_objects.js, ref) == data
    errors = [e.message for e in trace if isinstance(e, Error)]
    for name, reason in REFUSED.items():
        said = [m for m in errors if m.startswith(f"artifact {name!r} ")]
        assert len(said) == 1, (name, errors)
        assert reason in said[0], said[0]
    kept = [e.name for e in trace if isinstance(e, Artifact) and e.sha256 is None]
    assert sorted(kept) == sorted(REFUSED)  # the declarations not honoured stay as they were
    if target.docker is not None:  # the stopped container's archive, one per path the rules let through
        paths = [p for _, p in target.docker.archives]
        assert len(paths) == 7  # every path the rules let through
        assert "/evalbus/work/out/big.bin" in paths
    if target.nomad is not None:  # stat, then cat for one block, readat by offset for more
        reads = target.nomad.fs_requests
        assert ("stat", "case/local/work/out/big.bin") in reads
        assert ("cat", "case/local/work/out/report.html") in reads
        assert [p for kind, p in reads if kind == "readat"] == ["case/local/work/out/big.bin"] * 2
    if target.fake is not None:  # the runner held the pod: each file an exec of it, then the hold ended
        sends = [c for c in target.fake.exec_commands if "--send-file" in c]
        assert len(sends) == 7  # every path the rules let through
        ended = [c for c in target.fake.exec_commands if c[:2] == ["/bin/sh", "-c"] and c[2].startswith("kill -USR1 ")]
        assert len(ended) == 1
    assert target.gone is None or await target.gone()


async def test_declared_files_are_not_collected_from_an_unheld_pod(
    make: Callable[..., CaseRequested], run_objects: RunObjects
) -> None:
    async with FakeKubernetes() as fake:
        fake.add_node("node-a", cpu=2, memory="2Gi")
        config = k8s.Configuration()
        config.host = fake.url
        template = JobTemplate(namespace="evalbus", image=DEFAULT_IMAGE, runner_command=(sys.executable, "-m",
                               "evalbus.runner"), start_timeout_s=60.0, artifact_hold_s=0)  # fmt: skip
        backend = KubernetesBackend(k8s.ApiClient(config), template, poll_s=0.05)
        target = Target("kubernetes", backend, cluster=True, fake=fake)
        try:
            done = await run(target, make(FILING_HARNESS), [], objects=run_objects)
        finally:
            await backend.close()
        assert done.status == "succeeded", done.result.failure
        errors = [e.message for e in done.result.trace if isinstance(e, Error) and "'report'" in e.message]
        assert errors == [
            "artifact 'report' (out/report.html) not stored: the pod ended before its files could be read: the "
            "Job's artifact hold is off (artifact_hold_s 0)"
        ]
        assert fake.exec_commands == []
        assert fake.violations == []


# ---------------------------------------------------------------- orchestrator scenarios


async def test_image_pull_failure_fails_fast_with_evidence(cluster: Target, make: Callable[..., CaseRequested]) -> None:
    req = make("print('never')", compute=ComputeSpec(image="evalbus/no-such-image:0", cpu=0.5, memory_mb=256))
    done = await run(cluster, req, [])
    failure = done.result.failure
    assert failure is not None
    assert failure.code == "spawn_failed"
    assert re.search("ErrImagePull|ImagePullBackOff|Failed to pull", failure.message), failure.message
    evidence = "\n".join(m.message for m in failure.placement.events if m.event in ("pod", "task", "engine"))
    assert "Failed to pull" in evidence
    assert failure.placement.node is not None
    assert cluster.gone is None or await cluster.gone()  # the Job is deleted; the evidence stayed


async def test_oom_kill_is_read_from_the_container_status(cluster: Target, make: Callable[..., CaseRequested]) -> None:
    hog = (
        "import time\nblocks = []\nwhile True:\n    blocks.append(bytearray(16 * 1024 * 1024))\n    time.sleep(0.01)\n"
    )
    done = await run(cluster, make(hog, compute=ComputeSpec(cpu=0.5, memory_mb=96)), [])
    failure = done.result.failure
    assert failure is not None
    assert failure.code == "oom", failure
    assert done.result.exit_code == 137


async def test_blocked_then_placed(cluster: Target, make: Callable[..., CaseRequested]) -> None:
    add_node = cluster.add_node
    if add_node is None:
        pytest.skip("needs a cluster the test can add a node to (a fake)")
    add_node("node-b", 1, 1024, {"zone": "b"})
    in_zone_b = ComputeSpec(cpu=1, memory_mb=256, node_selector={"zone": "b"})
    first: list[LiveRecord] = []
    holder = asyncio.create_task(run(cluster, make(WAIT_FOR_GO, case_id="holder", compute=in_zone_b), first))
    await eventually(lambda: "tick 1" in log_text(first), timeout_s=60, what="the first case to hold node-b")
    records: list[LiveRecord] = []
    waiting = asyncio.create_task(
        run(cluster, make("print('placed at last')", case_id="waiter", compute=in_zone_b), records)
    )

    def blocked() -> bool:
        return any(
            m.event == "waiting" and re.search("Insufficient cpu|cpu exhausted", m.message) for m in marks(records)
        )

    await eventually(blocked, timeout_s=30, what="a blocked mark with the scheduler's message")
    waiter = cluster.handles[-1]
    assert isinstance(waiter, Observed)
    where = await waiter.placement()  # read from the orchestrator now, normalised
    assert where.phase == "blocked"
    assert where.reason is not None
    assert re.search("Insufficient cpu|cpu exhausted", where.reason)
    add_node("node-b2", 1, 1024, {"zone": "b"})
    done = await waiting
    assert done.status == "succeeded", done.result.failure
    assert done.result.answer == "placed at last"
    scheduled = [m.message for m in marks(records) if m.event == "scheduled"]
    assert len(scheduled) == 1
    assert "node-b2" in scheduled[0]
    holding = cluster.handles[0]
    assert isinstance(holding, Interactive)
    await holding.exec_live("touch go", 30, cap_bytes=1024)
    assert (await holder).status == "succeeded"


async def test_a_node_lost_mid_run_is_a_retryable_infrastructure_failure(
    cluster: Target, make: Callable[..., CaseRequested]
) -> None:
    lose_node = cluster.lose_node
    if lose_node is None:
        pytest.skip("needs a cluster the test can take a node from (a fake)")
    records: list[LiveRecord] = []
    task = asyncio.create_task(run(cluster, make(WAIT_FOR_GO), records))
    await eventually(lambda: "tick 1" in log_text(records), timeout_s=60, what="the harness to run")
    await lose_node("node-a")
    done = await task
    failure = done.result.failure
    assert failure is not None
    assert (failure.code, failure.failure_class, failure.retryable) == ("unit_lost", "infra", True)
    assert "tick 1" in (failure.log_tail or "")
    assert cluster.gone is None or await cluster.gone()


async def test_a_case_no_node_can_fit_fails_at_once(cluster: Target, make: Callable[..., CaseRequested]) -> None:
    done = await run(cluster, make("print(1)", compute=ComputeSpec(cpu=512, memory_mb=256)), [])
    failure = done.result.failure
    assert failure is not None
    assert failure.code == "unschedulable"
    assert not failure.retryable
    assert "cpu=512" in failure.message
    elsewhere = await run(cluster, make("print(1)", compute=ComputeSpec(cpu=0.5, node_selector={"zone": "mars"})), [])
    assert elsewhere.result.failure is not None
    assert elsewhere.result.failure.code == "unschedulable"
    assert "mars" in elsewhere.result.failure.message


# ---------------------------------------------------------------- settings


async def test_settings_select_the_kubernetes_backend_from_a_kubeconfig(tmp_path: Path) -> None:
    async with FakeKubernetes() as fake:
        fake.add_node("node-a", cpu=2, memory="2Gi")
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters: [{{name: fake, cluster: {{server: '{fake.url}'}}}}]\n"
            "users: [{name: me, user: {token: not-a-real-token}}]\n"
            "contexts: [{name: fake, context: {cluster: fake, user: me}}]\n"
        )
        environ = {"DISPATCHER_BACKEND": "kubernetes", "KUBECONFIG": str(kubeconfig), "DISPATCHER_SLOTS": "3"}
        settings = load_settings(DispatcherSettings, "dispatcher", environ)
        backend = kubernetes_backend(settings)
        try:
            assert backend.template.namespace == "evalbus"
            assert backend.access.headers == {"Authorization": "Bearer not-a-real-token"}
            assert backend.capacity().total == 3
            assert await backend.room(ComputeSpec(cpu=0.5, memory_mb=256)) == 4  # 2 CPUs / 0.5
        finally:
            await backend.close()
        assert fake.violations == []
    with pytest.raises(SettingsError, match="backend"):
        load_settings(DispatcherSettings, "dispatcher", {"DISPATCHER_BACKEND": "nomad-ish"})


async def test_settings_select_the_nomad_backend() -> None:
    async with FakeNomad() as agent:
        agent.add_node("node-a", cpu_mhz=3000, memory_mb=2048)
        environ = {"DISPATCHER_BACKEND": "nomad", "NOMAD_ADDR": agent.url, "NOMAD_TOKEN": "acl-canary-77"}
        settings = load_settings(DispatcherSettings, "dispatcher", environ)
        assert "acl-canary-77" not in repr(settings)
        backend = nomad_backend(settings)
        try:
            assert backend.headers() == {"X-Nomad-Token": "acl-canary-77"}
            assert await backend.node_resources() == [("node-a", 3000, 2048)]
        finally:
            await backend.close()
        assert agent.violations == []


async def test_settings_select_the_docker_backend_over_tcp() -> None:
    async with FakeDocker(ncpu=4, mem_total=8 * 1024**3, name="engine-b") as engine:
        environ = {"DISPATCHER_BACKEND": "docker", "DOCKER_HOST": engine.tcp_host, "DISPATCHER_DOCKER_NETWORK": "none",
                   "DISPATCHER_SLOTS": "3"}  # fmt: skip
        settings = load_settings(DispatcherSettings, "dispatcher", environ)
        backend = docker_backend(settings, SecretStore({}))
        try:
            assert backend.engine.address.kind == "tcp"
            assert backend.template.network == "none"
            assert backend.capacity().total == 3
            assert await backend.room(ComputeSpec(cpu=0.5, memory_mb=256)) == 8  # 4 CPUs / 0.5
        finally:
            await backend.close()
        assert engine.requests == [("GET", "/_ping"), ("GET", "/v1.43/info")]
        assert engine.violations == []
    with pytest.raises(ValueError, match="DOCKER_HOST"):
        docker_backend(load_settings(DispatcherSettings, "dispatcher", {"DOCKER_HOST": "ssh://box"}), SecretStore({}))
