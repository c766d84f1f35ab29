"""`evalbus up` → `status` → `down` as a user runs them: real commands in subprocesses, a real
nats-server, real PostgreSQL (`DATABASE_URL` when set, else the embedded server) and the services as
real processes.

The first test runs the real services (`python -m evalbus_<service>`). The others replace them with
`tests/standin_service.py` (a real HTTP server answering `/healthz`, `/readyz`, `/metrics`) through
`EVALBUS_SERVICE_CMD_<SERVICE>`, to drive the paths the real services should never take: a service
that dies at start, one that ignores SIGTERM and leaves a child behind.

Whether a process is gone is read from /proc independently of the code under test; a zombie (an
exited process nobody reaped, as happens to orphans here) counts as gone.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import shlex
import shutil
import signal
import socket
import stat
import subprocess
import sys
import time
import urllib.request
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import asyncpg
import pytest

from evalbus.infra.postgres import drop_database, with_database

SERVICES = ("dispatcher", "judge", "exporter", "collector", "gateway")
STANDIN = Path(__file__).resolve().parent / "standin_service.py"


# ---------------------------------------------------------------- helpers


def proc_state(pid: int) -> str | None:
    """State letter of `pid` from /proc (None when there is no such process)."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return None
    return raw[raw.rindex(")") + 2 :].split()[0]


def alive(pid: int) -> bool:
    """Running: present and neither a zombie nor dead."""
    return proc_state(pid) not in (None, "Z", "X")


def group_members(pgid: int) -> list[int]:
    """Live processes in process group `pgid`."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                raw = (entry / "stat").read_text()
            except (FileNotFoundError, ProcessLookupError):
                continue
            fields = raw[raw.rindex(")") + 2 :].split()
            if fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
                found.append(int(entry.name))
    return found


def listening(port: int) -> bool:
    """Something accepts connections on 127.0.0.1:`port`."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5):
            return True
    except OSError:
        return False


def port_of(url: str) -> int:
    port = urlsplit(url).port
    assert port is not None, url
    return port


