"""The users of deploy/nats/accounts.conf against a real nats-server: each service starts and does
its work with its own user only, and what a user may not do is refused by the server; with
deploy/nats/tls.conf and a self-signed CA, the chassis connects over TLS and a plain client is
refused.

The server runs the deployment's own configuration (`jetstream.conf` + `accounts.conf`; one node,
so without the cluster block), on free loopback ports given on the command line.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import uuid
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import aiohttp
import nats
import nats.errors
import pytest
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from evalbus.infra import nats_accounts
from evalbus.infra.nats import nats_server_binary
from evalbus.infra.ports import free_port, wait_port
from evalbus.testing.pipeline import eventually
from evalbus_collector.service import CollectorSettings, build_collector
from evalbus_contracts import (
    BatchRequested,
    BatchSpec,
    CaseExecuted,
    CasePlan,
    CaseRequested,
    CaseResult,
    CaseSpec,
    CommandHarness,
    DatasetIndex,
    JsonlSink,
    SuiteSpec,
    decode,
    decode_event,
    encode,
)
from evalbus_contracts.control import ExecReply, ExecRequest
from evalbus_contracts.streams import DATASETS
from evalbus_contracts.subjects import control_subject, hold_subject
from evalbus_dispatcher import LocalBackend
from evalbus_dispatcher.control import LiveControls
from evalbus_dispatcher.fanout import fan_out_batch
from evalbus_dispatcher.presence import Presence
from evalbus_dispatcher.service import DispatcherSettings, build_dispatcher
from evalbus_exporter.service import ExporterSettings, build_exporter
from evalbus_gateway.live.dispatchers import dispatcher_statuses, requests_ahead
from evalbus_gateway.live.terminal import TerminalTickets
from evalbus_gateway.service import GatewaySettings, build_gateway
from evalbus_judge.service import JudgeSettings, build_judge
from evalbus_runtime import Publisher, Service, connect, ensure_topology
from evalbus_runtime.nkeys import AccountKey
from evalbus_runtime.objects import object_info, put_object

pytestmark = [pytest.mark.integration]

NATS = Path(__file__).resolve().parents[1] / "deploy" / "nats"
USERS = ("gateway", "dispatcher", "collector", "judge", "exporter", "ingest", "runner-auth", "admin", "sys")


@dataclass(frozen=True)
class SecureNats:
    """A nats-server running the deployment's accounts."""

    port: int
    passwords: dict[str, str]
    issuer: AccountKey
    """The auth callout's issuer (its public key in the server's `$NATS_RUNNER_ISSUER`)."""
    scheme: str = "nats"

    def url(self, user: str, scheme: str | None = None) -> str:
        """The NATS URL of `user`, credentials included (as the deployments' Secrets hold it)."""
        return f"{scheme or self.scheme}://{user}:{self.passwords[user]}@127.0.0.1:{self.port}"

    def anonymous_url(self, scheme: str | None = None) -> str:
        """The server's URL without credentials (as a runner's job spec names it)."""
        return f"{scheme or self.scheme}://127.0.0.1:{self.port}"


