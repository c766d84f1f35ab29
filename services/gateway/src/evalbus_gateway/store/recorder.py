"""The recorder: CASES messages into the append-only `events` table, the read models and the seals.

`record(db, messages)` handles a batch of messages in ONE transaction:

1. Messages are taken in `stream_seq` order (a sequence given twice is kept once).
2. A message whose sequence is already in `events` or `rejections` was handled before (a
   redelivery after a crash between commit and ack): it is skipped silently, which makes
   `record` idempotent.
3. A message for a run that is already sealed (by an earlier transaction) is refused and written
   to `rejections` with reason `sealed`.
4. The dedupe key is the event's `Nats-Msg-Id` (`<type>:<run_id>` for run events,
   `<type>:<batch_id>` for batch events), unique in the table, so the first event of each type
   per run is kept; a later one with the same key is refused with reason `duplicate`. The others
   are inserted with `INSERT … SELECT FROM unnest(…)`, a few hundred rows per statement. A message
   PostgreSQL cannot store (a body jsonb cannot hold, a NUL in an id: hand-made payloads only) is
   refused with reason `invalid` instead of wedging the consumer.
5. The inserted events are folded into `batches` and `runs` (`store.projection`).
6. Each run this call touched whose trajectory is now complete (requested — except a re-judge
   replay, which starts at its `case.executed` —, executed, collected when its trace was deferred,
   judged, exported — in whatever order they were recorded) is sealed: the SHA-256
   hash chain over the run's stored bodies in `stream_seq` order, h_0 = 64 zeros,
   h_i = sha256_hex(h_{i-1} || sha256_hex(canonical body_i)), canonical = the stored jsonb body
   re-encoded with sorted keys and no whitespace. `store.chain` defines it to the byte; `evalbus
   verify` (`store.verify`) recomputes it. Each event's body digest is computed when it is
   inserted (from the payload, predicting what jsonb keeps: `chain.stored_body_digest`) and kept
   in `events.body_sha256`, so a seal chains digests and never reads bodies back.
7. The outcome lists the batches this call's messages concern that are now complete (every
   expected run is sealed: all its stages are recorded) and not finalized, so the caller can publish
   `batch.finalized`. Redelivered messages count too, so a crash between commit and ack cannot
   lose a finalisation; finalisation itself is idempotent (dedupe key `batch.finalized:<batch>`).

Transactions of the recorder (and `rebuild_read_models`) serialise on one advisory lock, so
several gateway replicas may record at once without racing a seal against a late event. Because
a seal waits for every stage of the run, replicas may record out of stream order. Under that lock
the recorder looks up which sequences and keys are taken before it inserts, so it knows every
outcome without `ON CONFLICT` (a conflict would fail the transaction, which is then retried).

Cost (1,000-message transactions, PostgreSQL 15 on two cores): most of the server's time goes to
parsing and compressing the jsonb bodies, most of Python's to the body digests. Python's work
(digests, the read-model fold) is done while the server executes the lookups and inserts
(`store.overlap`), and the lookups go by index only (`_LOCK`), so the cost of a transaction does
not grow with the store.

String bodies containing the escape `\\u0000` (which jsonb rejects) are stored with U+FFFD in its
place; the event is decoded again from the stored text so the read models match a rebuild.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import datetime
from functools import partial
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
from evalbus_gateway.store.chain import body_digest, chain_digests, stored_body_digest
from evalbus_gateway.store.connections import acquire
from evalbus_gateway.store.overlap import Overlap
from evalbus_gateway.store.projection import Fold, apply_fold, run_id_of

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


_LOCK = "SELECT pg_advisory_xact_lock($1), set_config('enable_seqscan', 'off', true)"
"""Serialise with other recorders; and look rows up by index only. Every read of the recorder is a
lookup by a bounded list of keys, but the planner, with statistics gathered when the store was
smaller (or a generic plan cached by a long-lived connection when it was empty), may prefer a
sequential scan whose cost grows with the whole store. The setting lasts until the transaction
ends: the recorder's own, or the caller's when `record` is given a connection inside one."""

_EXISTING = """
SELECT stream_seq, NULL::text AS dedupe_key FROM events WHERE stream_seq = ANY($1::bigint[])
UNION ALL SELECT stream_seq, NULL FROM rejections WHERE stream_seq = ANY($1::bigint[])
UNION ALL SELECT NULL, dedupe_key FROM events WHERE dedupe_key = ANY($2::text[])
"""
"""Sequences already handled (redeliveries) and dedupe keys already taken."""

_RUNS = """
SELECT r.run_id, s.run_id IS NOT NULL AS sealed, e.types, e.deferred, e.replayed, e.seqs, e.digests, e.batch_ids
FROM unnest($1::text[]) AS r(run_id)
LEFT JOIN seals AS s ON s.run_id = r.run_id
LEFT JOIN LATERAL (
    SELECT array_agg(type ORDER BY stream_seq) AS types,
           bool_or(type = 'case.executed' AND body->>'trace_complete' = 'false') AS deferred,
           bool_or(type = 'case.executed' AND body->>'rejudge_of' IS NOT NULL) AS replayed,
           array_agg(stream_seq ORDER BY stream_seq) AS seqs,
           array_agg(body_sha256 ORDER BY stream_seq) AS digests,
           array_agg(batch_id ORDER BY stream_seq) AS batch_ids
    FROM events WHERE events.run_id = r.run_id AND s.run_id IS NULL
) AS e ON true
"""
"""Per run: sealed already, or the stages stored so far and the links a seal would chain."""

_INSERT_EVENTS = """
INSERT INTO events (stream_seq, subject, type, event_id, batch_id, case_id, run_id, attempt, ts, body, dedupe_key,
                    body_sha256)
