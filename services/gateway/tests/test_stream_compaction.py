"""Stream compaction against a real nats-server and PostgreSQL: a finalized batch's events leave
the CASES stream only once the event store has handled every one of them, a message the store has
not handled keeps the whole batch on the stream, and the batch's SSE replay reads what left the
stream from the store — same ids, same events, same end.

With the purge turned off (`compact_batch` not calling it) both tests fail on the stream still
holding the batch; with the `unhandled` check skipped, the second fails on a purge that took an
unrecorded message; with the SSE reading only the stream, the first fails on frames missing."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import aiohttp
import asyncpg
import msgspec
import nats.js.errors
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.testing.pipeline import eventually
from evalbus_api.client import SseEvent
from evalbus_contracts import EventBase, decode_event, subjects
from evalbus_contracts.streams import CASES
from evalbus_gateway.compactor import compact_batch, stream_messages
from evalbus_gateway.store import RecordedMessage, record
from evalbus_gateway.store.compaction import compacted, due_batches
from evalbus_gateway.testing import BatchScript, RunningGateway, batch_events, batch_spec, member, running_gateway
from evalbus_runtime import Publisher

pytestmark = pytest.mark.integration

ALICE = "tok-alice"


async def read_events(
    http: aiohttp.ClientSession, gw: RunningGateway, batch_id: str, last_event_id: int | None = None
) -> list[SseEvent]:
    """The batch's event stream read through its `end` event."""
    return await batch_events(http, gw, batch_id, ALICE, last_event_id=last_event_id, timeout_s=30)


def new_script(cases: tuple[str, ...] = ("c1", "c2")) -> BatchScript:
    return BatchScript("b" + uuid.uuid4().hex[:12], batch_spec(cases))


async def published(pub: Publisher, events: list[EventBase]) -> list[RecordedMessage]:
    """Publish in order; each as the recorder would receive it."""
    out = []
    for event in events:
        ack = await pub.publish_event(event)
        data = msgspec.json.encode(event)
        out.append(RecordedMessage(ack.seq, event.subject(), data, decode_event(data)))
    return out


@pytest.fixture
async def compacting_gateway(gw_nats: str, database_url: str) -> AsyncIterator[RunningGateway]:
    async with running_gateway(
        gw_nats,
        database_url,
        tokens={ALICE: member("alice")},
        sse_heartbeat_s=0.2,
        stream_keep_finalized_s=0.0,
        stream_compact_interval_s=0.1,
    ) as gw:
        yield gw