@contextlib.contextmanager
def start_secure_nats(folder: Path, tls: Path | None = None) -> Iterator[SecureNats]:
    """nats-server with deploy/nats's jetstream.conf and accounts.conf (and tls.conf with the
    certificates in `tls`: tls.crt, tls.key, ca.crt)."""
    includes = ["jetstream.conf", "accounts.conf", *(["tls.conf"] if tls else [])]
    for name in includes:
        (folder / name).write_text((NATS / name).read_text(encoding="utf-8"), encoding="utf-8")
    conf = folder / "nats.conf"
    conf.write_text("".join(f"include ./{n}\n" for n in includes if n != "accounts.conf"), encoding="utf-8")
    passwords = {user: uuid.uuid4().hex for user in USERS}
    issuer = AccountKey.generate()
    env = {k: v for k, v in os.environ.items() if not k.startswith("NATS_")}
    env |= {nats_accounts.password_variable(u): p for u, p in passwords.items()}
    env[nats_accounts.ISSUER_VARIABLE] = issuer.public
    env |= {"SERVER_NAME": "secure", "NATS_STORE_DIR": str(folder / "js"), "NATS_MAX_FILE_STORE": "1G"}
    env["NATS_PID_FILE"] = str(folder / "nats.pid")
    if tls is not None:
        env |= {"NATS_TLS_CERT": str(tls / "tls.crt"), "NATS_TLS_KEY": str(tls / "tls.key")}
        env["NATS_TLS_CA"] = str(tls / "ca.crt")
    port, monitor = free_port(), free_port()
    args = [nats_server_binary(), "-c", str(conf), "-a", "127.0.0.1", "-p", str(port), "-m", str(monitor)]
    log = (folder / "nats.log").open("w")
    proc = subprocess.Popen(args, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
    try:
        wait_port(port)
        yield SecureNats(port=port, passwords=passwords, issuer=issuer, scheme="tls" if tls else "nats")
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        log.close()


@pytest.fixture
def secure_nats(tmp_path: Path) -> Iterator[SecureNats]:
    with start_secure_nats(tmp_path) as server:
        yield server


@dataclass
class Violations:
    """Permission errors the server sent one connection."""

    seen: list[str]

    async def reported(self, *parts: str) -> None:
        """Wait until the server has reported a violation naming every one of `parts` (it comes back
        asynchronously, on the connection)."""
        await eventually(
            lambda: any(all(part in v for part in parts) for v in self.seen),
            timeout_s=30,
            what=f"a permissions violation naming {parts}",
            diagnostics=lambda: f"violations reported: {self.seen}",
        )


@contextlib.asynccontextmanager
async def connect_as(server: SecureNats, user: str) -> AsyncIterator[tuple[NatsClient, Violations]]:
    """A raw connection as `user`, collecting the permission violations the server reports."""
    violations = Violations([])

    async def on_error(e: Exception) -> None:
        if "permissions violation" in str(e).lower():  # nats-py reports the server's -ERR lower-cased
            violations.seen.append(str(e).lower())

    nc = await nats.connect(server.url(user), error_cb=on_error, allow_reconnect=False, connect_timeout=5)
    try:
        yield nc, violations
    finally:
        await nc.close()


@contextlib.asynccontextmanager
async def running(service: Service) -> AsyncIterator[Service]:
    """`service` started (its streams, consumers and start hooks with its own user), then stopped."""
    await asyncio.wait_for(service.start(), 30)
    try:
        yield service
    finally:
        await service.stop()


def no_violations(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if "permissions violation" in r.getMessage().lower()]


async def test_admin_creates_the_topology(secure_nats: SecureNats) -> None:
    async with connect_as(secure_nats, "admin") as (nc, violations):
        await ensure_topology(nc.jetstream())
        assert violations.seen == []


async def test_the_judge_and_exporter_do_their_work_with_their_own_users(
    secure_nats: SecureNats, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    judge = Service(JudgeSettings(service="judge", nats_url=secure_nats.url("judge"), http_port=0))
    build_judge(judge, JudgeSettings(service="judge"))
    exporter_settings = ExporterSettings(service="exporter", export_dir=str(tmp_path / "exports"))
    exporter = Service(ExporterSettings(service="exporter", nats_url=secure_nats.url("exporter"), http_port=0))
    build_exporter(exporter, exporter_settings)
    batch = f"b{uuid.uuid4().hex[:8]}"
    async with running(judge), running(exporter), connect_as(secure_nats, "admin") as (nc, _):
        exported: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_exported(msg: Msg) -> None:
            await exported.put(msg.data)

        sub = await nc.subscribe(f"case.exported.{batch}.>", cb=on_exported)
        publisher = Publisher(nc)
        result = CaseResult(case_id="c1", run_id=f"evb-{batch}-c1", harness="h@1")
        await publisher.publish_event(
            CaseExecuted(
                batch_id=batch,
                case_id="c1",
                run_id=result.run_id,
                status="succeeded",
                result=result,
                plan=CasePlan(sinks=(JsonlSink(path="out.jsonl"),)),
            )
        )
        event = decode_event(await asyncio.wait_for(exported.get(), 30))
        assert event.type == "case.exported"
        await sub.unsubscribe()
        await publisher.stop()
    assert no_violations(caplog) == []


async def test_the_collector_dispatcher_and_gateway_start_with_their_own_users(
    secure_nats: SecureNats, tmp_path: Path, database_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING)
    collector = Service(CollectorSettings(service="collector", nats_url=secure_nats.url("collector"), http_port=0))
    online = build_collector(collector, CollectorSettings(service="collector", otlp_port=0, settle_s=0.2))
    dispatcher_settings = DispatcherSettings(service="dispatcher", slots=1, workdir_root=str(tmp_path / "work"))
    dispatcher = Service(
        DispatcherSettings(service="dispatcher", nats_url=secure_nats.url("dispatcher"), http_port=0, slots=1)
    )
    build_dispatcher(dispatcher, dispatcher_settings)
    gateway_settings = GatewaySettings(
        nats_url=secure_nats.url("gateway"), database_url=database_url, http_port=0, admin_token="t" * 32
    )
    gateway = Service(gateway_settings)
    build_gateway(gateway, gateway_settings)
    async with running(collector), running(dispatcher), running(gateway), connect_as(secure_nats, "admin") as (nc, _):
        # a trace through the collector's online path with its own user: spans stored on the
        # trace's subject, read back from the stream, its assembly recorded, its fate published
        trace_id = uuid.uuid4().hex
        fates: asyncio.Queue[bytes] = asyncio.Queue()

        async def on_fate(msg: Msg) -> None:
            await fates.put(msg.data)

        sub = await nc.subscribe(f"online.fate.{trace_id}", cb=on_fate)
        span = {"traceId": trace_id, "spanId": uuid.uuid4().hex[:16], "name": "root", "startTimeUnixNano": "1"}
        span["endTimeUnixNano"] = "2"
        body = {"resourceSpans": [{"scopeSpans": [{"spans": [span]}]}]}
        assert online.receiver is not None
        async with (
            aiohttp.ClientSession() as http,
            http.post(f"http://127.0.0.1:{online.receiver.port}/v1/traces", json=body) as resp,
        ):
            assert resp.status == 200, await resp.text()
        fate = decode_event(await asyncio.wait_for(fates.get(), 30))
        assert (fate.type, getattr(fate, "reason", None)) == ("online.fate", "no_suite")
        await sub.unsubscribe()
    assert no_violations(caplog) == []


async def test_a_judge_cannot_publish_case_exported(secure_nats: SecureNats) -> None:
    async with connect_as(secure_nats, "admin") as (admin, _):
        await ensure_topology(admin.jetstream())
    async with connect_as(secure_nats, "judge") as (nc, violations):
        js = nc.jetstream()
        ack = await js.publish("case.judged.b1.c1", b"{}")  # what it produces: stored
        assert ack.stream == "CASES"
        with pytest.raises((nats.errors.TimeoutError, nats.errors.NoRespondersError)):
            await js.publish("case.exported.b1.c1", b"{}", timeout=2)
        await violations.reported('"case.exported.b1.c1"')
        assert all("for publish to" in v for v in violations.seen)


async def test_dispatchers_answer_and_probe_hold_subjects_with_their_own_user(secure_nats: SecureNats) -> None:
    """The exclusive case stage (`Stage.exclusive`): a dispatcher holding a request answers on its
    hold subject, another dispatcher's probe gets that answer — or nats-server's "no responders" for
    a request nobody holds — and neither is a permission violation; the judge may not probe."""
    holding = hold_subject("CASES", "dispatcher-cases", 41)
    async with connect_as(secure_nats, "dispatcher") as (holder, holder_violations):

        async def answer(msg: Msg) -> None:
            await msg.respond(b"")

        await holder.subscribe(holding, cb=answer)
        await holder.flush()
        async with connect_as(secure_nats, "dispatcher") as (prober, violations):
            assert (await prober.request(holding, b"", timeout=5)).data == b""
            with pytest.raises(nats.errors.NoRespondersError):
                await prober.request(hold_subject("CASES", "dispatcher-cases", 42), b"", timeout=5)
            assert violations.seen == []
        assert holder_violations.seen == []
    async with connect_as(secure_nats, "judge") as (judge, violations):
        await judge.publish(holding, b"")
        await violations.reported("held.cases.dispatcher-cases.41")


async def test_the_exporter_cannot_read_batch_requested(secure_nats: SecureNats) -> None:
    async with connect_as(secure_nats, "admin") as (admin, _):
        await ensure_topology(admin.jetstream())
        await admin.jetstream().publish("batch.requested.b1", b"{}")
    async with connect_as(secure_nats, "exporter") as (nc, violations):
        await nc.subscribe("batch.requested.>")
        await violations.reported("subscription", "batch.requested.>")
        # nor through JetStream: an ephemeral consumer on CASES is refused
        with pytest.raises(nats.errors.TimeoutError):
            await nc.jetstream().subscribe("batch.requested.>", stream="CASES", ordered_consumer=True)
        await violations.reported("$js.api.consumer.create.cases")
        # nor by pulling another service's consumer
        await nc.publish("$JS.API.CONSUMER.MSG.NEXT.CASES.dispatcher-batches", b'{"batch": 1}')
        await violations.reported("dispatcher-batches")


async def test_datasets_go_through_the_object_store_with_the_gateway_and_dispatcher_users(
    secure_nats: SecureNats,
) -> None:
    async with connect_as(secure_nats, "admin") as (admin, _):
        await ensure_topology(admin.jetstream())
    rows = [CaseSpec(id=f"c{i}", input="x" * 1000) for i in range(300)]
    body = b"".join(encode(c) + b"\n" for c in rows)
    async with (
        connect_as(secure_nats, "gateway") as (gateway, gateway_violations),
        connect_as(secure_nats, "dispatcher") as (dispatcher, dispatcher_violations),
    ):
        await put_object(gateway.jetstream(), DATASETS, "ds-deploy", b"an upload replaced below")
        ref = await put_object(gateway.jetstream(), DATASETS, "ds-deploy", body)  # the old chunks purged
        await object_info(gateway.jetstream(), ref)  # what a batch naming it is checked against
        spec = BatchSpec(
            suite=SuiteSpec(id="s", dataset_ref=ref, dataset_index=DatasetIndex(cases=300)),
            harness=CommandHarness(id="h", command=("true",)),
        )
        runs = await fan_out_batch(dispatcher.jetstream(), BatchRequested(batch_id="b1", spec=spec, submitted_by="a"))
    assert [r.case for r in runs] == rows
    assert (gateway_violations.seen, dispatcher_violations.seen) == ([], [])


async def test_the_live_views_and_actions_work_with_the_gateway_and_dispatcher_users(
    secure_nats: SecureNats, tmp_path: Path
) -> None:
    """Placement (the dispatchers' bucket and queue), terminal tickets and a live exec, each side
    with its own user: the gateway's reads and requests, the dispatcher's presence and answers."""
    async with connect_as(secure_nats, "admin") as (admin, _):
        await ensure_topology(admin.jetstream())
        queued = await admin.jetstream().publish(f"case.requested.b{uuid.uuid4().hex[:8]}.c1", b"{}")
    backend = LocalBackend(slots=1, root=tmp_path)
    request = CaseRequested(
        batch_id="b1", case_id="c1", run_id=f"evb-perm-{uuid.uuid4().hex[:8]}", case=CaseSpec(id="c1", input="x"),
        harness=CommandHarness(id="h", command=("true",)), plan=CasePlan(),
    )  # fmt: skip
    sandbox = await backend.provision(request)

    async def mark(event: str, message: str) -> None:
        return None

    async with (
        connect_as(secure_nats, "dispatcher") as (dnc, d_violations),
        connect_as(secure_nats, "gateway") as (gnc, g_violations),
    ):
        presence = Presence("d-perm", slots=1)
        await presence.start(dnc.jetstream())
        controls = LiveControls(dnc)
        detach = await controls.attach(request.run_id or "", sandbox, mark)
        try:
            gjs = gnc.jetstream()
            assert [s.dispatcher for s in await dispatcher_statuses(gjs)] == ["d-perm"]
            assert await requests_ahead(gjs, queued.seq) == 0
            tickets = TerminalTickets(gjs, 30.0)
            ticket, _ = await tickets.mint(request.run_id or "", "alice")
            assert await tickets.spend(ticket, request.run_id or "") is not None
            reply = await gnc.request(
                control_subject(request.run_id or "", "exec"), encode(ExecRequest(command="echo ok")), timeout=10
            )
            assert decode(reply.data, ExecReply).stdout == "ok"
        finally:
            await detach()
            await sandbox.release()
            await presence.stop()
        assert d_violations.seen == []
        assert g_violations.seen == []


def make_certificates(folder: Path) -> Path:
    """A self-signed CA and a server certificate for localhost and 127.0.0.1 (openssl), in the
    layout of cert-manager's Secrets: tls.crt, tls.key, ca.crt."""
    folder.mkdir()

    def openssl(*args: str) -> None:
        subprocess.run(["openssl", *args], cwd=folder, check=True, capture_output=True, timeout=60)

    openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out", "ca.crt", "-days", "2", "-subj", "/CN=evalbus test CA")  # fmt: skip
    openssl("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "tls.key", "-out", "tls.csr", "-subj", "/CN=localhost")
    (folder / "san.ext").write_text("subjectAltName=DNS:localhost,IP:127.0.0.1\n", encoding="utf-8")
    openssl(
        "x509", "-req", "-in", "tls.csr", "-CA", "ca.crt", "-CAkey", "ca.key", "-CAcreateserial",
        "-out", "tls.crt", "-days", "2", "-extfile", "san.ext",
    )  # fmt: skip
    return folder


async def test_tls_with_a_self_signed_ca(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tls = make_certificates(tmp_path / "tls")
    with start_secure_nats(tmp_path, tls) as server:
        # a client that does not speak TLS is refused
        with pytest.raises(Exception, match=r"(?i)tls|ssl|secure"):
            await nats.connect(server.url("admin", "nats"), allow_reconnect=False, connect_timeout=3)
        # the chassis' own connection, trusting the CA the way a deployment does (SSL_CERT_FILE)
        monkeypatch.setenv("SSL_CERT_FILE", str(tls / "ca.crt"))
        nc = await connect(server.url("admin"), "tls-probe")
        try:
            await ensure_topology(nc.jetstream())
            ack = await nc.jetstream().publish("case.judged.b1.c1", b"{}")
            assert ack.stream == "CASES"
        finally:
            await nc.close()
        # without the CA, the server's certificate is not trusted
        monkeypatch.delenv("SSL_CERT_FILE")
        monkeypatch.setenv("SSL_CERT_DIR", str(tmp_path / "no-certs"))
        with pytest.raises(Exception, match=r"(?i)certificate"):
            await nats.connect(server.url("admin"), allow_reconnect=False, connect_timeout=3)
