"""Slots shared by several stages: the pool alone, then two consumer loops sharing one against a
real nats-server (two lanes of one dispatcher replica)."""

from __future__ import annotations

import asyncio
import uuid

import pytest
from nats.aio.client import Client as NatsClient

from evalbus.testing.bus import make_consumer, request
from evalbus.testing.pipeline import eventually
from evalbus_contracts import CaseRequested
from evalbus_contracts.streams import ConsumerDef
from evalbus_runtime import ConsumerLoop, Delivery, Publisher, ServiceMetrics, SlotPool, Stage
from evalbus_runtime.bus import ensure_consumer

# ---------------------------------------------------------------- the pool


async def test_takers_wait_first_come_first_served_and_a_give_back_goes_to_the_oldest() -> None:
    pool = SlotPool(1)
    assert pool.try_take()
    assert not pool.try_take()
    order: list[str] = []

    async def taker(name: str) -> None:
        await pool.take()
        order.append(name)

    first = asyncio.create_task(taker("first"))
    await eventually(lambda: pool.waiting == 1, timeout_s=10, what="the first taker to wait")
    second = asyncio.create_task(taker("second"))
    await eventually(lambda: pool.waiting == 2, timeout_s=10, what="the second taker to wait")
    assert pool.available() == 0
    pool.give_back()
    await first
    assert order == ["first"]
    assert pool.held == 1
    assert pool.waiting == 1
    assert not pool.try_take()  # a waiter is ahead of any newcomer
    pool.give_back()
    await second
    assert order == ["first", "second"]
    assert pool.held == 1
    pool.give_back()
    assert pool.held == 0
    assert pool.available() == 1


async def test_a_cancelled_taker_takes_nothing() -> None:
    pool = SlotPool(1)
    assert pool.try_take()
    waiting = asyncio.create_task(pool.take())
    await eventually(lambda: pool.waiting == 1, timeout_s=10, what="the taker to wait")
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    assert pool.waiting == 0
    pool.give_back()
    assert pool.held == 0
    assert pool.available() == 1


async def test_shrinking_keeps_the_holders_and_growing_wakes_the_waiters() -> None:
    pool = SlotPool(2)
    changes: list[int] = []
    pool.on_change(lambda: changes.append(pool.available()))
    assert pool.try_take()
    assert pool.try_take()
    pool.resize(1)
    assert pool.held == 2
    assert pool.available() == 0
    assert changes == []
    pool.give_back()
    assert pool.held == 1
    assert pool.available() == 0
    assert changes == []  # still at the new size
    waiting = asyncio.create_task(pool.take())
    await eventually(lambda: pool.waiting == 1, timeout_s=10, what="the taker to wait")
    pool.resize(3)
    await waiting
    assert pool.held == 2
    assert pool.available() == 1
    assert changes == [1]
    with pytest.raises(ValueError, match="at least 0"):
        pool.resize(-1)


def test_a_slot_given_back_that_was_never_taken_is_a_bug() -> None:
    with pytest.raises(RuntimeError, match="never taken"):
        SlotPool(1).give_back()
    with pytest.raises(ValueError, match="at least 0"):
        SlotPool(-1)


# ---------------------------------------------------------------- two lanes, one pool


class Lanes:
    """Two consumer loops (lanes) sharing `pool`; every handler holds its slot until `gate` opens."""

    def __init__(self, nc: NatsClient, pub: Publisher, pool: SlotPool, *, concurrency: int = 4) -> None:
        self.nc, self.pub, self.pool = nc, pub, pool
        self.batches = {lane: f"b{uuid.uuid4().hex[:8]}" for lane in ("a", "b")}
        # A long ack wait: a redelivery within a test's patience is a nak, never an expiry.
        self.consumers: dict[str, ConsumerDef] = {
            lane: make_consumer(b, ack_wait_s=60.0) for lane, b in self.batches.items()
        }
        self.gate = asyncio.Event()
        self.active = 0
        self.most = 0
        self.handled: list[str] = []
        service = f"w{uuid.uuid4().hex[:6]}"
        self.loops = [
            ConsumerLoop(
                nc,
                pub,
                Stage(consumer=c, handler=self.handle, accepts=(CaseRequested,), concurrency=concurrency, pool=pool),
                service=service,
                metrics=ServiceMetrics(service),
            )
            for c in self.consumers.values()
        ]

    async def handle(self, event: CaseRequested, _: Delivery) -> None:
        self.active += 1
        self.most = max(self.most, self.active)
        try:
            await self.gate.wait()
        finally:
            self.active -= 1
            self.handled.append(event.case_id or "")

    async def start(self) -> None:
        for consumer in self.consumers.values():
            await ensure_consumer(self.nc.jetstream(), consumer)
        for loop in self.loops:
            await loop.start()

    async def submit(self, lane: str, n: int) -> None:
        for i in range(n):
            await self.pub.publish_event(request(self.batches[lane], f"{lane}{i}"))

    async def stop(self) -> None:
        self.gate.set()
        for loop in self.loops:
            await loop.stop(5.0)


