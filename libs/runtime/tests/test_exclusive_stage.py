"""An exclusive stage (`Stage.exclusive`) never handles a message twice at once: a redelivery whose
holder still lives is left to it, one whose holder is gone runs — on a real nats-server.

The first test makes a healthy replica miss its `ack_wait` on purpose: replica A's ticker, which
sends `in_progress` for what it holds, is stopped (as a stalled event loop would not send it), while
the server's consumer redelivers after 1.5 s. Without `exclusive` (the parametrised control) replica B
then runs the message a second time while A still runs it — two handlers at once, the hazard a
short `ack_wait` brings; with it B's probe of the hold subject is answered and B leaves the message
to A. The process tests stop a holder with SIGSTOP (it cannot answer: left to it, and it finishes
once resumed) and kill one with SIGKILL (nats-server answers "no responders": the next replica
runs the message at once)."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import signal
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest
from nats.aio.client import Client as NatsClient

from evalbus.testing.bus import Marks, Workers, dead_letters, executed, executed_count, make_consumer, request
from evalbus.testing.pipeline import eventually
from evalbus_contracts import CaseRequested
from evalbus_contracts.events import EventBase
from evalbus_contracts.subjects import CASE_EXECUTED
from evalbus_runtime import Delivery, Publisher, Stage, connect, holds, settled_by_output
from evalbus_runtime.bus import ensure_consumer
from evalbus_runtime.consumer import ConsumerLoop
from evalbus_runtime.metrics import ServiceMetrics
from evalbus_runtime.tasks import cancel_and_wait

pytestmark = [pytest.mark.integration]

SERVER_ACK_WAIT_S = 1.5
"""The consumer's `ack_wait` on the server: a replica that does not touch a message this long loses it."""
HOLD_S = 4.0
"""How long a handler holds its message in the ack-wait test: well past `SERVER_ACK_WAIT_S`."""


def _batch() -> str:
    return f"x{uuid.uuid4().hex[:8]}"


class Replica:
    """A consumer loop on a connection of its own, in this process, counting its handler calls."""

    def __init__(self, name: str, release: asyncio.Event, service: str | None = None) -> None:
        self.name = name
        self.service = service or name
        self.release = release
        self.started: list[int] = []
        """Delivery counts of the handler calls."""
        self.running = 0
        self.metrics = ServiceMetrics(name)
        self.nc: NatsClient | None = None
        self.pub: Publisher | None = None
        self.loop: ConsumerLoop | None = None
        self.durable = ""

    async def handle(self, event: CaseRequested, delivery: Delivery) -> Sequence[EventBase]:
        self.started.append(delivery.num_delivered)
        self.running += 1
        try:
            await self.release.wait()
        finally:
            self.running -= 1
        return [executed(event)]

    async def start(self, nats_url: str, stage: Stage) -> None:
        self.nc = await connect(nats_url, self.name)
        self.pub = Publisher(self.nc)
        await self.pub.start()
        self.durable = stage.consumer.durable
        self.loop = ConsumerLoop(
            self.nc,
            self.pub,
            dataclasses.replace(stage, handler=self.handle),
            service=self.service,
            metrics=self.metrics,
        )
        await self.loop.start()

    def outcomes(self, outcome: str) -> float:
        value: Any = self.metrics.messages.labels(self.durable, outcome)._value.get()
        return float(value)

    async def stop(self) -> None:
        self.release.set()
        if self.loop is not None:
            await self.loop.stop(5.0)
        if self.pub is not None:
            await self.pub.stop()
        if self.nc is not None:
            await self.nc.close()


async def unused(_event: Any, _delivery: Delivery) -> Sequence[EventBase]:
    raise AssertionError("replaced by each replica's handler")


async def stalled_holder_beside(
    a: Replica, b: Replica, nats_url: str, stage: Stage, pub: Publisher, batch: str
) -> None:
    """Replica A takes c1 and never touches it (its ticker cancelled), so c1 outlives the server's
    ack wait; then B starts beside it."""
    await a.start(nats_url, stage)
    assert a.loop is not None
    assert a.loop._ticker is not None
    await cancel_and_wait(a.loop._ticker)
    await pub.publish_event(request(batch, "c1"))
    await eventually(lambda: a.started == [1], timeout_s=10, what="replica A to take c1")
    await b.start(nats_url, stage)


