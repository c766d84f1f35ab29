"""The recorder's write batcher as pure logic: group commit by size and by delay, stream order,
one write at a time, every waiter gets its own batch's outcome or its failure; while the database
is unavailable the same batch is written again, held, until it goes through."""

from __future__ import annotations

import asyncio
from collections.abc import Sequence

import asyncpg
import pytest

from evalbus_contracts import BatchCancelled, DecodeError, encode
from evalbus_gateway.recorder_stage import WriteBatcher, decode_recorded
from evalbus_gateway.store import RecordedMessage, RecordOutcome
from evalbus_runtime import Retry

pytestmark = pytest.mark.unit


def message(seq: int) -> RecordedMessage:
    event = BatchCancelled(batch_id=f"b{seq}", reason="cancelled", by="x")
    return RecordedMessage(seq, event.subject(), encode(event), event)


class Log:
    """A write that remembers its batches and checks that writes never overlap."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = []
        self.active = 0
        self.overlapped = False
        self.release: asyncio.Event | None = None
        self.entered = asyncio.Event()

    async def write(self, messages: Sequence[RecordedMessage]) -> RecordOutcome:
        self.active += 1
        self.entered.set()
        self.overlapped |= self.active > 1
        try:
            await asyncio.sleep(0)
            if self.release is not None:
                await self.release.wait()
            self.batches.append([m.stream_seq for m in messages])
            return RecordOutcome(inserted=len(messages), complete_batches=(f"batch-{len(self.batches)}",))
        finally:
            self.active -= 1


async def test_batches_by_size_in_order_one_write_at_a_time() -> None:
    log = Log()
    batcher = WriteBatcher(log.write, max_batch=100, max_delay_s=0.05)
    batcher.start()
    outcomes = await asyncio.wait_for(asyncio.gather(*(batcher.submit(message(i)) for i in range(250))), 10)
    await batcher.stop()
    assert [len(b) for b in log.batches][:2] == [100, 100]
    assert [seq for batch in log.batches for seq in batch] == list(range(250))
    assert not log.overlapped
    # Each waiter got the outcome of the write that held its message.
    written_in = {seq: i for i, batch in enumerate(log.batches) for seq in batch}
    assert all(o.complete_batches == (f"batch-{written_in[seq] + 1}",) for seq, o in enumerate(outcomes))


async def test_a_lone_message_is_written_after_the_delay() -> None:
    log = Log()
    batcher = WriteBatcher(log.write, max_batch=1000, max_delay_s=0.01)
    batcher.start()
    outcome = await asyncio.wait_for(batcher.submit(message(7)), 2.0)
    await batcher.stop()
    assert outcome.inserted == 1
    assert log.batches == [[7]]


async def test_messages_gather_while_a_write_is_in_flight() -> None:
    log = Log()
    log.release = asyncio.Event()
    batcher = WriteBatcher(log.write, max_batch=1000, max_delay_s=0.0)
    batcher.start()
    first = asyncio.ensure_future(batcher.submit(message(1)))
    await asyncio.wait_for(log.entered.wait(), 5)
    rest = [asyncio.ensure_future(batcher.submit(message(i))) for i in range(2, 40)]
    await asyncio.sleep(0)
    assert batcher.pending == 38
    log.release.set()
    await asyncio.wait_for(asyncio.gather(first, *rest), 5)
    await batcher.stop()
    assert log.batches == [[1], list(range(2, 40))]


async def test_a_failed_write_fails_its_waiters_with_retry() -> None:
    calls = 0

    async def broken(messages: Sequence[RecordedMessage]) -> RecordOutcome:
        nonlocal calls
        calls += 1
        raise asyncpg.DataError("a value the store cannot take")

    batcher = WriteBatcher(broken, max_batch=10, max_delay_s=0.001)
    batcher.start()
    results = await asyncio.gather(*(batcher.submit(message(i)) for i in range(5)), return_exceptions=True)
    await batcher.stop()
    assert all(isinstance(r, Retry) and "cannot take" in r.reason for r in results)
    assert calls >= 1


async def test_while_the_database_is_unavailable_the_batch_is_held_and_written_again() -> None:
    log = Log()
    failures: list[Exception] = [
        ConnectionRefusedError("connection refused"),
        asyncpg.exceptions.ObjectNotInPrerequisiteStateError('database "x" is not currently accepting connections'),
        asyncpg.exceptions.AdminShutdownError("terminating connection due to administrator command"),
    ]
    calls = 0

    async def flaky(messages: Sequence[RecordedMessage]) -> RecordOutcome:
        nonlocal calls
        calls += 1
        if failures:
            raise failures.pop(0)
        return await log.write(messages)

    batcher = WriteBatcher(flaky, max_batch=10, max_delay_s=0.001)
    batcher.start()
    outcomes = await asyncio.wait_for(asyncio.gather(*(batcher.submit(message(i)) for i in range(5))), 10)
    await batcher.stop()
    assert [o.inserted for o in outcomes] == [5] * 5  # no waiter saw the outage: one write of all five
    assert (calls, log.batches) == (4, [[0, 1, 2, 3, 4]])


async def test_stopping_during_an_outage_fails_the_held_batch_with_retry() -> None:
    attempts = asyncio.Event()

    async def down(messages: Sequence[RecordedMessage]) -> RecordOutcome:
        attempts.set()
        raise ConnectionRefusedError("connection refused")

    batcher = WriteBatcher(down, max_batch=10, max_delay_s=0.001)
    batcher.start()
    held = asyncio.ensure_future(batcher.submit(message(1)))
    await asyncio.wait_for(attempts.wait(), 5)
    await asyncio.wait_for(batcher.stop(), 5)
    with pytest.raises(Retry, match="connection refused"):
        held.result()


async def test_stop_writes_what_is_pending_then_refuses() -> None:
    log = Log()
    batcher = WriteBatcher(log.write, max_batch=1000, max_delay_s=60.0)
    batcher.start()
    waiting = [asyncio.ensure_future(batcher.submit(message(i))) for i in range(3)]
    await asyncio.sleep(0)
    await asyncio.wait_for(batcher.stop(), 5)
    assert [len(w.result().complete_batches) for w in waiting] == [1, 1, 1]
    assert log.batches == [[0, 1, 2]]
    with pytest.raises(Retry):
        await batcher.submit(message(9))


def test_decode_keeps_the_raw_bytes() -> None:
    event = BatchCancelled(batch_id="b1", reason="cancelled", by="x")
    data = encode(event)
    payload = decode_recorded(data)
    assert payload.data == data
    assert payload.event == event
    assert (payload.batch_id, payload.run_id) == ("b1", None)
    with pytest.raises(DecodeError):
        decode_recorded(b'{"type": "nope"}')
