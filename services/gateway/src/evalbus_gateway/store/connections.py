"""How store functions take their database: a pool or a single connection, chosen by the caller.

Every public store function accepts either; `acquire` yields a connection from a pool or the
connection itself, so tests and `evalbus` commands can pass a plain connection and services a pool.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, TypeAlias

import asyncpg

if TYPE_CHECKING:
    from asyncpg.pool import PoolConnectionProxy

    Connection: TypeAlias = asyncpg.Connection[asyncpg.Record] | PoolConnectionProxy[asyncpg.Record]
    """A connection, direct or borrowed from a pool."""
    Database: TypeAlias = asyncpg.Pool[asyncpg.Record] | Connection
    """What store functions accept: a pool or a connection."""


@asynccontextmanager
async def acquire(db: Database) -> AsyncIterator[Connection]:
    """A connection for the duration of the block: borrowed from a pool, or `db` itself."""
    if isinstance(db, asyncpg.Pool):
        async with db.acquire() as conn:
            yield conn
    else:
        yield db


@asynccontextmanager
async def snapshot(db: Database) -> AsyncIterator[Connection]:
    """A connection reading one consistent snapshot (a read-only repeatable-read transaction), or
    the caller's own transaction when `db` is a connection already inside one."""
    async with acquire(db) as conn:
        if conn.is_in_transaction():
            yield conn
        else:
            async with conn.transaction(isolation="repeatable_read", readonly=True):
                yield conn
