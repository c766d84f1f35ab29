"""`LivePurger` on a real nats-server: a settled run's subjects leave the LIVE stream once its keep is
over, and only its own (another run's output stays); a run that runs again — held by this replica,
or with another execution's mark last on the stream — is left alone; the metric counts each
result. (End to end, through the dispatcher and the gateway's store fallback:
`tests/test_live_purge_pipeline.py`.)"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator

import nats.js.errors
import pytest
from nats.aio.client import Client as NatsClient
from prometheus_client import CollectorRegistry

from evalbus.testing.pipeline import eventually
from evalbus_contracts import Infra, InfraMark, encode
from evalbus_contracts.streams import LIVE
from evalbus_contracts.subjects import live_subject
from evalbus_dispatcher.live_purge import LivePurger, purge_counter
from evalbus_runtime.bus import connect, ensure_topology

pytestmark = pytest.mark.integration

CHANNELS = ("infra", "log", "placement", "trace")


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    client = await connect(nats_url, "dispatcher-live-purge-test")
    await ensure_topology(client.jetstream())
    yield client
    await client.close()


async def publish_run(nc: NatsClient, execution: str = "mine") -> str:
    """A run with four messages on three channels, its last mark from `execution`; its id."""
    run_id = f"evb-purge-{uuid.uuid4().hex[:10]}"
    js = nc.jetstream()
    for channel in ("log", "log", "placement"):
        await js.publish(live_subject(run_id, channel), b"{}")
    mark = InfraMark(run_id=run_id, mark=Infra(scope="placement", event="released"), execution=execution)
    await js.publish(mark.subject(), encode(mark))
    return run_id


async def held_messages(nc: NatsClient, run_id: str) -> int:
    """How many LIVE messages of the run the stream holds."""
    js = nc.jetstream()
    count = 0
    for channel in CHANNELS:
        try:
            info = await js.stream_info(LIVE.name, subjects_filter=live_subject(run_id, channel))
        except nats.js.errors.NotFoundError:
            continue
        count += sum((info.state.subjects or {}).values())
    return count


def purger(nc: NatsClient, keep_s: float, held: frozenset[str] = frozenset()) -> tuple[LivePurger, CollectorRegistry]:
    registry = CollectorRegistry()
    made = LivePurger(nc.jetstream(), keep_s=keep_s, holds=lambda run: run in held, purges=purge_counter(registry))
    return made, registry


def metric(registry: CollectorRegistry, result: str) -> float:
    return registry.get_sample_value("evalbus_live_purges_total", {"result": result}) or 0.0


async def test_a_settled_run_leaves_the_stream_once_kept_and_only_it(nc: NatsClient) -> None:
    settled, other = await publish_run(nc), await publish_run(nc)
    keep_s = 0.5
    loop, registry = purger(nc, keep_s)
    loop.start()
    try:
        began = time.monotonic()
        loop.settled(settled, "mine")
        assert await held_messages(nc, settled) == 4  # kept for now

        async def gone() -> bool:
            return await held_messages(nc, settled) == 0

        await eventually(gone, timeout_s=10, what="the settled run purged")
        assert time.monotonic() - began >= keep_s
        assert await held_messages(nc, other) == 4
        assert (metric(registry, "purged"), loop.pending) == (1, 0)
    finally:
        await loop.stop()


async def test_a_run_that_runs_again_stays(nc: NatsClient) -> None:
    here, elsewhere, plain = await publish_run(nc), await publish_run(nc, execution="theirs"), await publish_run(nc)
    loop, registry = purger(nc, 0.0, held=frozenset({here}))
    await loop.purge(here, "mine")  # this replica runs it again (a redelivery)
    await loop.purge(elsewhere, "mine")  # another replica's execution marked it last
    assert metric(registry, "held") == 2
    assert await held_messages(nc, here) == await held_messages(nc, elsewhere) == 4
    await loop.purge(plain, "mine")  # the control: its own execution last, not held
    assert (metric(registry, "purged"), await held_messages(nc, plain)) == (1, 0)
