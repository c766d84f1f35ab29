"""Reads the API needs beyond `store.queries`: the batch list (newest first, keyset-paged), and the
stream's own word on a batch the recorder has not written yet.

The read models answer every read; the CASES stream is asked only for what is not recorded yet (a
batch submitted a few milliseconds ago) and for whether a batch is finalized, where the stream is
the source of truth and has no recording lag. Both are shared by every gateway replica.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING

import msgspec
import nats.js.errors
from nats.js import JetStreamContext

from evalbus_api.views import BatchView
from evalbus_contracts import (
    BatchFinalized,
    BatchRequested,
    DecodeError,
    StageCounts,
    decode_event,
    expected_runs,
    subjects,
)
from evalbus_contracts.streams import CASES
from evalbus_gateway.store import get_batch
from evalbus_gateway.store.connections import acquire
from evalbus_gateway.store.queries import batch_view

if TYPE_CHECKING:
    from evalbus_gateway.store.connections import Database


async def list_batches(
    db: Database,
    *,
    submitted_by: str | None,
    limit: int,
    after: tuple[datetime, str] | None = None,
) -> tuple[list[BatchView], tuple[datetime, str] | None]:
    """Recorded batches, newest first (`submitted_by` keeps one principal's), after the keyset
    position `after`; returns the page and the position to continue from (None at the end)."""
    async with acquire(db) as conn:
        rows = await conn.fetch(
            "SELECT * FROM batches WHERE spec IS NOT NULL AND created_at IS NOT NULL "
            "AND ($1::text IS NULL OR submitted_by = $1) "
            "AND ($2::timestamptz IS NULL OR (created_at, batch_id) < ($2::timestamptz, $3::text)) "
            "ORDER BY created_at DESC, batch_id DESC LIMIT $4",
            submitted_by,
            after[0] if after else None,
            after[1] if after else None,
            limit + 1,
        )
    views = [batch_view(r) for r in rows[:limit]]
    last = views[-1] if len(rows) > limit and views else None
    position = (last.created_at, last.batch_id) if last is not None and last.created_at is not None else None
    return views, position


async def _last_event(js: JetStreamContext, subject: str) -> tuple[int, object] | None:
    try:
        raw = await js.get_last_msg(CASES.name, subject)
    except nats.js.errors.NotFoundError:
        return None
    try:
        return int(raw.seq or 0), decode_event(raw.data or b"")
    except DecodeError:
        return None


async def requested_on_stream(js: JetStreamContext, batch_id: str) -> BatchRequested | None:
    """The batch's `batch.requested` as the stream holds it (None when there is none)."""
    found = await _last_event(js, subjects.batch_subject(subjects.BATCH_REQUESTED, batch_id))
    if found is None or not isinstance(found[1], BatchRequested):
        return None
    return found[1]


async def finalized_on_stream(js: JetStreamContext, batch_id: str) -> tuple[int, BatchFinalized] | None:
    """The batch's `batch.finalized` and its stream sequence (None while it is not finalized)."""
    found = await _last_event(js, subjects.batch_subject(subjects.BATCH_FINALIZED, batch_id))
    if found is None or not isinstance(found[1], BatchFinalized):
        return None
    return found[0], found[1]


def queued_view(event: BatchRequested) -> BatchView:
    """The view of a batch the stream holds but the recorder has not written yet."""
    batch_id = event.batch_id or ""
    return BatchView(
        batch_id=batch_id,
        status="queued",
        counts=StageCounts(),
        total_runs=expected_runs(event.spec),
        suite_id=event.spec.suite.id,
        submitted_by=event.submitted_by,
        supersede_key=event.spec.supersede_key,
        trials=max(1, event.spec.policy.trials),
        created_at=event.ts,
    )


async def find_batch(db: Database, js: JetStreamContext, batch_id: str) -> BatchView | None:
    """A batch from the read model, else (not recorded yet) from its `batch.requested` on the stream."""
    view = await get_batch(db, batch_id)
    if view is not None and view.submitted_by is not None:
        return view
    requested = await requested_on_stream(js, batch_id)
    if requested is None:
        return view
    if view is None:
        return queued_view(requested)
    # Case events were recorded before the batch's own request (replicas record out of order).
    queued = queued_view(requested)
    return msgspec.structs.replace(
        view,
        total_runs=queued.total_runs,
        suite_id=queued.suite_id,
        submitted_by=queued.submitted_by,
        supersede_key=queued.supersede_key,
        trials=queued.trials,
        created_at=queued.created_at,
    )
