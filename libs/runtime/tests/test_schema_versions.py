"""An event written by a newer release (a schema version this code does not know) is refused:
dead-lettered with that reason, never guessed at, while the messages after it flow."""

from __future__ import annotations

import uuid

import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.testing.bus import Marks, Workers, dead_letters, executed_count, make_consumer, request
from evalbus.testing.pipeline import eventually
from evalbus_contracts import decode_event, encode
from evalbus_contracts.codec import NewerSchemaError
from evalbus_runtime import Publisher


def with_version(data: bytes, v: int) -> bytes:
    doc = msgspec.json.decode(data)
    doc["v"] = v
    return msgspec.json.encode(doc)


@pytest.mark.unit
def test_a_newer_schema_version_is_refused_and_the_known_one_read() -> None:
    event = request("b1", "c1")
    data = encode(event)
    assert decode_event(with_version(data, 1)) == event
    with pytest.raises(
        NewerSchemaError, match=r"case.requested schema version 2 is newer than this service knows \(1\)"
    ):
        decode_event(with_version(data, 2))


@pytest.mark.integration
async def test_an_event_of_a_newer_schema_is_dead_lettered_with_that_reason(
    bus: tuple[NatsClient, Publisher], workers: Workers
) -> None:
    nc, pub = bus
    batch = f"v{uuid.uuid4().hex[:10]}"
    service = f"w{batch}"
    consumer = make_consumer(batch)
    newer = request(batch, "c1")
    await pub.publish_raw(newer.subject(), with_version(encode(newer), 2), {"Nats-Msg-Id": newer.msg_id()})
    await pub.publish_events([request(batch, "c2")])
    workers.start(consumer, Marks(workers.tmp / "marks"), worker_service=service)

    async def settled() -> bool:
        return len(await dead_letters(nc, service)) == 1 and (await executed_count(nc, batch)) == {"c2": 1}

    await eventually(settled, timeout_s=30, what="c1 dead-lettered and c2 executed")
    [letter] = await dead_letters(nc, service)
    assert letter.reason == "poison: case.requested schema version 2 is newer than this service knows (1)"
    assert letter.deliveries == 1
    assert decode_event(with_version(letter.payload.encode(), 1)).run_id == newer.run_id
