"""The recorder: CASES messages into the append-only `events` table, the read models and the seals.

`record(db, messages)` handles a batch of messages in ONE transaction:

1. Messages are taken in `stream_seq` order (a sequence given twice is kept once).
2. A message whose sequence is already in `events` or `rejections` was handled before (a
   redelivery after a crash between commit and ack): it is skipped silently, which makes
   `record` idempotent.
3. A message for a run that is already sealed (by an earlier transaction) is refused and written
   to `rejections` with reason `sealed`.
4. The others are inserted with one `INSERT … SELECT FROM unnest(…) ON CONFLICT DO NOTHING`.
   The dedupe key is the event's `Nats-Msg-Id` (`<type>:<run_id>` for run events,
   `<type>:<batch_id>` for batch events), unique in the table, so the first event of each type
   per run is kept; a later one with the same key is refused with reason `duplicate`. A message
   PostgreSQL cannot store (a body jsonb cannot hold, a NUL in an id: hand-made payloads only) is
   refused with reason `invalid` instead of wedging the consumer.
5. The inserted events are folded into `batches` and `runs` (`store.projection`).
6. Each run this call touched whose trajectory is now complete (executed, collected when its trace
   was deferred, judged, exported — in whatever order they were recorded) is sealed: the SHA-256
   hash chain over the run's
   stored bodies in `stream_seq` order, h_0 = 64 zeros,
   h_i = sha256_hex(h_{i-1} || sha256_hex(canonical body_i)), canonical = the stored jsonb body
   re-encoded with sorted keys and no whitespace. `store.chain` defines it to the byte; `evalbus
   verify` (`store.verify`) recomputes it.
7. The outcome lists the batches this call's messages concern that are now complete (every
   expected run has `case.exported`) and not finalized, so the caller can publish
   `batch.finalized`. Redelivered messages count too, so a crash between commit and ack cannot
   lose a finalisation; finalisation itself is idempotent (dedupe key `batch.finalized:<batch>`).

Transactions of the recorder (and `rebuild_read_models`) serialise on one advisory lock, so
several gateway replicas may record at once without racing a seal against a late event. Because
a seal waits for every stage of the run, replicas may record out of stream order.

String bodies containing the escape `\\u0000` (which jsonb rejects) are stored with U+FFFD in its
place; the event is decoded again from the stored text so the read models match a rebuild.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from typing import TYPE_CHECKING, Literal, NamedTuple

import asyncpg
import msgspec

from evalbus_contracts import (
    CaseCollected,
    CaseExecuted,
    CaseExported,
    CaseJudged,
    CaseRequested,
    Event,
    decode_event,
)
from evalbus_gateway.store.chain import chain
from evalbus_gateway.store.connections import acquire
from evalbus_gateway.store.projection import project, run_id_of

if TYPE_CHECKING:
    from evalbus_gateway.store.connections import Connection, Database

RECORDER_LOCK = 0x65766C_7265636F  # "evl" "reco": serialises recorder and rebuild transactions

RejectReason = Literal["duplicate", "sealed", "invalid"]


class RecordedMessage(NamedTuple):
    """One message of the CASES stream, as the consumer received and decoded it."""

    stream_seq: int
    """Its sequence in the stream."""
    subject: str
    """Subject it was published on."""
    data: bytes
    """Raw payload (JSON)."""
    event: Event
    """The payload decoded."""


class RecordOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What one `record` call did."""

    inserted: int = 0
    """Events appended to `events`."""
    already_recorded: int = 0
    """Messages whose sequence was already stored or refused (redeliveries), skipped."""
    duplicates: int = 0
    """Messages refused: the dedupe key was taken by an earlier event."""
    rejected_sealed: int = 0
    """Messages refused: their run was already sealed."""
    invalid: int = 0
    """Messages refused: the body cannot be stored."""
    sealed_runs: tuple[str, ...] = ()
    """Runs sealed in this transaction."""
    complete_batches: tuple[str, ...] = ()
    """Batches concerned by these messages that are complete and not finalized: finalize them."""


class _Row(NamedTuple):
    seq: int
    subject: str
    type: str
    event_id: str
    batch_id: str | None
    case_id: str | None
    run_id: str | None
    attempt: int
    ts: datetime
    body: str
    dedupe_key: str
    event: Event


_NUL_ESCAPE = re.compile(r"(?<!\\)((?:\\\\)*)\\u0000")


def _storable_body(data: bytes) -> tuple[str, bool]:
    """The payload as text jsonb accepts, and whether it had to change."""
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError:  # only in fields the decoder skipped
        text = data.decode("utf-8", errors="replace")
        changed = True
    else:
        changed = False
    if "\\u0000" not in text:
        return text, changed
    fixed = _NUL_ESCAPE.sub(lambda m: m.group(1) + "\\ufffd", text)
    return fixed, changed or fixed != text


