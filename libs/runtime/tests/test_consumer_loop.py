"""The consumer loop against a real nats-server, with workers as real processes."""

from __future__ import annotations

import asyncio
import itertools
import signal
import uuid
from pathlib import Path

import pytest
from nats.aio.client import Client as NatsClient

from evalbus.testing.bus import (
    Marks,
    Workers,
    advisory_listener,
    dead_letters,
    executed_count,
    exhaust,
    make_consumer,
    request,
)
from evalbus.testing.pipeline import eventually
from evalbus_contracts.streams import ConsumerDef
from evalbus_contracts.subjects import case_subject
from evalbus_runtime import Publisher

pytestmark = [pytest.mark.integration]


def _batch() -> str:
    return f"b{uuid.uuid4().hex[:8]}"


async def all_acked(nc: NatsClient, consumer: ConsumerDef, *, deliveries: int) -> bool:
    """Whether `consumer` made exactly `deliveries` deliveries and acked them all, with nothing
    left to deliver or redeliver."""
    info = await nc.jetstream().consumer_info(consumer.stream, consumer.durable)
    assert info.delivered is not None
    assert info.delivered.consumer_seq <= deliveries, info
    return (
        info.delivered.consumer_seq == deliveries
        and info.ack_floor is not None
        and info.ack_floor.consumer_seq == deliveries
        and info.num_pending == 0
        and info.num_ack_pending == 0
        and info.num_redelivered == 0
    )


async def test_sigkill_mid_message_is_redelivered_and_output_once(
    bus: tuple[NatsClient, Publisher], workers: Workers, tmp_path: Path
) -> None:
    nc, pub = bus
    batch = _batch()
    consumer = make_consumer(batch, ack_wait_s=2.0)
    marks = Marks(tmp_path / "marks")
    victim = workers.start(consumer, marks, worker_work_s="30", worker_service=f"w{batch}")
    await pub.publish_event(request(batch, "c1"))
    await eventually(lambda: marks.count("start") == 1, timeout_s=20, what="the first worker to start c1")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    assert marks.count("end") == 0
    workers.start(consumer, marks, worker_work_s="0", worker_service=f"w{batch}")
    await eventually(lambda: marks.count("end") == 1, timeout_s=30, what="the second worker to finish c1")
    starts = [line for line in marks.lines() if line[0] == "start"]
    assert [s[2] for s in starts] == ["1", "2"]  # delivery counts: redelivered after the crash
    # The chassis acks only after the output is stored. Once the consumer has acked every delivery
    # it made and holds nothing pending, no further delivery (and so no second output) can come.
    await eventually(
        lambda: all_acked(nc, consumer, deliveries=2), timeout_s=30, what="both deliveries of c1 to be acked"
    )
    assert await executed_count(nc, batch) == {"c1": 1}
    assert marks.count("start") == 2


async def test_poison_goes_to_dlq_while_next_messages_flow(
    bus: tuple[NatsClient, Publisher], workers: Workers, tmp_path: Path
) -> None:
    nc, pub = bus
    batch = _batch()
    service = f"w{batch}"
    marks = Marks(tmp_path / "marks")
    workers.start(make_consumer(batch), marks, worker_mode="poison-on-input", worker_service=service)
    # An undecodable payload on the consumer's subject, a poison decision, then good messages.
    await pub.publish_raw(case_subject("case.requested", batch, "garbage"), b"{not json", {"Nats-Msg-Id": batch + "g"})
    await pub.publish_event(request(batch, "bad", text="poison"))
    for i in range(5):
        await pub.publish_event(request(batch, f"ok{i}"))

    async def settled() -> bool:
        return len(await executed_count(nc, batch)) == 5 and len(await dead_letters(nc, service)) == 2

    await eventually(settled, timeout_s=25, what="five outputs and two dead letters")
    letters = await dead_letters(nc, service)
    reasons = sorted(letter.reason for letter in letters)
    assert len(letters) == 2
    assert reasons[0].startswith("poison: input says poison")
    assert reasons[1].startswith("poison: undecodable payload")
    garbage = next(letter for letter in letters if "undecodable" in letter.reason)
    assert garbage.payload == "{not json"
    assert garbage.stream == "CASES"
    assert garbage.stream_seq is not None
    assert await executed_count(nc, batch) == {f"ok{i}": 1 for i in range(5)}


async def test_retryable_error_backs_off_then_dead_letters_after_max_deliver(
    bus: tuple[NatsClient, Publisher], workers: Workers, tmp_path: Path
) -> None:
    nc, pub = bus
    batch = _batch()
    service = f"w{batch}"
    marks = Marks(tmp_path / "marks")
    workers.start(make_consumer(batch, max_deliver=4), marks, worker_mode="fail", worker_service=service)
    await pub.publish_event(request(batch, "c1"))

    async def dead_lettered() -> bool:
        return bool(await dead_letters(nc, service))

    await eventually(dead_lettered, timeout_s=30, what="c1 to be dead-lettered")
    letters = await dead_letters(nc, service)
    assert len(letters) == 1
    assert letters[0].deliveries == 4
    assert "max_deliver (4) exhausted" in letters[0].reason
    assert "always failing" in letters[0].reason
    starts = [(float(line[3]), int(line[2])) for line in marks.lines() if line[0] == "start"]
    assert [d for _, d in starts] == [1, 2, 3, 4]
    gaps = [b[0] - a[0] for a, b in itertools.pairwise(starts)]
    # retry_base_s=0.1 doubling: ≥ 0.1, 0.2, 0.4 s between deliveries (exponential backoff)
    for gap, expected in zip(gaps, [0.1, 0.2, 0.4], strict=True):
        assert gap >= expected * 0.9, (gaps, expected)
    assert gaps[2] > gaps[0]
    assert await executed_count(nc, batch) == {}


