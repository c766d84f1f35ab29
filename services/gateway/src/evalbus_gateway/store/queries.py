"""Reads for the HTTP API and the CLI, and the rebuild of the read models from `events`.

Views are frozen msgspec Structs so the API can encode them as they are. Run lists page by a
keyset cursor (the last run id of the previous page), stable while runs are added.
"""

from __future__ import annotations

from datetime import datetime
from typing import TYPE_CHECKING, Any, Literal

import msgspec

from evalbus_contracts import (
    BatchError,
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

BatchStatus = Literal["queued", "running", "succeeded", "failed", "cancelled", "superseded"]
Stage = Literal["requested", "executed", "collected", "judged", "exported"]
RunPhase = Literal[
    "queued", "blocked", "starting", "running", "finishing", "lost",
    "executed", "collected", "judged", "exported", "failed", "cancelled",
]  # fmt: skip
"""Where a run is, in one word: its sandbox's placement while it has not settled (`finishing` once
the sandbox is released, `lost` with its dispatcher), then the furthest stage recorded (`failed` or
`cancelled` when its execution was)."""


class LaneWaiting(msgspec.Struct, frozen=True, kw_only=True):
    """A lane of a running batch that no dispatcher serves: its cases wait."""

    lane: str
    """The lane (the harness's, or a case's own)."""
    reason: str
    """Why its cases wait (`no dispatcher serves lane gpu: …`), as their placement says it."""


class BatchView(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A batch as the read model holds it."""

    batch_id: str
    """Batch id."""
    status: BatchStatus
    """Current status (final once `finalized_at` is set)."""
    counts: StageCounts
    """Runs per stage so far."""
    total_runs: int | None = None
    """Runs the batch will have (cases × trials); None until `batch.requested` is recorded."""
    suite_id: str | None = None
    """Suite id."""
    submitted_by: str | None = None
    """Who submitted it."""
    supersede_key: str | None = None
    """Supersede key."""
    trials: int | None = None
    """Trials per case."""
    summary: BatchSummary | None = None
    """Final aggregate."""
    export: ExportSummary | None = None
    """Final export status."""
    error: BatchError | None = None
    """Why it failed."""
    judge_errors: int = 0
    """Runs whose judging escaped with an error."""
    created_at: datetime | None = None
    """`batch.requested` time."""
    finalized_at: datetime | None = None
    """`batch.finalized` time."""
    cancel_reason: Literal["cancelled", "superseded"] | None = None
    """Set once a `batch.cancelled` was recorded."""
    cancelled_by: str | None = None
    """Who cancelled it (or the superseding batch)."""
    superseded_by: str | None = None
    """The batch that superseded it."""
    waiting: tuple[LaneWaiting, ...] = ()
    """Lanes of its cases that no running dispatcher serves, while it runs (read when asked from
    the dispatchers' presence; a dataset's own case lanes are not read, only the harness's)."""


class LiveTraceLink(msgspec.Struct, frozen=True, kw_only=True):
    """Where a running run's trace can be watched on its harness's trace platform."""

    kind: str
    """Platform kind (`otel`, `mlflow`, `langfuse`, `langsmith`, `phoenix`)."""
    endpoint: str
    """Platform base URL, as the harness spec names it."""
    run_id: str
    """The key the platform's trace is found by (the run id the harness was given)."""


class RunView(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """A run as the read model holds it."""

    run_id: str
    """Run id."""
    case_id: str
    """Case id."""
    stage: Stage
    """Furthest stage reached."""
    batch_id: str | None = None
    """Batch id."""
    trial: int | None = None
    """Trial number."""
    attempt: int = 1
    """Latest attempt seen."""
    harness: str | None = None
    """`id@version`."""
    executed_status: Literal["succeeded", "failed", "cancelled"] | None = None
    """Execution outcome."""
    collected: bool = False
    """`case.collected` was recorded."""
    judged_status: Literal["judged", "skipped"] | None = None
    """Judge stage outcome."""
    exported_status: Literal["exported", "partial", "failed", "skipped"] | None = None
    """Export stage outcome."""
    requested_at: datetime | None = None
    """`case.requested` time."""
    executed_at: datetime | None = None
    """`case.executed` time."""
    collected_at: datetime | None = None
    """`case.collected` time."""
    judged_at: datetime | None = None
    """`case.judged` time."""
    exported_at: datetime | None = None
    """`case.exported` time."""
    failure: CaseFailure | None = None
    """Failure, if any."""
    scores: tuple[Score, ...] = ()
    """Scores of the furthest stage."""
    verdict: Literal["pass", "fail"] | None = None
    """Verdict by the ladder."""
    verdict_rung: str | None = None
    """Rung that decided."""
    answer: str | None = None
    """Final answer; null when it was too large to ride in the event (above the inline threshold:
    `GET /v1/runs/{run_id}/trajectory` reads it back from the object store)."""
    judge_error: str | None = None
    """An error that escaped a judge."""
    export_outcomes: tuple[SinkOutcome, ...] = ()
    """Per-sink export outcomes."""
    sandbox_seconds: float | None = None
    """Seconds the compute slot was held."""
    sealed: bool = False
    """The trajectory is sealed."""
    live_trace: LiveTraceLink | None = None
    """While the run is queued or running and its harness exports to a trace platform
    (`GET /v1/runs/{run_id}` only): where to watch its trace live. Gone once the run settles."""
    phase: RunPhase | None = None
    """Where the run is, in one word (`GET /v1/runs/{run_id}` only): its placement phase while it has
    not settled (`queued`, `blocked`, `starting`, `running`, `finishing` once its sandbox is
    released, `lost` with its dispatcher), then its furthest stage (`executed`, `collected`,
    `judged`, `exported`), or `failed` / `cancelled`."""


class RunPage(msgspec.Struct, frozen=True, kw_only=True):
    """One page of runs."""

    runs: tuple[RunView, ...]
    """Runs, by run id."""
    next_cursor: str | None = None
    """Pass as `cursor` for the next page; None on the last page."""


class SealView(msgspec.Struct, frozen=True, kw_only=True):
    """A run's seal."""

    head_hash: str
    """h_n."""
    event_count: int
    """n."""
    first_seq: int
    """First sequence covered."""
    last_seq: int
    """Last sequence covered."""
    sealed_at: datetime
    """When it was sealed."""


class TrajectoryEvent(msgspec.Struct, frozen=True, kw_only=True):
    """One stored event of a run."""

    stream_seq: int
    """Sequence in the CASES stream."""
    subject: str
    """Subject."""
    type: str
    """Event type."""
    ts: datetime
    """Event time."""
    body: msgspec.Raw
    """The stored event, as JSON (with its result's offloaded parts read back in: see `loaded`)."""
    loaded: tuple[str, ...] = ()
    """Result fields filled into `body` from the payload object `result.payload` names, after
    checking it against that reference; in the stored (sealed) body they are empty."""


class Trajectory(msgspec.Struct, frozen=True, kw_only=True):
    """A run's events in order, and its seal once settled."""

    run_id: str
    """Run id."""
    events: tuple[TrajectoryEvent, ...]
    """Events in sequence order."""
    seal: SealView | None = None
    """The seal, when the run is settled."""


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
