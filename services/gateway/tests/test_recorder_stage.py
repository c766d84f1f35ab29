"""The recorder stage against a real nats-server and PostgreSQL: events land in the store, acks
wait for the commit, failed writes are retried without duplicates, poison goes to the DLQ, and
complete batches get exactly one `batch.finalized` (also when cancelled, when a cancel arrives
for a batch already complete, and from the start-up sweep)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Sequence

import asyncpg
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.testing.pipeline import eventually
from evalbus_contracts import BatchFinalized, DeadLetter, EventBase, decode_event, encode, encode_token
from evalbus_contracts.streams import GATEWAY_RECORDER
from evalbus_gateway.store import RecordedMessage, RecordOutcome, get_batch, record
from evalbus_gateway.testing import BatchScript, batch_spec, running_gateway
from evalbus_runtime import Publisher

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture
async def pool(database_url: str) -> AsyncIterator[asyncpg.Pool[asyncpg.Record]]:
    """The test's view of the gateway's database."""
    p = await asyncpg.create_pool(database_url, min_size=1, max_size=2)
    yield p
    await p.close()


def new_batch_id() -> str:
    return "b" + uuid.uuid4().hex[:12]


async def publish(pub: Publisher, events: Sequence[EventBase]) -> None:
    for event in events:
        await pub.publish_event(event)


async def stored(pool: asyncpg.Pool[asyncpg.Record], batch_id: str) -> list[str]:
    rows = await pool.fetch("SELECT type FROM events WHERE batch_id = $1 ORDER BY stream_seq", batch_id)
    return [str(r["type"]) for r in rows]


async def stored_seqs(pool: asyncpg.Pool[asyncpg.Record], batch_id: str) -> list[int]:
    rows = await pool.fetch("SELECT stream_seq FROM events WHERE batch_id = $1 ORDER BY stream_seq", batch_id)
    return [int(r["stream_seq"]) for r in rows]


async def count_on_stream(nc: NatsClient, subject: str) -> int:
    info = await nc.jetstream().stream_info("CASES", subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def finalized_on_stream(nc: NatsClient, batch_id: str) -> BatchFinalized | None:
    try:
        raw = await nc.jetstream().get_last_msg("CASES", f"batch.finalized.{encode_token(batch_id)}")
    except Exception:
        return None
    event = decode_event(raw.data or b"")
    assert isinstance(event, BatchFinalized)
    return event


async def ack_pending(nc: NatsClient) -> int:
    info = await nc.jetstream().consumer_info("CASES", GATEWAY_RECORDER.durable)
    return int(info.num_ack_pending)


async def recorder_idle(nc: NatsClient) -> bool:
    """The recorder's consumer has delivered everything on the stream and holds no unacked message."""
    info = await nc.jetstream().consumer_info("CASES", GATEWAY_RECORDER.durable)
    return bool(info.num_pending == 0 and info.num_ack_pending == 0)


# ---------------------------------------------------------------- tests


async def test_records_a_batch_and_publishes_batch_finalized_once(
    gw_nats: str, database_url: str, bus: tuple[NatsClient, Publisher], pool: asyncpg.Pool[asyncpg.Record]
) -> None:
    nc, pub = bus
    script = BatchScript(new_batch_id(), batch_spec(("c1", "c2")))
    async with running_gateway(gw_nats, database_url):
        await publish(pub, [script.requested()])
        await publish(pub, script.case_events("c1", passed=True))
        await publish(pub, script.case_events("c2", passed=False))

        async def finalized_recorded() -> bool:
            view = await get_batch(pool, script.batch_id)
            return view is not None and view.finalized_at is not None

        await eventually(finalized_recorded, timeout_s=20, what="batch.finalized recorded")
        view = await get_batch(pool, script.batch_id)
        assert view is not None
        assert view.status == "succeeded"
        assert view.summary is not None
        assert view.summary.verdicts.passed == 1
        assert view.summary.verdicts.failed == 1
        types = await stored(pool, script.batch_id)
        assert types[0] == "batch.requested"
        assert types[-1] == "batch.finalized"
        assert sorted(types[1:-1]) == sorted(["case.requested", "case.executed", "case.judged", "case.exported"] * 2)
        sealed = await pool.fetchval("SELECT count(*) FROM seals WHERE batch_id = $1", script.batch_id)
        assert sealed == 2

        # Anything arriving after the finalisation does not finalize again.
        await pub.publish_event(script.cancelled())

        async def cancel_recorded() -> bool:
            return "batch.cancelled" in await stored(pool, script.batch_id)

        await eventually(cancel_recorded, timeout_s=20, what="late batch.cancelled recorded")
        # Once the recorder has acked the cancel, any finalisation it caused was published.
        await eventually(lambda: recorder_idle(nc), timeout_s=20, what="the recorder to ack the cancel")
        assert await count_on_stream(nc, f"batch.finalized.{script.batch_id}") == 1


