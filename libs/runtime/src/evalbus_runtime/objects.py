"""Claim checks: large payloads in JetStream object store buckets, read back verified.

An event never carries a dataset, a big stdout or an artifact; it carries an `ObjectRef` (bucket,
name, size, SHA-256) and the bytes live in an object store bucket (`evalbus_contracts.streams`).
Objects are written in nats-server's own object store layout — chunks on `$O.<bucket>.C.<nuid>`,
then one rolled-up meta message on `$O.<bucket>.M.<base64 name>` — so `nats object get` reads them
too; only the digest in the reference is kept as lower-case hex (the meta holds nats' base64 form).

Both directions stream: `put_object` takes an async iterable of byte blocks and never holds more
than a chunk of it, `iter_object` yields chunks through an ordered consumer. A reader is never
handed the complete payload unchecked: the size is compared before the first chunk and the SHA-256
before the last one is yielded, so a consumer that acts only once it has read to the end never acts
on a tampered or replaced object (it gets `ObjectDigestError` instead).
"""

from __future__ import annotations

import base64
import hashlib
import logging
import secrets
from collections.abc import AsyncIterable, AsyncIterator, Mapping
from datetime import UTC, datetime

import msgspec
from nats.errors import TimeoutError as NatsTimeoutError
from nats.js import JetStreamContext
from nats.js import api as jsapi
from nats.js.errors import BadRequestError, NotFoundError, ObjectNotFoundError

from evalbus_contracts import ObjectBucketDef, ObjectRef
from evalbus_runtime.errors import RuntimeFailure

log = logging.getLogger("evalbus.objects")

_STREAM = "OBJ_{bucket}"
_CHUNKS = "$O.{bucket}.C.{nuid}"
_META = "$O.{bucket}.M.{name}"
_DIGEST_PREFIX = "SHA-256="
_ROLLUP = {"Nats-Rollup": "sub"}


class ObjectStoreError(RuntimeFailure):
    """Root of the claim-check errors."""


class ObjectMissingError(ObjectStoreError):
    """No object of that name in the bucket (never written, deleted, or the bucket is gone)."""


class ObjectDigestError(ObjectStoreError):
    """The object's bytes are not the ones the reference pins: another size or another SHA-256
    (tampered with, or replaced under the same name). Never retryable."""


class ObjectReadError(ObjectStoreError):
    """Reading stalled (no chunk within the timeout): retryable."""


def _stream(bucket: str) -> str:
    return _STREAM.format(bucket=bucket)


def _meta_subject(bucket: str, name: str) -> str:
    return _META.format(bucket=bucket, name=base64.urlsafe_b64encode(name.encode()).decode())


def nats_digest(hex_digest: str) -> str:
    """A hex SHA-256 as the object meta writes it (`SHA-256=<base64url>`)."""
    return _DIGEST_PREFIX + base64.urlsafe_b64encode(bytes.fromhex(hex_digest)).decode()


async def ensure_object_bucket(js: JetStreamContext, bucket: ObjectBucketDef, replicas: int = 1) -> None:
    """Create the object store bucket, or update its stream when the definition changed — never
    lowering the replica count it already has."""
    config = jsapi.ObjectStoreConfig(
        description=bucket.description,
        ttl=bucket.ttl_s,
        storage=jsapi.StorageType.FILE,
        replicas=replicas,
    )
    try:
        await js.create_object_store(bucket.bucket, config)
    except BadRequestError:
        info = await js.stream_info(_stream(bucket.bucket))
        stream = info.config
        stream.max_age = bucket.ttl_s
        stream.description = bucket.description
        stream.num_replicas = max(replicas, int(stream.num_replicas or 1))
        await js.update_stream(stream)


async def _rechunk(blocks: AsyncIterable[bytes], size: int) -> AsyncIterator[bytes]:
    pending = bytearray()
    async for block in blocks:
        pending += block
        while len(pending) >= size:
            yield bytes(pending[:size])
            del pending[:size]
    if pending:
        yield bytes(pending)


async def _one(data: bytes) -> AsyncIterator[bytes]:
    yield data


