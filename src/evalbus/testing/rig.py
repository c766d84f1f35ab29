"""Session fixtures: a real nats-server on free ports with its own data folder, a fresh PostgreSQL
database (from `DATABASE_URL`, else the embedded server, else testcontainers where Docker runs),
and a 3-node NATS cluster on demand. No mock stands in for either."""

from __future__ import annotations

import os
import shutil
import tempfile
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from evalbus.infra.nats import STOCK_MAX_PAYLOAD, NatsServer, start_nats, start_nats_cluster
from evalbus.infra.postgres import create_database, drop_database, start_embedded_postgres


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Give every test a node id of its own. schemathesis names each API operation's item
    `test[GET /path]` but, under pytest 9, leaves them all the function's node id; pytest-xdist
    schedules by node id and would run one operation of each such test and drop the rest."""
    seen = Counter(item.nodeid for item in items)
    for item in items:
        if seen[item.nodeid] > 1 and item.parent is not None:
            unique_id = f"{item.parent.nodeid}::{item.name}"
            # pytest 9 keeps a node's id as a structured `NodeId` (`_id`); older ones as `_nodeid`.
            ident = getattr(item, "_id", None)
            if ident is not None and hasattr(type(ident), "parse"):
                item._id = type(ident).parse(unique_id)
            else:
                item._nodeid = unique_id  # type: ignore[attr-defined]
    shared = sorted(nodeid for nodeid, n in Counter(item.nodeid for item in items).items() if n > 1)
    if shared:
        raise pytest.UsageError(f"tests share node ids (pytest-xdist would run only one of each): {shared[:5]}")


@pytest.fixture(scope="session")
def rig_dir() -> Iterator[Path]:
    """A folder for this session's servers, outside pytest's rotated temp folders (a concurrent
    pytest session may delete those, and the servers' data with them)."""
    path = Path(tempfile.mkdtemp(prefix="evalbus-rig-"))
    yield path
    shutil.rmtree(path, ignore_errors=True)


@pytest.fixture(scope="session")
def nats_server(rig_dir: Path) -> Iterator[NatsServer]:
    """One nats-server with JetStream for the session."""
    server = start_nats(rig_dir / "nats")
    yield server
    server.stop()


@pytest.fixture(scope="session")
def nats_url(nats_server: NatsServer) -> str:
    """URL of the session's nats-server."""
    return nats_server.url


@pytest.fixture(scope="session")
def stock_nats(rig_dir: Path) -> Iterator[NatsServer]:
    """A nats-server with a stock server's 1 MB `max_payload`, for the session: what does not fit
    an event must go through the object store."""
    server = start_nats(rig_dir / "nats-stock", name="evalbus-stock", max_payload=STOCK_MAX_PAYLOAD)
    yield server
    server.stop()


@pytest.fixture
def fresh_nats(tmp_path: Path) -> Iterator[NatsServer]:
    """A nats-server of the test's own (for tests that restart or reconfigure it)."""
    server = start_nats(tmp_path / "nats")
    yield server
    server.stop()


@pytest.fixture
def nats_cluster(tmp_path: Path) -> Iterator[list[NatsServer]]:
    """A 3-node JetStream cluster on loopback, for failover tests."""
    servers = start_nats_cluster(tmp_path / "cluster", 3)
    yield servers
    for s in servers:
        s.stop()


def _testcontainers_url() -> tuple[str, object] | None:
    if shutil.which("docker") is None:
        return None
    try:
        from testcontainers.postgres import PostgresContainer

        container = PostgresContainer("postgres:16-alpine", driver=None)
        container.start()
    except Exception:
        return None
    return str(container.get_connection_url()), container


@pytest.fixture(scope="session")
def pg_admin_url(rig_dir: Path) -> Iterator[str]:
    """A PostgreSQL server URL on which tests may create databases."""
    env = os.environ.get("DATABASE_URL")
    if env:
        yield env
        return
    try:
        embedded = start_embedded_postgres(rig_dir / "pg")
    except Exception:
        found = _testcontainers_url()
        if found is None:
            raise
        url, container = found
        yield url
        container.stop()  # type: ignore[attr-defined]
        return
    yield embedded.url
    embedded.stop()


@pytest.fixture
async def database_url(pg_admin_url: str) -> AsyncIterator[str]:
    """A fresh, empty database for one test."""
    url = await create_database(pg_admin_url, "evalbus_test")
    yield url
    await drop_database(pg_admin_url, url)