SELECT u.seq, u.subject, u.type, u.event_id, u.batch_id, u.case_id, u.run_id, u.attempt, u.ts, u.body::jsonb, u.k,
       u.digest
FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[], $8::int[],
            $9::timestamptz[], $10::text[], $11::text[], $12::text[])
     AS u(seq, subject, type, event_id, batch_id, case_id, run_id, attempt, ts, body, k, digest)
ORDER BY u.seq
"""
"""No ON CONFLICT: under the recorder lock `_EXISTING` told exactly what is new (a conflict would be
an error, and the transaction is retried, never a silent skip)."""

_INSERT_REJECTIONS = """
INSERT INTO rejections (stream_seq, subject, type, event_id, batch_id, run_id, dedupe_key, reason, detail)
SELECT * FROM unnest($1::bigint[], $2::text[], $3::text[], $4::text[], $5::text[], $6::text[], $7::text[],
                     $8::text[], $9::text[])
ON CONFLICT (stream_seq) DO NOTHING
"""

_INSERT_SEALS = """
INSERT INTO seals (run_id, batch_id, head_hash, event_count, first_seq, last_seq, seqs, hashes)
VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT (run_id) DO NOTHING
"""

SETTLED = """b.total_runs IS NOT NULL AND b.exported_count >= b.total_runs AND b.finalized_at IS NULL
AND (SELECT count(*) FROM runs r WHERE r.batch_id = b.batch_id AND r.sealed) >= b.total_runs"""
"""A batch is complete when every expected run is SEALED — every stage of it recorded — not merely
exported: the recorder may record a run's `case.exported` before its `case.executed` (a replica
died holding the executed event, which comes back after `ack_wait`), and an aggregate taken then
would miss that run's results. (The cheap counter test goes first; the count of sealed runs only
for batches that pass it.)"""

_COMPLETE = (
    "SELECT b.batch_id FROM batches b WHERE b.batch_id = ANY($1::text[]) AND "  # noqa: S608 - constants only
    + SETTLED
    + " ORDER BY b.batch_id"
)


async def _insert_events(conn: Connection, rows: Sequence[_Row], digests: Sequence[str | None]) -> None:
    if not rows:
        return
    columns = [list(c) for c in zip(*[r[:11] for r in rows], strict=True)]
    await conn.execute(_INSERT_EVENTS, *columns, list(digests))


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


class _Link(NamedTuple):
    """One stored event of a run, as its seal needs it."""

    seq: int
    digest: str | None
    """Its body digest; None when it must be computed from `body::text` (rows stored before the
    digests were kept, bodies `stored_body_digest` does not vouch for)."""
    batch_id: str | None


@dataclass
class _RunState:
    """What is stored of one run: the stages (a run is settled, and sealed, once all are in) and
    the links of its events.

    Every stage counts, `case.requested` included: replicas record out of stream order, so a run's
    later stages may all be stored while the replica holding its `case.requested` died with it
    uncommitted; sealing then would refuse that event as `sealed` when it comes back after
    `ack_wait`, and the store would lose it. A re-judge replay has no `case.requested` (it starts
    at the `case.executed` copied from the original run)."""

    types: set[str] = field(default_factory=set)
    deferred: bool = False
    replayed: bool = False
    links: list[_Link] = field(default_factory=list)

    def add(self, event: Event) -> None:
        self.types.add(event.type)
        if isinstance(event, CaseExecuted):
            self.deferred = self.deferred or not event.trace_complete
            self.replayed = self.replayed or event.rejudge_of is not None

    @property
    def settled(self) -> bool:
        need = {"case.executed", "case.judged", "case.exported"}
        if not self.replayed:
            need.add("case.requested")
        if self.deferred:
            need.add("case.collected")
        return need <= self.types


async def _existing(conn: Connection, rows: Sequence[_Row]) -> tuple[set[int], set[str]]:
    """Of `rows`, the sequences already handled, and the dedupe keys already taken."""
    seqs: set[int] = set()
    keys: set[str] = set()
    for r in await conn.fetch(_EXISTING, [r.seq for r in rows], [r.dedupe_key for r in rows]):
        if r["stream_seq"] is not None:
            seqs.add(int(r["stream_seq"]))
        else:
            keys.add(str(r["dedupe_key"]))
    return seqs, keys


async def _run_states(conn: Connection, run_ids: Sequence[str]) -> tuple[set[str], dict[str, _RunState]]:
    """The runs already sealed, and the stored state of the others."""
    sealed: set[str] = set()
    states: dict[str, _RunState] = {}
    for r in await conn.fetch(_RUNS, list(run_ids)):
        run_id = str(r["run_id"])
        if r["sealed"]:
            sealed.add(run_id)
            continue
        state = states[run_id] = _RunState()
        if r["seqs"] is not None:
            state.types.update(r["types"])
            state.deferred = bool(r["deferred"])
            state.replayed = bool(r["replayed"])
            state.links.extend(_Link(*link) for link in zip(r["seqs"], r["digests"], r["batch_ids"], strict=True))
    return sealed, states


class _Verdicts(NamedTuple):
    """What becomes of a call's new messages."""

    stored: list[_Row]
    """To insert, in sequence order."""
    refused: list[tuple[_Row, RejectReason, str]]
    """To write to `rejections`, with the reason and its detail."""
    settled: list[str]
    """Runs whose last missing stage is among `stored`: sealed in this transaction."""