async def test_acks_wait_for_the_commit(
    gw_nats: str, database_url: str, bus: tuple[NatsClient, Publisher], pool: asyncpg.Pool[asyncpg.Record]
) -> None:
    """While the transaction is held, the messages stay unacknowledged and nothing is stored;
    once it commits they are acked."""
    nc, pub = bus
    gate = asyncio.Event()
    held = asyncio.Event()
    committed: list[int] = []

    async def gated(db: object, messages: Sequence[RecordedMessage]) -> RecordOutcome:
        held.set()
        await gate.wait()
        outcome = await record(db, messages)  # type: ignore[arg-type]
        committed.extend(m.stream_seq for m in messages)
        return outcome

    script = BatchScript(new_batch_id(), batch_spec(("c1",)))
    events = [script.requested(), *script.case_events("c1")]
    # What earlier tests of the module left on the stream is recorded first, so that the held
    # transaction holds this test's messages and nothing else.
    async with running_gateway(gw_nats, database_url):
        await eventually(lambda: recorder_idle(nc), timeout_s=20, what="the recorder to catch up")
    async with running_gateway(gw_nats, database_url, record_with=gated):
        seqs = [(await pub.publish_event(e)).seq for e in events]
        await asyncio.wait_for(held.wait(), 10)

        async def all_delivered_unacked() -> bool:
            return await ack_pending(nc) == len(events)

        await eventually(all_delivered_unacked, timeout_s=20, what="every message delivered to the recorder")
        assert await stored(pool, script.batch_id) == []
        assert committed == []
        assert await ack_pending(nc) == len(events)

        gate.set()

        async def recorded_and_acked() -> bool:
            # The batch's messages and the `batch.finalized` their commit triggered.
            return len(await stored(pool, script.batch_id)) == len(events) + 1 and await recorder_idle(nc)

        await eventually(recorded_and_acked, timeout_s=20, what="the batch recorded and every message acked")
        assert (await stored(pool, script.batch_id))[-1] == "batch.finalized"
        # Every message went through the held write exactly once: the acks came after its commit.
        assert sorted(committed) == await stored_seqs(pool, script.batch_id)
        assert set(seqs) < set(committed)


async def test_a_failed_write_is_retried_and_recorded_once(
    gw_nats: str, database_url: str, bus: tuple[NatsClient, Publisher], pool: asyncpg.Pool[asyncpg.Record]
) -> None:
    _, pub = bus
    failures = {"left": 1}

    async def flaky(db: object, messages: Sequence[RecordedMessage]) -> RecordOutcome:
        if failures["left"] > 0:
            failures["left"] -= 1
            raise ConnectionError("database went away")
        return await record(db, messages)  # type: ignore[arg-type]

    script = BatchScript(new_batch_id(), batch_spec(("c1",)))
    async with running_gateway(gw_nats, database_url, record_with=flaky):
        await publish(pub, [script.requested(), *script.case_events("c1")])

        async def finalized() -> bool:
            return "batch.finalized" in await stored(pool, script.batch_id)

        await eventually(finalized, timeout_s=20, what="the batch recorded and finalized after the retry")
    assert failures["left"] == 0
    types = await stored(pool, script.batch_id)
    assert len(types) == len(set(types)) == 6


async def test_poison_goes_to_the_dlq_and_recording_continues(
    gw_nats: str, database_url: str, bus: tuple[NatsClient, Publisher], pool: asyncpg.Pool[asyncpg.Record]
) -> None:
    nc, pub = bus
    batch_id = new_batch_id()
    subject = f"case.executed.{batch_id}.c1"
    await pub.publish_raw(
        subject, b'{"type": "case.executed", "not": "an event"', {"Nats-Msg-Id": f"poison-{batch_id}"}
    )
    script = BatchScript(batch_id, batch_spec(("c1",)))
    async with running_gateway(gw_nats, database_url):
        await pub.publish_event(script.requested())

        async def requested_recorded() -> bool:
            return await stored(pool, batch_id) == ["batch.requested"]

        await eventually(requested_recorded, timeout_s=20, what="the valid event after the poison recorded")

        async def dead_lettered() -> bool:
            return await count_on_stream_dlq(nc, "dlq.gateway") > 0

        await eventually(dead_lettered, timeout_s=20, what="the poison dead-lettered")
    letters = await read_dlq(nc, "dlq.gateway")
    mine = [d for d in letters if d.subject_ == subject]
    assert len(mine) == 1
    assert mine[0].reason.startswith("poison")
    assert mine[0].stream == "CASES"


