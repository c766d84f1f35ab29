"""The local-stack pieces `evalbus up/status/down` are made of, one at a time: the endpoints file,
the admin token, service command and environment, log tails, process liveness and stopping."""

from __future__ import annotations

import os
import signal
import stat
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from evalbus.cli.status import render_table
from evalbus.infra.endpoints import Endpoints, ServiceEndpoint, load_endpoints, redact_url, save_endpoints
from evalbus.infra.health import ComponentHealth, StackHealth
from evalbus.infra.processes import ProcessId, group_members, identify, is_alive, spawn_detached, stop
from evalbus.infra.stack import RUN_MARKER, ensure_token, log_tail, service_command, service_env


@pytest.mark.unit
def test_endpoints_round_trip_privately(tmp_path: Path) -> None:
    svc = ServiceEndpoint(
        pid=12, started=34, http="http://127.0.0.1:1234", metrics="http://127.0.0.1:1234/metrics", log="x"
    )
    endpoints = Endpoints(
        nats="nats://127.0.0.1:4222", database="postgresql://u:secret@h:5/evalbus", services={"judge": svc}
    )
    assert load_endpoints(tmp_path) is None
    save_endpoints(tmp_path, endpoints)
    assert load_endpoints(tmp_path) == endpoints
    assert stat.S_IMODE((tmp_path / "endpoints.json").stat().st_mode) == 0o600
    assert endpoints.processes() == {"judge": ProcessId(12, 34)}
    assert svc.port == 1234


@pytest.mark.unit
def test_redact_url_hides_only_the_password() -> None:
    assert (
        redact_url("postgresql://u:secret@db:5432/x?sslmode=require") == "postgresql://u:***@db:5432/x?sslmode=require"
    )
    assert redact_url("postgresql://postgres@127.0.0.1:5432/evalbus") == "postgresql://postgres@127.0.0.1:5432/evalbus"


@pytest.mark.unit
def test_token_is_private_random_and_stable(tmp_path: Path) -> None:
    path = tmp_path / "token"
    token = ensure_token(path)
    assert len(token) >= 32
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert ensure_token(path) == token
    assert ensure_token(tmp_path / "other") != token
    path.write_text("")
    path.chmod(0o644)
    renewed = ensure_token(path)
    assert renewed
    assert renewed != token
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.unit
def test_service_command_defaults_to_the_module_and_honours_the_override() -> None:
    assert service_command("judge", {}) == [sys.executable, "-m", "evalbus_judge"]
    env = {"EVALBUS_SERVICE_CMD_JUDGE": "python 'my judge.py' --fast"}
    assert service_command("judge", env) == ["python", "my judge.py", "--fast"]
    assert service_command("gateway", env) == [sys.executable, "-m", "evalbus_gateway"]


@pytest.mark.unit
def test_service_env_owns_its_keys_and_gives_the_token_to_the_gateway_only(tmp_path: Path) -> None:
    caller = {
        "PATH": "/bin",
        "JUDGE_HTTP_PORT": "1",
        "JUDGE_NATS_URL": "nats://elsewhere:1",
        "JUDGE_CONCURRENCY": "3",
        "GATEWAY_ADMIN_TOKEN": "stale",
    }

    def env_for(name: str) -> dict[str, str]:
        return service_env(
            name,
            caller,
            nats="nats://127.0.0.1:4222",
            database="postgresql://db/evalbus",
            port=5555,
            state_dir=tmp_path,
            token="tok",
        )

    judge = env_for("judge")
    assert judge["HTTP_PORT"] == "5555"
    assert judge["HTTP_HOST"] == "127.0.0.1"
    assert judge["NATS_URL"] == "nats://127.0.0.1:4222"
    assert judge["DATABASE_URL"] == "postgresql://db/evalbus"
    assert judge["EVALBUS_STATE_DIR"] == str(tmp_path)
    assert "JUDGE_HTTP_PORT" not in judge
    assert "JUDGE_NATS_URL" not in judge
    assert judge["JUDGE_CONCURRENCY"] == "3"
    assert "GATEWAY_ADMIN_TOKEN" not in judge
    gateway = env_for("gateway")
    assert gateway["GATEWAY_ADMIN_TOKEN"] == "tok"