class Stack:
    """Runs `evalbus` commands against one state folder."""

    def __init__(self, workdir: Path, env: dict[str, str], database: str) -> None:
        self.workdir = workdir
        self.dir = workdir / ".evalbus"
        self.env = env
        self.database = database

    def run(self, *args: str, timeout: float = 180.0) -> subprocess.CompletedProcess[str]:
        """`evalbus <args> --dir <state dir>`; output captured."""
        return subprocess.run(
            [sys.executable, "-m", "evalbus.cli", *args, "--dir", str(self.dir)],
            capture_output=True,
            text=True,
            env=self.env,
            cwd=self.workdir,
            timeout=timeout,
            check=False,
        )

    def up(self, *args: str) -> subprocess.CompletedProcess[str]:
        """`evalbus up` on this test's own database."""
        return self.run("up", "--database", self.database, *args)

    def endpoints(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads((self.dir / "endpoints.json").read_text())
        return data

    def status(self) -> tuple[int, dict[str, Any]]:
        done = self.run("status", "--json")
        doc: dict[str, Any] = json.loads(done.stdout)
        return done.returncode, doc


def recorded_pids(endpoints: dict[str, Any]) -> dict[str, int]:
    pids = {name: svc["pid"] for name, svc in endpoints["services"].items() if svc["pid"]}
    if endpoints.get("nats_pid"):
        pids["nats"] = endpoints["nats_pid"]
    if endpoints.get("postgres_pid"):
        pids["postgres"] = endpoints["postgres_pid"]
    return pids


def recorded_ports(endpoints: dict[str, Any]) -> dict[str, int]:
    ports = {name: port_of(svc["http"]) for name, svc in endpoints["services"].items()}
    ports["nats"] = port_of(endpoints["nats"])
    ports["nats-monitor"] = port_of(endpoints["nats_monitor"])
    if endpoints["postgres"] == "embedded":
        ports["postgres"] = port_of(endpoints["database"])
    return ports


def assert_nothing_left(pids: dict[str, int], ports: dict[str, int]) -> None:
    still = {name: pid for name, pid in pids.items() if alive(pid)}
    assert not still, f"processes left running: {still}"
    groups = {name: group_members(pid) for name, pid in pids.items()}
    assert not any(groups.values()), f"processes left in their groups: {groups}"
    open_ports = {name: port for name, port in ports.items() if listening(port)}
    assert not open_ports, f"still listening: {open_ports}"


def wait_for(condition: Callable[[], object], what: str, timeout_s: float = 30.0) -> None:
    """Poll `condition` until it holds; fail after `timeout_s`."""
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            pytest.fail(f"timed out waiting for {what}")
        time.sleep(0.05)


def explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"


@pytest.fixture
def stack(tmp_path: Path) -> Iterator[Stack]:
    """A state folder of the test's own; whatever the test leaves up is brought down, and a database
    it created on the `DATABASE_URL` server is dropped."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVALBUS_SERVICE_CMD_")}
    env.pop("EVALBUS_DIR", None)
    database = f"evalbus_up_{uuid.uuid4().hex[:10]}"
    s = Stack(tmp_path, env, database)
    yield s
    if (s.dir / "endpoints.json").exists():
        s.run("down", "--timeout", "2")
    admin = s.env.get("DATABASE_URL")
    if admin:
        asyncio.run(drop_database(admin, with_database(admin, database)))


def use_standins(stack: Stack, **extra_args: str) -> None:
    """Replace each service by the stand-in, with extra arguments for some."""
    for name in SERVICES:
        cmd = [sys.executable, str(STANDIN), *shlex.split(extra_args.get(name, ""))]
        stack.env[f"EVALBUS_SERVICE_CMD_{name.upper()}"] = shlex.join(cmd)


# ---------------------------------------------------------------- the real services


@pytest.mark.e2e
@pytest.mark.slow
def test_up_status_down_with_the_real_services(stack: Stack) -> None:
    done = stack.up()
    assert done.returncode == 0, explain(done)
    endpoints = stack.endpoints()
    assert set(endpoints["services"]) == set(SERVICES)
    assert endpoints["nats"].startswith("nats://127.0.0.1:")
    assert endpoints["gateway"] == endpoints["services"]["gateway"]["http"]
    assert endpoints["postgres"] == ("external" if "DATABASE_URL" in stack.env else "embedded")
    assert endpoints["database"].endswith(f"/{stack.database}")
    token = stack.dir / "token"
    assert stat.S_IMODE(token.stat().st_mode) == 0o600
    assert len(token.read_text().strip()) >= 32

    code, doc = stack.status()
    assert code == 0, doc
    assert doc["healthy"] is True
    assert set(doc["components"]) == {"nats", "postgres", *SERVICES}
    table = stack.run("status")
    assert table.returncode == 0, explain(table)
    assert table.stdout.splitlines()[-1] == f"stack   {stack.dir.resolve()}"  # which stack answered
    for name, component in doc["components"].items():
        assert component["healthy"] is True, (name, component)
    for name in SERVICES:
        assert doc["components"][name]["live"] is True
        assert doc["components"][name]["ready"] is True
        with urllib.request.urlopen(endpoints["services"][name]["metrics"], timeout=5) as resp:
            assert resp.status == 200
    # the collector's OTLP receiver listens where endpoints.json says (an empty export is valid)
    assert endpoints["otlp"].startswith("http://127.0.0.1:")
    export = urllib.request.Request(
        f"{endpoints['otlp']}/v1/traces", data=b"{}", headers={"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(export, timeout=5) as resp:  # noqa: S310 - loopback
        assert resp.status == 200

    again = stack.up()
    assert again.returncode == 0, explain(again)
    assert "already up" in again.stdout
    assert recorded_pids(stack.endpoints()) == recorded_pids(endpoints)

    pids, ports = recorded_pids(endpoints), recorded_ports(endpoints)
    ports["otlp"] = port_of(endpoints["otlp"])
    down = stack.run("down")
    assert down.returncode == 0, explain(down)
    assert_nothing_left(pids, ports)
    code, doc = stack.status()
    assert code != 0
    assert doc["up"] is False


# ---------------------------------------------------------------- mechanics, with stand-in services


@pytest.mark.integration
@pytest.mark.slow
def test_down_escalates_to_sigkill_and_reaps_children(stack: Stack) -> None:
    use_standins(stack, exporter="--ignore-sigterm --with-child")
    done = stack.up()
    assert done.returncode == 0, explain(done)
    code, doc = stack.status()
    assert code == 0, doc
    endpoints = stack.endpoints()
    pids, ports = recorded_pids(endpoints), recorded_ports(endpoints)
    log = Path(endpoints["services"]["exporter"]["log"]).read_text()
    child = int(re.findall(r"child pid (\d+)", log)[-1])
    assert alive(child)

    down = stack.run("down", "--timeout", "1")
    assert down.returncode == 0, explain(down)
    assert re.search(r"exporter\s+killed after the grace period", down.stdout), down.stdout
    assert_nothing_left({**pids, "exporter-child": child}, ports)
    cleared = stack.endpoints()
    assert recorded_pids(cleared) == {}


@pytest.mark.integration
@pytest.mark.slow
def test_up_names_a_service_that_dies_and_shows_its_log(stack: Stack) -> None:
    use_standins(stack, judge="--exit-at-once 3")
    done = stack.up("--timeout", "30")
    assert done.returncode == 1, explain(done)
    assert re.search(r"judge: not running", done.stderr), explain(done)
    assert "failing at start with code 3" in done.stderr
    endpoints = stack.endpoints()
    pids, ports = recorded_pids(endpoints), recorded_ports(endpoints)
    # The others started alongside; the stack stays unhealthy only because of the judge.
    wait_for(lambda: stack.status()[1]["components"]["dispatcher"]["healthy"], "the dispatcher to be healthy")
    code, doc = stack.status()
    assert code == 1
    assert [name for name, c in doc["components"].items() if not c["healthy"]] == ["judge"]

    down = stack.run("down")
    assert down.returncode == 0, explain(down)
    assert_nothing_left(pids, ports)


@pytest.mark.integration
@pytest.mark.slow
def test_up_restarts_what_died_and_keeps_the_rest(stack: Stack) -> None:
    use_standins(stack, collector="--with-child")
    assert (done := stack.up()).returncode == 0, explain(done)
    before = stack.endpoints()
    victim = before["services"]["collector"]["pid"]
    orphan = int(re.findall(r"child pid (\d+)", Path(before["services"]["collector"]["log"]).read_text())[-1])
    os.kill(victim, signal.SIGKILL)
    wait_for(lambda: not alive(victim), f"pid {victim} to die")
    assert alive(orphan)
    code, doc = stack.status()
    assert code == 1
    assert doc["components"]["collector"]["running"] is False

    again = stack.up()
    assert again.returncode == 0, explain(again)
    assert not alive(orphan), "the dead collector's child survived the restart"
    after = stack.endpoints()
    assert after["services"]["collector"]["pid"] != victim
    assert after["services"]["collector"]["http"] == before["services"]["collector"]["http"]
    unchanged = {k: v for k, v in recorded_pids(before).items() if k != "collector"}
    assert {k: v for k, v in recorded_pids(after).items() if k != "collector"} == unchanged
    assert stack.status()[0] == 0
    pids, ports = recorded_pids(after), recorded_ports(after)
    assert stack.run("down").returncode == 0
    assert_nothing_left(pids, ports)


@pytest.mark.integration
@pytest.mark.slow
def test_restart_keeps_ports_and_no_services_mode(stack: Stack) -> None:
    done = stack.up("--no-services")
    assert done.returncode == 0, explain(done)
    first = stack.endpoints()
    assert first["services"] == {}
    code, doc = stack.status()
    assert code == 0, doc
    assert set(doc["components"]) == {"nats", "postgres"}
    assert stack.run("down").returncode == 0
    assert_nothing_left(recorded_pids(first), recorded_ports(first))

    again = stack.up("--no-services")
    assert again.returncode == 0, explain(again)
    second = stack.endpoints()
    assert second["nats"] == first["nats"]
    assert second["database"] == first["database"]
    assert recorded_pids(second).keys() == recorded_pids(first).keys()
    assert stack.run("down").returncode == 0
    assert_nothing_left(recorded_pids(second), recorded_ports(second))


@pytest.mark.integration
@pytest.mark.slow
def test_external_database_gets_its_database_and_schema(stack: Stack, pg_admin_url: str) -> None:
    stack.env["DATABASE_URL"] = pg_admin_url  # the fixture drops the database afterwards
    done = stack.up("--no-services")
    assert done.returncode == 0, explain(done)
    endpoints = stack.endpoints()
    assert endpoints["postgres"] == "external"
    assert endpoints["database"] == with_database(pg_admin_url, stack.database)
    assert "postgres" not in recorded_pids(endpoints)

    async def tables() -> set[str]:
        conn = await asyncpg.connect(endpoints["database"])
        try:
            rows = await conn.fetch("select tablename from pg_tables where schemaname = 'public'")
        finally:
            await conn.close()
        return {r["tablename"] for r in rows}

    assert "schema_migrations" in asyncio.run(tables())
    assert stack.run("down").returncode == 0
    assert_nothing_left(recorded_pids(endpoints), recorded_ports(endpoints))


@pytest.mark.e2e
@pytest.mark.slow
def test_a_database_serves_one_stack(stack: Stack, pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    """Two stacks on one PostgreSQL server never share an event store (the second's recorder would
    take its stream's first events for the first's, recorded already, and hang): the one named
    explicitly is refused, and this folder's next stack after `.evalbus` was removed is one too."""
    stack.env["DATABASE_URL"] = pg_admin_url
    first = stack.up("--no-services")
    assert first.returncode == 0, explain(first)
    # A plain `up` keeps the database this stack used (no --database needed again).
    again = stack.run("up", "--no-services")
    assert again.returncode == 0, explain(again)
    assert stack.endpoints()["database"] == with_database(pg_admin_url, stack.database)

    other = Stack(tmp_path_factory.mktemp("other-stack"), dict(stack.env), stack.database)
    try:
        refused = other.up("--no-services")
        assert refused.returncode == 1, explain(refused)
        assert f"database {stack.database} is the event store of the stack in {stack.dir}" in refused.stderr
        assert "--database NAME" in refused.stderr
        assert "evalbus down" not in refused.stderr  # it started nothing: nothing to stop
        assert not (other.dir / "endpoints.json").exists() or not recorded_pids(other.endpoints())
    finally:
        if (other.dir / "endpoints.json").exists():
            other.run("down", "--timeout", "5")

    # A different explicit database for the running stack: named, with what to do.
    moved = stack.run("up", "--no-services", "--database", "evalbus_elsewhere")
    assert moved.returncode == 1, explain(moved)
    assert f"the stack runs with database {stack.database}, not evalbus_elsewhere" in moved.stderr

    assert stack.run("down").returncode == 0
    shutil.rmtree(stack.dir)  # the folder's stack is gone; its events would stay in the database
    named = stack.up("--no-services")
    assert named.returncode == 1, explain(named)
    assert f"is the event store of the stack in {stack.dir} (since removed)" in named.stderr


@pytest.mark.integration
def test_status_and_down_before_any_up(stack: Stack) -> None:
    code, doc = stack.status()
    assert code == 1
    assert doc == {"healthy": False, "up": False, "dir": str(stack.dir), "components": {}}
    down = stack.run("down")
    assert down.returncode == 0, explain(down)
    assert "nothing to stop" in down.stdout