@pytest.mark.parametrize("exclusive", [True, False], ids=["exclusive", "control"])
async def test_a_holder_that_misses_its_ack_wait_is_not_joined_by_a_second_run(
    bus: tuple[NatsClient, Publisher], nats_url: str, exclusive: bool
) -> None:
    nc, pub = bus
    batch = _batch()
    consumer = make_consumer(batch, ack_wait_s=SERVER_ACK_WAIT_S, max_deliver=20)
    await ensure_consumer(nc.jetstream(), consumer)
    stage = Stage(
        consumer=consumer,
        handler=unused,  # each replica's own
        accepts=(CaseRequested,),
        concurrency=1,
        exclusive=exclusive,
    )
    release = asyncio.Event()
    a, b = Replica("replica-a", release), Replica("replica-b", release)
    try:
        await stalled_holder_beside(a, b, nats_url, stage, pub, batch)
        if exclusive:
            # redelivered to B (A has no free slot) after 1.5 s; B's probe is answered by A
            await eventually(lambda: b.outcomes("held") >= 1, timeout_s=10, what="B to leave c1 to A")
            assert b.started == []
            assert a.running == 1
        else:
            await eventually(lambda: b.started != [], timeout_s=10, what="B to run c1 as well")
            assert a.running == 1  # the hazard: the same message handled twice at once
            assert b.running == 1
        release.set()
        await eventually(lambda: a.running == 0 and b.running == 0, timeout_s=10, what="the handlers to end")

        async def stored_once() -> bool:
            return await executed_count(nc, batch) == {"c1": 1}

        await eventually(stored_once, timeout_s=10, what="c1's output stored")
        assert a.started == [1]
        assert len(b.started) == (0 if exclusive else 1)
    finally:
        await a.stop()
        await b.stop()


async def test_a_stopped_holder_keeps_its_message_and_finishes_it_once_resumed(
    bus: tuple[NatsClient, Publisher], workers: Workers, tmp_path: Path
) -> None:
    """A worker stopped by SIGSTOP sends no `in_progress` and answers no probe: the other worker
    gets the redelivery, waits out the probe's timeout and leaves the message (a stopped or starved
    process still holds it). Resumed, the first worker finishes it: one run, one output."""
    nc, pub = bus
    batch = _batch()
    consumer = make_consumer(batch, ack_wait_s=SERVER_ACK_WAIT_S, max_deliver=20)
    marks = Marks(tmp_path / "marks")
    service = f"w{batch}"
    holder = workers.start(
        consumer, marks, worker_work_s="2", worker_concurrency="1", worker_exclusive="1", worker_service=service
    )
    await pub.publish_event(request(batch, "c1"))
    await eventually(lambda: marks.count("start") == 1, timeout_s=20, what="the first worker to start c1")
    holder.send_signal(signal.SIGSTOP)
    try:
        other = workers.start(consumer, marks, worker_exclusive="1", worker_service=service)
        log = workers.tmp / f"worker-{len(workers.procs) - 1}.log"

        def left_to_its_holder() -> bool:
            return log.exists() and "did not answer" in log.read_text(errors="replace")

        await eventually(left_to_its_holder, timeout_s=30, what="the other worker to leave c1 to the stopped one")
        assert marks.count("start") == 1
        assert other.poll() is None
    finally:
        holder.send_signal(signal.SIGCONT)

    async def done_once() -> bool:
        return await executed_count(nc, batch) == {"c1": 1}

    await eventually(done_once, timeout_s=30, what="c1's output from the resumed worker")
    assert [(line[0], line[1]) for line in marks.lines()] == [("start", "c1"), ("end", "c1")]
    assert {line[4] for line in marks.lines()} == {str(holder.pid)}


async def test_a_killed_holders_message_runs_at_once_on_the_next_delivery(
    bus: tuple[NatsClient, Publisher], workers: Workers, tmp_path: Path
) -> None:
    """A SIGKILLed holder's connection is gone, so its hold subject has no responder: the redelivery
    after `ack_wait` runs without waiting for any probe timeout."""
    nc, pub = bus
    batch = _batch()
    consumer = make_consumer(batch, ack_wait_s=SERVER_ACK_WAIT_S)
    marks = Marks(tmp_path / "marks")
    service = f"w{batch}"
    victim = workers.start(consumer, marks, worker_work_s="30", worker_exclusive="1", worker_service=service)
    await pub.publish_event(request(batch, "c1"))
    await eventually(lambda: marks.count("start") == 1, timeout_s=20, what="the first worker to start c1")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    workers.start(consumer, marks, worker_exclusive="1", worker_service=service)
    await eventually(lambda: marks.count("end") == 1, timeout_s=30, what="the second worker to finish c1")
    assert [line[2] for line in marks.lines() if line[0] == "start"] == ["1", "2"]

    async def done_once() -> bool:
        return await executed_count(nc, batch) == {"c1": 1}

    await eventually(done_once, timeout_s=10, what="c1's output")
    log = (workers.tmp / "worker-1.log").read_text(errors="replace")
    assert "left to it" not in log


