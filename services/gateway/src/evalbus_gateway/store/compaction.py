"""The store's side of stream compaction (`evalbus_gateway.compactor` is the bus side): which
finalized batches are due, which of a batch's stream messages the store has not handled, and the
record of a compaction.

A stream message is handled when its sequence is in `events` (recorded) or in `rejections`
(refused with a reason: a duplicate, a sealed run, an invalid event) — the recorder writes every
message it acknowledges to one of the two, so the pair is exactly what the stream may lose.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

from evalbus_gateway.store.connections import acquire

if TYPE_CHECKING:
    from evalbus_gateway.store.connections import Database

_DUE = """
SELECT b.batch_id FROM batches AS b
LEFT JOIN stream_compactions AS c ON c.batch_id = b.batch_id
WHERE b.finalized_at IS NOT NULL AND b.finalized_at < now() - make_interval(secs => $1::float8)
  AND c.batch_id IS NULL AND NOT (b.batch_id = ANY($3::text[]))
ORDER BY b.finalized_at, b.batch_id
LIMIT $2
"""

_HANDLED = """
SELECT stream_seq FROM events WHERE stream_seq = ANY($1::bigint[])
UNION ALL SELECT stream_seq FROM rejections WHERE stream_seq = ANY($1::bigint[])
"""

_MARK = """
INSERT INTO stream_compactions (batch_id, purged_below, messages) VALUES ($1, $2, $3)
ON CONFLICT (batch_id) DO NOTHING
"""


@dataclass(frozen=True, slots=True)
class Compacted:
    """What the stream no longer holds of a batch: its messages below `purged_below`."""

    batch_id: str
    purged_below: int
    messages: int


async def due_batches(db: Database, keep_s: float, limit: int, *, skip: list[str] | None = None) -> list[str]:
    """Batches finalized more than `keep_s` seconds ago (by the store's clock) and not compacted
    yet, but those in `skip`; oldest first, at most `limit`."""
    async with acquire(db) as conn:
        rows = await conn.fetch(_DUE, keep_s, limit, skip or [])
    return [str(r["batch_id"]) for r in rows]


async def unhandled(db: Database, seqs: list[int]) -> list[int]:
    """Those of the stream sequences `seqs` the store has neither recorded nor refused, in order."""
    if not seqs:
        return []
    async with acquire(db) as conn:
        rows = await conn.fetch(_HANDLED, seqs)
    handled = {int(r["stream_seq"]) for r in rows}
    return [seq for seq in sorted(set(seqs)) if seq not in handled]


async def mark_compacted(db: Database, done: Compacted) -> None:
    """Record a compaction (the first record of a batch stays: two replicas may race)."""
    async with acquire(db) as conn:
        await conn.execute(_MARK, done.batch_id, done.purged_below, done.messages)


async def compacted(db: Database, batch_id: str) -> Compacted | None:
    """The batch's compaction, None while its events are still on the stream."""
    async with acquire(db) as conn:
        row = await conn.fetchrow("SELECT purged_below, messages FROM stream_compactions WHERE batch_id = $1", batch_id)
    if row is None:
        return None
    return Compacted(batch_id=batch_id, purged_below=int(row["purged_below"]), messages=int(row["messages"]))


async def recorded_events(db: Database, batch_id: str, *, after: int, before: int) -> list[tuple[int, str, bytes]]:
    """The batch's recorded events with a stream sequence in (`after`, `before`), in stream order:
    (sequence, type, body as JSON)."""
    async with acquire(db) as conn:
        rows = await conn.fetch(
            "SELECT stream_seq, type, body::text AS body FROM events "
            "WHERE batch_id = $1 AND stream_seq > $2 AND stream_seq < $3 ORDER BY stream_seq",
            batch_id,
            after,
            before,
        )
    return [(int(r["stream_seq"]), str(r["type"]), str(r["body"]).encode()) for r in rows]


async def last_recorded_seq(db: Database, batch_id: str) -> int | None:
    """The highest stream sequence of the batch's recorded events (None: nothing recorded)."""
    async with acquire(db) as conn:
        found = await conn.fetchval("SELECT max(stream_seq) FROM events WHERE batch_id = $1", batch_id)
    return None if found is None else int(found)


async def finalized_body(db: Database, batch_id: str) -> bytes | None:
    """The JSON of the batch's recorded `batch.finalized` (the first: the one the store keeps)."""
    async with acquire(db) as conn:
        body = await conn.fetchval(
            "SELECT body::text FROM events WHERE batch_id = $1 AND type = 'batch.finalized' "
            "ORDER BY stream_seq LIMIT 1",
            batch_id,
        )
    return None if body is None else str(body).encode()
