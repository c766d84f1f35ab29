"""Reads for the HTTP API, and the rebuild of the read models from `events`.

They answer the views of `evalbus_api.views`, frozen msgspec Structs the API encodes as they are. Run lists page by a
keyset cursor (the last run id of the previous page), stable while runs are added.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import msgspec

from evalbus_api.views import (
    BatchView,
    RunPage,
    RunView,
    SealView,
    Stage,
    Trajectory,
    TrajectoryEvent,
)
from evalbus_contracts import (
    BatchError,
    BatchRequested,
    BatchSpec,
    BatchSummary,
    CaseFailure,
    DecodeError,
    ExportSummary,
    Score,
    SinkOutcome,
    StageCounts,
    TraceSpec,
    decode,
    decode_event,
)
from evalbus_gateway.store.connections import acquire, snapshot
from evalbus_gateway.store.projection import project
from evalbus_gateway.store.recorder import RECORDER_LOCK, SETTLED

if TYPE_CHECKING:
    import asyncpg

    from evalbus_gateway.store.connections import Database


def _load(data: Any, kind: Any) -> Any:
    return None if data is None else decode(str(data), kind)


def batch_view(row: asyncpg.Record) -> BatchView:
    """A `batches` row as a view."""
    return BatchView(
        batch_id=row["batch_id"],
        status=row["status"],
        counts=StageCounts(
            requested=row["requested_count"],
            executed=row["executed_count"],
            collected=row["collected_count"],
            judged=row["judged_count"],
            exported=row["exported_count"],
            failed=row["failed_count"],
            cancelled=row["cancelled_count"],
        ),
        total_runs=row["total_runs"],
        suite_id=row["suite_id"],
        submitted_by=row["submitted_by"],
        supersede_key=row["supersede_key"],
        trials=row["trials"],
        summary=_load(row["summary"], BatchSummary),
        export=_load(row["export"], ExportSummary),
        error=_load(row["error"], BatchError),
        judge_errors=row["judge_errors"],
        created_at=row["created_at"],
        finalized_at=row["finalized_at"],
        cancel_reason=row["cancel_reason"],
        cancelled_by=row["cancelled_by"],
        superseded_by=row["superseded_by"],
    )


def run_view(row: asyncpg.Record) -> RunView:
    """A `runs` row as a view."""
    scores = _load(row["scores"], tuple[Score, ...])
    outcomes = _load(row["export_outcomes"], tuple[SinkOutcome, ...])
    return RunView(
        run_id=row["run_id"],
        case_id=row["case_id"],
        stage=row["stage"],
        batch_id=row["batch_id"],
        trial=row["trial"],
        attempt=row["attempt"],
        harness=row["harness"],
        executed_status=row["executed_status"],
        collected=row["collected_status"] is not None,
        judged_status=row["judged_status"],
        exported_status=row["exported_status"],
        requested_at=row["requested_at"],
        executed_at=row["executed_at"],
        collected_at=row["collected_at"],
        judged_at=row["judged_at"],
        exported_at=row["exported_at"],
        failure=_load(row["failure"], CaseFailure),
        scores=scores or (),
        verdict=row["verdict"],
        verdict_rung=row["verdict_rung"],
        answer=row["answer"],
        judge_error=row["judge_error"],
        export_outcomes=outcomes or (),
        sandbox_seconds=row["sandbox_seconds"],
        sealed=row["sealed"],
    )


async def get_batch(db: Database, batch_id: str) -> BatchView | None:
    """A batch: status, per-stage counts, summary, export, error; None when unknown."""
    async with acquire(db) as conn:
        row = await conn.fetchrow("SELECT * FROM batches WHERE batch_id = $1", batch_id)
    return None if row is None else batch_view(row)


async def get_batch_spec(db: Database, batch_id: str) -> BatchSpec | None:
    """The spec a batch was submitted with; None when unknown."""
    async with acquire(db) as conn:
        spec = await conn.fetchval("SELECT spec::text FROM batches WHERE batch_id = $1", batch_id)
    return None if spec is None else decode(str(spec), BatchSpec)


async def get_batch_request(db: Database, batch_id: str) -> BatchRequested | None:
    """The batch's recorded `batch.requested` (the first one the stream held: the store keeps one
    per batch); None when none is recorded."""
    async with acquire(db) as conn:
        body = await conn.fetchval("SELECT body::text FROM events WHERE dedupe_key = $1", f"batch.requested:{batch_id}")
    if body is None:
        return None
    event = decode_event(str(body).encode("utf-8"))
    return event if isinstance(event, BatchRequested) else None


async def get_harness_trace(db: Database, batch_id: str) -> TraceSpec | None:
    """Where the harness of a batch sends its trace (without reading the whole spec); None when
    the batch is not recorded."""
    async with acquire(db) as conn:
        trace = await conn.fetchval(
            "SELECT coalesce(spec->'harness'->'trace', '{}'::jsonb)::text FROM batches "
            "WHERE batch_id = $1 AND spec IS NOT NULL",
            batch_id,
        )
    return None if trace is None else decode(str(trace), TraceSpec)


async def list_runs(
    db: Database,
    batch_id: str,
    *,
    limit: int = 100,
    cursor: str | None = None,
    stage: Stage | None = None,
) -> RunPage:
    """A page of a batch's runs by run id, after `cursor`; `stage` keeps runs whose furthest stage
    is that one (e.g. `executed`: executed and waiting for their judges)."""
    limit = max(1, min(limit, 1000))
    async with acquire(db) as conn:
        rows = await conn.fetch(
            "SELECT * FROM runs WHERE batch_id = $1 AND ($2::text IS NULL OR run_id > $2) "
            "AND ($3::text IS NULL OR stage = $3) ORDER BY run_id LIMIT $4",
            batch_id,
            cursor,
            stage,
            limit + 1,
        )
    runs = tuple(run_view(r) for r in rows[:limit])
    return RunPage(runs=runs, next_cursor=runs[-1].run_id if len(rows) > limit else None)


async def get_run(db: Database, run_id: str) -> RunView | None:
    """A run; None when unknown."""
    async with acquire(db) as conn:
        row = await conn.fetchrow("SELECT * FROM runs WHERE run_id = $1", run_id)
    return None if row is None else run_view(row)


async def get_trajectory(db: Database, run_id: str) -> Trajectory | None:
    """A run's stored events in sequence order, with its seal; None when nothing was recorded."""
    async with snapshot(db) as conn:
        rows = await conn.fetch(
            "SELECT stream_seq, subject, type, ts, body::text AS body FROM events WHERE run_id = $1 "
            "ORDER BY stream_seq",
            run_id,
        )
        seal = await conn.fetchrow(
            "SELECT head_hash, event_count, first_seq, last_seq, sealed_at FROM seals WHERE run_id = $1", run_id
        )
    if not rows and seal is None:
        return None
    events = tuple(
        TrajectoryEvent(
            stream_seq=r["stream_seq"],
            subject=r["subject"],
            type=r["type"],
            ts=r["ts"],
            body=msgspec.Raw(str(r["body"]).encode("utf-8")),
        )
        for r in rows
    )
    return Trajectory(
        run_id=run_id,
        events=events,
        seal=None
        if seal is None
        else SealView(
            head_hash=seal["head_hash"],
            event_count=seal["event_count"],
            first_seq=seal["first_seq"],
            last_seq=seal["last_seq"],
            sealed_at=seal["sealed_at"],
        ),
    )


