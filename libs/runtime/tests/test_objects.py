"""Claim checks on a real nats-server with a stock 1 MB `max_payload`: objects several times the
message limit go in and come back whole, readable by nats-py's own object store, and a reader
refuses an object that is not the bytes its reference pins."""

from __future__ import annotations

import hashlib
import random
import uuid
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NatsClient

from evalbus.infra.nats import STOCK_MAX_PAYLOAD, NatsServer
from evalbus_contracts import ObjectBucketDef, ObjectRef
from evalbus_contracts.streams import DATASETS
from evalbus_runtime import connect, ensure_topology
from evalbus_runtime.objects import (
    ObjectDigestError,
    ObjectMissingError,
    get_object,
    iter_lines,
    iter_object,
    object_headers,
    object_info,
    put_object,
)

pytestmark = pytest.mark.integration


@pytest.fixture
async def stock_bus(stock_nats: NatsServer) -> AsyncIterator[NatsClient]:
    nc = await connect(stock_nats.url, "objects-test")
    await ensure_topology(nc.jetstream())
    yield nc
    await nc.close()


async def blocks(data: bytes, seed: int) -> AsyncIterator[bytes]:
    """`data` cut at random places, as an HTTP body arrives."""
    rng = random.Random(seed)
    at = 0
    while at < len(data):
        step = rng.randint(1, 300_000)
        yield data[at : at + step]
        at += step


def name() -> str:
    return f"t-{uuid.uuid4().hex}"


async def test_an_object_three_times_the_message_limit_round_trips_chunked(stock_bus: NatsClient) -> None:
    js = stock_bus.jetstream()
    assert stock_bus.max_payload == STOCK_MAX_PAYLOAD
    data = random.Random(1).randbytes(3 * STOCK_MAX_PAYLOAD + 12_345)
    key = name()
    ref = await put_object(js, DATASETS, key, blocks(data, seed=2), headers={"Evalbus-Uploaded-By": "alice"})
    assert ref == ObjectRef(bucket="datasets", name=key, size=len(data), sha256=hashlib.sha256(data).hexdigest())
    chunks = [chunk async for chunk in iter_object(js, ref)]
    assert b"".join(chunks) == data
    assert max(len(c) for c in chunks) == DATASETS.chunk_size
    info = await object_info(js, ref)
    assert info.chunks == len(chunks)
    assert object_headers(info) == {"Evalbus-Uploaded-By": "alice"}
    # The layout is nats-server's own: nats-py's object store reads it and checks its digest.
    theirs = await (await js.object_store("datasets")).get(key)
    assert theirs.data == data


async def test_a_replaced_object_fails_its_old_reference(stock_bus: NatsClient) -> None:
    js = stock_bus.jetstream()
    key = name()
    original = random.Random(3).randbytes(400_000)
    ref = await put_object(js, DATASETS, key, original)
    tampered = bytearray(original)
    tampered[-1] ^= 0xFF
    await put_object(js, DATASETS, key, bytes(tampered))
    seen = bytearray()

    async def read() -> None:
        async for chunk in iter_object(js, ref):
            seen.extend(chunk)

    with pytest.raises(ObjectDigestError, match="does not match its reference"):
        await read()
    # The reader never handed over the whole (tampered) payload: the last chunk was withheld.
    assert len(seen) < len(original)
    # Another length is refused before any byte is read.
    await put_object(js, DATASETS, key, original + b"!")
    with pytest.raises(ObjectDigestError, match="the reference pins 400000"):
        await get_object(js, ref)


async def test_a_missing_object_and_an_empty_one(stock_bus: NatsClient) -> None:
    js = stock_bus.jetstream()
    missing = ObjectRef(bucket="datasets", name=name(), size=1, sha256="0" * 64)
    with pytest.raises(ObjectMissingError, match="is not in bucket 'datasets'"):
        await get_object(js, missing)
    empty = await put_object(js, DATASETS, name(), b"")
    assert (empty.size, empty.sha256) == (0, hashlib.sha256(b"").hexdigest())
    assert await get_object(js, empty) == b""


async def test_buckets_are_created_idempotently_and_updated_in_place(stock_bus: NatsClient) -> None:
    js = stock_bus.jetstream()
    bucket = ObjectBucketDef(bucket=f"b{uuid.uuid4().hex[:8]}", description="first")
    await ensure_topology(js, (), (), buckets=(), object_buckets=(bucket,))
    ref = await put_object(js, bucket, "kept", b"payload")
    changed = ObjectBucketDef(bucket=bucket.bucket, description="second", ttl_s=3600.0)
    await ensure_topology(js, (), (), buckets=(), object_buckets=(changed,))
    info = await js.stream_info(f"OBJ_{bucket.bucket}")
    assert (info.config.description, info.config.max_age) == ("second", 3600.0)
    assert await get_object(js, ref) == b"payload"


async def test_lines_survive_any_chunking() -> None:
    text = b'{"id": "a"}\n{"id": "b"}\r\n\n{"id": "c"}'

    async def cut(size: int) -> AsyncIterator[bytes]:
        for at in range(0, len(text), size):
            yield text[at : at + size]

    for size in (1, 2, 5, 13, len(text)):
        assert [line async for line in iter_lines(cut(size))] == [b'{"id": "a"}', b'{"id": "b"}', b"", b'{"id": "c"}']