def dedupe_key(event: Event) -> str:
    """The unique key of an event in the store: `<type>:<run_id>` for a run's stage events (the run
    id taken from the result when the envelope lacks it), else the event's `Nats-Msg-Id`
    (`<type>:<batch_id>` for batch events)."""
    run_id = run_id_of(event)
    if run_id is not None and isinstance(
        event, CaseRequested | CaseExecuted | CaseCollected | CaseJudged | CaseExported
    ):
        return f"{event.type}:{run_id}"
    return event.msg_id()


def _row(message: RecordedMessage) -> _Row:
    body, changed = _storable_body(message.data)
    event = decode_event(body.encode("utf-8")) if changed else message.event
    return _Row(
        seq=message.stream_seq,
        subject=message.subject,
        type=event.type,
        event_id=event.event_id,
        batch_id=event.batch_id,
        case_id=event.case_id,
        run_id=run_id_of(event),
        attempt=event.attempt,
        ts=event.ts,
        body=body,
        dedupe_key=dedupe_key(event),
        event=event,
    )


_INSERT_EVENTS = """
INSERT INTO events (stream_seq, subject, type, event_id, batch_id, case_id, run_id, attempt, ts, body, dedupe_key)
SELECT u.seq, u.subject, u.type, u.event_id, u.batch_id, u.case_id, u.run_id, u.attempt, u.ts, u.body::jsonb, u.k
FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::int[],
            $9::timestamptz[], $10::text[], $11::text[])
     AS u(seq, subject, type, event_id, batch_id, case_id, run_id, attempt, ts, body, k)
ORDER BY u.seq
ON CONFLICT DO NOTHING
RETURNING stream_seq
"""

_INSERT_REJECTIONS = """
INSERT INTO rejections (stream_seq, subject, type, event_id, batch_id, run_id, dedupe_key, reason, detail)
SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                     $8::text[], $9::text[])
ON CONFLICT (stream_seq) DO NOTHING
"""


async def _insert_events(conn: Connection, rows: Sequence[_Row]) -> set[int]:
    if not rows:
        return set()
    columns = list(zip(*[r[:11] for r in rows], strict=True))
    inserted = await conn.fetch(_INSERT_EVENTS, *[list(c) for c in columns])
    return {int(r["stream_seq"]) for r in inserted}


async def _insert_rejections(conn: Connection, refused: Sequence[tuple[_Row, RejectReason, str]]) -> None:
    if not refused:
        return
    values = [
        tuple(
            _text(v) if isinstance(v, str) else v
            for v in (r.seq, r.subject, r.type, r.event_id, r.batch_id, r.run_id, r.dedupe_key, reason, detail)
        )
        for r, reason, detail in refused
    ]
    columns = [list(c) for c in zip(*values, strict=True)]
    await conn.execute(_INSERT_REJECTIONS, *columns)


async def _unstorable(conn: Connection, rows: Iterable[_Row]) -> dict[int, str]:
    """Rows PostgreSQL refuses (a body jsonb cannot hold, a NUL in an id), each checked under its
    own savepoint: the slow path taken only after a batch failed with a DataError."""
    bad: dict[int, str] = {}
    for row in rows:
        try:
            async with conn.transaction():
                await conn.fetchval(
                    "SELECT $1::jsonb IS NOT NULL AND concat($2::text, $3::text, $4::text, $5::text, $6::text, "
                    "$7::text, $8::text) IS NOT NULL",
                    row.body,
                    row.subject,
                    row.type,
                    row.event_id,
                    row.batch_id,
                    row.case_id,
                    row.run_id,
                    row.dedupe_key,
                )
        except asyncpg.DataError as e:
            bad[row.seq] = f"{type(e).__name__}: {e}"
    return bad


def _text(value: str | None) -> str | None:
    """Text PostgreSQL accepts (NUL replaced), for the rejection row of an unstorable message."""
    return None if value is None else value.replace("\x00", "\ufffd")


async def seal_runs(conn: Connection, run_ids: Sequence[str]) -> list[str]:
    """Seal runs: hash-chain their stored events and write the seal (inside the caller's transaction)."""
    if not run_ids:
        return []
    rows = await conn.fetch(
        "SELECT run_id, batch_id, stream_seq, body::text AS body FROM events "
        "WHERE run_id = ANY($1::text[]) ORDER BY run_id, stream_seq",
        list(run_ids),
    )
    per_run: dict[str, list[asyncpg.Record]] = {}
    for r in rows:
        per_run.setdefault(str(r["run_id"]), []).append(r)
    seals: list[tuple[object, ...]] = []
    for run_id, events in per_run.items():
        hashes = chain(str(e["body"]) for e in events)
        seqs = [int(e["stream_seq"]) for e in events]
        batch_id = next((e["batch_id"] for e in events if e["batch_id"] is not None), None)
        seals.append((run_id, batch_id, hashes[-1], len(seqs), seqs[0], seqs[-1], seqs, hashes))
    await conn.executemany(
        "INSERT INTO seals (run_id, batch_id, head_hash, event_count, first_seq, last_seq, seqs, hashes) "
        "VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (run_id) DO NOTHING",
        seals,
    )
    sealed = sorted(per_run)
    await conn.execute("UPDATE runs SET sealed = true WHERE run_id = ANY($1::text[])", sealed)
    return sealed