def _sort_out(
    new: Sequence[_Row], invalid: dict[int, str], sealed: set[str], taken: set[str], states: dict[str, _RunState]
) -> _Verdicts:
    """Decide, in sequence order, which new messages are stored and which refused (`sealed` and
    `taken` grow as the later messages of a settled run and the keys of stored ones are seen)."""
    verdicts = _Verdicts([], [], [])
    for row in new:
        if row.seq in invalid:
            verdicts.refused.append((row, "invalid", invalid[row.seq]))
        elif row.run_id is not None and row.run_id in sealed:
            verdicts.refused.append((row, "sealed", f"run {row.run_id} is sealed"))
        elif row.dedupe_key in taken:
            verdicts.refused.append((row, "duplicate", row.dedupe_key))
        else:
            taken.add(row.dedupe_key)
            verdicts.stored.append(row)
            if row.run_id is not None:
                state = states.setdefault(row.run_id, _RunState())
                state.add(row.event)
                if state.settled:
                    sealed.add(row.run_id)  # later sequences of this run come after its seal
                    verdicts.settled.append(row.run_id)
    return verdicts


class _Seal(NamedTuple):
    run_id: str
    batch_id: str | None
    head_hash: str
    event_count: int
    first_seq: int
    last_seq: int
    seqs: list[int]
    hashes: list[str]


async def _seals(conn: Connection, links_by_run: dict[str, list[_Link]]) -> list[_Seal]:
    """The seal of each run from its links: the hash chain over its body digests in sequence
    order. Digests not known yet are computed from `body::text` (inside the caller's transaction,
    which stored this call's events already)."""
    missing = [link.seq for links in links_by_run.values() for link in links if link.digest is None]
    computed: dict[int, str] = {}
    if missing:
        rows = await conn.fetch(
            "SELECT stream_seq, body::text AS body FROM events WHERE stream_seq = ANY($1::bigint[])", missing
        )
        computed = {int(r["stream_seq"]): body_digest(str(r["body"])) for r in rows}
    seals: list[_Seal] = []
    for run_id in sorted(links_by_run):
        links = sorted(links_by_run[run_id])
        hashes = chain_digests(computed[link.seq] if link.digest is None else link.digest for link in links)
        seqs = [link.seq for link in links]
        batch_id = next((link.batch_id for link in links if link.batch_id is not None), None)
        seals.append(_Seal(run_id, batch_id, hashes[-1], len(seqs), seqs[0], seqs[-1], seqs, hashes))
    return seals


