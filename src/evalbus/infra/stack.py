"""A local evalbus stack under one state folder (`.evalbus/` by default): bring it up, down, check it.

Layout of the state folder:

    endpoints.json     what runs and where (see `evalbus.infra.endpoints`)
    token              the local admin token (mode 0600), given to the gateway as GATEWAY_ADMIN_TOKEN
    nats/              nats-server config and JetStream data
    pg/                the embedded PostgreSQL server (only without DATABASE_URL)
    logs/<name>.log    nats-server and each service's stdout and stderr

`bring_up` converges: whatever recorded process still runs is kept, whatever is missing is
started, so running it twice is harmless. Every process runs in a session of its own and outlives
the command; `bring_down` stops them by their recorded pids.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import secrets
import shlex
import signal
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

import asyncpg
import msgspec
from msgspec.structs import replace

from evalbus.infra import nats_accounts
from evalbus.infra.endpoints import (
    SERVICES,
    Endpoints,
    ServiceEndpoint,
    load_endpoints,
    redact_url,
    save_endpoints,
    url_as,
    url_port,
)
from evalbus.infra.health import StackHealth, check_stack
from evalbus.infra.lanes import render_accounts
from evalbus.infra.nats import start_nats
from evalbus.infra.ports import free_port, port_is_free
from evalbus.infra.postgres import (
    DatabaseTaken,
    claim_database,
    embedded_log,
    embedded_postmaster,
    ensure_database,
    start_embedded_postgres,
    stop_embedded_postgres,
    with_database,
)
from evalbus.infra.processes import ProcessId, identify, is_alive, spawn_detached, stop
from evalbus_runtime.nkeys import AccountKey

MIGRATIONS_MODULE = "evalbus_gateway.store.migrate"
"""Module whose `migrate(connection)` brings the event store schema up to date."""

SERVICE_CMD_ENV = "EVALBUS_SERVICE_CMD_"
"""`EVALBUS_SERVICE_CMD_<SERVICE>` replaces `python -m evalbus_<service>` (a shell-quoted command)."""

# Settings `up` owns for every service. The chassis reads `<SERVICE>_<KEY>` before `<KEY>`, so a
# prefixed variable left in the caller's environment would silently override what `up` recorded.
_MANAGED_KEYS = ("NATS_URL", "DATABASE_URL", "HTTP_HOST", "HTTP_PORT", "STATE_DIR", "ADMIN_TOKEN", "OTLP_PORT")

RUN_MARKER = "==== evalbus up"
"""First line `up` appends to a service's log before starting it: tails start after the last one."""

Say = Callable[[str], None]
"""Where progress lines go."""


class UpError(RuntimeError):
    """The stack could not be brought up; `component` names what failed."""

    def __init__(self, component: str, message: str, log: Path | None = None, *, started: bool = True) -> None:
        super().__init__(f"{component}: {message}")
        self.component = component
        self.message = message
        self.log = log
        self.started = started
        """Whether anything may have been started before it failed (False: refused up front)."""


class UnhealthyError(RuntimeError):
    """Components did not become healthy before the deadline (or their process died)."""

    def __init__(self, health: StackHealth, logs: Mapping[str, Path]) -> None:
        names = ", ".join(c.name for c in health.unhealthy())
        super().__init__(f"not healthy: {names}")
        self.health = health
        self.logs = dict(logs)


@dataclass(frozen=True)
class UpOptions:
    """What `bring_up` starts and how."""

    state_dir: Path
    """The state folder."""
    services: bool = True
    """Start the five services (False: only nats-server and PostgreSQL)."""
    nats_port: int | None = None
    """Fixed NATS client port (None: the remembered one when free, else any free port)."""
    database_url: str | None = None
    """Server to use (`DATABASE_URL`); None starts the embedded server."""
    database_name: str | None = None
    """Database created on that server when missing (None: the one this stack used before, else
    `evalbus`; a default that is another stack's event store gives way to one of this stack's own)."""
    timeout_s: float = 60.0
    """How long to wait for everything to become healthy."""
    secure: bool = False
    """Run NATS with the deployments' least-privilege users (`evalbus.infra.nats_accounts`): each
    service connects as its own user, the CLI as `admin`; passwords in `nats/users.json` (0600)."""


