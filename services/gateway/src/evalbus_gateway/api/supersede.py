"""Which batch a new submission with a supersede key replaces, when the one before it is too
recent for the read model.

The read model lists the open batches with a key once the recorder has written them; a batch
submitted a few milliseconds earlier (a CI job pushed twice) is not there yet, and both would run.
So each fresh submission also records itself as the latest of its submitter's key in the
`supersede-keys` bucket (`streams.SUPERSEDE_KEYS`), by compare-and-set on the key's revision, and
learns the batch it displaced. Ordering is by the stream sequence of the `batch.requested`: a
request whose batch was published before the one the bucket holds lost the race, and it is the
one superseded — the later submission always wins, whichever gateway replica took each.
"""

from __future__ import annotations

import hashlib

import msgspec
from nats.js import JetStreamContext
from nats.js.errors import KeyNotFoundError, KeyWrongLastSequenceError, NotFoundError
from nats.js.kv import KeyValue

from evalbus_contracts import subjects
from evalbus_contracts.streams import CASES


class Latest(msgspec.Struct, frozen=True, kw_only=True):
    """The bucket's value: the latest batch of a submitter's key."""

    batch_id: str
    """The batch."""
    seq: int
    """The CASES stream sequence of its `batch.requested`."""


class Displaced(msgspec.Struct, frozen=True, kw_only=True):
    """A batch to cancel as superseded, and the batch that supersedes it."""

    old: str
    """The superseded batch."""
    new: str
    """The batch that supersedes it."""


async def requested_seq(js: JetStreamContext, batch_id: str) -> int | None:
    """The CASES stream sequence of the batch's `batch.requested` (None when the stream no longer
    holds it: compacted, so finalized long ago)."""
    try:
        found = await js.get_last_msg(CASES.name, subjects.batch_subject(subjects.BATCH_REQUESTED, batch_id))
    except NotFoundError:
        return None
    return found.seq


def bucket_key(submitter: str, supersede_key: str) -> str:
    """The bucket's key of a submitter's supersede key (a digest: any text is a valid key)."""
    return hashlib.sha256(f"{submitter}\0{supersede_key}".encode()).hexdigest()


async def claim_latest(kv: KeyValue, key: str, batch_id: str, seq: int) -> Displaced | None:
    """Record batch `batch_id` (published at `seq`) as the latest of `key`; the pair to cancel: the
    batch it displaced, or itself when a later one is recorded already. None when it is the first."""
    value = msgspec.json.encode(Latest(batch_id=batch_id, seq=seq))
    while True:
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:
            try:
                await kv.create(key, value)
            except KeyWrongLastSequenceError:
                continue  # another submission was first: read it
            return None
        latest = msgspec.json.decode(entry.value or b"", type=Latest)
        if latest.batch_id == batch_id:
            return None
        if latest.seq > seq:
            return Displaced(old=batch_id, new=latest.batch_id)
        try:
            await kv.update(key, value, last=entry.revision)
        except KeyWrongLastSequenceError:
            continue  # moved meanwhile: decide again against the newer value
        return Displaced(old=latest.batch_id, new=batch_id)