async def count_on_stream_dlq(nc: NatsClient, subject: str) -> int:
    info = await nc.jetstream().stream_info("DLQ", subjects_filter=subject)
    return sum((info.state.subjects or {}).values())


async def read_dlq(nc: NatsClient, subject: str) -> list[DeadLetter]:
    js = nc.jetstream()
    total = await count_on_stream_dlq(nc, subject)
    sub = await js.subscribe(subject, stream="DLQ", ordered_consumer=True)
    out: list[DeadLetter] = []
    try:
        for _ in range(total):
            msg = await sub.next_msg(timeout=5)
            event = decode_event(msg.data)
            assert isinstance(event, DeadLetter)
            out.append(event)
    finally:
        await sub.unsubscribe()
    return out


async def test_a_cancelled_batch_ends_cancelled_with_a_partial_summary(
    gw_nats: str, database_url: str, bus: tuple[NatsClient, Publisher], pool: asyncpg.Pool[asyncpg.Record]
) -> None:
    nc, pub = bus
    script = BatchScript(new_batch_id(), batch_spec(("c1", "c2")))
    async with running_gateway(gw_nats, database_url):
        await publish(pub, [script.requested(), *script.case_events("c1")])
        await pub.publish_event(script.cancelled())
        # The dispatcher turns the case that had not started into `case.executed: cancelled`.
        await publish(
            pub,
            [
                script.case_requested("c2"),
                script.executed("c2", status="cancelled"),
                script.judged("c2"),
                script.exported("c2"),
            ],
        )

        async def finalized() -> bool:
            return await finalized_on_stream(nc, script.batch_id) is not None

        await eventually(finalized, timeout_s=20, what="batch.finalized")
    event = await finalized_on_stream(nc, script.batch_id)
    assert event is not None
    assert event.status == "cancelled"
    assert event.summary.counts.cancelled == 1
    assert event.summary.verdicts.passed == 1


async def test_a_cancel_of_an_already_complete_batch_finalizes_it(
    gw_nats: str, database_url: str, bus: tuple[NatsClient, Publisher], pool: asyncpg.Pool[asyncpg.Record]
) -> None:
    """A batch whose cases were all exported but whose finalisation was lost (written to the store
    directly here, as a crash between commit and publish would leave it) is finalized when a
    `batch.cancelled` for it is recorded."""
    nc, pub = bus
    script = BatchScript(new_batch_id(), batch_spec(("c1",)))
    events = [script.requested(), *script.case_events("c1")]
    async with running_gateway(gw_nats, database_url) as gw:
        base = 10**12 + int(uuid.uuid4().int % 10**6) * 100
        outcome = await record(
            gw.state.pool,
            [RecordedMessage(base + i, e.subject(), encode(e), e) for i, e in enumerate(events)],
        )
        assert outcome.complete_batches == (script.batch_id,)
        assert await finalized_on_stream(nc, script.batch_id) is None
        await pub.publish_event(script.cancelled())

        async def finalized() -> bool:
            return await finalized_on_stream(nc, script.batch_id) is not None

        await eventually(finalized, timeout_s=20, what="batch.finalized after the cancel")
    event = await finalized_on_stream(nc, script.batch_id)
    assert event is not None
    # Nothing finalized the batch before the cancel was recorded (the start-up sweep ran before
    # the events were written), so the recorded cancel decides the status.
    assert event.status == "cancelled"
    assert event.summary.verdicts.passed == 1
    assert event.summary.counts.cancelled == 0


async def test_the_start_up_sweep_finalizes_a_complete_batch(
    gw_nats: str, database_url: str, bus: tuple[NatsClient, Publisher], pool: asyncpg.Pool[asyncpg.Record]
) -> None:
    nc, _ = bus
    script = BatchScript(new_batch_id(), batch_spec(("c1",)))
    events = [script.requested(), *script.case_events("c1")]
    async with running_gateway(gw_nats, database_url):
        pass  # migrate the fresh database
    base = 2 * 10**12 + int(uuid.uuid4().int % 10**6) * 100
    await record(pool, [RecordedMessage(base + i, e.subject(), encode(e), e) for i, e in enumerate(events)])
    assert await finalized_on_stream(nc, script.batch_id) is None
    async with running_gateway(gw_nats, database_url):
        event = await finalized_on_stream(nc, script.batch_id)
        assert event is not None, "finalized during start-up"
        assert event.status == "succeeded"
