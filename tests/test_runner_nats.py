"""The in-job runner publishing its live log and trace straight to NATS (`RunnerJob.live`), against
real nats-servers: the runner itself, and the cluster backends on their protocol-level fakes (which
run the real runner as a local process) with the dispatcher's own `LiveBus`, on the deployment's
accounts — each runner logs in with its run's token (tests/test_runner_auth.py: what that user may
do); the live lines arrive once, published by the runner, the result unchanged; an unreachable
server or a refused token leaves the live view to the job log as before; the token is in the job
spec only, never in a live message, an event or a line the runner prints.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import sys
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import nats
import nats.errors
import pytest
from kubernetes import client as k8s
from nats.aio.msg import Msg
from prometheus_client import generate_latest
from tests.test_deploy_nats_live import SecureNats, connect_as, running, start_secure_nats
from tests.test_runner_auth import answering

from evalbus.infra import nats_accounts
from evalbus.infra.nats import NatsServer
from evalbus.infra.ports import free_port
from evalbus.runner import live as runner_live_module
from evalbus.runner.run import REDACTED, run_job
from evalbus.testing.fake_docker import FakeDocker
from evalbus.testing.fake_kubernetes import DEFAULT_IMAGE, FakeKubernetes
from evalbus.testing.fake_nomad import FakeNomad
from evalbus.testing.pipeline import eventually
from evalbus_contracts import (
    CaseExecuted,
    CasePlan,
    CaseRequested,
    CaseSpec,
    CommandHarness,
    ComputeSpec,
    Event,
    InfraMark,
    LiveLog,
    LiveTrace,
    Message,
    TraceEvent,
    batch_run_id,
    decode_event,
    encode,
)
from evalbus_contracts.runner import JOB_ENV, RunnerJob, RunnerLive, Started, read_line
from evalbus_contracts.subjects import live_filter
from evalbus_dispatcher import execute_case
from evalbus_dispatcher import live as dispatcher_live
from evalbus_dispatcher.backends.base import Backend
from evalbus_dispatcher.backends.docker import DockerTemplate, connect_docker
from evalbus_dispatcher.backends.job_spec import LiveHandoffs, RunnerNats
from evalbus_dispatcher.backends.kubernetes import JobTemplate, KubernetesBackend
from evalbus_dispatcher.backends.nomad import NomadTemplate, connect_nomad
from evalbus_dispatcher.harness_output import parse_line
from evalbus_dispatcher.live_bus import LiveBus
from evalbus_dispatcher.runner_auth import TOKEN_MARGIN_S, RunTokens
from evalbus_dispatcher.service import DispatcherSettings, build_dispatcher
from evalbus_runtime import Publisher, Service, ensure_topology
from evalbus_runtime.nkeys import AccountKey
from evalbus_runtime.secrets import SecretStore

pytestmark = [pytest.mark.integration]

HARNESS = """
import os, sys
print("line one")
print("on stderr", file=sys.stderr, flush=True)
print('EVALBUS_EVENT {"kind": "message", "role": "assistant", "text": "thinking", "t": 0.25}')
print("the key is", os.environ.get("API_KEY"))
print("job spec seen:", os.environ.get("EVALBUS_JOB"))
print('EVALBUS_RESULT {"answer": "42"}')
print("line two")
"""
STDOUT_LINES = ["line one", f"the key is {REDACTED}", "job spec seen: None", "line two"]
"""The harness's live stdout log: control lines left out, the secret masked, no job spec (nor its
run token) in its environment."""
API_KEY = "api-key-value-5e1c"


@pytest.fixture(scope="module")
def secure(tmp_path_factory: pytest.TempPathFactory) -> Any:
    with start_secure_nats(tmp_path_factory.mktemp("secure-nats")) as server:
        yield server


async def _topology(server: SecureNats) -> None:
    async with connect_as(server, "admin") as (nc, _):
        await ensure_topology(nc.jetstream())


# ---------------------------------------------------------------- the runner itself


def runner_job(url: str, **live: Any) -> RunnerJob:
    return RunnerJob(
        run_id=f"evb-runner-{uuid.uuid4().hex[:8]}",
        case_id="c1",
        batch_id="b1",
        attempt=2,
        command=(sys.executable, "harness.py"),
        files={"harness.py": HARNESS},
        secret_vars=("API_KEY",),
        live=RunnerLive(nats_url=url, **live),
    )


@dataclass
class Heard:
    """What a subscription to one run's live subjects received."""

    messages: list[tuple[str, Event]] = field(default_factory=list)
    raw: list[bytes] = field(default_factory=list)

    def logs(self) -> list[LiveLog]:
        return [e for _, e in self.messages if isinstance(e, LiveLog)]

    def traces(self) -> list[LiveTrace]:
        return [e for _, e in self.messages if isinstance(e, LiveTrace)]

    def log_lines(self, stream: str) -> list[str]:
        text = "".join(c.text for c in self.logs() if c.stream == stream)
        return text.split("\n")[:-1]

    def events(self) -> list[TraceEvent]:
        return [e for t in self.traces() for e in t.events]


