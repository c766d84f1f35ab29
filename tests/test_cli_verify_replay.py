"""`evalbus verify` and `evalbus replay` as real subprocesses against a real event store, filled
by a real gateway recording batches from a real nats-server: verify passes on sealed runs and
names the first sequence a forged or deleted event breaks; replay rebuilds the read models exactly,
and `--from-stream` fills an empty database from the CASES stream (idempotently)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import asyncpg
import pytest

from evalbus.infra.nats import NatsServer
from evalbus.infra.postgres import create_database, drop_database
from evalbus_gateway.store import get_batch
from evalbus_gateway.testing import BatchScript, RunningGateway, batch_spec, running_gateway
from evalbus_runtime import Publisher, connect, ensure_topology

pytestmark = pytest.mark.integration


@pytest.fixture
async def gateway(fresh_nats: NatsServer, database_url: str) -> AsyncIterator[RunningGateway]:
    async with running_gateway(fresh_nats.url, database_url) as gw:
        yield gw


async def finalized_batches(gw: RunningGateway, nats_url: str, *cases: tuple[str, ...]) -> list[BatchScript]:
    """Publish one whole batch per `cases` (every case through every stage); wait until each is finalized."""
    nc = await connect(nats_url, "test-verify-replay")
    await ensure_topology(nc.jetstream())
    pub = Publisher(nc)
    await pub.start()
    scripts = [BatchScript("b" + uuid.uuid4().hex[:12], batch_spec(c)) for c in cases]
    try:
        for script in scripts:
            await pub.publish_event(script.requested())
            for case_id in script.case_ids:
                await pub.publish_events(script.case_events(case_id, passed=case_id != "c2"))
    finally:
        await pub.stop()
        await nc.close()
    deadline = time.monotonic() + 30
    for script in scripts:
        while True:
            view = await get_batch(gw.state.pool, script.batch_id)
            if view is not None and view.finalized_at is not None:
                break
            assert time.monotonic() < deadline, f"{script.batch_id} not finalized"
            await asyncio.sleep(0.02)
    return scripts


async def evalbus(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVALBUS_")}
    env["EVALBUS_DIR"] = "/nonexistent-evalbus-dir"
    command = [sys.executable, "-m", "evalbus.cli", *args]
    return await asyncio.to_thread(subprocess.run, command, env=env, capture_output=True, text=True, timeout=120)


async def tampered(database_url: str, sql: str, *args: Any) -> None:
    """Change the append-only event table as a superuser bypassing its trigger would."""
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("ALTER TABLE events DISABLE TRIGGER events_append_only")
        await conn.execute(sql, *args)
        await conn.execute("ALTER TABLE events ENABLE TRIGGER events_append_only")
    finally:
        await conn.close()


async def fetch(database_url: str, sql: str, *args: Any) -> list[tuple[Any, ...]]:
    conn = await asyncpg.connect(database_url)
    try:
        return [tuple(r) for r in await conn.fetch(sql, *args)]
    finally:
        await conn.close()


READ_MODELS = ("SELECT * FROM batches ORDER BY batch_id", "SELECT * FROM runs ORDER BY run_id")


async def read_models(database_url: str) -> list[list[tuple[Any, ...]]]:
    return [await fetch(database_url, sql) for sql in READ_MODELS]


async def test_verify_passes_and_detects_tampering(
    gateway: RunningGateway, fresh_nats: NatsServer, database_url: str
) -> None:
    [script] = await finalized_batches(gateway, fresh_nats.url, ("c1", "c2", "c3"))
    ok = await evalbus("verify", script.batch_id, "--database", database_url)
    assert ok.returncode == 0, ok.stdout + ok.stderr
    lines = ok.stdout.splitlines()
    assert lines[-1] == f"batch {script.batch_id}: ok — 3 ok, 0 mismatched, 0 not sealed"
    assert sum(line.startswith("ok ") for line in lines) == 3

    run_id = script.run_id("c2")
    one = await evalbus("verify", run_id, "--database", database_url)
    assert one.returncode == 0
    assert one.stdout.splitlines()[0].startswith(f"ok          {run_id}  (4 events")

    [(judged_seq,)] = await fetch(
        database_url, "SELECT stream_seq FROM events WHERE run_id = $1 AND type = 'case.judged'", run_id
    )
    await tampered(
        database_url,
        "UPDATE events SET body = jsonb_set(body, '{result,answer}', '\"forged\"') WHERE stream_seq = $1",
        judged_seq,
    )
    bad = await evalbus("verify", script.batch_id, "--database", database_url)
    assert bad.returncode == 1
    assert f"MISMATCH    {run_id}  at seq {judged_seq}: event {judged_seq} does not match its sealed link" in bad.stdout
    assert bad.stdout.splitlines()[-1] == f"batch {script.batch_id}: NOT OK — 2 ok, 1 mismatched, 0 not sealed"
    assert (await evalbus("verify", run_id, "--database", database_url)).returncode == 1

    other = script.run_id("c3")
    [(executed_seq,)] = await fetch(
        database_url, "SELECT stream_seq FROM events WHERE run_id = $1 AND type = 'case.executed'", other
    )
    await tampered(database_url, "DELETE FROM events WHERE stream_seq = $1", executed_seq)
    gone = await evalbus("verify", other, "--database", database_url, "--json")
    assert gone.returncode == 1
    assert f'"first_bad_seq": {executed_seq}' in gone.stdout


async def test_verify_of_unknown_and_unsealed_ids_fails(
    gateway: RunningGateway, fresh_nats: NatsServer, database_url: str
) -> None:
    unknown = await evalbus("verify", "b-never-submitted", "--database", database_url)
    assert unknown.returncode == 1
    assert "nothing recorded for b-never-submitted" in unknown.stdout
    script = BatchScript("b" + uuid.uuid4().hex[:12], batch_spec(("c1",)))
    nc = await connect(fresh_nats.url, "test-unsealed")
    await ensure_topology(nc.jetstream())
    pub = Publisher(nc)
    await pub.start()
    await pub.publish_events([script.requested(), script.case_requested("c1"), script.executed("c1")])
    await pub.stop()
    await nc.close()
    deadline = time.monotonic() + 20
    while not await fetch(
        database_url, "SELECT 1 FROM runs WHERE run_id = $1 AND stage = 'executed'", script.run_id("c1")
    ):
        assert time.monotonic() < deadline
        await asyncio.sleep(0.02)
    open_run = await evalbus("verify", script.batch_id, "--database", database_url)
    assert open_run.returncode == 1
    assert f"NOT SEALED  {script.run_id('c1')}  (2 events" in open_run.stdout


async def test_replay_rebuilds_the_read_models(
    gateway: RunningGateway, fresh_nats: NatsServer, database_url: str
) -> None:
    await finalized_batches(gateway, fresh_nats.url, ("c1", "c2"), ("c1", "c2", "c3"))
    before = await read_models(database_url)
    assert [len(rows) for rows in before] == [2, 5]

    conn = await asyncpg.connect(database_url)
    try:  # the read models are derived data: damage them
        await conn.execute("DELETE FROM runs WHERE case_id = 'c1'")
        await conn.execute("UPDATE batches SET status = 'failed', summary = NULL")
    finally:
        await conn.close()
    assert await read_models(database_url) != before

    done = await evalbus("replay", "--database", database_url)
    assert done.returncode == 0, done.stderr
    events = (await fetch(database_url, "SELECT count(*) FROM events"))[0][0]
    assert done.stdout.splitlines() == [
        f"read models rebuilt from {events} events (0 undecodable): 2 batches, 5 runs (5 sealed)"
    ]
    assert await read_models(database_url) == before


async def test_replay_from_the_stream_fills_an_empty_event_store(
    gateway: RunningGateway, fresh_nats: NatsServer, database_url: str, pg_admin_url: str
) -> None:
    scripts = await finalized_batches(gateway, fresh_nats.url, ("c1", "c2"), ("c1",))
    empty = await create_database(pg_admin_url, "evalbus_replay")
    try:
        no_store = await evalbus("verify", "b-anything", "--database", empty)  # a database `up` did not make
        assert no_store.returncode == 1
        assert "holds no event store: name the database `evalbus up` made" in no_store.stderr
        first = await evalbus("replay", "--from-stream", "--database", empty, "--nats", fresh_nats.url)
        assert first.returncode == 0, first.stderr
        stored = "SELECT stream_seq, subject, type, dedupe_key, body FROM events ORDER BY stream_seq"
        original = await fetch(database_url, stored)
        copied = await fetch(empty, stored)
        assert copied == original
        assert f"stream: {len(original)} messages read (sequences 1..{len(original)}): {len(original)} recorded" in (
            first.stdout
        )
        assert await read_models(empty) == await read_models(database_url)
        seals = "SELECT run_id, head_hash, seqs, hashes FROM seals ORDER BY run_id"
        assert await fetch(empty, seals) == await fetch(database_url, seals)

        again = await evalbus("replay", "--from-stream", "--database", empty, "--nats", fresh_nats.url)
        assert again.returncode == 0, again.stderr
        assert f"0 recorded, {len(original)} already recorded" in again.stdout
        assert await fetch(empty, stored) == original
        verified = await evalbus("verify", scripts[0].batch_id, "--database", empty)
        assert verified.returncode == 0, verified.stdout
    finally:
        await drop_database(pg_admin_url, empty)
