"""Batches, runs and trajectories as the HTTP API serves them (the gateway's read-model views).

Frozen msgspec Structs, so the gateway encodes them as they are and the client decodes them.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

from evalbus_contracts import BatchError, BatchSummary, CaseFailure, ExportSummary, Score, SinkOutcome, StageCounts

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