@contextlib.asynccontextmanager
async def hearing(url: str, run_id: str) -> AsyncIterator[Heard]:
    heard = Heard()
    nc = await nats.connect(url)

    async def on_msg(msg: Msg) -> None:
        heard.raw.append(msg.data)
        heard.messages.append((msg.subject, decode_event(msg.data)))

    await nc.subscribe(live_filter(run_id), cb=on_msg)
    await nc.flush()
    try:
        yield heard
    finally:
        await nc.close()


async def run_runner(job: RunnerJob, workdir: Path, environ: dict[str, str]) -> list[str]:
    lines: list[str] = []
    await run_job(job, workdir=workdir, environ=environ, write=lines.append)
    return lines


def started_of(lines: list[str]) -> Started:
    found = [r for r in map(read_line, lines) if isinstance(r, Started)]
    assert len(found) == 1
    return found[0]


async def test_a_connected_runner_publishes_the_live_log_and_trace_as_the_dispatcher_would(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    job = runner_job(nats_server.url, execution="exec-1", offset=100, t_offset=3.0)
    environ = {"PATH": "/usr/bin:/bin", "API_KEY": API_KEY}
    async with hearing(nats_server.url, job.run_id) as heard:
        lines = await run_runner(job, tmp_path / "work", environ)

        async def all_heard() -> bool:
            return heard.log_lines("stdout") == STDOUT_LINES and bool(heard.events())

        await eventually(all_heard, timeout_s=10, what="the runner's live log and trace")
    assert started_of(lines).live == "nats"
    # the job log is as without the live view: every stdout line, every record
    plain = await run_runner(msgspec.structs.replace(job, live=None), tmp_path / "plain", environ)
    assert [line for line in lines if not line.startswith("EVALBUS_RUNNER ")] == [
        line for line in plain if not line.startswith("EVALBUS_RUNNER ")
    ]
    assert heard.log_lines("stderr") == ["on stderr"]
    logs = heard.logs()
    assert {(c.run_id, c.case_id, c.batch_id, c.attempt, c.execution) for c in logs} == {
        (job.run_id, "c1", "b1", 2, "exec-1")
    }
    # the offsets continue the run's log from where the dispatcher said it stands
    ordered = sorted(logs, key=lambda c: c.offset)
    assert ordered[0].offset == 100
    for before, after in itertools.pairwise(ordered):
        assert after.offset == before.offset + len(before.text.encode("utf-8"))
    assert [c.seq for c in logs if c.stream == "stdout"] == list(range(1, 1 + sum(c.stream == "stdout" for c in logs)))
    (event,) = heard.events()
    assert isinstance(event, Message)
    assert (event.text, event.t) == ("thinking", 3.25)  # on the run's clock
    assert [t.seq for t in heard.traces()] == [1]
    assert all(API_KEY.encode() not in raw for raw in heard.raw)
    assert all(s in (f"run.{job.run_id}.live.log", f"run.{job.run_id}.live.trace") for s, _ in heard.messages)


async def test_an_unreachable_server_leaves_the_live_view_to_the_job_log(
    nats_server: NatsServer, tmp_path: Path
) -> None:
    job = runner_job(f"nats://127.0.0.1:{free_port()}", connect_timeout_s=1.0)
    loop = asyncio.get_running_loop()
    began = loop.time()
    lines = await run_runner(job, tmp_path / "work", {"PATH": "/usr/bin:/bin", "API_KEY": API_KEY})
    assert loop.time() - began < 10
    assert started_of(lines).live == "log"
    assert "line one" in lines


async def test_a_refused_token_leaves_the_live_view_to_the_job_log_and_is_masked(
    secure: SecureNats, tmp_path: Path
) -> None:
    await _topology(secure)
    async with answering(secure):
        run = f"evb-runner-{uuid.uuid4().hex[:8]}"
        wrong = RunTokens(AccountKey.generate().token_key()).mint(run, 60)
        job = msgspec.structs.replace(
            runner_job(secure.anonymous_url(), token=wrong),
            run_id=run, env={"ECHOED": wrong}, files={"harness.py": "import os; print(os.environ['ECHOED'])"},
        )  # fmt: skip
        lines = await run_runner(job, tmp_path / "work", {"PATH": "/usr/bin:/bin"})
        assert started_of(lines).live == "log"
        assert REDACTED in lines
        assert not any(wrong in line for line in lines)

        token = RunTokens(secure.issuer.token_key()).mint(run, 60)
        right = msgspec.structs.replace(job, live=RunnerLive(nats_url=secure.anonymous_url(), token=token),
                                        files={"harness.py": HARNESS}, env={})  # fmt: skip
        async with hearing(secure.url("admin"), job.run_id) as heard:
            lines = await run_runner(right, tmp_path / "right", {"PATH": "/usr/bin:/bin", "API_KEY": API_KEY})
            await eventually(lambda: _true(heard.log_lines("stdout") == STDOUT_LINES), timeout_s=10, what="live log")
        assert started_of(lines).live == "nats"
        assert not any(token in line for line in lines)
        assert all(token.encode() not in raw for raw in heard.raw)


async def _true(value: bool) -> bool:
    return value


def test_the_runner_reads_lines_and_chunks_them_as_the_dispatchers_live_tee() -> None:
    assert runner_live_module.MAX_PENDING_BYTES == dispatcher_live.MAX_PENDING_BYTES
    assert runner_live_module.MAX_EVENT_BYTES == dispatcher_live.MAX_EVENT_BYTES
    assert runner_live_module.FLUSH_INTERVAL_S == dispatcher_live.FLUSH_INTERVAL_S
    lines = [
        "plain", "  EVALBUS_EVENT {\"kind\": \"message\", \"role\": \"user\", \"text\": \"x\"}", "EVALBUS_EVENT {torn",
        'EVALBUS_RESULT {"answer": "a"}', "EVALBUS_CDP http://127.0.0.1:9222", "EVALBUS_CDP nonsense",
        "EVALBUS_DISPLAY :99", "EVALBUS_EVENTS are words", "EVALBUS_RUNNER {}", "",
    ]  # fmt: skip
    for line in lines:
        parsed = parse_line(line)
        found = runner_live_module.classify(line)
        if parsed.kind == "event":
            assert found == parsed.event, line
        else:
            assert found is (parsed.kind == "text"), line
    # The log's chunking (and its limit) is one implementation for both: evalbus_contracts.live_text,
    # tested in services/dispatcher/tests/test_dispatcher_live.py.


# ---------------------------------------------------------------- the backends on their fakes


@dataclass
class Cluster:
    """A backend on a fake orchestrator, its runners told where NATS is."""

    backend: Backend
    bodies: Callable[[], list[Any]]
    """What the orchestrator was sent (the Jobs, jobs, create requests)."""
    violations: Callable[[], list[Any]]


@contextlib.asynccontextmanager
async def cluster_on(name: str, url: str, issuer: AccountKey, handoffs: LiveHandoffs) -> AsyncIterator[Cluster]:
    runner = RunnerNats(url=url, tokens=RunTokens(issuer.token_key()))
    argv = (sys.executable, "-m", "evalbus.runner")
    if name == "kubernetes":
        async with FakeKubernetes() as fake:
            fake.add_node("node-a", cpu=2, memory="2Gi")
            fake.add_secret("api-key", {"value": API_KEY})
            config = k8s.Configuration()
            config.host = fake.url
            template = JobTemplate(namespace="evalbus", image=DEFAULT_IMAGE, runner_command=argv,
                                   start_timeout_s=60.0, runner_nats=runner)  # fmt: skip
            backend = KubernetesBackend(k8s.ApiClient(config), template, slots=2, poll_s=0.05, live=handoffs)
            try:
                yield Cluster(backend, lambda: fake.created_jobs, lambda: fake.violations)
            finally:
                await backend.close()
    elif name == "nomad":
        async with FakeNomad() as agent:
            agent.add_node("node-a", cpu_mhz=2000, memory_mb=2048)
            agent.set_variable("evalbus/secrets/api-key", value=API_KEY)
            nomad_template = NomadTemplate(image="evalbus/case:test", runner_command=argv, start_timeout_s=60.0,
                                           runner_nats=runner)  # fmt: skip
            nomad = connect_nomad(nomad_template, address=agent.url, slots=2, poll_s=0.05, live=handoffs)
            try:
                yield Cluster(nomad, lambda: agent.registered, lambda: agent.violations)
            finally:
                await nomad.close()
    else:
        async with FakeDocker(ncpu=2, mem_total=2 * 1024**3) as engine:
            store = SecretStore({"EVALBUS_SECRET_API_KEY": API_KEY})
            docker_template = DockerTemplate(image=DEFAULT_IMAGE, runner_command=argv, start_timeout_s=60.0,
                                             stats_interval_s=0.2, runner_nats=runner)  # fmt: skip
            docker = connect_docker(docker_template, store, host=engine.host, slots=2, live=handoffs)
            try:
                yield Cluster(docker, lambda: engine.created, lambda: engine.violations)
            finally:
                await docker.close()


def case_request(name: str) -> CaseRequested:
    batch = f"b-{name}-{uuid.uuid4().hex[:6]}"
    return CaseRequested(
        batch_id=batch,
        case_id="c1",
        run_id=batch_run_id(batch, "c1", None),
        case=CaseSpec(id="c1", input="6 x 7?"),
        harness=CommandHarness(
            id="agent",
            command=(sys.executable, "harness.py"),
            files={"harness.py": HARNESS},
            secret_env={"API_KEY": "api-key"},
            compute=ComputeSpec(cpu=0.5, memory_mb=256),
        ),
        plan=CasePlan(suite_id="suite", submitted_by="alice"),
    )


async def execute_with_live(
    secure: SecureNats, name: str, url: str, handoffs: LiveHandoffs, cluster: Cluster
) -> tuple[Any, LiveBus, Heard]:
    """One case through `execute_case` with the dispatcher's own `LiveBus` on the bus (as the
    dispatcher user), every live message of the run heard."""
    req = case_request(name)
    run_id = req.run_id or ""
    async with connect_as(secure, "dispatcher") as (dnc, violations), hearing(secure.url("admin"), run_id) as heard:
        publisher = Publisher(dnc)
        bus = LiveBus(publisher, req)
        with handoffs.holding(run_id, bus):
            executed = await execute_case(req, cluster.backend, live=bus, on_release=lambda: None)

        async def released_heard() -> bool:
            return any(isinstance(e, InfraMark) and "released" in {m.event for m in e.marks} for _, e in heard.messages)

        await eventually(released_heard, timeout_s=10, what="the released mark on the live subjects")
        await publisher.stop()
        assert violations.seen == []
    return executed, bus, heard


@pytest.mark.parametrize("name", ["kubernetes", "docker", "nomad"])
async def test_the_runner_publishes_the_live_view_once_and_the_result_is_unchanged(
    secure: SecureNats, name: str
) -> None:
    await _topology(secure)
    url = secure.anonymous_url()  # no credentials in it: the runner logs in with its run's token
    handoffs = LiveHandoffs()
    async with answering(secure) as auth, cluster_on(name, url, secure.issuer, handoffs) as cluster:
        executed, bus, heard = await execute_with_live(secure, name, url, handoffs, cluster)
        assert cluster.violations() == []
        bodies = list(cluster.bodies())
    assert (auth.granted, auth.refused) == (1, 0)
    assert executed.status == "succeeded", executed.result.failure
    assert executed.result.answer == "42"
    assert bus.by_runner  # the runner said `live: nats`: the dispatcher relayed nothing itself
    assert heard.log_lines("stdout") == STDOUT_LINES  # each line once
    assert heard.log_lines("stderr") == ["on stderr"]
    assert [e.text for e in heard.events() if isinstance(e, Message)] == ["thinking"]
    assert {c.execution for c in heard.logs() + heard.traces()} == {bus.execution}
    marks = [m.event for _, e in heard.messages if isinstance(e, InfraMark) for m in e.marks]
    assert {"accepted", "placed", "exited", "released"} <= set(marks)  # the dispatcher's own, as before
    # the job spec carries the run's token (worth that run's live view, until the job's longest life
    # is over), and nothing else does: no other part of the job, no live message, no event
    (spec,) = [job_spec_of(name, body) for body in bodies]
    assert spec.live is not None
    assert spec.live.token is not None
    assert spec.live.execution == bus.execution
    run_id, exp = RunTokens(secure.issuer.token_key()).check(spec.live.token)
    assert run_id == spec.run_id
    life = exp - time.time()  # the job's longest (start timeout, harness, hold, 2 min) and the clocks' margin
    longest = 60.0 + spec.timeout_s + spec.hold_s + 120.0
    assert longest + TOKEN_MARGIN_S - 5 <= life <= longest + TOKEN_MARGIN_S + 1
    assert json.dumps(bodies).count(spec.live.token) == 1
    assert all(spec.live.token.encode() not in raw for raw in heard.raw)
    assert spec.live.token.encode() not in encode(executed)
    sealed = [e for e in executed.result.trace if isinstance(e, Message)]
    assert [e.text for e in sealed] == ["thinking"]


def job_spec_of(name: str, body: dict[str, Any]) -> RunnerJob:
    """The runner's job spec (`EVALBUS_JOB`) in what the orchestrator was sent."""
    if name == "kubernetes":
        env = body["spec"]["template"]["spec"]["containers"][0]["env"]
        raw = next(v["value"] for v in env if v["name"] == JOB_ENV)
    elif name == "nomad":
        raw = body["TaskGroups"][0]["Tasks"][0]["Env"][JOB_ENV]
    else:
        raw = next(item for item in body["Env"] if item.startswith(JOB_ENV + "=")).split("=", 1)[1]
    return msgspec.json.decode(raw, type=RunnerJob)


@pytest.mark.parametrize("name", ["kubernetes", "docker"])
async def test_an_unreachable_nats_url_falls_back_to_the_dispatcher_relaying_the_job_log(
    secure: SecureNats, name: str
) -> None:
    await _topology(secure)
    url = f"nats://127.0.0.1:{free_port()}"
    handoffs = LiveHandoffs()
    async with answering(secure), cluster_on(name, url, secure.issuer, handoffs) as cluster:
        executed, bus, heard = await execute_with_live(secure, name, url, handoffs, cluster)
        assert cluster.violations() == []
    assert executed.status == "succeeded", executed.result.failure
    assert executed.result.answer == "42"
    assert not bus.by_runner
    assert heard.log_lines("stdout") == STDOUT_LINES  # relayed by the dispatcher, once
    assert [e.text for e in heard.events() if isinstance(e, Message)] == ["thinking"]


def test_the_dispatcher_settings_for_the_runners_nats() -> None:
    assert DispatcherSettings(runner_nats_url="nats://nats.evalbus:4222").runner_nats() == RunnerNats(
        url="nats://nats.evalbus:4222"
    )
    seed = AccountKey.generate().seed
    with_auth = DispatcherSettings(
        runner_nats_url="nats://nats.evalbus:4222", runner_auth_url="nats://runner-auth:pw@nats:4222",
        runner_auth_seed=seed,
    )  # fmt: skip
    nats = with_auth.runner_nats()
    assert nats is not None
    assert nats.tokens == RunTokens(AccountKey.from_seed(seed).token_key())
    assert seed not in repr(with_auth)
    assert "pw@" not in repr(with_auth)
    assert DispatcherSettings().runner_nats() is None  # off by default
    with pytest.raises(ValueError, match="DISPATCHER_RUNNER_AUTH_SEED: needed"):
        DispatcherSettings(runner_auth_url="nats://runner-auth:pw@nats:4222")
    with pytest.raises(ValueError, match="DISPATCHER_RUNNER_AUTH_URL: needed"):
        DispatcherSettings(runner_auth_seed=seed)
    with pytest.raises(ValueError, match="DISPATCHER_RUNNER_AUTH_SEED: not an account seed"):
        DispatcherSettings(runner_auth_url="nats://x:y@nats:4222", runner_auth_seed=AccountKey.generate().public)
    with pytest.raises(ValueError, match="DISPATCHER_RUNNER_NATS_SECRET: the runners' shared NATS password is gone"):
        DispatcherSettings(runner_nats_url="nats://nats:4222", runner_nats_secret="runner-nats")
    with pytest.raises(ValueError, match="DISPATCHER_RUNNER_NATS_URL: no password"):
        DispatcherSettings(runner_nats_url="nats://runner:hunter2@nats:4222")
    with pytest.raises(ValueError, match="DISPATCHER_RUNNER_NATS_URL"):
        DispatcherSettings(runner_nats_url="http://nats:4222")


async def test_the_dispatcher_service_hands_the_live_view_to_the_runner(secure: SecureNats, tmp_path: Path) -> None:
    """The wiring, as deployed: a Kubernetes dispatcher (the fake cluster) with its own user,
    `DISPATCHER_RUNNER_NATS_URL` without credentials and `DISPATCHER_RUNNER_AUTH_URL` / `_SEED` —
    it answers its runners' logins itself; a case published on the bus runs, its live log arrives
    once, from the runner, and `case.executed` follows."""
    await _topology(secure)
    async with FakeKubernetes() as fake:
        fake.add_node("node-a", cpu=2, memory="2Gi")
        fake.add_secret("api-key", {"value": API_KEY})
        kubeconfig = tmp_path / "kubeconfig"
        kubeconfig.write_text(
            "apiVersion: v1\nkind: Config\ncurrent-context: fake\n"
            f"clusters: [{{name: fake, cluster: {{server: '{fake.url}'}}}}]\n"
            "users: [{name: me, user: {}}]\ncontexts: [{name: fake, context: {cluster: fake, user: me}}]\n"
        )
        settings = DispatcherSettings(
            service="dispatcher", nats_url=secure.url("dispatcher"), http_port=0, backend="kubernetes",
            kubeconfig=str(kubeconfig), image=DEFAULT_IMAGE, cluster_poll_s=0.05, slots=1, slots_from_room=False,
            workdir_root=str(tmp_path / "work"), runner_nats_url=secure.anonymous_url(),
            runner_auth_url=secure.url(nats_accounts.RUNNER_AUTH_USER), runner_auth_seed=secure.issuer.seed,
        )  # fmt: skip
        service = Service(settings)
        build_dispatcher(service, settings)
        req = case_request("service")
        run_id = req.run_id or ""
        async with running(service), hearing(secure.url("admin"), run_id) as heard:
            nc = await nats.connect(secure.url("admin"))
            executed: asyncio.Queue[Event] = asyncio.Queue()

            async def on_executed(msg: Msg) -> None:
                await executed.put(decode_event(msg.data))

            await nc.subscribe(f"case.executed.{req.batch_id}.>", cb=on_executed)
            publisher = Publisher(nc)
            await publisher.publish_event(req)
            done = await asyncio.wait_for(executed.get(), 60)
            await publisher.stop()
            await nc.close()
            await eventually(
                lambda: _true(heard.log_lines("stdout") == STDOUT_LINES), timeout_s=10, what="the live log"
            )
        assert isinstance(done, CaseExecuted)
        assert done.status == "succeeded", done.result.failure
        assert done.result.answer == "42"
        (spec,) = [job_spec_of("kubernetes", job) for job in fake.created_jobs]
        assert spec.live is not None
        assert spec.live.token is not None
        assert spec.live.execution == heard.logs()[0].execution
        assert {c.execution for c in heard.logs()} == {spec.live.execution}  # the runner's, once
        scraped = generate_latest(service.metrics.registry).decode()
        assert 'evalbus_runner_logins_total{outcome="granted"} 1.0' in scraped
        assert fake.violations == []
