"""The Docker backend's own parts: the create request, the stream framing, `DOCKER_HOST`, reading a
container, an archive's tar stream and path stat; and, against the protocol-level fake engine, what
the behaviour suite does not look at: a terminal resize the program sees, a secret the store lacks,
secret values kept out of logs and marks, a container's archive as the Engine API documents it."""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import io
import json
import logging
import sys
import tarfile
from pathlib import Path
from typing import Any

import pytest

from evalbus.testing.fake_docker import DEFAULT_IMAGE, FakeDocker
from evalbus.testing.pipeline import eventually
from evalbus.testing.tls import make_test_certs
from evalbus_contracts import CasePlan, CaseRequested, CaseSpec, CommandHarness, ComputeSpec, TestsPassGrader
from evalbus_contracts.runner import JOB_ENV
from evalbus_dispatcher.backends.docker import DockerSandbox, connect_docker
from evalbus_dispatcher.backends.docker_container import (
    RUN_LABEL,
    DockerTemplate,
    StreamMask,
    container_body,
    fit_problem,
    image_reference,
    read_container,
    read_stats,
)
from evalbus_dispatcher.backends.docker_engine import (
    DockerEngine,
    EngineError,
    FrameSplitter,
    frame,
    parse_host,
    path_stat,
    read_tar_entry,
)
from evalbus_dispatcher.errors import BackendError
from evalbus_runtime.secrets import SecretStore

SECRET = "docker-canary-7a1c9e"
TEMPLATE = DockerTemplate(image="evalbus/case:latest", network="none")


def request(code: str = "print(1)", **compute: Any) -> CaseRequested:
    return CaseRequested(
        batch_id="b1",
        case_id="c1",
        run_id="evb-b1-c1",
        case=CaseSpec(id="c1", input="hi", graders=(TestsPassGrader(id="t", command="true", timeout_s=30),)),
        harness=CommandHarness(
            id="agent",
            command=(sys.executable, "harness.py"),
            files={"harness.py": code},
            secret_env={"API_KEY": "api-key"},
            compute=ComputeSpec(**compute),
        ),
        plan=CasePlan(suite_id="s", submitted_by="alice"),
    )


@pytest.mark.unit
def test_the_create_request_carries_resources_labels_and_the_secret_only_in_env() -> None:
    body = container_body(request(cpu=1.5, memory_mb=512, gpus=2), "evb-b1-c1", TEMPLATE, {"API_KEY": SECRET})
    host = body["HostConfig"]
    assert (host["NanoCpus"], host["Memory"], host["MemorySwap"]) == (1_500_000_000, 512 << 20, 512 << 20)
    assert host["NetworkMode"] == "none"
    assert host["DeviceRequests"] == [{"Driver": "nvidia", "Count": 2, "Capabilities": [["gpu"]]}]
    assert body["Labels"][RUN_LABEL] == "evb-b1-c1"
    assert body["Cmd"] == ["python", "-m", "evalbus.runner", "--workdir", "work"]
    assert f"API_KEY={SECRET}" in body["Env"]
    spec = json.loads(next(e for e in body["Env"] if e.startswith(f"{JOB_ENV}=")).split("=", 1)[1])
    assert spec["secret_vars"] == ["API_KEY"]
    everything_else = json.dumps({k: v for k, v in body.items() if k != "Env"}) + json.dumps(spec)
    assert SECRET not in everything_else
    assert "DeviceRequests" not in container_body(request(), "r", TEMPLATE, {})["HostConfig"]


@pytest.mark.unit
def test_network_none_overrides_the_templates_network() -> None:
    bridged = DockerTemplate(image="evalbus/case:latest", network="evals-net")
    assert container_body(request(network="none"), "r", bridged, {})["HostConfig"]["NetworkMode"] == "none"
    assert container_body(request(), "r", bridged, {})["HostConfig"]["NetworkMode"] == "evals-net"


@pytest.mark.unit
def test_multiplexed_frames_are_split_across_chunk_boundaries() -> None:
    data = frame(1, b"out line\n") + frame(2, b"err") + frame(1, b"")
    splitter = FrameSplitter()
    got = [f for i in range(len(data)) for f in splitter.push(data[i : i + 1])]
    assert got == [(1, b"out line\n"), (2, b"err"), (1, b"")]
    assert splitter.pending == 0


