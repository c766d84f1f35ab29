"""Fixtures shared by the gateway's tests: a migrated database of the test's own, a nats-server per test module (so the durable
`gateway-recorder` consumer of one module never sees another module's events) and a bus
connection publishing as the other services would."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import asyncpg
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.infra.nats import start_nats
from evalbus_gateway.store import migrate
from evalbus_runtime import Publisher, connect, ensure_topology


@pytest.fixture(scope="module")
def gw_nats() -> Iterator[str]:
    """A nats-server of this module's own."""
    folder = Path(tempfile.mkdtemp(prefix="evalbus-gw-"))
    server = start_nats(folder / "nats")
    yield server.url
    server.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
async def bus(gw_nats: str) -> AsyncIterator[tuple[NatsClient, Publisher]]:
    """The test's own connection and publisher (streams and consumers created)."""
    nc = await connect(gw_nats, "gateway-test")
    await ensure_topology(nc.jetstream())
    pub = Publisher(nc)
    await pub.start()
    yield nc, pub
    await pub.stop()
    await nc.close()


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool[asyncpg.Record]]:
    """A migrated database of the test's own."""
    pool = await asyncpg.create_pool(database_url, min_size=1, max_size=4)
    await migrate(pool)
    yield pool
    await pool.close()