@pytest.mark.unit
def test_log_tail_starts_at_the_last_run(tmp_path: Path) -> None:
    log = tmp_path / "svc.log"
    assert log_tail(log) == ""
    log.write_text(f"{RUN_MARKER} one\nold failure\n{RUN_MARKER} two\n" + "".join(f"line {i}\n" for i in range(30)))
    tail = log_tail(log, lines=5).splitlines()
    assert tail == [f"line {i}" for i in range(25, 30)]
    assert "old failure" not in log_tail(log, lines=100)
    assert log_tail(log, lines=100).startswith(f"{RUN_MARKER} two")


@pytest.mark.unit
def test_status_table_lists_every_component() -> None:
    health = StackHealth(
        components=(
            ComponentHealth(name="nats", kind="nats", healthy=True, detail="JetStream ready", url="nats://x:1", pid=7),
            ComponentHealth(name="judge", kind="service", healthy=False, detail="not running"),
        )
    )
    lines = render_table(health).splitlines()
    assert lines[0].split() == ["COMPONENT", "STATE", "PID", "URL", "DETAIL"]
    assert lines[1].split() == ["nats", "healthy", "7", "nats://x:1", "JetStream", "ready"]
    assert lines[2].split() == ["judge", "UNHEALTHY", "-", "-", "not", "running"]
    assert not health.healthy


def _wait(condition: Callable[[], bool], timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.02)


@pytest.mark.integration
def test_is_alive_sees_through_zombies_and_reused_pids() -> None:
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        me = identify(child.pid)
        assert me.started is not None
        assert is_alive(me)
        assert not is_alive(ProcessId(child.pid, me.started + 1))  # same pid, another process
        child.send_signal(signal.SIGKILL)
        # Not reaped yet: a zombie, which must count as gone.
        _wait(lambda: Path(f"/proc/{child.pid}/stat").read_text().split(") ")[1][0] == "Z")
        assert not is_alive(me)
    finally:
        child.kill()
        child.wait()


_STUBBORN = (
    "import signal, subprocess, sys, time\n"
    "signal.signal(signal.SIGTERM, signal.SIG_IGN)\n"
    "code = 'import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(60)'\n"
    "c = subprocess.Popen([sys.executable, '-c', code])\n"
    "print(c.pid, flush=True)\n"
    "time.sleep(60)\n"
)
"""A group leader that ignores SIGTERM and starts a child that ignores it too; prints the child's pid."""


def _spawn_stubborn(log: Path) -> tuple[ProcessId, int]:
    leader = spawn_detached([sys.executable, "-c", _STUBBORN], {}, log)
    _wait(lambda: log.read_text().strip() != "")
    return leader, int(log.read_text().split()[0])


@pytest.mark.integration
def test_stop_escalates_and_leaves_no_group_member(tmp_path: Path) -> None:
    polite = spawn_detached([sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "polite.log")
    stubborn, child = _spawn_stubborn(tmp_path / "stubborn.log")
    assert set(group_members(stubborn.pid)) == {stubborn.pid, child}
    killed = stop([polite, stubborn], timeout_s=0.5)
    assert killed == [stubborn]
    assert not is_alive(polite)
    assert not is_alive(stubborn)
    assert group_members(stubborn.pid) == []
    assert group_members(polite.pid) == []


@pytest.mark.integration
def test_stop_kills_what_a_dead_leader_left_but_never_a_reused_pid(tmp_path: Path) -> None:
    leader, child = _spawn_stubborn(tmp_path / "stubborn.log")
    os.kill(leader.pid, signal.SIGKILL)
    _wait(lambda: not is_alive(leader))
    assert group_members(leader.pid) == [child]
    assert stop([leader], timeout_s=0.5) == []
    assert group_members(leader.pid) == []

    foreign = spawn_detached([sys.executable, "-c", "import time; time.sleep(60)"], {}, tmp_path / "foreign.log")
    assert foreign.started is not None
    impostor = ProcessId(foreign.pid, foreign.started - 1)  # what we recorded, before the pid was reused
    assert stop([impostor], timeout_s=0.5) == []
    assert is_alive(foreign)
    stop([foreign], timeout_s=5)
    assert not is_alive(foreign)


@pytest.mark.unit
def test_free_port_never_hands_out_the_same_port_twice_in_a_row() -> None:
    """Ports are taken only when their server binds them; two stacks starting together must not
    both be given one (the kernel may offer the same port to consecutive `bind(0)` calls)."""
    from evalbus.infra.ports import free_port

    ports = [free_port() for _ in range(300)]
    assert len(set(ports)) == len(ports)