@pytest.mark.unit
def test_docker_host_forms() -> None:
    assert parse_host("unix:///var/run/docker.sock").path == "/var/run/docker.sock"
    tcp = parse_host("tcp://127.0.0.1:2376")
    assert (tcp.kind, tcp.host, tcp.port) == ("tcp", "127.0.0.1", 2376)
    for bad in ("ssh://box", "unix://relative.sock", "npipe:////./pipe/docker_engine"):
        with pytest.raises(ValueError, match="DOCKER_HOST"):
            parse_host(bad)


@pytest.mark.unit
def test_image_references_always_name_a_tag() -> None:
    assert image_reference("evalbus/case") == ("evalbus/case", "latest")
    assert image_reference("registry:5000/team/case:v2") == ("registry:5000/team/case", "v2")
    assert image_reference("case@sha256:abc") == ("case", "sha256:abc")


@pytest.mark.unit
def test_a_container_reads_as_a_placement() -> None:
    assert read_container(None, "e").phase == "queued"
    running = read_container({"Id": "a" * 64, "State": {"Status": "running", "Running": True}}, "e")
    assert (running.phase, running.unit, running.node) == ("running", "a" * 12, "e")
    oom = read_container({"Id": "b", "State": {"Status": "exited", "OOMKilled": True, "ExitCode": 137}}, "e")
    assert (oom.phase, oom.oom, oom.exit_code, oom.reason) == ("dead", True, 137, "OOMKilled (exit 137)")


@pytest.mark.unit
def test_stats_read_as_the_units_usage() -> None:
    stats = {
        "memory_stats": {"usage": 50 << 20, "stats": {"inactive_file": 8 << 20}},
        "cpu_stats": {"cpu_usage": {"total_usage": 1_500_000_000}},
        "pids_stats": {"current": 3},
    }
    used = read_stats(stats, 42)
    assert (used.pid, used.processes, used.rss_bytes, used.cpu_seconds) == (42, 3, 42 << 20, 1.5)
    assert read_stats({}, 7).rss_bytes is None


@pytest.mark.unit
def test_a_secret_split_across_terminal_chunks_is_still_masked() -> None:
    mask = StreamMask([SECRET, "other"])
    shown = mask.push(b"key=" + SECRET.encode()[:5]) + mask.push(SECRET.encode()[5:] + b"\r\n$ ") + mask.flush()
    assert shown == b"key=[redacted]\r\n$ "
    assert mask.push(b"ot") == b""  # could begin "other": held
    assert mask.holding
    assert mask.push(b"ter") == b"otter"  # it did not


@pytest.mark.unit
def test_fit_reads_the_engine_info() -> None:
    info = {"Name": "e", "NCPU": 2, "MemTotal": 1 << 30, "Labels": ["zone=a"]}
    assert fit_problem(ComputeSpec(cpu=2, memory_mb=1024, node_selector={"zone": "a"}), info) is None
    assert "cpu=3" in (fit_problem(ComputeSpec(cpu=3), info) or "")
    assert "memory=2048Mi" in (fit_problem(ComputeSpec(memory_mb=2048), info) or "")
    assert "zone" in (fit_problem(ComputeSpec(node_selector={"zone": "b"}), info) or "")


# ---------------------------------------------------------------- against the protocol-level fake


