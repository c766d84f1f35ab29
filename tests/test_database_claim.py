"""`claim_database`: which database a stack's `evalbus up` settles on, on a real PostgreSQL server.
A database is one stack's event store: its mark (the database's comment) names the stack's id and
folder; another stack gets a database of its own, or a refusal when it named the taken one."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import asyncpg
import pytest

from evalbus.infra.postgres import ClaimedDatabase, DatabaseTaken, claim_database, drop_database, with_database

pytestmark = pytest.mark.integration


@pytest.fixture
async def name(pg_admin_url: str) -> AsyncIterator[str]:
    """A database name of the test's own; it and its stack-specific variants are dropped after."""
    base = f"evalbus_claim_{uuid.uuid4().hex[:8]}"
    yield base
    conn = await asyncpg.connect(pg_admin_url)
    try:
        rows = await conn.fetch("SELECT datname FROM pg_database WHERE datname LIKE $1", base + "%")
    finally:
        await conn.close()
    for row in rows:
        await drop_database(pg_admin_url, with_database(pg_admin_url, row["datname"]))


async def claim(
    admin: str, name: str, stack_id: str, folder: Path, *, explicit: bool = False, remembered: bool = False
) -> ClaimedDatabase:
    return await claim_database(
        admin, name, stack_id=stack_id, state_dir=str(folder), explicit=explicit, remembered=remembered
    )


async def test_a_stack_keeps_its_database_and_another_gets_its_own(
    pg_admin_url: str, name: str, tmp_path: Path
) -> None:
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir()
    (a / "endpoints.json").write_text("{}")
    first = await claim(pg_admin_url, name, "aaaaaaaa11111111", a)
    assert first == ClaimedDatabase(url=with_database(pg_admin_url, name))
    assert await claim(pg_admin_url, name, "aaaaaaaa11111111", a) == first  # its own again: no note

    other = await claim(pg_admin_url, name, "bbbbbbbb22222222", b)
    assert other.url == with_database(pg_admin_url, f"{name}_bbbbbbbb")
    assert other.note == f"database {name} is the event store of the stack in {a}: this stack uses {name}_bbbbbbbb"
    assert await claim(pg_admin_url, f"{name}_bbbbbbbb", "bbbbbbbb22222222", b) == ClaimedDatabase(url=other.url)

    with pytest.raises(DatabaseTaken, match=rf"database {name} is the event store of the stack in {a}; name another"):
        await claim(pg_admin_url, name, "bbbbbbbb22222222", b, explicit=True)
    (a / "endpoints.json").unlink()  # that stack was removed: its events still are not this one's
    with pytest.raises(DatabaseTaken, match=r"\(since removed\)"):
        await claim(pg_admin_url, name, "cccccccc33333333", a, explicit=True)


async def test_an_unmarked_database_is_taken_when_empty_or_remembered(
    pg_admin_url: str, name: str, tmp_path: Path
) -> None:
    conn = await asyncpg.connect(pg_admin_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    # Empty and unmarked (a database made by hand, or by a release before the mark): used.
    assert (await claim(pg_admin_url, name, "dddddddd44444444", tmp_path)).note is None

    held = f"{name}_held"
    conn = await asyncpg.connect(pg_admin_url)
    try:
        await conn.execute(f'CREATE DATABASE "{held}"')
    finally:
        await conn.close()
    store = await asyncpg.connect(with_database(pg_admin_url, held))
    try:
        await store.execute("CREATE TABLE events (seq bigint)")
        await store.execute("INSERT INTO events VALUES (1)")
    finally:
        await store.close()
    # Unmarked with events: another stack's unless this stack used it before.
    moved = await claim(pg_admin_url, held, "eeeeeeee55555555", tmp_path)
    assert moved.url == with_database(pg_admin_url, f"{held}_eeeeeeee")
    assert moved.note is not None
    assert "a stack that left no mark (it holds events)" in moved.note
    kept = await claim(pg_admin_url, held, "eeeeeeee55555555", tmp_path, remembered=True)
    assert kept == ClaimedDatabase(url=with_database(pg_admin_url, held))