class OutputTail(NamedTuple):
    """The end of a settled run's output, as recorded."""

    text: str
    attempt: int


async def get_output_tail(db: Database, run_id: str) -> OutputTail | None:
    """The end of a settled run's output as its `case.executed` recorded it (`output_tail`, or its
    failure's `log_tail`; the store keeps one `case.executed` a run); None when the run is not
    recorded as executed or printed nothing."""
    async with acquire(db) as conn:
        row = await conn.fetchrow(
            "SELECT coalesce(body->>'output_tail', body->'result'->'failure'->>'log_tail') AS tail, "
            "coalesce((body->>'attempt')::int, 1) AS attempt FROM events "
            "WHERE run_id = $1 AND type = 'case.executed' ORDER BY stream_seq DESC LIMIT 1",
            run_id,
        )
    return None if row is None or row["tail"] is None else OutputTail(text=row["tail"], attempt=row["attempt"])


async def open_batches_by_supersede_key(db: Database, supersede_key: str) -> list[str]:
    """Batches with this supersede key that are not finalized and not already cancelled, oldest first."""
    async with acquire(db) as conn:
        rows = await conn.fetch(
            "SELECT batch_id FROM batches WHERE supersede_key = $1 AND finalized_at IS NULL "
            "AND cancel_reason IS NULL ORDER BY created_at NULLS LAST, batch_id",
            supersede_key,
        )
    return [str(r["batch_id"]) for r in rows]


async def complete_unfinalized_batches(db: Database) -> list[str]:
    """Every batch whose runs are all sealed but that has no `batch.finalized` yet (a start-up
    sweep, in case a finalisation was lost)."""
    async with acquire(db) as conn:
        query = f"SELECT b.batch_id FROM batches b WHERE {SETTLED} ORDER BY b.batch_id"  # noqa: S608 - constants only
        rows = await conn.fetch(query)
    return [str(r["batch_id"]) for r in rows]


class RebuildOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What `rebuild_read_models` did."""

    events: int
    """Events replayed."""
    undecodable: int
    """Stored events this version cannot decode (kept in `events`, left out of the read models)."""


async def rebuild_read_models(db: Database, *, chunk_size: int = 2000) -> RebuildOutcome:
    """Truncate `batches` and `runs` and derive them again from `events` in sequence order (what
    `evalbus replay` runs). One transaction: readers see the old models until it commits. Seals and
    rejections are not derived data and stay as they are; `runs.sealed` is restored from `seals`."""
    replayed = undecodable = 0
    async with acquire(db) as conn, conn.transaction():
        await conn.execute("SELECT pg_advisory_xact_lock($1)", RECORDER_LOCK)
        await conn.execute("TRUNCATE batches, runs")
        cursor = await conn.cursor("SELECT body::text AS body FROM events ORDER BY stream_seq")
        while True:
            rows = await cursor.fetch(chunk_size)
            if not rows:
                break
            events = []
            for row in rows:
                try:
                    events.append(decode_event(str(row["body"]).encode("utf-8")))
                except DecodeError:
                    undecodable += 1
            await project(conn, events)
            replayed += len(rows)
        await conn.execute("UPDATE runs SET sealed = true FROM seals WHERE seals.run_id = runs.run_id")
    return RebuildOutcome(events=replayed, undecodable=undecodable)
