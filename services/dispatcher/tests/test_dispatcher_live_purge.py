"""`LivePurger` on a real nats-server: a settled run's subjects leave the LIVE stream once its keep is
over, and only its own (another run's output stays); a run the replica holds again is left alone;
a run whose keep is not over stays; the metric counts each result; stop leaves what is not due.
(End to end, through the dispatcher and the gateway's store fallback: `tests/test_live_purge_pipeline.py`.)"""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import nats.js.errors
import pytest
from nats.aio.client import Client as NatsClient
from prometheus_client import CollectorRegistry

from evalbus.testing.pipeline import eventually
from evalbus_contracts.streams import LIVE
from evalbus_contracts.subjects import live_subject
from evalbus_dispatcher.live_purge import LivePurger
from evalbus_runtime.bus import connect, ensure_topology


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    client = await connect(nats_url, "dispatcher-live-purge-test")
    await ensure_topology(client.jetstream())
    yield client
    await client.close()


async def publish_run(nc: NatsClient) -> str:
    """A run with output on three channels; its id."""
    run_id = f"evb-purge-{uuid.uuid4().hex[:10]}"
    js = nc.jetstream()
    for channel in ("infra", "log", "log", "placement"):
        await js.publish(live_subject(run_id, channel), b"{}")
    return run_id


async def held_messages(nc: NatsClient, run_id: str) -> int:
    """How many LIVE messages of the run the stream holds."""
    js = nc.jetstream()
    count = 0
    for channel in ("infra", "log", "placement", "trace"):
        try:
            info = await js.stream_info(LIVE.name, subjects_filter=live_subject(run_id, channel))
        except nats.js.errors.NotFoundError:
            continue
        count += sum((info.state.subjects or {}).values())
    return count


def metric(registry: CollectorRegistry, result: str) -> float:
    return registry.get_sample_value("evalbus_live_purges_total", {"result": result}) or 0.0


async def test_a_settled_run_leaves_the_stream_and_only_it(nc: NatsClient) -> None:
    settled, other = await publish_run(nc), await publish_run(nc)
    registry = CollectorRegistry()
    purger = LivePurger(nc.jetstream(), keep_s=0.0, holds=lambda _run: False, registry=registry)
    purger.start()
    try:
        purger.settled(settled)

        async def gone() -> bool:
            return await held_messages(nc, settled) == 0

        await eventually(gone, timeout_s=10, what="the settled run purged")
        assert await held_messages(nc, other) == 4
        assert metric(registry, "purged") == 1
    finally:
        await purger.stop()


async def test_a_run_held_again_or_not_due_stays(nc: NatsClient) -> None:
    again, later = await publish_run(nc), await publish_run(nc)
    registry = CollectorRegistry()
    purger = LivePurger(nc.jetstream(), keep_s=0.0, holds=lambda run: run == again, registry=registry)
    await purger.purge(again)  # the replica runs it again (a redelivery): its live output stays
    assert metric(registry, "held") == 1
    assert await held_messages(nc, again) == 4

    patient = LivePurger(nc.jetstream(), keep_s=3600.0, holds=lambda _run: False, registry=CollectorRegistry())
    patient.start()
    patient.settled(later)
    await patient.stop()  # stopped before the keep is over: nothing purged, left to the max age
    assert patient.pending == 1
    assert await held_messages(nc, later) == 4
