"""Deterministic fault points (`FAULT_KILL`): parsing, matching, and a worker process killed at each
point of the delivery contract, whose message a second worker then finishes exactly once."""

from __future__ import annotations

import uuid

import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.testing.bus import Marks, Workers, await_until, executed_count, make_consumer, request, window_passed
from evalbus.testing.pipeline import eventually
from evalbus_contracts.streams import CASES
from evalbus_runtime import Publisher
from evalbus_runtime.bus import ensure_stream
from evalbus_runtime.faults import FaultRule, Faults, FaultSpecError, parse_faults


@pytest.mark.unit
def test_a_fault_spec_reads_into_rules() -> None:
    rules = parse_faults("before_ack:judge-cases:*:evb-*-c05; before_publish:*:case.judged:-")
    assert rules == (
        FaultRule(point="before_ack", consumer="judge-cases", event_type="*", run_id="evb-*-c05"),
        FaultRule(point="before_publish", consumer="*", event_type="case.judged", run_id="-"),
    )
    assert parse_faults(None) == parse_faults("") == ()
    assert not Faults.from_setting(None).armed
    assert Faults.from_setting("before_ack:a:b:c").armed


@pytest.mark.unit
@pytest.mark.parametrize(
    ("spec", "error"),
    [
        ("before_ack:judge-cases:*", "must be <point>:<consumer>:<event type>:<run id>"),
        ("before_ack:judge-cases::evb-1", "must be"),
        ("after_lunch:judge-cases:*:*", "'after_lunch' is not one of before_publish, before_ack"),
    ],
)
def test_a_bad_fault_spec_is_refused_with_the_reason(spec: str, error: str) -> None:
    with pytest.raises(FaultSpecError, match=error):
        parse_faults(spec)


@pytest.mark.unit
def test_a_rule_matches_on_every_field() -> None:
    rule = FaultRule(point="before_ack", consumer="judge-*", event_type="case.executed", run_id="evb-*-c05")
    assert rule.matches("before_ack", "judge-cases", "case.executed", "evb-b1-c05")
    assert not rule.matches("before_publish", "judge-cases", "case.executed", "evb-b1-c05")
    assert not rule.matches("before_ack", "exporter-cases", "case.executed", "evb-b1-c05")
    assert not rule.matches("before_ack", "judge-cases", "case.collected", "evb-b1-c05")
    assert not rule.matches("before_ack", "judge-cases", "case.executed", "evb-b1-c06")
    assert not rule.matches("before_ack", "judge-cases", "case.executed", None)
    anonymous = FaultRule(point="before_ack", consumer="*", event_type="*", run_id="-")
    assert anonymous.matches("before_ack", "x", "batch.requested", None)
    assert not anonymous.matches("before_ack", "x", "case.executed", "evb-b1-c01")


async def ack_pending(nc: NatsClient, durable: str) -> int:
    info = await nc.jetstream().consumer_info("CASES", durable)
    return int(info.num_ack_pending) + int(info.num_pending)


@pytest.mark.integration
@pytest.mark.parametrize("point", ["before_publish", "before_ack"])
async def test_worker_killed_at_a_fault_point_has_its_message_finished_once_by_another(
    bus: tuple[NatsClient, Publisher], workers: Workers, point: str
) -> None:
    """Worker 1 dies by SIGKILL at `point` on c2 (after publishing c2's output for `before_ack`);
    worker 2 gets c2 again after `ack_wait` and handles it: c2's `case.executed` is stored once.
    At `before_ack` the second publish is a real duplicate that only `Nats-Msg-Id` absorbs: with
    the publisher's msg id made unique per publish, this test fails with
    `{'c1': 1, 'c2': 2, 'c3': 1} == {'c1': 1, 'c2': 1, 'c3': 1}`."""
    nc, pub = bus
    batch = f"f{uuid.uuid4().hex[:10]}"
    consumer = make_consumer(batch, ack_wait_s=2.0)
    marks = Marks(workers.tmp / f"marks-{point}")
    victim_run = f"evb-{batch}-c2"
    victim = workers.start(
        consumer,
        marks,
        worker_service=f"w{batch}",
        worker_concurrency="1",
        fault_kill=f"{point}:{consumer.durable}:case.requested:{victim_run}",
    )
    await pub.publish_events([request(batch, f"c{i}") for i in range(1, 4)])
    await await_until(lambda: victim.poll() is not None, timeout_s=30, what="the worker to kill itself")
    assert victim.returncode == -9
    published_before_death = (await executed_count(nc, batch)).get("c2", 0)
    assert published_before_death == (1 if point == "before_ack" else 0)

    workers.start(consumer, marks, worker_service=f"w{batch}")

    async def all_acked() -> bool:
        return await ack_pending(nc, consumer.durable) == 0 and marks.count("end") >= 4

    await eventually(all_acked, timeout_s=30, what="every message handled and acknowledged")
    starts_of_c2 = [parts for parts in marks.lines() if parts[:2] == ["start", "c2"]]
    assert [parts[2] for parts in starts_of_c2] == ["1", "2"]  # handled by both workers
    assert await executed_count(nc, batch) == {"c1": 1, "c2": 1, "c3": 1}


@pytest.mark.integration
@pytest.mark.parametrize("settled", [False, True], ids=["handled-again", "settled"])
async def test_a_redelivery_after_the_duplicate_window_publishes_nothing_twice(
    bus: tuple[NatsClient, Publisher], workers: Workers, settled: bool
) -> None:
    """Worker 1 dies at `before_ack` on c2, its output stored; the CASES duplicate window then
    forgets c2's `Nats-Msg-Id` (shortened to 1 s here, probed) before worker 2 gets c2 again, so
    JetStream would store a second copy. The redelivery finds the first on the stream instead:
    without `settled_by` the handler runs again and `publish_missing` skips the stored output; with
    it, the handler does not run at all. Publishing a redelivery's outputs with `publish_events`,
    as before, fails this test with `{'c1': 1, 'c2': 2, 'c3': 1} == {'c1': 1, 'c2': 1, 'c3': 1}`."""
    nc, pub = bus
    batch = f"f{uuid.uuid4().hex[:10]}"
    consumer = make_consumer(batch, ack_wait_s=2.0)
    marks = Marks(workers.tmp / f"marks-window-{settled}")
    victim = workers.start(
        consumer,
        marks,
        worker_service=f"w{batch}",
        worker_concurrency="1",
        fault_kill=f"before_ack:{consumer.durable}:case.requested:evb-{batch}-c2",
    )
    await pub.publish_events([request(batch, f"c{i}") for i in range(1, 4)])
    await await_until(lambda: victim.poll() is not None, timeout_s=30, what="the worker to kill itself")
    assert (await executed_count(nc, batch)).get("c2", 0) == 1

    js = nc.jetstream()
    await ensure_stream(js, msgspec.structs.replace(CASES, duplicate_window_s=1.0))
    try:
        await window_passed(nc)  # c2's output id, older than the probe's, is forgotten too
    finally:
        await ensure_stream(js, CASES)
    workers.start(consumer, marks, worker_service=f"w{batch}", **({"worker_settled": "1"} if settled else {}))

    async def all_acked() -> bool:
        return await ack_pending(nc, consumer.durable) == 0 and marks.count("end") >= 3

    await eventually(all_acked, timeout_s=30, what="every message handled and acknowledged")
    starts_of_c2 = [parts[2] for parts in marks.lines() if parts[:2] == ["start", "c2"]]
    assert starts_of_c2 == (["1"] if settled else ["1", "2"])
    assert await executed_count(nc, batch) == {"c1": 1, "c2": 1, "c3": 1}
