"""Verification of sealed trajectories: recompute each run's hash chain from `events` and compare
it, link by link, with the seal written when the run settled (`store.chain` defines the chain).

A run is `ok` when its stored events are exactly the sealed sequences and every recomputed link
equals the sealed one (and, when an object check is given, every object its events name — a large
result's payload, a stored artifact — still has the size and SHA-256 its reference pins); `mismatch` names the first sequence where they part (an altered body, an
event removed or added); `not_sealed` when the run has no seal (still in flight, or unknown).
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Literal

import msgspec

from evalbus_gateway.store.chain import chain
from evalbus_gateway.store.connections import snapshot

if TYPE_CHECKING:
    from evalbus_gateway.store.connections import Connection, Database

VerifyStatus = Literal["ok", "mismatch", "not_sealed"]


class VerifyResult(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The verification of one run."""

    run_id: str
    """Run id."""
    status: VerifyStatus
    """`ok`, `mismatch` or `not_sealed`."""
    event_count: int = 0
    """Events of the run in the store now."""
    sealed_count: int | None = None
    """Events the seal covers."""
    first_bad_seq: int | None = None
    """The first sequence whose link no longer matches (mismatch only)."""
    sealed_head: str | None = None
    """Head hash in the seal."""
    computed_head: str | None = None
    """Head hash recomputed from the stored events."""
    detail: str | None = None
    """What differs."""
    objects_checked: int | None = None
    """Objects the run's events name that were read and matched their references (None: not
    checked)."""

    @property
    def ok(self) -> bool:
        """The run is sealed and intact."""
        return self.status == "ok"


class BatchVerifyResult(msgspec.Struct, frozen=True, kw_only=True):
    """The verification of every run of a batch."""

    batch_id: str
    """Batch id."""
    runs: tuple[VerifyResult, ...]
    """Per run, by run id."""
    ok_count: int
    """Runs sealed and intact."""
    mismatched: int
    """Runs whose events no longer match their seal."""
    not_sealed: int
    """Runs without a seal."""

    @property
    def ok(self) -> bool:
        """Every run is sealed and intact."""
        return self.mismatched == 0 and self.not_sealed == 0


class SealLinks(msgspec.Struct, frozen=True, kw_only=True):
    """What a seal recorded: every sequence and link, and the head."""

    seqs: tuple[int, ...]
    """Sequences covered, in order."""
    hashes: tuple[str, ...]
    """h_1..h_n."""
    head: str
    """h_n as stored in `head_hash`."""


def _first_difference(seqs: list[int], hashes: list[str], seal: SealLinks) -> tuple[int | None, str | None]:
    for i in range(max(len(seqs), len(seal.seqs))):
        if i >= len(seqs):
            return seal.seqs[i], f"sealed event {seal.seqs[i]} is missing"
        if i >= len(seal.seqs):
            return seqs[i], f"event {seqs[i]} is not covered by the seal"
        if seqs[i] != seal.seqs[i]:
            return min(seqs[i], seal.seqs[i]), f"expected event {seal.seqs[i]} at position {i}, found {seqs[i]}"
        if i >= len(seal.hashes) or hashes[i] != seal.hashes[i]:
            return seqs[i], f"event {seqs[i]} does not match its sealed link"
    if not seal.hashes or seal.hashes[-1] != seal.head:
        return (seal.seqs[-1] if seal.seqs else None), "the seal's head is not its last link"
    return None, None


def compare(run_id: str, events: list[tuple[int, str]], seal: SealLinks | None) -> VerifyResult:
    """Compare stored `(seq, body)` pairs (in sequence order) with a seal (pure)."""
    seqs = [seq for seq, _ in events]
    hashes = chain(body for _, body in events)
    computed = hashes[-1] if hashes else None
    if seal is None:
        return VerifyResult(
            run_id=run_id,
            status="not_sealed",
            event_count=len(events),
            computed_head=computed,
            detail="no seal" if events else "no events and no seal",
        )
    first_bad, detail = _first_difference(seqs, hashes, seal)
    return VerifyResult(
        run_id=run_id,
        status="ok" if detail is None else "mismatch",
        event_count=len(events),
        sealed_count=len(seal.seqs),
        first_bad_seq=first_bad,
        sealed_head=seal.head,
        computed_head=computed,
        detail=detail,
    )


ObjectCheck = Callable[[list[tuple[int, str]]], Awaitable[tuple[int | None, str | None, int]]]
"""Checks the objects stored `(seq, body)` events name against their references: `(seq, detail,
checked)` of the first that does not match, or `(None, None, checked)` (the CLI passes
`evalbus_runtime.payloads.first_bad_object` on a NATS connection; the store does no NATS I/O)."""


async def _check_objects(result: VerifyResult, events: list[tuple[int, str]], objects: ObjectCheck) -> VerifyResult:
    """A chain-intact run whose named objects are checked too: `mismatch` at the first event whose
    object was replaced or altered (the chain covers the reference, the object must match it)."""
    if result.status != "ok":
        return result
    bad_seq, detail, checked = await objects(events)
    if detail is None:
        return msgspec.structs.replace(result, objects_checked=checked)
    return msgspec.structs.replace(
        result, status="mismatch", first_bad_seq=bad_seq, detail=detail, objects_checked=checked
    )


async def _verify(conn: Connection, run_id: str, objects: ObjectCheck | None = None) -> VerifyResult:
    rows = await conn.fetch(
        "SELECT stream_seq, body::text AS body FROM events WHERE run_id = $1 ORDER BY stream_seq", run_id
    )
    seal = await conn.fetchrow("SELECT seqs, hashes, head_hash FROM seals WHERE run_id = $1", run_id)
    events = [(int(r["stream_seq"]), str(r["body"])) for r in rows]
    if seal is None:
        return compare(run_id, events, None)
    links = SealLinks(
        seqs=tuple(int(s) for s in seal["seqs"]),
        hashes=tuple(str(h) for h in seal["hashes"]),
        head=str(seal["head_hash"]),
    )
    result = compare(run_id, events, links)
    return result if objects is None else await _check_objects(result, events, objects)


async def verify_run(db: Database, run_id: str, objects: ObjectCheck | None = None) -> VerifyResult:
    """Recompute one run's chain from `events` and compare it with its seal; with `objects`, also
    check every object its events name."""
    async with snapshot(db) as conn:
        return await _verify(conn, run_id, objects)


async def verify_batch(db: Database, batch_id: str, objects: ObjectCheck | None = None) -> BatchVerifyResult:
    """Verify every run of a batch (runs found in `events` or in `seals`), with `objects` as in
    `verify_run`."""
    async with snapshot(db) as conn:
        rows = await conn.fetch(
            "SELECT run_id FROM events WHERE batch_id = $1 AND run_id IS NOT NULL "
            "UNION SELECT run_id FROM seals WHERE batch_id = $1 ORDER BY run_id",
            batch_id,
        )
        results = [await _verify(conn, str(r["run_id"]), objects) for r in rows]
    return BatchVerifyResult(
        batch_id=batch_id,
        runs=tuple(results),
        ok_count=sum(1 for r in results if r.status == "ok"),
        mismatched=sum(1 for r in results if r.status == "mismatch"),
        not_sealed=sum(1 for r in results if r.status == "not_sealed"),
    )
