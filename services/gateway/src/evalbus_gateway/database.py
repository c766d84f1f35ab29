"""The gateway's PostgreSQL pool.

`json` / `jsonb` get a text codec on every connection: values read stay JSON text (what the store
decodes with msgspec, straight into contract types), and values written may be JSON text or any
contract value, encoded with msgspec — never Python's `json` module.
"""

from __future__ import annotations

from typing import Any

import asyncpg

from evalbus_contracts import encode


def encode_json(value: Any) -> str:
    """A parameter for a `json`/`jsonb` column: text as it is, anything else encoded by msgspec."""
    if isinstance(value, str):
        return value
    if isinstance(value, bytes | bytearray | memoryview):
        return bytes(value).decode("utf-8")
    return encode(value).decode("utf-8")


def _json_text(value: str) -> str:
    return value


async def register_json_codecs(conn: asyncpg.Connection[asyncpg.Record]) -> None:
    """Install the JSON codecs on one connection (the pool's `init`)."""
    for name in ("json", "jsonb"):
        await conn.set_type_codec(name, schema="pg_catalog", encoder=encode_json, decoder=_json_text, format="text")


async def create_pool(url: str, *, min_size: int = 2, max_size: int = 16) -> asyncpg.Pool[asyncpg.Record]:
    """Open the pool the gateway reads and records with."""
    pool: asyncpg.Pool[asyncpg.Record] = await asyncpg.create_pool(
        url, min_size=min_size, max_size=max_size, init=register_json_codecs
    )
    return pool
