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

from evalbus.infra.nats import NatsServer, start_nats
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

    def __init__(self, *, database: bool, prefix: str = "evalbus-bench-") -> None:
        self._want_db = database
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
        """Pid of the embedded PostgreSQL server (None with `DATABASE_URL`: not ours to measure)."""
        if self._embedded is None:
            return None
        master = embedded_postmaster(self._embedded.data_dir)
        return None if master is None else master.pid

    def new_nats(self, name: str) -> NatsServer:
        """Another nats-server of this benchmark (stopped with the rest)."""
        server = start_nats(self.workdir / name)
        self._extra.append(server)
        return server

    async def __aenter__(self) -> Infra:
        try:
            self.nats = start_nats(self.workdir / "nats")
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