@pytest.mark.integration
async def test_a_terminal_resize_reaches_the_program_and_secrets_stay_out_of_logs(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG)
    code = "import os, time\nprint('up', flush=True)\nwhile not os.path.exists('go'):\n    time.sleep(0.02)\n"
    async with FakeDocker() as engine:
        store = SecretStore({"EVALBUS_SECRET_API_KEY": SECRET})
        template = DockerTemplate(image=DEFAULT_IMAGE, runner_command=(sys.executable, "-m", "evalbus.runner"))
        backend = connect_docker(template, store, host=engine.host)
        marks: list[str] = []
        lines: list[str] = []

        async def mark(event: str, message: str) -> None:
            marks.append(f"{event} {message}")

        async def out(_stream: str, line: str) -> None:
            lines.append(line)

        try:
            sandbox = await backend.provision(request(code))
            assert isinstance(sandbox, DockerSandbox)
            sandbox.observe(mark)
            running = asyncio.create_task(sandbox.run_harness(out))
            await eventually(lambda: "up" in lines, timeout_s=30, what="the harness to run")
            where = await sandbox.placement()
            assert (where.phase, where.node) == ("running", "fake-engine")
            assert [e.reason for e in where.events][:2] == ["create", "start"]
            screen: list[bytes] = []

            async def seen(data: bytes) -> None:
                screen.append(data)

            shell = await sandbox.open_shell(80, 24, seen)
            shell.write(b"echo key=$API_KEY\n")
            await eventually(lambda: b"key=[redacted]" in b"".join(screen), timeout_s=30, what="the masked secret")
            shell.resize(132, 40)
            await eventually(lambda: (40, 132) in engine.execs[next(iter(engine.execs))].sizes, timeout_s=10,
                             what="the resize request")  # fmt: skip
            shell.write(b"stty size\n")
            await eventually(lambda: b"40 132" in b"".join(screen), timeout_s=30, what="stty to see the new size")
            shell.write(b"touch go; exit 7\n")
            assert await shell.wait() == 7
            run = await running
            assert run.exit_code == 0
            assert "engine" in " ".join(marks)
            assert any("die" in m for m in marks)
            assert (await sandbox.placement()).phase == "dead"
            await sandbox.release()
        finally:
            await backend.close()
        assert engine.violations == []
        assert not engine.containers
    assert SECRET not in caplog.text
    assert SECRET not in "\n".join(marks + lines)
    assert all(SECRET.encode() not in chunk for chunk in screen)


@pytest.mark.integration
async def test_a_secret_the_store_lacks_fails_provisioning_as_config() -> None:
    async with FakeDocker() as engine:
        backend = connect_docker(DockerTemplate(image=DEFAULT_IMAGE), SecretStore({}), host=engine.host)
        try:
            with pytest.raises(BackendError) as caught:
                await backend.provision(request())
        finally:
            await backend.close()
        assert (caught.value.code, caught.value.failure_class, caught.value.retryable) == (
            "missing_secret",
            "config",
            False,
        )
        assert engine.requests == []  # refused before anything reached the engine


@pytest.mark.integration
async def test_the_fake_engine_refuses_what_the_engine_api_does_not_document() -> None:
    async with FakeDocker() as engine:
        client = DockerEngine(parse_host(engine.host))
        try:
            engine.pulled.add(DEFAULT_IMAGE)
            with pytest.raises(EngineError) as unknown:
                await client.call(
                    "POST", "/containers/create", body={"Image": DEFAULT_IMAGE, "HostConfig": {"Cpus": 1}}
                )
            assert unknown.value.status == 400
            assert "Cpus" in unknown.value.message
            made = await client.call(
                "POST", "/containers/create", body={"Image": DEFAULT_IMAGE, "Cmd": ["sleep", "30"]}
            )
            await client.call("POST", f"/containers/{made['Id']}/start")
            exec_made = await client.call("POST", f"/containers/{made['Id']}/exec", body={"Cmd": ["true"]})
            with pytest.raises(EngineError) as no_upgrade:  # an attached start must ask to hijack the connection
                await client.call("POST", f"/exec/{exec_made['Id']}/start", body={"Detach": False})
            assert no_upgrade.value.status == 400
            await client.call("DELETE", f"/containers/{made['Id']}", params={"force": "1"})
        finally:
            await client.close()
        assert len(engine.violations) == 2, engine.violations
        assert not engine.containers


def _tar(name: str, data: bytes, tar_format: int, kind: bytes = tarfile.REGTYPE) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tar_format) as tar:
        info = tarfile.TarInfo(name)
        info.type, info.size = kind, len(data) if kind == tarfile.REGTYPE else 0
        tar.addfile(info, io.BytesIO(data) if kind == tarfile.REGTYPE else None)
    return out.getvalue()