async def test_two_lanes_never_hold_more_than_the_pool_and_each_case_runs_once(
    bus: tuple[NatsClient, Publisher],
) -> None:
    nc, pub = bus
    lanes = Lanes(nc, pub, SlotPool(2), concurrency=4)
    await lanes.start()
    try:
        await lanes.submit("a", 3)
        await lanes.submit("b", 3)
        await eventually(
            lambda: lanes.active == 2, timeout_s=10, what=f"two cases holding the pool (handled {lanes.handled})"
        )
        assert lanes.pool.held == 2
        lanes.gate.set()
        await eventually(lambda: len(lanes.handled) == 6, timeout_s=20, what=f"all six cases ({lanes.handled})")
        assert sorted(lanes.handled) == ["a0", "a1", "a2", "b0", "b1", "b2"]
        assert lanes.most == 2, f"{lanes.most} cases held slots at once from a pool of 2"
        await eventually(lambda: lanes.pool.held == 0, timeout_s=10, what="every slot given back")
    finally:
        await lanes.stop()


async def test_an_idle_lane_does_not_keep_the_other_from_the_whole_pool(bus: tuple[NatsClient, Publisher]) -> None:
    nc, pub = bus
    lanes = Lanes(nc, pub, SlotPool(3), concurrency=3)
    await lanes.start()
    try:
        await lanes.submit("b", 3)  # lane a has a pull request waiting for work that never comes
        await eventually(
            lambda: lanes.active == 3, timeout_s=10, what=f"lane b holding all three slots ({lanes.handled})"
        )
    finally:
        await lanes.stop()


async def test_a_pool_grown_from_nothing_starts_pulling(bus: tuple[NatsClient, Publisher]) -> None:
    nc, pub = bus
    lanes = Lanes(nc, pub, SlotPool(0), concurrency=2)
    lanes.gate.set()
    await lanes.start()
    try:
        await lanes.submit("a", 2)
        assert lanes.handled == []
        lanes.pool.resize(1)
        await eventually(
            lambda: len(lanes.handled) == 2, timeout_s=10, what=f"both cases, one at a time ({lanes.handled})"
        )
        assert lanes.most == 1
    finally:
        await lanes.stop()


async def test_stopping_hands_a_case_waiting_for_a_slot_back_to_the_stream(bus: tuple[NatsClient, Publisher]) -> None:
    nc, pub = bus
    pool = SlotPool(1)
    lanes = Lanes(nc, pub, pool, concurrency=2)
    await lanes.start()
    try:
        await lanes.submit("a", 1)
        await eventually(lambda: lanes.active == 1, timeout_s=10, what="the first case holding the only slot")
        await lanes.submit("b", 1)
        await eventually(lambda: pool.waiting == 1, timeout_s=10, what="lane b's case waiting for the slot")
        stopping = asyncio.ensure_future(lanes.loops[1].stop(5.0))
        await eventually(lambda: pool.waiting == 0, timeout_s=10, what="the waiting case to be handed back")
        assert await stopping

        # A new loop on lane b gets the case within seconds though its ack wait is a minute: the
        # stopping loop nak'd it back to the consumer.
        lanes.gate.set()
        await eventually(lambda: pool.held == 0, timeout_s=10, what="lane a's case to give its slot back")
        service = f"w{uuid.uuid4().hex[:6]}"
        again = ConsumerLoop(
            nc,
            pub,
            Stage(consumer=lanes.consumers["b"], handler=lanes.handle, accepts=(CaseRequested,), pool=pool),
            service=service,
            metrics=ServiceMetrics(service),
        )
        lanes.loops.append(again)
        await again.start()
        await eventually(lambda: "b0" in lanes.handled, timeout_s=10, what="lane b's case, handed back, to run")
        assert sorted(lanes.handled) == ["a0", "b0"]
    finally:
        await lanes.stop()
