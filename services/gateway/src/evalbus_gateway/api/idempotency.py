"""`Idempotency-Key` on the requests that create a batch (`POST /v1/batches` and
`POST /v1/batches/{batch_id}/rejudge`), behaving like Stripe's idempotency keys.

The key names the batch: its id is derived from the principal and the key (and, for a re-judge,
the old batch), so every replica mints the same id for a retry. What the key promises is checked
against the batch's `batch.requested`, which carries the `request_digest` of the request that
created it (a SHA-256 of the normalised spec, `spec_digest`):

- same principal, key and request → `202` with the same batch id; no second `batch.requested`;
- same key, another request → `409 idempotency_key_reused` (field `Idempotency-Key`), naming the
  batch the key was used for; that batch is unchanged;
- another principal → another batch id, so two principals never share a key.

How a keyed request claims its batch id (`claim_batch`):

1. Look the batch's `batch.requested` up: on the CASES stream (the last message on
   `batch.requested.<id>`, no recording lag), else in the event store (which keeps it after the
   stream lost it). Found: the digests are compared — a match is a retry and nothing is published
   (after JetStream's duplicate window a publish would be a *second* `batch.requested` for the
   batch), a mismatch is the 409.
2. Not found: publish it. Its `Nats-Msg-Id` (`batch.requested:<id>`) lets JetStream store exactly
   one of several concurrent requests: they overlap in time, so each is inside the others' 2-minute
   duplicate window. A request whose PubAck says `duplicate` lost the race and goes back to step 1,
   where the winner's event now is: 202 when the requests are the same, 409 when not.

So at most one request per key wins, inside the duplicate window and after it, and the check is
one stream read (the store only when the stream does not have it). A table of keys in PostgreSQL
would add a write to the request path and a second source of truth beside the stream, which the
recorder fills only after the fact; the stream already serialises the publishes.

"Same request" is the spec after decoding (so a re-serialised body — other key order, spacing,
defaults spelled out — is the same request), encoded with sorted keys, without the dataset index
the gateway fills in itself, its dataset named by content (`spec_digest`). A re-judge's request is
the new batch's spec (the old spec with the requested judges), so naming the old judges explicitly
is the same request as naming none.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

import msgspec
from aiohttp import web

from evalbus_api.models import IDEMPOTENCY_KEY_MAX, ErrorBody
from evalbus_contracts import BatchRequested, BatchSpec
from evalbus_gateway.api.errors import ApiError
from evalbus_gateway.api.reads import requested_on_stream
from evalbus_gateway.api.table import Body, Param
from evalbus_gateway.state import GatewayState
from evalbus_gateway.store import get_batch_request

log = logging.getLogger("evalbus.gateway.api")

HEADER = "Idempotency-Key"
"""The request header (and the `field` of its errors)."""
KEY_MAX = IDEMPOTENCY_KEY_MAX
"""Longest key accepted, characters."""
KEY_REUSED = Body(
    "The `Idempotency-Key` was used with a different request (`error.field` = `Idempotency-Key`)", ErrorBody
)
"""The documented 409 of a route taking the key."""


def key_param(description: str) -> Param:
    """The `Idempotency-Key` header parameter of a route's documentation."""
    return Param(HEADER, "header", description, {"type": "string", "maxLength": KEY_MAX})


def idempotency_key(request: web.Request) -> str | None:
    """The request's `Idempotency-Key` (None without one); 400 when it is empty, too long or not
    printable."""
    key = request.headers.get(HEADER)
    if key is None:
        return None
    if not key or len(key) > KEY_MAX or not key.isprintable():
        raise ApiError(400, "invalid", f"{HEADER} must be 1 to {KEY_MAX} printable characters", HEADER)
    return key


def keyed_batch_id(*parts: str) -> str:
    """The batch id a key names: `b` + 12 hex digits of the SHA-256 of `parts` (the principal, the
    key, and whatever else scopes it)."""
    return "b" + hashlib.sha256("\0".join(parts).encode()).hexdigest()[:12]


def spec_digest(spec: BatchSpec) -> str:
    """SHA-256 (hex) of the normalised spec: encoded with sorted keys, without the dataset index
    (the gateway replaces a submitted one by its own) and with the dataset named by its content —
    bucket, size and digest, not the object's name, which is new at every upload, so a client that
    uploads its cases again before retrying sends the same request."""
    suite = spec.suite
    if suite.dataset_ref is not None:
        suite = msgspec.structs.replace(suite, dataset_ref=msgspec.structs.replace(suite.dataset_ref, name=""))
    suite = msgspec.structs.replace(suite, dataset_index=None)
    normalised = msgspec.structs.replace(spec, suite=suite)
    return hashlib.sha256(msgspec.json.encode(normalised, order="sorted")).hexdigest()


def digest_of(event: BatchRequested) -> str:
    """The request digest a `batch.requested` carries, or (an event from before the field) its
    spec's."""
    return event.request_digest or spec_digest(event.spec)


def key_reused(batch_id: str) -> ApiError:
    """The 409 for a key already used with another request."""
    return ApiError(
        409,
        "idempotency_key_reused",
        f"this {HEADER} was used for batch {batch_id} with a different request; "
        "send the same request to get that batch back, or use a new key",
        HEADER,
    )


async def original_request(state: GatewayState, batch_id: str) -> BatchRequested | None:
    """The batch's `batch.requested`: the stream's (no recording lag), else the event store's (kept
    after the stream lost it); None when neither has one."""
    found = await requested_on_stream(state.js, batch_id)
    if found is not None:
        return found
    return await get_batch_request(state.pool, batch_id)


@dataclass(frozen=True, slots=True)
class Claim:
    """A keyed request's batch: the `batch.requested` that created it, and whether this request
    published it."""

    original: BatchRequested
    """The batch's `batch.requested` (this request's own when `published`)."""
    published: bool
    """This request stored the batch's `batch.requested`; False for a retry."""
    seq: int | None = None
    """Where it stored it on the CASES stream (when `published`)."""


async def claim_batch(state: GatewayState, event: BatchRequested) -> Claim:
    """Publish `event` (a keyed request's `batch.requested`, its `request_digest` set) unless its
    batch exists; raises the 409 when the batch exists from a different request (see the module
    docstring for why this admits one request per key)."""
    batch_id = event.batch_id or ""
    found = await original_request(state, batch_id)
    if found is None:
        ack = await state.publisher.publish_event(event)
        if not ack.duplicate:
            return Claim(original=event, published=True, seq=ack.seq)
        found = await original_request(state, batch_id)
        if found is None:
            raise ApiError(
                503,
                "unavailable",
                f"batch {batch_id} of this {HEADER} is being created by another request; retry",
                HEADER,
                headers={"Retry-After": "1"},
            )
    if digest_of(found) != digest_of(event):
        raise key_reused(batch_id)
    log.info("batch %s: a retry with its %s, nothing published", batch_id, HEADER)
    return Claim(original=found, published=False)