async def _entry(archive: bytes) -> tuple[Any, bytes]:
    reader = asyncio.StreamReader()
    reader.feed_data(archive)
    reader.feed_eof()
    entry = await read_tar_entry(reader)
    return entry, await reader.readexactly(entry.size) if entry is not None else b""


@pytest.mark.unit
async def test_an_archives_member_is_read_through_pax_and_gnu_long_names() -> None:
    long = "deep/" * 30 + "report.html"  # over the 100 bytes of a plain header's name
    for tar_format in (tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT, tarfile.GNU_FORMAT):
        name = "report.html" if tar_format == tarfile.USTAR_FORMAT else long
        entry, data = await _entry(_tar(name, b"<h1>hi</h1>" * 100, tar_format))
        assert (entry.name, entry.size, entry.regular, data) == (name, 1100, True, b"<h1>hi</h1>" * 100), tar_format
    link, _ = await _entry(_tar("link.txt", b"", tarfile.PAX_FORMAT, kind=tarfile.SYMTYPE))
    assert link.regular is False
    empty, _ = await _entry(bytes(1024))
    assert empty is None
    with pytest.raises(ValueError, match="checksum"):
        await _entry(b"not a tar header".ljust(512, b"x"))


@pytest.mark.unit
def test_the_path_stat_header_tells_a_regular_file() -> None:
    def header(mode: int) -> str:
        return base64.b64encode(json.dumps({"name": "a", "size": 5, "mode": mode, "linkTarget": ""}).encode()).decode()

    assert path_stat(header(0o644)) is not None
    assert path_stat(header(0o644)).regular  # type: ignore[union-attr]
    assert not path_stat(header((1 << 31) | 0o755)).regular  # type: ignore[union-attr]  # a folder
    assert not path_stat(header((1 << 27) | 0o777)).regular  # type: ignore[union-attr]  # a link
    assert path_stat("not base64 json") is None
    assert path_stat(None) is None


@pytest.mark.integration
async def test_the_fake_engine_serves_a_containers_archive_as_documented(tmp_path: Path) -> None:
    async with FakeDocker() as engine:
        client = DockerEngine(parse_host(engine.host))
        try:
            engine.pulled.add(DEFAULT_IMAGE)
            body = {"Image": DEFAULT_IMAGE, "WorkingDir": "/evalbus", "Cmd": ["sh", "-c", "echo hi > note.txt"]}
            made = await client.call("POST", "/containers/create", body=body)
            await client.call("POST", f"/containers/{made['Id']}/start")
            await client.call("POST", f"/containers/{made['Id']}/wait")  # exited: its files are still there
            answer = await client.open_stream("GET", f"/containers/{made['Id']}/archive",
                                              params={"path": "/evalbus/note.txt"})  # fmt: skip
            try:
                assert answer.content_type == "application/x-tar"
                stat = path_stat(answer.headers.get("X-Docker-Container-Path-Stat"))
                assert stat is not None
                assert (stat.name, stat.size, stat.regular) == ("note.txt", 3, True)
                with tarfile.open(fileobj=io.BytesIO(await answer.read())) as tar:
                    member = tar.extractfile("note.txt")
                    assert member is not None
                    assert member.read() == b"hi\n"
            finally:
                answer.close()
            with pytest.raises(EngineError) as missing:
                await client.open_stream("GET", f"/containers/{made['Id']}/archive", params={"path": "/evalbus/no"})
            assert missing.value.status == 404
            assert engine.violations == []
            with pytest.raises(EngineError) as relative:
                await client.open_stream("GET", f"/containers/{made['Id']}/archive", params={"path": "note.txt"})
            assert relative.value.status == 400
            await client.call("DELETE", f"/containers/{made['Id']}")
        finally:
            await client.close()
        assert len(engine.violations) == 1, engine.violations