async def complete_batches(conn: Connection, batch_ids: Iterable[str]) -> list[str]:
    """Of `batch_ids`, those whose expected runs are all sealed and that are not finalized."""
    ids = sorted(set(batch_ids))
    if not ids:
        return []
    return [str(r["batch_id"]) for r in await conn.fetch(_COMPLETE, ids)]


class _Digests:
    """The body digests of a call's rows (`stored_body_digest`), computed a few rows at a time
    while the transaction's statements run (`store.overlap`), and kept if it is retried."""

    SLICE = 4
    """Rows per slice (about 0.1 ms: the event loop gets back often enough to keep the
    connection's I/O moving)."""

    def __init__(self, rows: Sequence[_Row]) -> None:
        self._rows = rows
        self._done = 0
        self.by_seq: dict[int, str | None] = {}

    def compute(self) -> Iterator[None]:
        """The work left, one slice per `next()`."""
        while self._done < len(self._rows):
            for row in self._rows[self._done : self._done + self.SLICE]:
                # only a run's events are chained (and a batch.requested can weigh megabytes)
                self.by_seq[row.seq] = None if row.run_id is None else stored_body_digest(row.body)
            self._done += self.SLICE
            yield

    def ready(self, seq: int) -> bool:
        """The digest of the row with this sequence is computed."""
        return seq in self.by_seq


def _fold_slices(folded: Fold, rows: Sequence[_Row], size: int = 8) -> Iterator[None]:
    """Fold `rows` into `folded`, `size` rows per `next()`."""
    for start in range(0, len(rows), size):
        for row in rows[start : start + size]:
            folded.add(row.event)
        yield


_INSERT_SLICE = 200
"""Events per INSERT: the digests of the next slice are computed while the server stores one."""


async def _record_in(conn: Connection, rows: Sequence[_Row], digests: _Digests, *, check_rows: bool) -> RecordOutcome:
    overlap = Overlap()
    overlap.add(digests.compute())
    await overlap.during(conn.execute(_LOCK, RECORDER_LOCK))
    existing, taken = await overlap.during(_existing(conn, rows))
    new = [r for r in rows if r.seq not in existing]
    invalid = await _unstorable(conn, new) if check_rows else {}
    sealed, states = await overlap.during(_run_states(conn, sorted({r.run_id for r in new if r.run_id is not None})))
    verdicts = _sort_out(new, invalid, sealed, taken, states)

    folded = Fold()
    overlap.add(_fold_slices(folded, verdicts.stored))
    for start in range(0, len(verdicts.stored), _INSERT_SLICE):
        part = verdicts.stored[start : start + _INSERT_SLICE]
        overlap.run_until(partial(digests.ready, part[-1].seq))
        await overlap.during(_insert_events(conn, part, [digests.by_seq[r.seq] for r in part]))
    await overlap.during(_insert_rejections(conn, verdicts.refused))
    overlap.finish()

    for row in verdicts.stored:
        if row.run_id is not None:
            states[row.run_id].links.append(_Link(row.seq, digests.by_seq[row.seq], row.batch_id))
    seals = await _seals(conn, {run_id: states[run_id].links for run_id in verdicts.settled})
    await apply_fold(conn, folded, sealed_runs=verdicts.settled)
    if seals:
        await conn.executemany(_INSERT_SEALS, seals)
    complete = await complete_batches(
        conn, (r.batch_id for r in rows if r.seq not in invalid and r.batch_id is not None)
    )

    def refused_count(reason: RejectReason) -> int:
        return sum(1 for _, why, _ in verdicts.refused if why == reason)

    return RecordOutcome(
        inserted=len(verdicts.stored),
        already_recorded=len(rows) - len(new),
        duplicates=refused_count("duplicate"),
        rejected_sealed=refused_count("sealed"),
        invalid=refused_count("invalid"),
        sealed_runs=tuple(sorted(verdicts.settled)),
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
    digests = _Digests(rows)
    async with acquire(db) as conn:
        try:
            async with conn.transaction():
                return await _record_in(conn, rows, digests, check_rows=False)
        except asyncpg.DataError:
            async with conn.transaction():
                return await _record_in(conn, rows, digests, check_rows=True)