async def test_max_ack_pending_bounds_concurrency_across_two_workers(
    bus: tuple[NatsClient, Publisher], workers: Workers, tmp_path: Path
) -> None:
    nc, pub = bus
    batch = _batch()
    consumer = make_consumer(batch, max_ack_pending=3)
    marks = Marks(tmp_path / "marks")
    for _ in range(2):
        workers.start(consumer, marks, worker_work_s="0.3", worker_concurrency="8", worker_service=f"w{batch}")
    n = 18
    for i in range(n):
        await pub.publish_event(request(batch, f"c{i}"))
    await eventually(lambda: marks.count("end") == n, timeout_s=60, what="all cases handled")
    events = sorted(
        ((float(parts[3]), 1 if parts[0] == "start" else -1, parts[4]) for parts in marks.lines()),
        key=lambda e: (e[0], e[1]),
    )
    running = peak = 0
    pids = set()
    for _, delta, pid in events:
        running += delta
        peak = max(peak, running)
        pids.add(pid)
    assert peak <= 3, peak
    assert peak >= 2  # the limit was actually reached, so the bound is what held it
    assert len(pids) == 2  # both workers took part
    assert len(await executed_count(nc, batch)) == n


async def test_graceful_shutdown_finishes_in_flight_work(
    bus: tuple[NatsClient, Publisher], workers: Workers, tmp_path: Path
) -> None:
    nc, pub = bus
    batch = _batch()
    marks = Marks(tmp_path / "marks")
    proc = workers.start(make_consumer(batch), marks, worker_work_s="1.5", worker_service=f"w{batch}")
    for i in range(3):
        await pub.publish_event(request(batch, f"c{i}"))
    await eventually(lambda: marks.count("start") == 3, timeout_s=20, what="three messages in flight")
    proc.send_signal(signal.SIGTERM)
    code = await asyncio.to_thread(proc.wait, 30)
    assert code == 0
    assert marks.count("end") == 3
    assert await executed_count(nc, batch) == {"c0": 1, "c1": 1, "c2": 1}


async def test_exhausted_deliveries_without_answer_are_dead_lettered_from_the_advisory(
    bus: tuple[NatsClient, Publisher], nats_url: str, tmp_path: Path
) -> None:
    """A worker that never answers (crashes every time) exhausts max_deliver; the chassis copies
    the message to the DLQ from JetStream's advisory."""
    from evalbus_runtime import connect
    from evalbus_runtime.bus import ensure_consumer

    nc, pub = bus
    batch = _batch()
    service = f"w{batch}"
    consumer = make_consumer(batch, ack_wait_s=0.5, max_deliver=2)
    await ensure_consumer(nc.jetstream(), consumer)
    listener = await advisory_listener(nc, pub, consumer, service)
    raw = await connect(nats_url, "crasher")
    try:
        await pub.publish_event(request(batch, "c1"))
        await exhaust(raw, consumer, 2)

        async def dead_lettered() -> bool:
            return bool(await dead_letters(nc, service))

        await eventually(dead_lettered, timeout_s=20, what="the exhausted message to be dead-lettered")
        letters = await dead_letters(nc, service)
        assert len(letters) == 1
        assert "max_deliver exhausted" in letters[0].reason
        assert '"case_id":"c1"' in letters[0].payload
        assert letters[0].stream_seq is not None
        assert letters[0].deliveries == 2
    finally:
        await listener.stop(1)
        await raw.close()


async def test_a_handler_that_ignores_its_cancellation_does_not_hang_the_stop(
    bus: tuple[NatsClient, Publisher], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """Past the drain timeout `stop` cancels what is in flight and waits `CANCEL_GRACE_S` for it,
    no longer: a handler that swallows its cancellation is logged with where it is stuck, and the
    message goes back to the stream (never acked). Before, the wait was unbounded (a stuck handler
    hung the service's stop until the test's own timeout)."""
    from evalbus_runtime import ConsumerLoop, ServiceMetrics, Stage
    from evalbus_runtime import consumer as consumer_module
    from evalbus_runtime.bus import ensure_consumer

    monkeypatch.setattr(consumer_module, "CANCEL_GRACE_S", 0.5)
    nc, pub = bus
    batch = _batch()
    consumer = make_consumer(batch)
    await ensure_consumer(nc.jetstream(), consumer)
    entered, release = asyncio.Event(), asyncio.Event()

    async def stubborn(event: object, delivery: object) -> None:
        entered.set()
        while not release.is_set():
            try:
                await release.wait()
            except asyncio.CancelledError:
                continue  # ignores it: the bug `stop` must survive

    loop = ConsumerLoop(
        nc, pub, Stage(consumer=consumer, handler=stubborn, concurrency=1), service="stubborn",
        metrics=ServiceMetrics("stubborn"),
    )  # fmt: skip
    await loop.start()
    try:
        await pub.publish_event(request(batch, "c1"))
        await asyncio.wait_for(entered.wait(), 20)
        finished = await asyncio.wait_for(loop.stop(0.2), 10)  # bounded: 0.2 s drain + 0.5 s grace
        assert finished is False
        assert any(
            "did not stop within 0.5s of its cancellation; it waits at" in r.getMessage() for r in caplog.records
        )
        assert "stubborn" in "".join(r.getMessage() for r in caplog.records)  # where it is stuck
    finally:
        release.set()
