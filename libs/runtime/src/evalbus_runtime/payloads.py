"""Results too large for an event: their bulk in the `artifacts` bucket, loaded back verified.

A `CaseResult` whose answer, trace and snapshot together encode to more than the inline threshold
(`DEFAULT_INLINE_MAX_BYTES`, the `payload_inline_max_bytes` setting) is published with those parts
moved into one `ResultPayload` object — largest first, until what stays inline fits — and a
`payload` reference (name, size, SHA-256) in their place. Every reader that needs the parts calls
`load_result`, which checks the object against the reference: a replaced or altered object raises
`ObjectDigestError`, never yields other bytes.

Object names are deterministic per run attempt (`runs/<run token>/a<attempt>/...`), so a
redelivered stage writes the same bytes under the same name: a retried put replaces the object
with itself. The bucket has no TTL: an object lives as long as the events that name it (the event
store keeps them forever; a sealed trajectory's hash covers the reference's digest).

`object_refs` finds every reference in a stored event body (the payload, and the stored
`artifact` trace events), so `evalbus verify` can check the objects a trajectory names.
"""

from __future__ import annotations

import hashlib
from collections.abc import Iterable, Iterator, Mapping
from typing import Any

import msgspec
from nats.js import JetStreamContext

from evalbus_contracts import CaseResult, ObjectRef, ResultPayload, encode, encode_token
from evalbus_contracts.results import OffloadedField
from evalbus_contracts.streams import ARTIFACTS
from evalbus_runtime.objects import (
    ObjectDigestError,
    ObjectMissingError,
    ObjectStoreError,
    get_object,
    iter_object,
    put_object,
)

DEFAULT_INLINE_MAX_BYTES = 256 * 1024
"""Largest answer + trace + snapshot (encoded JSON bytes) a result carries inline."""
PAYLOAD_FILE = "result.json"
"""Object name (under the attempt's prefix) of the offloaded parts of a `case.executed` result."""
COLLECTED_FILE = "collected.json"
"""Object name of the offloaded parts of a `case.collected` result (the completed trace)."""
MAX_PAYLOAD_READ = 512 * 1024 * 1024
"""Largest payload object a reader loads into memory."""

_FIELDS: tuple[OffloadedField, ...] = ("answer", "trace", "snapshot")
_MAX_TOKEN = 160
_payload_decoder = msgspec.json.Decoder(ResultPayload)


def run_prefix(run_id: str, attempt: int) -> str:
    """The object-name prefix of one run attempt: `runs/<token>/a<attempt>`, where the token is the
    run id's subject token (`~` written `=`, outside the token alphabet so still reversible), or a
    digest of it when that would be too long for an object name."""
    token = encode_token(run_id).replace("~", "=")
    if len(token) > _MAX_TOKEN:
        token = "sha256-" + hashlib.sha256(run_id.encode("utf-8")).hexdigest()
    return f"runs/{token}/a{attempt}"


def field_sizes(result: CaseResult) -> dict[OffloadedField, int]:
    """Encoded bytes of each part that may be offloaded (0 when empty)."""
    return {
        "answer": len(encode(result.answer)) if result.answer else 0,
        "trace": len(encode(result.trace)) if result.trace else 0,
        "snapshot": len(encode(result.snapshot)) if result.snapshot is not None else 0,
    }


def plan_offload(sizes: Mapping[OffloadedField, int], inline_max: int) -> tuple[OffloadedField, ...]:
    """Which parts to move out (pure): none while their total is at most `inline_max`; else the
    largest first (ties in field order) until what stays inline fits. In field order."""
    remaining = sum(sizes.values())
    if remaining <= inline_max:
        return ()
    moved: list[OffloadedField] = []
    for name in sorted(_FIELDS, key=lambda f: (-sizes.get(f, 0), _FIELDS.index(f))):
        if remaining <= inline_max or sizes.get(name, 0) == 0:
            break
        moved.append(name)
        remaining -= sizes.get(name, 0)
    return tuple(f for f in _FIELDS if f in moved)


def split_result(result: CaseResult, fields: tuple[OffloadedField, ...]) -> tuple[CaseResult, ResultPayload]:
    """The result without `fields` and the payload holding them (pure)."""
    payload = ResultPayload(
        answer=result.answer if "answer" in fields else None,
        trace=result.trace if "trace" in fields else (),
        snapshot=result.snapshot if "snapshot" in fields else None,
    )
    slim = msgspec.structs.replace(
        result,
        answer=None if "answer" in fields else result.answer,
        trace=() if "trace" in fields else result.trace,
        snapshot=None if "snapshot" in fields else result.snapshot,
        offloaded=fields,
    )
    return slim, payload


def join_result(result: CaseResult, payload: ResultPayload) -> CaseResult:
    """The result with its offloaded parts back in place (pure)."""
    fields = result.offloaded
    return msgspec.structs.replace(
        result,
        answer=payload.answer if "answer" in fields else result.answer,
        trace=payload.trace if "trace" in fields else result.trace,
        snapshot=payload.snapshot if "snapshot" in fields else result.snapshot,
        payload=None,
        offloaded=(),
    )