async def test_no_responders_right_after_a_reconnect_is_not_believed(
    bus: tuple[NatsClient, Publisher],
    nats_url: str,
    workers: Workers,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """After a nats-server restart the replicas come back one by one: a holder not back yet has no
    hold subscription for a moment. A replica that reconnected within `RECONNECT_GRACE_S` leaves a
    redelivery with no holder for its next delivery; after the grace it runs it. (The holder here
    is gone for good — SIGKILLed — which "no responders" cannot tell from one not back yet.)"""
    monkeypatch.setattr(holds, "RECONNECT_GRACE_S", 2.0)
    nc, pub = bus
    batch = _batch()
    consumer = make_consumer(batch, ack_wait_s=SERVER_ACK_WAIT_S, max_deliver=20)
    marks = Marks(tmp_path / "marks")
    victim = workers.start(consumer, marks, worker_work_s="30", worker_exclusive="1", worker_service=f"w{batch}")
    await pub.publish_event(request(batch, "c1"))
    await eventually(lambda: marks.count("start") == 1, timeout_s=20, what="the worker to start c1")
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    release = asyncio.Event()
    release.set()
    b = Replica("replica-b", release)
    stage = Stage(consumer=consumer, handler=unused, accepts=(CaseRequested,), concurrency=1, exclusive=True)
    try:
        await b.start(nats_url, stage)
        assert b.loop is not None
        b.loop.reset_requests()  # as the chassis does when B's connection comes back
        await eventually(lambda: b.outcomes("held") >= 1, timeout_s=10, what="B to leave c1 inside its grace")
        assert b.started == []
        await eventually(lambda: b.started != [], timeout_s=15, what="B to run c1 after its grace")

        async def stored_once() -> bool:
            return await executed_count(nc, batch) == {"c1": 1}

        await eventually(stored_once, timeout_s=10, what="c1's output stored")
        assert b.started[0] >= 3  # delivered to the victim, left by B, run by B
    finally:
        await b.stop()


async def test_a_loop_touches_what_it_holds_against_the_servers_shorter_ack_wait(
    bus: tuple[NatsClient, Publisher], nats_url: str
) -> None:
    """A replica whose own definition says 10 s (an older release, or another `ACK_WAIT_S`) while
    the server's consumer says 1.5 s (set by another replica) follows the server: a case it holds
    for 4 s is never redelivered to the replica beside it. Touching it at a quarter of its own
    10 s, it would be (tried: the read-back made to do nothing)."""
    nc, pub = bus
    batch = _batch()
    consumer = make_consumer(batch, ack_wait_s=SERVER_ACK_WAIT_S)
    await ensure_consumer(nc.jetstream(), consumer)
    own = dataclasses.replace(
        Stage(consumer=consumer, handler=unused, accepts=(CaseRequested,), concurrency=1),
        consumer=make_consumer(batch, durable=consumer.durable, ack_wait_s=10.0),
    )
    release = asyncio.Event()
    a, b = Replica("replica-a", release), Replica("replica-b", release)
    try:
        await a.start(nats_url, own)
        await pub.publish_event(request(batch, "c1"))
        await eventually(lambda: a.started == [1], timeout_s=10, what="replica A to take c1")
        await b.start(nats_url, dataclasses.replace(own, consumer=consumer))  # B pulls what A would lose
        await asyncio.sleep(HOLD_S)  # the work itself: A holds c1 well past the server's ack_wait
        release.set()

        async def done_once() -> bool:
            return await executed_count(nc, batch) == {"c1": 1}

        await eventually(done_once, timeout_s=10, what="c1's output")
        info = await nc.jetstream().consumer_info(consumer.stream, consumer.durable)
        assert info.num_redelivered == 0
        assert a.started == [1]
        assert b.started == []
    finally:
        await a.stop()
        await b.stop()


async def test_a_case_that_ran_out_of_deliveries_while_its_holder_stalled_is_watched_not_dead_lettered(
    bus: tuple[NatsClient, Publisher], nats_url: str, caplog: pytest.LogCaptureFixture
) -> None:
    """Each redelivery left to a stalled holder still counts against `max_deliver`. When they run
    out while the holder still holds the case, the case is watched, not dead-lettered: the holder
    finishes, its output is stored, no letter. (Dead-lettered at once before: tried.)"""
    caplog.set_level(logging.INFO, logger="evalbus.consumer")
    nc, pub = bus
    batch = _batch()
    service = f"w{batch}"
    consumer = make_consumer(batch, ack_wait_s=SERVER_ACK_WAIT_S, max_deliver=2)
    await ensure_consumer(nc.jetstream(), consumer)
    stage = Stage(
        consumer=consumer,
        handler=unused,
        accepts=(CaseRequested,),
        concurrency=1,
        exclusive=True,
        settled_by=settled_by_output(CASE_EXECUTED),
    )
    release = asyncio.Event()
    a, b = Replica("replica-a", release, service), Replica("replica-b", release, service)
    try:
        await stalled_holder_beside(a, b, nats_url, stage, pub, batch)

        def logged(text: str) -> bool:
            return any(text in r.getMessage() for r in caplog.records)

        await eventually(lambda: logged("ran out of deliveries while a replica still holds it"), timeout_s=15,
                         what="c1's deliveries to run out while A holds it")  # fmt: skip
        release.set()
        await eventually(lambda: logged("its output is stored: no dead letter"), timeout_s=15, what="c1 settled")

        async def stored_once() -> bool:
            return await executed_count(nc, batch) == {"c1": 1}

        await eventually(stored_once, timeout_s=10, what="c1's output")
        assert await dead_letters(nc, service) == []
        assert a.started == [1]
        assert b.started == []
    finally:
        await a.stop()
        await b.stop()