async def test_a_finalized_recorded_batch_leaves_the_stream_and_its_events_replay_from_the_store(
    compacting_gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    nc, pub = bus
    js = nc.jetstream()
    pool = compacting_gateway.state.pool
    script, open_one = new_script(), new_script(("c1",))
    events: list[EventBase] = [script.requested()]
    for case_id in script.case_ids:
        events += script.case_events(case_id)
    seqs = [m.stream_seq for m in await published(pub, events)]
    # Another batch, not finalized (one case never exported): it stays on the stream.
    await published(pub, [open_one.requested(), open_one.case_requested("c1")])

    async def is_compacted() -> bool:
        return await compacted(pool, script.batch_id) is not None

    await eventually(is_compacted, timeout_s=30, what="the finalized batch compacted")
    done = await compacted(pool, script.batch_id)
    assert done is not None
    assert done.messages == len(events) + 1  # and the gateway's own batch.finalized
    assert await stream_messages(js, script.batch_id) == []
    for subject in subjects.batch_filter(script.batch_id):
        with pytest.raises(nats.js.errors.NotFoundError):
            await js.get_msg(CASES.name, seq=1, subject=subject, next=True)
    assert len(await stream_messages(js, open_one.batch_id)) == 2
    assert await compacted(pool, open_one.batch_id) is None
    registry = compacting_gateway.service.metrics.registry
    assert (registry.get_sample_value("evalbus_stream_compactions_total", {"result": "compacted"}) or 0) >= 1
    assert (registry.get_sample_value("evalbus_stream_compacted_messages_total") or 0) >= len(events) + 1

    async with aiohttp.ClientSession() as http:
        received = await read_events(http, compacting_gateway, script.batch_id)
        frames, end = received[:-1], received[-1]
        finalized_seq = frames[-1].id
        assert finalized_seq is not None
        assert done.purged_below == finalized_seq + 1
        assert [f.id for f in frames] == [*seqs, finalized_seq]
        assert [f.event for f in frames] == [e.type for e in events] + ["batch.finalized"]
        assert [decode_event(f.data.encode()).event_id for f in frames[:-1]] == [e.event_id for e in events]
        assert msgspec.json.decode(end.data) == {"batch_id": script.batch_id, "status": "succeeded"}

        # Resuming in the middle of what the store serves goes on exactly after that sequence…
        resumed = await read_events(http, compacting_gateway, script.batch_id, last_event_id=seqs[3])
        assert [f.id for f in resumed[:-1]] == [*seqs[4:], finalized_seq]
        # …and after the batch's batch.finalized, it ends at once.
        after_end = await read_events(http, compacting_gateway, script.batch_id, last_event_id=finalized_seq)
        assert [f.event for f in after_end] == ["end"]
        assert msgspec.json.decode(after_end[0].data) == {"batch_id": script.batch_id, "status": "succeeded"}

        # The batch and its runs are the store's.
        async with http.get(
            f"{compacting_gateway.base_url}/v1/batches/{script.batch_id}",
            headers={"Authorization": f"Bearer {ALICE}"},
        ) as got:
            assert got.status == 200
            assert msgspec.json.decode(await got.read())["status"] == "succeeded"

        # The batch's runs are the store's: every case is still listed with its stages.
        async with http.get(
            f"{compacting_gateway.base_url}/v1/batches/{script.batch_id}/cases",
            headers={"Authorization": f"Bearer {ALICE}"},
        ) as got:
            assert got.status == 200
            runs = msgspec.json.decode(await got.read())["cases"]
        assert sorted(r["case_id"] for r in runs) == ["c1", "c2"]


async def test_a_message_the_store_has_not_handled_keeps_the_batch_on_the_stream(
    bus: tuple[NatsClient, Publisher], pool: asyncpg.Pool[asyncpg.Record]
) -> None:
    nc, pub = bus
    js = nc.jetstream()
    script = new_script(("c1", "c2", "c3"))  # c3 comes after the compaction
    events: list[EventBase] = [script.requested()]
    for case_id in ("c1", "c2"):
        events += script.case_events(case_id)
    events.append(script.finalized())
    messages = await published(pub, events)
    late = messages[-2]  # c2's case.exported: not recorded yet
    await record(pool, [m for m in messages if m is not late])
    assert script.batch_id in await due_batches(pool, 0.0, 1000)
    assert script.batch_id not in await due_batches(pool, 3600.0, 1000)

    assert await compact_batch(js, pool, script.batch_id) is None
    assert len(await stream_messages(js, script.batch_id)) == len(events)
    assert await compacted(pool, script.batch_id) is None

    await record(pool, [late])
    done = await compact_batch(js, pool, script.batch_id)
    assert done is not None
    assert done.messages == len(events)
    assert done.purged_below == messages[-1].stream_seq + 1
    assert await stream_messages(js, script.batch_id) == []
    assert script.batch_id not in await due_batches(pool, 0.0, 1000)

    # A message published after the compaction is not purged unchecked: the store has not handled
    # it, so the batch is not compacted again until it has.
    after = await published(pub, [script.case_requested("c3")])
    assert await compact_batch(js, pool, script.batch_id) is None
    assert [seq for seq, _ in await stream_messages(js, script.batch_id)] == [after[0].stream_seq]
    await record(pool, after)
    again = await compact_batch(js, pool, script.batch_id)
    assert again is not None
    assert again.messages == 1
    assert await stream_messages(js, script.batch_id) == []


async def test_a_batch_the_stream_no_longer_holds_replays_whole_from_the_store(
    gw_nats: str, database_url: str, bus: tuple[NatsClient, Publisher], pool: asyncpg.Pool[asyncpg.Record]
) -> None:
    """Its messages gone from CASES before compaction (purged by hand, lost with a stream, or — as
    once — another stack's gateway compacting against its own stream): the compaction covers all the
    store holds, so its event stream replays every event, not only `end` (`purged_below` was 0)."""
    nc, pub = bus
    js = nc.jetstream()
    script = new_script(("c1",))
    events: list[EventBase] = [script.requested(), *script.case_events("c1"), script.finalized()]
    messages = await published(pub, events)
    await record(pool, messages)
    for subject in subjects.batch_filter(script.batch_id):
        await js.purge_stream(CASES.name, subject=subject)
    done = await compact_batch(js, pool, script.batch_id)
    assert done is not None
    assert (done.messages, done.purged_below) == (0, messages[-1].stream_seq + 1)
    async with (
        running_gateway(gw_nats, database_url, tokens={ALICE: member("alice")}, sse_heartbeat_s=0.2) as gw,
        aiohttp.ClientSession() as http,
    ):
        received = await read_events(http, gw, script.batch_id)
    assert [f.id for f in received[:-1]] == [m.stream_seq for m in messages]
    assert received[-1].event == "end"


async def test_a_compacted_batch_is_rejudged_from_the_store(
    compacting_gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    _, pub = bus
    pool = compacting_gateway.state.pool
    script = new_script()
    events: list[EventBase] = [script.requested()]
    for case_id in script.case_ids:
        events += script.case_events(case_id)
    await published(pub, events)

    async def is_compacted() -> bool:
        return await compacted(pool, script.batch_id) is not None

    await eventually(is_compacted, timeout_s=30, what="the finalized batch compacted")
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{compacting_gateway.base_url}/v1/batches/{script.batch_id}/rejudge",
            headers={"Authorization": f"Bearer {ALICE}"},
        ) as resp,
    ):
        assert resp.status == 202, await resp.text()
        new = msgspec.json.decode(await resp.read())["batch_id"]

    async def replayed() -> bool:
        async with pool.acquire() as conn:
            count = await conn.fetchval(
                "SELECT count(*) FROM events WHERE batch_id = $1 AND type = 'case.executed'", new
            )
        return bool(count == len(script.case_ids))

    await eventually(replayed, timeout_s=30, what="the re-judge's executed runs recorded")
