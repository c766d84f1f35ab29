"""The five services as real processes against a given NATS and PostgreSQL, for end-to-end tests
and benchmarks: start, wait until ready, SIGKILL, restart, stop.

    stack = ServiceStack(nats_url, database_url, tmp_path)
    stack.start_all()                     # gateway, dispatcher, collector, judge, exporter
    stack.kill("judge"); stack.start("judge")
    client = stack.client()               # evalbus_api.client for the gateway
"""

from __future__ import annotations

import os
import secrets
import signal
import subprocess
import sys
import time
import typing
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from evalbus.infra.nats import NatsServer
from evalbus.infra.ports import free_port
from evalbus_api.client import GatewayClient

SERVICES = ("gateway", "dispatcher", "collector", "judge", "exporter")
PORT_RETRIES = 3
"""Starts again on other ports after a free port was taken before the service bound it."""
ADDRESS_IN_USE = "address already in use"


@dataclass
class ServiceProc:
    """One running service process."""

    name: str
    process: subprocess.Popen[bytes]
    port: int
    log_path: Path
    log_file: typing.IO[bytes]
    extra_env: dict[str, str] = field(default_factory=dict)
    """What `start` was given beside the stack's environment (a start again gets it too)."""
    new_ports: bool = False
    """Whether its ports were picked for this start (no client knows them yet: they may change
    when the start fails on a port taken meanwhile)."""

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"


