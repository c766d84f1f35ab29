"""A 3-node JetStream cluster: the stream leader is SIGKILLed while the chassis publisher publishes
to an R3 stream; every acknowledged message is in the stream afterwards, exactly once."""

from __future__ import annotations

import signal

import pytest
from nats.js import JetStreamContext

from evalbus.infra.nats import NatsServer
from evalbus.testing.pipeline import eventually
from evalbus_contracts.streams import StreamDef
from evalbus_runtime import Publisher, connect
from evalbus_runtime.bus import ensure_stream

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def ensure_replicated(js: JetStreamContext, stream: StreamDef) -> None:
    """Define `stream` at R3 once the fresh cluster can: JetStream refuses until it has elected its
    meta leader, which takes longer on a loaded machine."""
    refused: list[str] = []

    async def defined() -> bool:
        try:
            await ensure_stream(js, stream, replicas=3)
        except Exception as e:
            refused[:] = [f"{type(e).__name__}: {e}"]
            return False
        return True

    await eventually(
        defined, timeout_s=60, what=f"stream {stream.name} defined at R3", diagnostics=lambda: "; ".join(refused)
    )


async def test_publisher_rides_out_a_leader_failover_without_loss_or_duplicates(
    nats_cluster: list[NatsServer],
) -> None:
    url = ",".join(s.url for s in nats_cluster)
    nc = await connect(url, "failover")
    js = nc.jetstream()
    stream = StreamDef(name="FAILOVER", subjects=("fo.>",), duplicate_window_s=600)
    await ensure_replicated(js, stream)
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
        await ensure_replicated(js, stream)
        assert (await js.stream_info("REPLICAS")).config.num_replicas == 3
        changed = StreamDef(name="REPLICAS", subjects=("replicas.>",), duplicate_window_s=120)
        await ensure_stream(js, changed, replicas=1)
        info = await js.stream_info("REPLICAS")
        assert info.config.num_replicas == 3
        assert info.config.duplicate_window == 120  # the definition change itself applied
    finally:
        await nc.close()
