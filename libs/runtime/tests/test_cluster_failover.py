"""A 3-node JetStream cluster: the stream leader is SIGKILLed while the chassis publisher publishes
to an R3 stream; every acknowledged message is in the stream afterwards, exactly once."""

from __future__ import annotations

import asyncio
import signal

import pytest

from evalbus.infra.nats import NatsServer
from evalbus_contracts.streams import StreamDef
from evalbus_runtime import Publisher, connect
from evalbus_runtime.bus import ensure_stream

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def test_publisher_rides_out_a_leader_failover_without_loss_or_duplicates(
    nats_cluster: list[NatsServer],
) -> None:
    url = ",".join(s.url for s in nats_cluster)
    nc = await connect(url, "failover")
    js = nc.jetstream()
    stream = StreamDef(name="FAILOVER", subjects=("fo.>",), duplicate_window_s=600)
    for _ in range(100):  # the cluster elects its meta leader first
        try:
            await ensure_stream(js, stream, replicas=3)
            break
        except Exception:
            await asyncio.sleep(0.1)
    info = await js.stream_info("FAILOVER")
    assert info.cluster is not None
    leader = next(s for s in nats_cluster if s.name == info.cluster.leader)

    publisher = Publisher(nc, timeout_s=3.0, attempts=10)
    acked: set[int] = set()
    n = 600

    async def publish(i: int) -> None:
        await publisher.publish_raw(f"fo.{i}", b"x" * 200, {"Nats-Msg-Id": f"fo:{i}"})
        acked.add(i)

    try:
        for i in range(n):
            if i == n // 3:
                leader.process.send_signal(signal.SIGKILL)  # mid-stream, the leader dies
                leader.process.wait()
            await publish(i)
        assert acked == set(range(n))
        info = await js.stream_info("FAILOVER")
        assert info.cluster is not None
        assert info.cluster.leader != leader.name
        assert info.state.messages == n  # nothing lost, nothing stored twice
    finally:
        await publisher.stop()
        await nc.close()


async def test_a_service_never_shrinks_a_replicated_stream(nats_cluster: list[NatsServer]) -> None:
    """An operator runs the streams at R3 (`STREAM_REPLICAS=3`); a replica started with the default
    (1) updates the definitions at its start, and the streams stay R3; a new stream takes the
    setting."""
    url = ",".join(s.url for s in nats_cluster)
    nc = await connect(url, "replicas")
    js = nc.jetstream()
    stream = StreamDef(name="REPLICAS", subjects=("replicas.>",), duplicate_window_s=60)
    try:
        for _ in range(100):  # the cluster elects its meta leader first
            try:
                await ensure_stream(js, stream, replicas=3)
                break
            except Exception:
                await asyncio.sleep(0.1)
        assert (await js.stream_info("REPLICAS")).config.num_replicas == 3
        changed = StreamDef(name="REPLICAS", subjects=("replicas.>",), duplicate_window_s=120)
        await ensure_stream(js, changed, replicas=1)
        info = await js.stream_info("REPLICAS")
        assert info.config.num_replicas == 3
        assert info.config.duplicate_window == 120  # the definition change itself applied
    finally:
        await nc.close()
