"""The NATS connection and idempotent creation of the streams and consumers defined in contracts."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable, Iterable

import nats
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import BadRequestError, NotFoundError
from nats.js.kv import KeyValue

from evalbus_contracts.streams import (
    BUCKETS,
    CONSUMERS,
    OBJECT_BUCKETS,
    STREAMS,
    ConsumerDef,
    KvDef,
    ObjectBucketDef,
    StreamDef,
)
from evalbus_runtime.objects import ensure_object_bucket

log = logging.getLogger("evalbus.bus")


async def connect(
    url: str,
    name: str,
    *,
    on_disconnect: Callable[[], Awaitable[None]] | None = None,
    on_reconnect: Callable[[], Awaitable[None]] | None = None,
    inbox_prefix: str = "_INBOX",
) -> NatsClient:
    """Connect with unlimited reconnects to every server in `url` (comma-separated), quiet errors;
    replies come to `<inbox_prefix>.…` (a scoped user may subscribe to its own inboxes only)."""

    async def error_cb(e: Exception) -> None:
        log.warning("nats error: %s", e)

    async def disconnected_cb() -> None:
        log.warning("nats disconnected")
        if on_disconnect is not None:
            await on_disconnect()

    async def reconnected_cb() -> None:
        log.info("nats reconnected")
        if on_reconnect is not None:
            await on_reconnect()

    servers = [u.strip() for u in url.split(",") if u.strip()]
    return await nats.connect(
        servers=servers,
        name=name,
        max_reconnect_attempts=-1,
        reconnect_time_wait=0.5,
        allow_reconnect=True,
        connect_timeout=5,
        error_cb=error_cb,
        disconnected_cb=disconnected_cb,
        reconnected_cb=reconnected_cb,
        pending_size=64 * 1024 * 1024,
        inbox_prefix=inbox_prefix,
    )


def stream_config(stream: StreamDef, replicas: int = 1) -> jsapi.StreamConfig:
    """nats-py config of a stream definition."""
    return jsapi.StreamConfig(
        name=stream.name,
        subjects=list(stream.subjects),
        retention=jsapi.RetentionPolicy(stream.retention),
        storage=jsapi.StorageType.FILE,
        max_age=stream.max_age_s,
        max_msgs_per_subject=stream.max_msgs_per_subject,
        duplicate_window=stream.duplicate_window_s,
        max_msg_size=stream.max_msg_size,
        num_replicas=replicas,
    )


def consumer_config(consumer: ConsumerDef) -> jsapi.ConsumerConfig:
    """nats-py config of a consumer definition (explicit ack, deliver all, pull). Named, so it is
    created through `$JS.API.CONSUMER.CREATE.<stream>.<durable>.<filter>`: a user's permissions can
    pin the filter of the consumers it may create (a lane dispatcher's credential)."""
    return jsapi.ConsumerConfig(
        name=consumer.durable,
        durable_name=consumer.durable,
        filter_subjects=list(consumer.filter_subjects) if len(consumer.filter_subjects) > 1 else None,
        filter_subject=consumer.filter_subjects[0] if len(consumer.filter_subjects) == 1 else None,
        ack_policy=jsapi.AckPolicy.EXPLICIT,
        deliver_policy=jsapi.DeliverPolicy.ALL,
        ack_wait=consumer.ack_wait_s,
        max_deliver=consumer.max_deliver,
        max_ack_pending=consumer.max_ack_pending,
        backoff=list(consumer.backoff_s) or None,
        max_waiting=4096,
    )


async def ensure_stream(js: JetStreamContext, stream: StreamDef, replicas: int = 1) -> None:
    """Create the stream with `replicas`, or update it when its definition changed — never lowering
    the replica count it already has (a replica started with the default 1 must not shrink the R3
    streams an operator set up on a cluster)."""
    config = stream_config(stream, replicas)
    try:
        await js.add_stream(config)
    except BadRequestError:
        current = await existing_stream(js, stream.name)
        config.num_replicas = max(replicas, int(current.config.num_replicas or 1))
        await js.update_stream(config)


SETTLE_S = 30.0
"""How long a stream that exists may still be reported "not found" (see `existing_stream`): 10 s
was once too short for a fresh 3-node cluster's placement on a loaded two-core machine."""


async def existing_stream(js: JetStreamContext, name: str, *, settle_s: float = SETTLE_S) -> jsapi.StreamInfo:
    """The info of stream `name`, which exists: another process refused our `add_stream` with a
    different definition. On a cluster it may be created by then but not yet placed (its group
    still forming), and JetStream answers "stream not found" meanwhile — a dispatcher starting
    beside the services of a fresh 3-node cluster once died of that. Asked again, with a growing
    pause, for up to `settle_s`; then the `NotFoundError` stands."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + settle_s
    pause = 0.05
    while True:
        try:
            return await js.stream_info(name)
        except NotFoundError:
            if loop.time() + pause > deadline:
                raise
            await asyncio.sleep(pause)  # the cluster's own placement: nothing here to wait on instead
            pause = min(pause * 2, 1.0)


async def ensure_consumer(js: JetStreamContext, consumer: ConsumerDef) -> None:
    """Create the durable consumer, or update it in place (its ack state is kept)."""
    await js.add_consumer(consumer.stream, consumer_config(consumer))


async def ensure_bucket(js: JetStreamContext, bucket: KvDef, replicas: int = 1) -> None:
    """Create the key-value bucket, or update it when its definition changed."""
    config = jsapi.KeyValueConfig(
        bucket=bucket.bucket,
        ttl=bucket.ttl_s,
        history=bucket.history,
        max_value_size=bucket.max_value_size,
        storage=jsapi.StorageType.FILE,
        replicas=replicas,
    )
    try:
        await js.create_key_value(config)
    except BadRequestError:
        # The bucket exists with another definition: its stream is updated in place.
        info = await js.stream_info(f"KV_{bucket.bucket}")
        stream = info.config
        stream.max_age = bucket.ttl_s
        stream.max_msgs_per_subject = bucket.history
        stream.max_msg_size = bucket.max_value_size
        await js.update_stream(stream)


async def open_bucket(js: JetStreamContext, bucket: KvDef, replicas: int = 1) -> KeyValue:
    """A service's own key-value bucket, created (or updated) with `replicas` replicas — the
    service's `STREAM_REPLICAS`, so the bucket survives a node as the streams do — then opened."""
    await ensure_bucket(js, bucket, replicas)
    return await js.key_value(bucket.bucket)


async def ensure_topology(
    js: JetStreamContext,
    streams: Iterable[StreamDef] = STREAMS,
    consumers: Iterable[ConsumerDef] = CONSUMERS,
    replicas: int = 1,
    buckets: Iterable[KvDef] = BUCKETS,
    object_buckets: Iterable[ObjectBucketDef] = OBJECT_BUCKETS,
) -> None:
    """Create every stream, key-value bucket, object store bucket and consumer evalbus needs
    (idempotent; safe from several replicas)."""
    for stream in streams:
        await ensure_stream(js, stream, replicas)
    for bucket in buckets:
        await ensure_bucket(js, bucket, replicas)
    for object_bucket in object_buckets:
        await ensure_object_bucket(js, object_bucket, replicas)
    for consumer in consumers:
        await ensure_consumer(js, consumer)