@dataclass
class _Progress:
    """Which stages of a run are recorded: a run is settled (and sealed) once all are."""

    types: set[str] = field(default_factory=set)
    deferred: bool = False

    def add(self, event: Event) -> None:
        self.types.add(type(event).__struct_config__.tag)  # type: ignore[arg-type]
        if isinstance(event, CaseExecuted) and not event.trace_complete:
            self.deferred = True

    @property
    def settled(self) -> bool:
        need = {"case.executed", "case.judged", "case.exported"} | ({"case.collected"} if self.deferred else set())
        return need <= self.types


async def _run_progress(conn: Connection, run_ids: Sequence[str]) -> dict[str, _Progress]:
    rows = await conn.fetch(
        "SELECT run_id, array_agg(type) AS types, "
        "bool_or(type = 'case.executed' AND body->>'trace_complete' = 'false') AS deferred "
        "FROM events WHERE run_id = ANY($1::text[]) GROUP BY run_id",
        list(run_ids),
    )
    return {str(r["run_id"]): _Progress(set(r["types"]), bool(r["deferred"])) for r in rows}


async def complete_batches(conn: Connection, batch_ids: Iterable[str]) -> list[str]:
    """Of `batch_ids`, those whose expected runs are all exported and that are not finalized."""
    ids = sorted(set(batch_ids))
    if not ids:
        return []
    rows = await conn.fetch(
        "SELECT batch_id FROM batches WHERE batch_id = ANY($1::text[]) AND total_runs IS NOT NULL "
        "AND exported_count >= total_runs AND finalized_at IS NULL ORDER BY batch_id",
        ids,
    )
    return [str(r["batch_id"]) for r in rows]


async def _record_in(conn: Connection, rows: Sequence[_Row], *, check_rows: bool) -> RecordOutcome:
    await conn.execute("SELECT pg_advisory_xact_lock($1)", RECORDER_LOCK)
    seqs = [r.seq for r in rows]
    existing = {
        int(r["stream_seq"])
        for r in await conn.fetch(
            "SELECT stream_seq FROM events WHERE stream_seq = ANY($1::bigint[]) "
            "UNION ALL SELECT stream_seq FROM rejections WHERE stream_seq = ANY($1::bigint[])",
            seqs,
        )
    }
    invalid = await _unstorable(conn, (r for r in rows if r.seq not in existing)) if check_rows else {}
    valid = [r for r in rows if r.seq not in invalid]
    run_ids = sorted({r.run_id for r in valid if r.run_id is not None})
    sealed = {
        str(r["run_id"]) for r in await conn.fetch("SELECT run_id FROM seals WHERE run_id = ANY($1::text[])", run_ids)
    }

    progress = await _run_progress(conn, [r for r in run_ids if r not in sealed])
    candidates: list[_Row] = []
    refused: list[tuple[_Row, RejectReason, str]] = []
    settled_now: list[str] = []
    for row in rows:
        if row.seq in existing:
            continue
        if row.seq in invalid:
            refused.append((row, "invalid", invalid[row.seq]))
        elif row.run_id is not None and row.run_id in sealed:
            refused.append((row, "sealed", f"run {row.run_id} is sealed"))
        else:
            candidates.append(row)
            if row.run_id is not None:
                state = progress.setdefault(row.run_id, _Progress())
                state.add(row.event)
                if state.settled:
                    sealed.add(row.run_id)  # later sequences of this run come after its seal
                    settled_now.append(row.run_id)

    inserted = await _insert_events(conn, candidates)
    for row in candidates:
        if row.seq not in inserted:
            refused.append((row, "duplicate", row.dedupe_key))
    await _insert_rejections(conn, refused)

    stored = [r for r in candidates if r.seq in inserted]
    await project(conn, [r.event for r in stored])
    sealed_now = await seal_runs(conn, sorted(settled_now))
    complete = await complete_batches(conn, (r.batch_id for r in valid if r.batch_id is not None))

    def refused_count(reason: RejectReason) -> int:
        return sum(1 for _, why, _ in refused if why == reason)

    return RecordOutcome(
        inserted=len(stored),
        already_recorded=len(existing),
        duplicates=refused_count("duplicate"),
        rejected_sealed=refused_count("sealed"),
        invalid=refused_count("invalid"),
        sealed_runs=tuple(sealed_now),
        complete_batches=tuple(complete),
    )


async def record(db: Database, messages: Sequence[RecordedMessage]) -> RecordOutcome:
    """Record a batch of CASES messages in one transaction (see the module docstring)."""
    by_seq: dict[int, RecordedMessage] = {}
    for message in messages:
        by_seq.setdefault(message.stream_seq, message)
    if not by_seq:
        return RecordOutcome()
    rows = [_row(by_seq[seq]) for seq in sorted(by_seq)]
    async with acquire(db) as conn:
        try:
            async with conn.transaction():
                return await _record_in(conn, rows, check_rows=False)
        except asyncpg.DataError:
            async with conn.transaction():
                return await _record_in(conn, rows, check_rows=True)
