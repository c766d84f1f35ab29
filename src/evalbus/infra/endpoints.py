"""`.evalbus/endpoints.json`: what `evalbus up` started and where it listens.

Other tools read it to find the stack (`nats`, `gateway`, `database`, each service's `metrics`);
`status` and `down` read the pids from it. `down` clears the pids but keeps the file, so the next
`up` can listen on the same ports again when they are still free.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Literal
from urllib.parse import quote, urlsplit, urlunsplit

import msgspec

from evalbus.infra.processes import ProcessId

SERVICES: tuple[str, ...] = ("dispatcher", "judge", "exporter", "collector", "gateway")
"""The five services `up` starts, in start order."""

PostgresKind = Literal["external", "embedded"]
"""`external`: the server named by `DATABASE_URL`; `embedded`: the wheel's server under `<dir>/pg`."""


class ServiceEndpoint(msgspec.Struct, frozen=True, kw_only=True):
    """One service process and its HTTP port (`/healthz`, `/readyz`, `/metrics`)."""

    pid: int | None = None
    """Process id while it runs (None after `down`)."""
    started: int | None = None
    """Kernel start time of `pid` (guards against a reused pid)."""
    http: str
    """Base URL of its health and metrics server."""
    metrics: str
    """Prometheus scrape URL."""
    log: str
    """Log file (stdout and stderr)."""

    @property
    def process(self) -> ProcessId | None:
        """The recorded process, if any."""
        return None if self.pid is None else ProcessId(self.pid, self.started)

    @property
    def port(self) -> int:
        """Its HTTP port."""
        return url_port(self.http)


class Endpoints(msgspec.Struct, frozen=True, kw_only=True):
    """The contents of `endpoints.json`."""

    nats: str | None = None
    """NATS client URL."""
    nats_monitor: str | None = None
    """nats-server HTTP monitoring base URL (`/healthz?js-enabled-only=true`)."""
    nats_pid: int | None = None
    """nats-server pid while it runs."""
    nats_started: int | None = None
    """Kernel start time of `nats_pid`."""
    nats_log: str | None = None
    """nats-server log file."""
    nats_users: str | None = None
    """With `evalbus up --secure`: the file (mode 0600) holding each NATS user's password; the
    services connect as their own least-privilege user, the CLI as `admin`."""
    database: str | None = None
    """PostgreSQL URL of the `evalbus` database."""
    postgres: PostgresKind | None = None
    """Which PostgreSQL server."""
    postgres_pid: int | None = None
    """Postmaster pid of the embedded server while it runs."""
    postgres_started: int | None = None
    """Kernel start time of `postgres_pid`."""
    postgres_log: str | None = None
    """Embedded server log file."""
    gateway: str | None = None
    """The gateway's HTTP URL."""
    otlp: str | None = None
    """The collector's OTLP/HTTP receiver base URL (production traces go to `<otlp>/v1/traces`)."""
    services: dict[str, ServiceEndpoint] = msgspec.field(default_factory=dict)
    """Service name → process and URLs."""
    token_file: str | None = None
    """File holding the local admin token."""
    stack_id: str | None = None
    """This stack's id (random, made by its first `up`): the mark on its PostgreSQL database, so
    no other stack — nor this folder's next stack after `.evalbus` was removed — takes it for its own."""

    @property
    def nats_process(self) -> ProcessId | None:
        """The recorded nats-server process, if any."""
        return None if self.nats_pid is None else ProcessId(self.nats_pid, self.nats_started)

    @property
    def postgres_process(self) -> ProcessId | None:
        """The recorded embedded postmaster, if any."""
        return None if self.postgres_pid is None else ProcessId(self.postgres_pid, self.postgres_started)

    def processes(self) -> dict[str, ProcessId]:
        """Every recorded process by component name."""
        out = {name: svc.process for name, svc in self.services.items()}
        out["nats"] = self.nats_process
        out["postgres"] = self.postgres_process
        return {name: proc for name, proc in out.items() if proc is not None}


def endpoints_path(state_dir: Path) -> Path:
    """`<state_dir>/endpoints.json`."""
    return state_dir / "endpoints.json"


def load_endpoints(state_dir: Path) -> Endpoints | None:
    """The recorded endpoints, or None when `up` never ran here."""
    try:
        data = endpoints_path(state_dir).read_bytes()
    except FileNotFoundError:
        return None
    return msgspec.json.decode(data, type=Endpoints)


def save_endpoints(state_dir: Path, endpoints: Endpoints) -> None:
    """Write `endpoints.json` atomically, readable by its owner only (the database URL may hold a password)."""
    path = endpoints_path(state_dir)
    tmp = path.with_suffix(".json.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(msgspec.json.format(msgspec.json.encode(endpoints), indent=2) + b"\n")
    os.replace(tmp, path)


def url_port(url: str) -> int:
    """The port of a URL that names one."""
    port = urlsplit(url).port
    if port is None:
        raise ValueError(f"no port in {url!r}")
    return port


def url_as(url: str, user: str, password: str) -> str:
    """`url` (a server's, without credentials) with `user`'s credentials."""
    parts = urlsplit(url)
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{parts.hostname}:{parts.port}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))


def redact_url(url: str) -> str:
    """`url` with any password replaced, for printing."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    host = parts.hostname or ""
    netloc = f"{parts.username or ''}:***@{host}" + (f":{parts.port}" if parts.port else "")
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