def keep_offloaded(updated: CaseResult, original: CaseResult) -> CaseResult:
    """`updated` (a loaded result a stage added to: scores) in `original`'s offloaded form, so a
    later event names the same object instead of carrying the parts again (pure)."""
    if original.payload is None:
        return updated
    return msgspec.structs.replace(
        updated,
        answer=original.answer,
        trace=original.trace,
        snapshot=original.snapshot,
        payload=original.payload,
        offloaded=original.offloaded,
    )


async def offload_result(
    js: JetStreamContext,
    result: CaseResult,
    *,
    attempt: int,
    inline_max: int = DEFAULT_INLINE_MAX_BYTES,
    file: str = PAYLOAD_FILE,
) -> CaseResult:
    """`result` as an event may carry it: unchanged when small (or already offloaded), else with its
    largest parts in an object of the `artifacts` bucket named for the run attempt and the stage
    (`file`: each stage that changes the parts writes its own, so an earlier event's reference
    stays true)."""
    if result.payload is not None:
        return result
    fields = plan_offload(field_sizes(result), inline_max)
    if not fields:
        return result
    slim, payload = split_result(result, fields)
    name = f"{run_prefix(result.run_id, attempt)}/{file}"
    ref = await put_object(js, ARTIFACTS, name, encode(payload), headers={"Evalbus-Run": result.run_id})
    return msgspec.structs.replace(slim, payload=ref)


async def load_result(js: JetStreamContext, result: CaseResult) -> CaseResult:
    """`result` complete: its offloaded parts read from their object and checked against the
    reference (`ObjectDigestError` when the bytes are not the ones it pins, `ObjectMissingError`
    when the object is gone)."""
    if result.payload is None:
        return result
    data = await get_object(js, result.payload, limit=MAX_PAYLOAD_READ)
    return join_result(result, _payload_decoder.decode(data))


def object_refs(value: Any) -> Iterator[ObjectRef]:
    """Every object reference in a decoded JSON value (pure): objects shaped as an `ObjectRef`, and
    stored `artifact` trace events (`ref` `<bucket>/<name>`, `size`, `sha256`)."""
    if isinstance(value, dict):
        if _is_ref(value):
            yield ObjectRef(
                bucket=str(value["bucket"]),
                name=str(value["name"]),
                size=int(value["size"]),
                sha256=str(value["sha256"]),
            )
            return
        if value.get("kind") == "artifact" and _is_stored_artifact(value):
            bucket, _, name = str(value["ref"]).partition("/")
            yield ObjectRef(bucket=bucket, name=name, size=int(value["size"]), sha256=str(value["sha256"]))
        for item in value.values():
            yield from object_refs(item)
    elif isinstance(value, list):
        for item in value:
            yield from object_refs(item)


def _is_ref(value: dict[str, Any]) -> bool:
    return (
        set(value) == {"bucket", "name", "size", "sha256"}
        and isinstance(value["size"], int)
        and all(isinstance(value[k], str) for k in ("bucket", "name", "sha256"))
    )


def _is_stored_artifact(value: dict[str, Any]) -> bool:
    ref, size, digest = value.get("ref"), value.get("size"), value.get("sha256")
    return isinstance(ref, str) and "/" in ref and isinstance(size, int) and isinstance(digest, str)


async def check_object(js: JetStreamContext, ref: ObjectRef) -> list[ObjectRef]:
    """Read `ref`'s object to its end, checking its size and SHA-256 (raises `ObjectStoreError`
    subclasses); the references found inside it when it is a result payload (its trace's stored
    artifacts), which the caller checks in turn."""
    if ref.name.endswith(("/" + PAYLOAD_FILE, "/" + COLLECTED_FILE)):
        data = await get_object(js, ref, limit=MAX_PAYLOAD_READ)
        return list(object_refs(msgspec.json.decode(data)))
    async for _ in iter_object(js, ref):
        pass
    return []


async def first_bad_object(
    js: JetStreamContext, events: Iterable[tuple[int, str]]
) -> tuple[int | None, str | None, int]:
    """Check every object the stored `(seq, body)` events name, in order, each once (those named
    inside payload objects too): `(seq, detail, checked)` of the first event whose object does not
    match its reference, or `(None, None, checked)` when all do."""
    seen: set[tuple[str, str, str]] = set()
    for seq, body in events:
        pending = list(object_refs(msgspec.json.decode(body)))
        while pending:
            ref = pending.pop(0)
            key = (ref.bucket, ref.name, ref.sha256)
            if key in seen:
                continue
            seen.add(key)
            try:
                pending.extend(await check_object(js, ref))
            except ObjectStoreError as e:
                return seq, f"object {ref.bucket}/{ref.name}: {unreadable(e)}", len(seen)
    return None, None, len(seen)


def unreadable(e: ObjectStoreError) -> str:
    """What a reader says of an object it could not read as its reference pins."""
    if isinstance(e, ObjectDigestError):
        return f"the object does not match its reference (tampered with or replaced): {e}"
    if isinstance(e, ObjectMissingError):
        return f"the object is missing from the object store: {e}"
    return str(e)