@dataclass
class ServiceStack:
    """Services of one test (or benchmark), each a `python -m evalbus_<name>` process."""

    nats_url: str
    database_url: str
    workdir: Path
    env: dict[str, str] = field(default_factory=dict)
    """Environment for every service."""
    service_env: dict[str, dict[str, str]] = field(default_factory=dict)
    """Extra environment per service name (`"judge"` applies to its replicas `"judge@2"`… too;
    `"judge@2"` to that replica alone, after it)."""
    admin_token: str = field(default_factory=lambda: secrets.token_hex(16))
    procs: dict[str, ServiceProc] = field(default_factory=dict)
    otlp_port: int = 0
    """The collector's OTLP/HTTP receiver port (picked at its first start)."""
    _starts: int = 0
    _otlp_ports: dict[str, int] = field(default_factory=dict)

    def start(self, name: str, *, wait: bool = True, **extra_env: str) -> ServiceProc:
        """Start (or restart) service `name`; wait until `/readyz` answers 200. `judge@2` is
        another replica of the judge (the part before `@` names the service). A restart keeps
        the ports it had."""
        return self._start(name, wait=wait, fresh=False, extra_env=extra_env)

    def _start(self, name: str, *, wait: bool, fresh: bool, extra_env: Mapping[str, str]) -> ServiceProc:
        """`start`; with `fresh`, on new ports (a first start whose ports were taken)."""
        old = self.procs.get(name)
        if old is not None and old.process.poll() is None:
            raise RuntimeError(f"{name} is already running")
        if old is not None:
            old.log_file.close()  # the old process's log; a new one is opened below
        new_ports = old is None or fresh
        port = self._new_port() if new_ports or old is None else old.port
        self._starts += 1
        log_path = self.workdir / f"{name}-{self._starts}.log"
        log_file = open(log_path, "wb")  # noqa: SIM115 - closed in stop()
        module = name.split("@", 1)[0]
        if module == "collector" and not self.otlp_port:
            self.otlp_port = self._new_port()
        env = {
            **os.environ,
            "NATS_URL": self.nats_url,
            "DATABASE_URL": self.database_url,
            "HTTP_HOST": "127.0.0.1",
            "HTTP_PORT": str(port),
            "GATEWAY_ADMIN_TOKEN": self.admin_token,
            "EVALBUS_STATE_DIR": str(self.workdir),
            "LOG_LEVEL": "INFO",
            "SHUTDOWN_TIMEOUT_S": "10",
            **self.env,
            **self.service_env.get(module, {}),  # a replica ("judge@2") is configured as its service
            **(self.service_env.get(name, {}) if name != module else {}),
            **extra_env,
        }
        if module == "collector":  # a replica gets a receiver of its own
            otlp = self.otlp_port if name == "collector" else self._otlp_ports.setdefault(name, self._new_port())
            env["COLLECTOR_OTLP_PORT"] = str(otlp)
        proc = subprocess.Popen(
            [sys.executable, "-m", f"evalbus_{module}"],
            env=env,
            stdout=log_file,
            stderr=subprocess.STDOUT,
            cwd=self.workdir,
        )
        sp = ServiceProc(
            name=name,
            process=proc,
            port=port,
            log_path=log_path,
            log_file=log_file,
            extra_env=dict(extra_env),
            new_ports=new_ports,
        )
        self.procs[name] = sp
        if wait:
            self.wait_ready(name)
        return self.procs[name]  # another one when it had to start again on other ports

    def _forget_ports(self, name: str) -> None:
        """Let the next start of `name` pick new ports (its HTTP port and its OTLP receiver's)."""
        if name == "collector":
            self.otlp_port = 0
        self._otlp_ports.pop(name, None)

    def _new_port(self) -> int:
        # Services started together could be handed the same free port before either binds it.
        taken = {sp.port for sp in self.procs.values()} | {self.otlp_port, *self._otlp_ports.values()}
        while (port := free_port()) in taken:
            pass
        return port

    def start_all(self, names: typing.Iterable[str] = SERVICES) -> None:
        """Start every named service, then wait for all of them."""
        for name in names:
            self.start(name, wait=False)
        for name in names:
            self.wait_ready(name)

    def wait_ready(self, name: str, timeout_s: float = 60.0) -> None:
        """Block until `name` answers 200 on `/readyz` (raise with its log tail if it dies). A first
        start that lost its free port to another process before it could bind it (tests run in
        parallel) is started again on other ports, up to `PORT_RETRIES` times."""
        sp = self.procs[name]
        deadline = time.monotonic() + timeout_s
        retries = PORT_RETRIES
        while True:
            if sp.process.poll() is not None:
                if retries > 0 and sp.new_ports and ADDRESS_IN_USE in self.log_tail(name):
                    retries -= 1
                    self._forget_ports(name)
                    sp = self._start(name, wait=False, fresh=True, extra_env=sp.extra_env)
                    continue
                raise RuntimeError(f"{name} exited with {sp.process.returncode}:\n{self.log_tail(name)}")
            try:
                with urllib.request.urlopen(f"{sp.url}/readyz", timeout=1) as resp:  # noqa: S310 - loopback
                    if resp.status == 200:
                        return
            except OSError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"{name} not ready after {timeout_s}s:\n{self.log_tail(name)}")
            time.sleep(0.05)

    def kill(self, name: str, sig: int = signal.SIGKILL) -> None:
        """Send `sig` (SIGKILL by default) to `name` and wait for it to exit."""
        sp = self.procs[name]
        if sp.process.poll() is None:
            sp.process.send_signal(sig)
            sp.process.wait(timeout=60)

    def restart(self, name: str) -> ServiceProc:
        """SIGKILL `name` if it runs, then start it again on the same port."""
        self.kill(name)
        return self.start(name)

    def stop(self) -> None:
        """Stop every service (SIGTERM, then SIGKILL after 15 s) and close the logs."""
        for sp in self.procs.values():
            if sp.process.poll() is None:
                sp.process.send_signal(signal.SIGTERM)
        for sp in self.procs.values():
            try:
                sp.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                sp.process.kill()
                sp.process.wait()
            sp.log_file.close()

    def log_tail(self, name: str, lines: int = 40) -> str:
        """The last lines of the current log of `name`."""
        text = self.procs[name].log_path.read_text(errors="replace")
        return "\n".join(text.splitlines()[-lines:])

    @property
    def otlp_url(self) -> str:
        """Base URL of the collector's OTLP/HTTP receiver (`<url>/v1/traces`)."""
        return f"http://127.0.0.1:{self.otlp_port}"

    def otlp_url_of(self, name: str) -> str:
        """Base URL of the OTLP/HTTP receiver of collector replica `name` (`collector@2`...)."""
        port = self.otlp_port if name == "collector" else self._otlp_ports[name]
        return f"http://127.0.0.1:{port}"

    @property
    def gateway_url(self) -> str:
        """Base URL of the gateway."""
        return self.procs["gateway"].url

    def headers(self) -> Mapping[str, str]:
        """Admin auth headers for the gateway."""
        return {"Authorization": f"Bearer {self.admin_token}"}

    def client(self, token: str | None = None) -> GatewayClient:
        """A client of the gateway (admin token unless another is given); close it (`async with`)."""
        return GatewayClient(self.gateway_url, self.admin_token if token is None else token)


@pytest.fixture
def service_stack(fresh_nats: NatsServer, database_url: str, tmp_path: Path) -> Iterator[ServiceStack]:
    """A stack of the test's own (own nats-server, own database); services are started by the test."""
    stack = ServiceStack(nats_url=fresh_nats.url, database_url=database_url, workdir=tmp_path)
    yield stack
    stack.stop()