@dataclass
class UpResult:
    """What `bring_up` did."""

    endpoints: Endpoints
    """The recorded endpoints."""
    health: StackHealth
    """Health once everything answered."""
    started: list[str] = field(default_factory=list)
    """Components started by this call."""
    kept: list[str] = field(default_factory=list)
    """Components that were already running."""
    migrations: str = ""
    """What happened to the schema."""


@dataclass(frozen=True)
class _Layout:
    root: Path

    @property
    def nats_dir(self) -> Path:
        return self.root / "nats"

    @property
    def pg_dir(self) -> Path:
        return self.root / "pg"

    @property
    def logs(self) -> Path:
        return self.root / "logs"

    @property
    def token(self) -> Path:
        return self.root / "token"

    @property
    def runner_issuer(self) -> Path:
        return self.nats_dir / "runner-issuer.seed"

    def log(self, name: str) -> Path:
        return self.logs / f"{name}.log"


def _quiet(_: str) -> None:
    """Discard progress lines."""


def ensure_token(path: Path) -> str:
    """The local admin token in `path`, created (random, mode 0600) when missing."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except FileExistsError:
        os.chmod(path, 0o600)
        token = path.read_text().strip()
        if token:
            return token
        fd = os.open(path, os.O_WRONLY | os.O_TRUNC)
    token = secrets.token_urlsafe(32)
    with os.fdopen(fd, "w") as f:
        f.write(token + "\n")
    return token


def apply_migrations(database_url: str) -> str:
    """Bring the event store schema up to date with the gateway's migrations; say what happened.

    Guarded so the stack still comes up in a checkout where the gateway's store is absent.
    """
    try:
        from evalbus_gateway.store.migrate import migrate
    except ModuleNotFoundError as e:
        if e.name not in {"evalbus_gateway", "evalbus_gateway.store", MIGRATIONS_MODULE}:
            raise
        return f"skipped ({MIGRATIONS_MODULE} is not available)"

    async def run() -> list[int]:
        conn = await asyncpg.connect(database_url, timeout=10)
        try:
            return await migrate(conn)
        finally:
            await conn.close()

    applied = asyncio.run(run())
    return f"applied {', '.join(f'{v:04d}' for v in applied)}" if applied else "up to date"


def log_tail(path: Path | None, lines: int = 20) -> str:
    """The last `lines` lines of a log file since `up` last started its process ("" when there is none)."""
    if path is None:
        return ""
    try:
        with path.open("rb") as f:
            f.seek(0, os.SEEK_END)
            f.seek(max(0, f.tell() - 16384))
            text = f.read().decode("utf-8", errors="replace")
    except (FileNotFoundError, PermissionError):
        return ""
    tail = text.splitlines()
    starts = [i for i, line in enumerate(tail) if line.startswith(RUN_MARKER)]
    if starts:
        tail = tail[starts[-1] :]
    return "\n".join(tail[-lines:])


def component_logs(endpoints: Endpoints) -> dict[str, Path]:
    """Log file of each component, by name."""
    logs = {name: Path(svc.log) for name, svc in endpoints.services.items()}
    if endpoints.nats_log:
        logs["nats"] = Path(endpoints.nats_log)
    if endpoints.postgres_log:
        logs["postgres"] = Path(endpoints.postgres_log)
    return logs


def _pick_port(remembered: int | None, taken: set[int]) -> int:
    """The remembered port when it is still free, else a fresh free one not in `taken`."""
    if remembered and remembered not in taken and port_is_free(remembered):
        return remembered
    while True:
        port = free_port()
        if port not in taken:
            return port


def _alive(proc: ProcessId | None) -> bool:
    return proc is not None and is_alive(proc)


DEFAULT_DATABASE = "evalbus"
"""The database `up` creates on the server `DATABASE_URL` names (or the embedded one)."""


def _database_name(previous: Endpoints, opts: UpOptions) -> tuple[str, bool]:
    """The database to use on the `DATABASE_URL` server and whether this stack used it before."""
    before = None
    same_server = bool(previous.database and opts.database_url) and _server(previous.database or "") == _server(
        opts.database_url or ""
    )
    if previous.postgres == "external" and same_server:
        before = urlsplit(previous.database or "").path.lstrip("/") or None
    name = opts.database_name or before or DEFAULT_DATABASE
    return name, name == before


def _server(url: str) -> tuple[str | None, int]:
    """Where a PostgreSQL URL points: host and port (not who connects: a changed password is the
    same server, and its database the same stack's)."""
    parts = urlsplit(url)
    return parts.hostname, parts.port or 5432


def _same_database(a: str, b: str) -> bool:
    return _server(a) == _server(b) and urlsplit(a).path == urlsplit(b).path


def _check_compatible(previous: Endpoints, opts: UpOptions, external_url: str | None) -> None:
    """Refuse to mix a running stack with a different NATS port or PostgreSQL."""
    running = [name for name, proc in previous.processes().items() if is_alive(proc)]
    if not running:
        return
    wanted = "external" if opts.database_url else "embedded"
    if previous.postgres is not None and previous.postgres != wanted:
        raise UpError(
            "postgres", f"the stack runs with {previous.postgres} PostgreSQL; run `evalbus down` first", started=False
        )
    if (
        external_url is not None
        and previous.database is not None
        and not _same_database(previous.database, external_url)
    ):
        assert previous.database is not None
        raise UpError(
            "postgres",
            f"the stack runs with database {urlsplit(previous.database).path.lstrip('/')}, not "
            f"{urlsplit(external_url).path.lstrip('/')}: leave --database out, or run `evalbus down` first",
            started=False,
        )
    if _alive(previous.nats_process) and bool(previous.nats_users) != opts.secure:
        now, wanted = ("with", "without") if previous.nats_users else ("without", "with")
        raise UpError(
            "nats", f"nats-server runs {now} --secure; run `evalbus down` first to start it {wanted}", started=False
        )
    if opts.nats_port and _alive(previous.nats_process) and previous.nats and url_port(previous.nats) != opts.nats_port:
        raise UpError(
            "nats", f"nats-server runs on {previous.nats}; run `evalbus down` first to change the port", started=False
        )


def ensure_nats_users(path: Path) -> dict[str, str]:
    """Every NATS user's password (`evalbus.infra.nats_accounts.users()`), made once at random and
    kept in `path` with mode 0600; a user added by a newer release gets one too."""
    known: dict[str, str] = {}
    if path.exists():
        known = msgspec.json.decode(path.read_bytes(), type=dict[str, str])
    wanted = {user: _kept(known.get(user)) or new_nats_password() for user in nats_accounts.users()}
    # the lane users `evalbus lane credential` added are kept
    wanted |= {user: pw for user, pw in known.items() if user.startswith(nats_accounts.LANE_USER_PREFIX)}
    if wanted != known:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(msgspec.json.encode(wanted))
    os.chmod(path, 0o600)
    return wanted


def ensure_runner_issuer(path: Path) -> AccountKey:
    """The runners' credential check's account key (its seed kept in `path`, mode 0600, made once):
    the public key goes to nats-server (`$NATS_RUNNER_ISSUER`), the seed to the dispatchers."""
    if path.exists():
        with contextlib.suppress(ValueError):
            return AccountKey.from_seed(path.read_text(encoding="utf-8"))
    key = AccountKey.generate()
    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w", encoding="utf-8") as f:
        f.write(key.seed + "\n")
    os.chmod(path, 0o600)
    return key


def new_nats_password() -> str:
    """A random password nats-server reads back intact from `$NATS_PASSWORD_<USER>`: it parses a
    variable's value as configuration, so a value that looks like a number (`12e4…`, `-3…`) or has
    punctuation may come back as something else, or not parse at all, and the server does not
    start. A letter, then hex, is always a plain string (and needs no quoting in a URL)."""
    return "p" + secrets.token_hex(24)


def _kept(password: str | None) -> str | None:
    """A recorded password, when it is of the safe form (older files may hold others)."""
    return password if password and password[0].isalpha() and password.isalnum() else None


def nats_url_as(endpoints: Endpoints, user: str) -> str:
    """The NATS URL for `user` (a service's name, or `admin`): with its password when the stack
    runs `--secure`, else the plain URL."""
    assert endpoints.nats is not None
    if not endpoints.nats_users:
        return endpoints.nats
    passwords = msgspec.json.decode(Path(endpoints.nats_users).read_bytes(), type=dict[str, str])
    return url_as(endpoints.nats, user, passwords[user])


def _up_nats(layout: _Layout, previous: Endpoints, opts: UpOptions, result: UpResult, say: Say) -> Endpoints:
    if _alive(previous.nats_process) and previous.nats:
        result.kept.append("nats")
        say(f"nats       already running at {previous.nats} (pid {previous.nats_pid})")
        return previous
    port = opts.nats_port or _pick_port(url_port(previous.nats) if previous.nats else None, set())
    monitor = _pick_port(url_port(previous.nats_monitor) if previous.nats_monitor else None, {port})
    log = layout.log("nats")
    layout.logs.mkdir(parents=True, exist_ok=True)
    users_file: Path | None = None
    include: Path | None = None
    server_env: dict[str, str] = {}
    if opts.secure:
        users_file = layout.nats_dir / "users.json"
        passwords = ensure_nats_users(users_file)
        include = layout.nats_dir / "accounts.conf"
        render_accounts(include, passwords)  # with the lane users `evalbus lane credential` added
        server_env = {nats_accounts.password_variable(user): pw for user, pw in passwords.items()}
        server_env[nats_accounts.ISSUER_VARIABLE] = ensure_runner_issuer(layout.runner_issuer).public
    try:
        server = start_nats(
            layout.nats_dir, port, detach=True, monitor_port=monitor, log_file=log, include=include, env=server_env
        )
    except (OSError, TimeoutError) as e:
        raise UpError("nats", f"nats-server did not start: {e}", log) from e
    proc = identify(server.process.pid)
    result.started.append("nats")
    say(f"nats       started at {server.url} (pid {proc.pid})")
    return replace(
        previous,
        nats=server.url,
        nats_monitor=server.monitor_url,
        nats_pid=proc.pid,
        nats_started=proc.started,
        nats_log=str(log),
        nats_users=str(users_file) if users_file is not None else None,
    )


def _up_postgres(layout: _Layout, current: Endpoints, opts: UpOptions, result: UpResult, say: Say) -> Endpoints:
    if opts.database_url:
        assert current.stack_id is not None
        name, used_before = _database_name(current, opts)
        try:
            claimed = asyncio.run(
                claim_database(
                    opts.database_url,
                    name,
                    stack_id=current.stack_id,
                    state_dir=str(layout.root),
                    explicit=opts.database_name is not None and not used_before,
                    remembered=used_before,
                )
            )
        except DatabaseTaken as e:
            raise UpError("postgres", str(e), started=bool(result.started)) from e
        except Exception as e:
            raise UpError("postgres", f"cannot use DATABASE_URL: {type(e).__name__}: {e}") from e
        url = claimed.url
        if claimed.note:
            say(f"postgres   {claimed.note}")
        result.kept.append("postgres")
        say(f"postgres   using {redact_url(url)} (DATABASE_URL)")
        return replace(
            current, database=url, postgres="external", postgres_pid=None, postgres_started=None, postgres_log=None
        )
    log = embedded_log(layout.pg_dir)
    found = embedded_postmaster(layout.pg_dir)
    if found is not None and is_alive(ProcessId(found.pid)):
        port, pid = found.port, found.pid
        recorded = current.postgres_process
        started = recorded.started if recorded and recorded.pid == pid else identify(pid).started
        result.kept.append("postgres")
        say(f"postgres   already running on 127.0.0.1:{port} (embedded, pid {pid})")
    else:
        remembered = url_port(current.database) if current.database and current.postgres == "embedded" else None
        port = _pick_port(remembered, set())
        try:
            start_embedded_postgres(layout.pg_dir, port)
        except Exception as e:
            raise UpError("postgres", f"embedded PostgreSQL did not start: {type(e).__name__}: {e}", log) from e
        found = embedded_postmaster(layout.pg_dir)
        if found is None:
            raise UpError("postgres", "embedded PostgreSQL started but wrote no postmaster.pid", log)
        pid = found.pid
        started = identify(pid).started
        result.started.append("postgres")
        say(f"postgres   started on 127.0.0.1:{port} (embedded, pid {pid})")
    admin = f"postgresql://postgres@127.0.0.1:{port}/postgres"
    try:
        url = asyncio.run(ensure_database(admin, opts.database_name or DEFAULT_DATABASE))
    except Exception as e:
        raise UpError("postgres", f"cannot create database {opts.database_name or DEFAULT_DATABASE}: {e}", log) from e
    return replace(
        current, database=url, postgres="embedded", postgres_pid=pid, postgres_started=started, postgres_log=str(log)
    )


def service_command(name: str, environ: Mapping[str, str]) -> list[str]:
    """How a service is started: `python -m evalbus_<name>`, unless `EVALBUS_SERVICE_CMD_<NAME>` says otherwise."""
    override = environ.get(SERVICE_CMD_ENV + name.upper())
    if override:
        return shlex.split(override)
    return [sys.executable, "-m", f"evalbus_{name}"]


def service_env(
    name: str,
    environ: Mapping[str, str],
    *,
    nats: str,
    database: str,
    port: int,
    state_dir: Path,
    token: str,
    otlp_port: int | None = None,
) -> dict[str, str]:
    """The environment a service is started with (the collector's OTLP receiver on `otlp_port`)."""
    prefix = name.upper() + "_"
    env = {k: v for k, v in environ.items() if not (k.startswith(prefix) and k[len(prefix) :] in _MANAGED_KEYS)}
    env.update(
        NATS_URL=nats,
        DATABASE_URL=database,
        HTTP_HOST="127.0.0.1",
        HTTP_PORT=str(port),
        EVALBUS_STATE_DIR=str(state_dir),
        PYTHONUNBUFFERED="1",
    )
    env.pop("GATEWAY_ADMIN_TOKEN", None)
    if name == "gateway":
        env["GATEWAY_ADMIN_TOKEN"] = token
    if name == "collector" and otlp_port is not None:
        env["COLLECTOR_OTLP_PORT"] = str(otlp_port)
    return env


def _up_services(layout: _Layout, previous: Endpoints, current: Endpoints, result: UpResult, say: Say) -> Endpoints:
    assert current.nats is not None, "nats is up before the services"
    assert current.database is not None, "the database is up before the services"
    token = ensure_token(layout.token)
    # Services keep the URLs they were started with: restart them when nats or the database moved.
    moved = previous.nats != current.nats or previous.database != current.database
    services = dict(current.services)
    taken = {url_port(current.nats)}
    keep = {name for name in SERVICES if (svc := services.get(name)) is not None and _alive(svc.process) and not moved}
    taken |= {services[name].port for name in keep}
    otlp = current.otlp if "collector" in keep else None
    if otlp is not None:
        taken.add(url_port(otlp))
    restart = [svc.process for name, svc in services.items() if name not in keep and svc.process is not None]
    stop([p for p in restart if p is not None])
    for name in SERVICES:
        svc = services.get(name)
        if name in keep and svc is not None:
            result.kept.append(name)
            say(f"{name:<10} already running at {svc.http} (pid {svc.pid})")
            continue
        port = _pick_port(svc.port if svc else None, taken)
        taken.add(port)
        otlp_port = None
        if name == "collector":
            otlp_port = _pick_port(url_port(previous.otlp) if previous.otlp else None, taken)
            taken.add(otlp_port)
            otlp = f"http://127.0.0.1:{otlp_port}"
        log = layout.log(name)
        argv = service_command(name, os.environ)
        env = service_env(
            name,
            os.environ,
            nats=nats_url_as(current, name),
            database=current.database,
            port=port,
            state_dir=layout.root,
            token=token,
            otlp_port=otlp_port,
        )
        if name == "dispatcher" and current.nats_users:  # it answers the runners' logins (run tokens)
            env["DISPATCHER_RUNNER_AUTH_URL"] = nats_url_as(current, nats_accounts.RUNNER_AUTH_USER)
            env["DISPATCHER_RUNNER_AUTH_SEED"] = ensure_runner_issuer(layout.runner_issuer).seed
        log.parent.mkdir(parents=True, exist_ok=True)
        with log.open("a") as f:
            f.write(f"{RUN_MARKER} {time.strftime('%Y-%m-%dT%H:%M:%S%z')}: {shlex.join(argv)}\n")
        try:
            proc = spawn_detached(argv, env, log)
        except OSError as e:
            raise UpError(name, f"could not start {shlex.join(argv)}: {e}", log) from e
        http = f"http://127.0.0.1:{port}"
        services[name] = ServiceEndpoint(
            pid=proc.pid, started=proc.started, http=http, metrics=f"{http}/metrics", log=str(log)
        )
        result.started.append(name)
        say(f"{name:<10} started at {http} (pid {proc.pid})")
    gateway = services.get("gateway")
    return replace(
        current,
        services=services,
        gateway=gateway.http if gateway else None,
        otlp=otlp,
        token_file=str(layout.token),
    )


def wait_healthy(endpoints: Endpoints, *, services: bool, timeout_s: float) -> StackHealth:
    """Poll until every component is healthy. Raises `UnhealthyError` at the deadline, or at once
    when a component's process has exited (it will not come back by waiting)."""
    deadline = time.monotonic() + timeout_s
    while True:
        health = asyncio.run(check_stack(endpoints, services=services))
        if health.healthy:
            return health
        dead = [c for c in health.unhealthy() if c.running is False]
        if dead or time.monotonic() > deadline:
            shown = StackHealth(components=tuple(dead)) if dead else health
            raise UnhealthyError(shown, component_logs(endpoints))
        time.sleep(0.2)


def bring_up(opts: UpOptions, say: Say = _quiet) -> UpResult:
    """Start whatever of the stack is not running, record it, and wait until it is healthy.

    Raises `UpError` when a component cannot start and `UnhealthyError` when one does not become
    healthy in time; what did start stays recorded, so `bring_down` can stop it.
    """
    layout = _Layout(opts.state_dir.resolve())
    layout.root.mkdir(parents=True, exist_ok=True)
    previous = load_endpoints(layout.root) or Endpoints()
    if previous.stack_id is None:
        previous = replace(previous, stack_id=secrets.token_hex(8))
    external = with_database(opts.database_url, _database_name(previous, opts)[0]) if opts.database_url else None
    _check_compatible(previous, opts, external)
    result = UpResult(endpoints=previous, health=StackHealth(components=()))

    # PostgreSQL first: a database that is another stack's event store is refused before anything starts.
    current = _up_postgres(layout, previous, opts, result, say)
    save_endpoints(layout.root, current)
    current = _up_nats(layout, current, opts, result, say)
    save_endpoints(layout.root, current)
    assert current.database is not None
    try:
        result.migrations = apply_migrations(current.database)
    except Exception as e:
        raise UpError("migrations", f"{type(e).__name__}: {e}") from e
    say(f"schema     migrations {result.migrations}")
    if opts.services:
        current = _up_services(layout, previous, current, result, say)
    else:
        # Services left running by an earlier `up` stay (and stay checked); stopped ones are forgotten.
        ensure_token(layout.token)
        services = {name: svc for name, svc in current.services.items() if _alive(svc.process)}
        gateway = services.get("gateway")
        current = replace(
            current, services=services, gateway=gateway.http if gateway else None, token_file=str(layout.token)
        )
    save_endpoints(layout.root, current)
    result.endpoints = current
    result.health = wait_healthy(current, services=opts.services, timeout_s=opts.timeout_s)
    return result


def bring_down(state_dir: Path, timeout_s: float = 10.0, say: Say = _quiet) -> Endpoints | None:
    """Stop every process `bring_up` recorded under `state_dir` (services first, then nats-server,
    then the embedded PostgreSQL) and clear their pids. Returns the updated endpoints (None when
    `up` never ran there)."""
    root = state_dir.resolve()
    endpoints = load_endpoints(root)
    pg_dir = _Layout(root).pg_dir
    if endpoints is None and not pg_dir.exists():
        return None
    endpoints = endpoints or Endpoints()
    # Dead ones too: a service that died may have left children in its process group.
    services = {name: svc.process for name, svc in endpoints.services.items() if svc.process is not None}
    running = {name: proc for name, proc in services.items() if is_alive(proc)}
    killed = stop(list(services.values()), timeout_s)
    for name, proc in running.items():
        how = "killed after the grace period" if proc in killed else "stopped"
        say(f"{name:<10} {how} (pid {proc.pid})")
    if (nats := endpoints.nats_process) is not None:
        was_running = is_alive(nats)
        stop([nats], timeout_s)
        if was_running:
            say(f"nats       stopped (pid {nats.pid})")
    postmaster = embedded_postmaster(pg_dir) if pg_dir.exists() else None
    if postmaster is not None and is_alive(ProcessId(postmaster.pid)):
        stop_embedded_postgres(pg_dir)
        # pg_ctl waited for a clean shutdown. If it failed, SIGINT asks for a fast shutdown (SIGTERM
        # would wait for clients to disconnect), then SIGKILL takes the process group.
        stop([ProcessId(postmaster.pid)], timeout_s, sig=signal.SIGINT)
        say(f"postgres   stopped (embedded, pid {postmaster.pid})")
    cleared = replace(
        endpoints,
        nats_pid=None,
        nats_started=None,
        postgres_pid=None,
        postgres_started=None,
        services={name: replace(svc, pid=None, started=None) for name, svc in endpoints.services.items()},
    )
    if endpoints != Endpoints():
        save_endpoints(root, cleared)
    return cleared