async def put_object(
    js: JetStreamContext,
    bucket: ObjectBucketDef,
    name: str,
    data: bytes | AsyncIterable[bytes],
    *,
    headers: Mapping[str, str] | None = None,
) -> ObjectRef:
    """Write `data` (bytes, or blocks of any size as they arrive) as object `name` of `bucket` in
    chunks of `bucket.chunk_size`; its reference once the meta message is acknowledged. `headers`
    go in the meta and are read only after the last block, so a writer may add what it learned from
    the data. An object already of that name is replaced (its old chunks purged afterwards). On
    failure — a block source that raises included — the chunks written so far are purged and the
    error propagates."""
    blocks = _one(data) if isinstance(data, bytes) else data
    stream = _stream(bucket.bucket)
    previous: jsapi.ObjectInfo | None = None
    store = await js.object_store(bucket.bucket)
    try:
        previous = await store.get_info(name)
    except (ObjectNotFoundError, NotFoundError):
        previous = None
    nuid = secrets.token_hex(11)  # a fresh chunk subject, so a replaced object's chunks never mix
    subject = _CHUNKS.format(bucket=bucket.bucket, nuid=nuid)
    digest = hashlib.sha256()
    size = chunks = 0
    try:
        async for chunk in _rechunk(blocks, bucket.chunk_size):
            digest.update(chunk)
            await js.publish(subject, chunk, stream=stream)
            size += len(chunk)
            chunks += 1
        ref = ObjectRef(bucket=bucket.bucket, name=name, size=size, sha256=digest.hexdigest())
        info = jsapi.ObjectInfo(
            name=name,
            bucket=bucket.bucket,
            nuid=nuid,
            size=size,
            chunks=chunks,
            digest=nats_digest(ref.sha256),
            mtime=datetime.now(UTC).isoformat(),
            headers=dict(headers) if headers else None,
            options=jsapi.ObjectMetaOptions(max_chunk_size=bucket.chunk_size),
        )
        await js.publish(
            _meta_subject(bucket.bucket, name),
            msgspec.json.encode(info.as_dict()),
            stream=stream,
            headers=_ROLLUP,
        )
    except BaseException:
        try:
            await js.purge_stream(stream, subject=subject)
        except Exception:  # noqa: BLE001 - the original failure is the one to report
            log.warning("could not purge the chunks of the failed write of %r", name)
        raise
    if previous is not None and not previous.deleted and previous.nuid:
        await js.purge_stream(stream, subject=_CHUNKS.format(bucket=bucket.bucket, nuid=previous.nuid))
    return ref


async def object_info(js: JetStreamContext, ref: ObjectRef) -> jsapi.ObjectInfo:
    """The object's meta (`ObjectMissingError` when there is none)."""
    try:
        store = await js.object_store(ref.bucket)
        info = await store.get_info(ref.name)
    except (ObjectNotFoundError, NotFoundError) as e:
        raise ObjectMissingError(f"object {ref.name!r} is not in bucket {ref.bucket!r}") from e
    return info


def object_headers(info: jsapi.ObjectInfo) -> dict[str, str]:
    """The headers an object was written with (`put_object(headers=...)`)."""
    return {str(k): str(v) for k, v in (info.headers or {}).items()}


async def iter_object(js: JetStreamContext, ref: ObjectRef, *, chunk_timeout_s: float = 10.0) -> AsyncIterator[bytes]:
    """The object's bytes, chunk by chunk, checked against `ref`: `ObjectDigestError` before the
    first chunk when the size differs, and instead of the last chunk when the SHA-256 does."""
    info = await object_info(js, ref)
    if info.size != ref.size:
        raise ObjectDigestError(f"object {ref.name!r} is {info.size} bytes; the reference pins {ref.size}")
    digest = hashlib.sha256()
    if ref.size == 0:
        if digest.hexdigest() != ref.sha256:
            raise ObjectDigestError(f"object {ref.name!r} is empty; the reference pins sha256 {ref.sha256}")
        return
    sub = await js.subscribe(
        _CHUNKS.format(bucket=ref.bucket, nuid=info.nuid), stream=_stream(ref.bucket), ordered_consumer=True
    )
    try:
        read = 0
        while read < ref.size:
            try:
                msg = await sub.next_msg(timeout=chunk_timeout_s)
            except NatsTimeoutError as e:
                raise ObjectReadError(
                    f"object {ref.name!r}: no chunk within {chunk_timeout_s:g} s after {read} of {ref.size} bytes"
                ) from e
            read += len(msg.data)
            digest.update(msg.data)
            if read > ref.size:
                raise ObjectDigestError(f"object {ref.name!r} holds more than the {ref.size} bytes its meta says")
            if read == ref.size and digest.hexdigest() != ref.sha256:
                raise ObjectDigestError(
                    f"object {ref.name!r} does not match its reference: sha256 {digest.hexdigest()}, "
                    f"expected {ref.sha256}"
                )
            yield msg.data
    finally:
        await sub.unsubscribe()


async def get_object(js: JetStreamContext, ref: ObjectRef, *, limit: int | None = None) -> bytes:
    """The whole object, checked against `ref` (for payloads a reader needs in one piece; `limit`
    refuses a reference larger than the reader is prepared to hold)."""
    if limit is not None and ref.size > limit:
        raise ObjectStoreError(f"object {ref.name!r} is {ref.size} bytes, more than the {limit} this reader takes")
    out = bytearray()
    async for chunk in iter_object(js, ref):
        out += chunk
    return bytes(out)


async def iter_lines(chunks: AsyncIterable[bytes]) -> AsyncIterator[bytes]:
    """The lines of a chunked text (JSONL), without their line ends, however chunks cut them."""
    tail = b""
    async for chunk in chunks:
        block = tail + chunk
        lines = block.split(b"\n")
        tail = lines.pop()
        for line in lines:
            yield line.removesuffix(b"\r")
    if tail:
        yield tail.removesuffix(b"\r")