@pytest.mark.integration
async def test_an_older_engine_is_spoken_to_in_its_own_api_version() -> None:
    async with FakeDocker(max_api=41) as older, FakeDocker(max_api=40) as too_old:
        client = DockerEngine(parse_host(older.host))
        try:
            assert (await client.call("GET", "/info"))["Name"] == "fake-engine"
        finally:
            await client.close()
        assert older.requests == [("GET", "/_ping"), ("GET", "/v1.41/info")]
        ancient = DockerEngine(parse_host(too_old.host))
        try:
            with pytest.raises(EngineError, match=r"serves API 1\.40; evalbus needs 1\.41"):
                await ancient.call("GET", "/info")
        finally:
            await ancient.close()
        assert older.violations == too_old.violations == []


@pytest.mark.integration
async def test_an_engine_behind_tls_is_reached_with_the_docker_cli_files(tmp_path: Path) -> None:
    """`DOCKER_TLS_VERIFY` as the docker CLI does it: the engine's certificate checked against
    `ca.pem`, the client's own certificate presented (the fake, like `dockerd --tlsverify`, refuses
    a connection without one) — on the API calls and on the hijacked exec connection alike."""
    certs = make_test_certs(tmp_path / "tls")
    store = SecretStore({"EVALBUS_SECRET_API_KEY": SECRET})
    async with FakeDocker(tls=certs.server_context()) as engine:
        template = DockerTemplate(image=DEFAULT_IMAGE, runner_command=(sys.executable, "-m", "evalbus.runner"))
        backend = connect_docker(template, store, host=engine.tcp_host, tls_verify=True, cert_path=certs.client)
        lines: list[str] = []

        async def out(_stream: str, line: str) -> None:
            lines.append(line)

        try:
            code = "import os, time\nprint('over tls', flush=True)\nwhile not os.path.exists('go'):\n    time.sleep(0.02)\n"
            sandbox = await backend.provision(request(code))
            assert isinstance(sandbox, DockerSandbox)
            running = asyncio.create_task(sandbox.run_harness(out))
            await eventually(lambda: "over tls" in lines, timeout_s=30, what="the harness to run")
            done = await sandbox.exec_live("echo hijacked; touch go", 30, cap_bytes=4096)  # the hijacked connection
            assert (done.exit_code, done.stdout.strip()) == (0, "hijacked")
            run = await running
            assert run.exit_code == 0
            await sandbox.release()
        finally:
            await backend.close()
        assert engine.violations == []
        assert not engine.containers

        no_client_cert = tmp_path / "ca-only"
        no_client_cert.mkdir()
        (no_client_cert / "ca.pem").write_bytes((certs.client / "ca.pem").read_bytes())
        refused = connect_docker(template, store, host=engine.tcp_host, tls_verify=True, cert_path=no_client_cert)
        other = make_test_certs(tmp_path / "other")
        untrusted = connect_docker(template, store, host=engine.tcp_host, tls_verify=True, cert_path=other.client)
        plain = connect_docker(template, store, host=engine.tcp_host)
        for backend in (refused, untrusted, plain):
            try:
                with pytest.raises(BackendError) as caught:
                    await backend.provision(request())
                assert "cannot be reached" in caught.value.message, caught.value.message
            finally:
                await backend.close()


@pytest.mark.unit
def test_tls_settings_that_cannot_work_are_refused_with_the_reason(tmp_path: Path) -> None:
    template = DockerTemplate(image=DEFAULT_IMAGE)
    with pytest.raises(ValueError, match="need a tcp:// DOCKER_HOST"):
        connect_docker(template, SecretStore({}), host="unix:///var/run/docker.sock", tls_verify=True)
    with pytest.raises(ValueError, match=r"DOCKER_TLS_VERIFY needs the engine's CA in .*ca\.pem"):
        connect_docker(template, SecretStore({}), host="tcp://127.0.0.1:2376", tls_verify=True, cert_path=tmp_path)
    (tmp_path / "cert.pem").write_text("not a certificate")
    (tmp_path / "key.pem").write_text("not a key")
    with pytest.raises(ValueError, match="cannot be used"):
        connect_docker(template, SecretStore({}), host="tcp://127.0.0.1:2376", tls=True, cert_path=tmp_path)
    with pytest.raises(ValueError, match="pass its context"):
        DockerEngine(dataclasses.replace(parse_host("tcp://127.0.0.1:2376"), tls=True))
