"""The servers and processes of one benchmark run.

- `Infra`: a nats-server of the benchmark's own and, when asked, fresh PostgreSQL databases
  (on the server named by `DATABASE_URL` when set, else on the embedded server).
- `pipeline_stack`: the five services as real processes (`evalbus.testing.stack.ServiceStack`), with
  the repository root on `PYTHONPATH` so the judge can load `bench.plugins`; `running` stops them.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Mapping
from pathlib import Path
from types import TracebackType

import asyncpg

from evalbus.infra.nats import NatsServer, start_nats
from evalbus.infra.ports import free_port
from evalbus.infra.postgres import (
    EmbeddedPostgres,
    create_database,
    drop_database,
    embedded_postmaster,
    start_embedded_postgres,
)
from evalbus.testing.stack import ServiceStack

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository root (this file is `<root>/bench/_infra.py`)."""


# ---------------------------------------------------------------- infrastructure


def quiet_logs() -> None:
    """Keep the runtime's connection warnings (a disconnect when the benchmark closes) off the output."""
    logging.getLogger("evalbus").setLevel(logging.ERROR)


class Infra:
    """A nats-server and (optionally) a fresh database, in a temporary folder, for one benchmark."""

    def __init__(self, *, database: bool, prefix: str = "evalbus-bench-", nats_profiler: bool = False) -> None:
        self._want_db = database
        self._nats_profiler = nats_profiler
        self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
        self.workdir = Path(self._tmp.name)
        self.nats: NatsServer | None = None
        self.database_url = ""
        """URL of the fresh database ("" when none was asked for)."""
        self.database_source = ""
        """`DATABASE_URL` or `embedded`."""
        self._admin_url: str | None = None
        self._embedded: EmbeddedPostgres | None = None
        self._extra: list[NatsServer] = []
        self._databases: list[str] = []
        self._server_pid: int | None = None

    @property
    def nats_url(self) -> str:
        """Client URL of the benchmark's nats-server."""
        assert self.nats is not None
        return self.nats.url

    @property
    def admin_url(self) -> str:
        """URL of the PostgreSQL server the fresh databases are on (for faults such as refusing
        one database's connections; "" when no database was asked for)."""
        return self._admin_url or ""

    def postgres_pid(self) -> int | None:
        """Pid of the PostgreSQL server's postmaster: the embedded one's, or that of `DATABASE_URL`'s
        server when it runs on this machine where its processes can be read (None otherwise)."""
        if self._embedded is None:
            return self._server_pid
        master = embedded_postmaster(self._embedded.data_dir)
        return None if master is None else master.pid

    def new_nats(self, name: str) -> NatsServer:
        """Another nats-server of this benchmark (stopped with the rest)."""
        server = start_nats(self.workdir / name)
        self._extra.append(server)
        return server

    async def __aenter__(self) -> Infra:
        try:
            self.nats = start_nats(self.workdir / "nats", prof_port=free_port() if self._nats_profiler else None)
            if self._want_db:
                admin = os.environ.get("DATABASE_URL")
                if admin:
                    self.database_source = "DATABASE_URL"
                else:
                    self._embedded = start_embedded_postgres(self.workdir / "pg")
                    admin = self._embedded.url
                    self.database_source = "embedded"
                self._admin_url = admin
                self.database_url = await self.new_database()
                if self._embedded is None:
                    self._server_pid = await local_postmaster(self.database_url)
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def new_database(self) -> str:
        """Another fresh database on the same server (dropped with the rest)."""
        assert self._admin_url is not None
        url = await create_database(self._admin_url, prefix="evalbus_bench")
        self._databases.append(url)
        return url

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for url in self._databases if self._admin_url else []:
            with contextlib.suppress(Exception):
                await drop_database(self._admin_url or "", url)
        if self._embedded is not None:
            self._embedded.stop()
        for server in [*self._extra, *([self.nats] if self.nats else [])]:
            server.stop()
        self._tmp.cleanup()


async def local_postmaster(url: str) -> int | None:
    """The postmaster of the server at `url` when it is on this machine: the parent of the backend
    serving a connection, if that pid is a PostgreSQL process here (a server in a container or on
    another host has pids of its own, and this one does not measure it)."""
    conn = await asyncpg.connect(url)
    try:  # read while the backend lives: it exits with the connection
        return _postgres_parent(int(await conn.fetchval("SELECT pg_backend_pid()")))
    finally:
        await conn.close()


def _postgres_parent(pid: int) -> int | None:
    """The parent of `pid` when `pid` is a PostgreSQL process on this machine."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    if not stat[stat.index("(") + 1 : stat.rindex(")")].startswith("postgres"):
        return None
    return int(stat[stat.rindex(")") + 2 :].split()[1])


def pipeline_stack(
    infra: Infra,
    name: str,
    *,
    service_env: Mapping[str, Mapping[str, str]] | None = None,
) -> ServiceStack:
    """A `ServiceStack` for one run (own log folder), quiet logs, the repo root on `PYTHONPATH`."""
    workdir = infra.workdir / name
    workdir.mkdir(parents=True, exist_ok=True)
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return ServiceStack(
        nats_url=infra.nats_url,
        database_url=infra.database_url,
        workdir=workdir,
        env={"PYTHONPATH": pythonpath, "LOG_LEVEL": "WARNING", "LOG_FORMAT": "text"},
        service_env={k: dict(v) for k, v in (service_env or {}).items()},
    )


@contextlib.asynccontextmanager
async def running(stack: ServiceStack) -> AsyncIterator[ServiceStack]:
    """Stop every service of `stack` on the way out (also on errors)."""
    try:
        yield stack
    finally:
        await asyncio.to_thread(stack.stop)
