"""The read models as a fold over events: `batches` and `runs` rows from batch and case events.

Shared by the recorder (events just inserted) and `rebuild_read_models` (every stored event). The
fold is written so the result does not depend on how events are chunked or on the order of
different event types: stage columns are first-write-wins, counters add, and a run's result
columns (scores, failure, answer, verdict) come from the furthest stage recorded (executed <
collected < judged), whatever the order in which those events arrive. A chunk's run changes are
merged per run in Python and written with one `unnest` upsert (which also marks the runs the
recorder sealed in the same transaction); batch changes with one pipelined `executemany` per kind.

`Fold` (pure) and `apply_fold` (I/O) are separate so the recorder can fold while PostgreSQL is
busy with its inserts; `project` does both.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Collection, Iterable
from dataclasses import dataclass
from datetime import datetime
from typing import TYPE_CHECKING, Any

from evalbus_contracts import (
    BatchCancelled,
    BatchFinalized,
    BatchRequested,
    CaseCollected,
    CaseExecuted,
    CaseExported,
    CaseJudged,
    CaseRequested,
    Event,
    ObservationFate,
    encode,
)
from evalbus_contracts import expected_runs as contract_expected_runs
from evalbus_grading.verdict import decide, objective_metrics_of

if TYPE_CHECKING:
    from evalbus_gateway.store.connections import Connection

ONLINE_BATCH_PREFIX = "online-"
"""The pseudo-batch of an online suite's judged observations is `online-<suite id>` (the judge's)."""

_ONLINE_FATE = (
    "INSERT INTO online_fates (suite_id, observation_id, fate, reason, detail, trace_id, target, ts)"
    " VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING"
)

RESULT_RANK: dict[str, int] = {"case.executed": 1, "case.collected": 2, "case.judged": 3}
"""Which stage's result a run shows: the furthest recorded."""


def _json(value: Any) -> str:
    return encode(value).decode("utf-8")


def run_id_of(event: Event) -> str | None:
    """The run an event concerns (the envelope's id, else the result's)."""
    if event.run_id:
        return event.run_id
    if isinstance(event, CaseExecuted | CaseCollected | CaseJudged):
        return event.result.run_id
    return None


def expected_runs(event: BatchRequested) -> int:
    """Runs a batch will have (`evalbus_contracts.expected_runs`, the rule the fan-out shares)."""
    return contract_expected_runs(event.spec)


@dataclass(slots=True)
class _Counts:
    requested: int = 0
    executed: int = 0
    collected: int = 0
    judged: int = 0
    exported: int = 0
    failed: int = 0
    cancelled: int = 0
    judge_errors: int = 0

    def row(self, batch_id: str) -> tuple[Any, ...]:
        return (
            batch_id,
            self.requested,
            self.executed,
            self.collected,
            self.judged,
            self.exported,
            self.failed,
            self.cancelled,
            self.judge_errors,
        )


_BATCH_REQUESTED = """
INSERT INTO batches AS b (batch_id, suite_id, submitted_by, supersede_key, spec, trials, total_runs, created_at)
VALUES ($1, $2, $3, $4, $5::jsonb, $6, $7, $8)
ON CONFLICT (batch_id) DO UPDATE SET
    suite_id = EXCLUDED.suite_id,
    submitted_by = EXCLUDED.submitted_by,
    supersede_key = EXCLUDED.supersede_key,
    spec = EXCLUDED.spec,
    trials = EXCLUDED.trials,
    total_runs = EXCLUDED.total_runs,
    created_at = EXCLUDED.created_at
"""

_BATCH_COUNTS = """
INSERT INTO batches AS b (
    batch_id, status, requested_count, executed_count, collected_count, judged_count, exported_count,
    failed_count, cancelled_count, judge_errors)
VALUES ($1, 'running', $2, $3, $4, $5, $6, $7, $8, $9)
ON CONFLICT (batch_id) DO UPDATE SET
    status = CASE WHEN b.status = 'queued' THEN 'running' ELSE b.status END,
    requested_count = b.requested_count + EXCLUDED.requested_count,
    executed_count = b.executed_count + EXCLUDED.executed_count,
    collected_count = b.collected_count + EXCLUDED.collected_count,
    judged_count = b.judged_count + EXCLUDED.judged_count,
    exported_count = b.exported_count + EXCLUDED.exported_count,
    failed_count = b.failed_count + EXCLUDED.failed_count,
    cancelled_count = b.cancelled_count + EXCLUDED.cancelled_count,
    judge_errors = b.judge_errors + EXCLUDED.judge_errors
"""

_BATCH_CANCELLED = """
INSERT INTO batches AS b (batch_id, cancel_reason, cancelled_by, superseded_by)
VALUES ($1, $2, $3, $4)
ON CONFLICT (batch_id) DO UPDATE SET
    cancel_reason = COALESCE(b.cancel_reason, EXCLUDED.cancel_reason),
    cancelled_by = CASE WHEN b.cancel_reason IS NULL THEN EXCLUDED.cancelled_by ELSE b.cancelled_by END,
    superseded_by = CASE WHEN b.cancel_reason IS NULL THEN EXCLUDED.superseded_by ELSE b.superseded_by END
"""

_BATCH_FINALIZED = """
INSERT INTO batches AS b (batch_id, status, summary, export, error, finalized_at)
VALUES ($1, $2, $3::jsonb, $4::jsonb, $5::jsonb, $6)
ON CONFLICT (batch_id) DO UPDATE SET
    status = EXCLUDED.status,
    summary = EXCLUDED.summary,
    export = EXCLUDED.export,
    error = EXCLUDED.error,
    finalized_at = EXCLUDED.finalized_at
WHERE b.finalized_at IS NULL
"""

_RUN_COLUMNS: tuple[tuple[str, str], ...] = (
    ("run_id", "text"),
    ("batch_id", "text"),
    ("case_id", "text"),
    ("trial", "int"),
    ("attempt", "int"),
    ("harness", "text"),
    ("requested_status", "text"),
    ("requested_at", "timestamptz"),
    ("executed_status", "text"),
    ("executed_at", "timestamptz"),
    ("collected_status", "text"),
    ("collected_at", "timestamptz"),
    ("judged_status", "text"),
    ("judged_at", "timestamptz"),
    ("judge_error", "text"),
    ("exported_status", "text"),
    ("exported_at", "timestamptz"),
    ("export_outcomes", "jsonb"),
    ("result_rank", "smallint"),
    ("failure", "jsonb"),
    ("scores", "jsonb"),
    ("answer", "text"),
    ("verdict", "text"),
    ("verdict_rung", "text"),
    ("sandbox_seconds", "float8"),
    ("sealed", "bool"),
)
_FIRST_WINS = (
    "batch_id", "trial", "harness", "requested_status", "requested_at", "executed_status", "executed_at",
    "collected_status", "collected_at", "judged_status", "judged_at", "judge_error", "exported_status",
    "exported_at", "export_outcomes",
)  # fmt: skip
_RESULT = ("failure", "scores", "answer", "verdict", "verdict_rung", "sandbox_seconds")


def _run_upsert_sql() -> str:
    names = [name for name, _ in _RUN_COLUMNS]
    arrays = ", ".join(f"${i}::{'text' if kind == 'jsonb' else kind}[]" for i, (_, kind) in enumerate(_RUN_COLUMNS, 1))
    select = ", ".join(f"u.{name}::jsonb" if kind == "jsonb" else f"u.{name}" for name, kind in _RUN_COLUMNS)
    sets = [f"{c} = COALESCE(r.{c}, EXCLUDED.{c})" for c in _FIRST_WINS]
    sets += [
        "attempt = GREATEST(r.attempt, EXCLUDED.attempt)",
        "result_rank = GREATEST(r.result_rank, EXCLUDED.result_rank)",
        "sealed = r.sealed OR EXCLUDED.sealed",
    ]
    sets += [f"{c} = CASE WHEN EXCLUDED.result_rank > r.result_rank THEN EXCLUDED.{c} ELSE r.{c} END" for c in _RESULT]
    return (
        f"INSERT INTO runs AS r ({', '.join(names)})\n"
        f"SELECT {select}\nFROM unnest({arrays}) AS u({', '.join(names)})\n"
        f"ON CONFLICT (run_id) DO UPDATE SET\n    " + ",\n    ".join(sets)
    )


_RUN_UPSERT = _run_upsert_sql()
"""One statement for every run of a chunk: first write wins for stage columns, the furthest stage
for the result columns (each run appears once: patches are merged in Python first)."""


@dataclass(slots=True)
class _RunPatch:
    """What a chunk of events changes on one run, in `_RUN_COLUMNS` order."""

    run_id: str
    batch_id: str | None = None
    case_id: str = ""
    trial: int | None = None
    attempt: int = 1
    harness: str | None = None
    requested_status: str | None = None
    requested_at: datetime | None = None
    executed_status: str | None = None
    executed_at: datetime | None = None
    collected_status: str | None = None
    collected_at: datetime | None = None
    judged_status: str | None = None
    judged_at: datetime | None = None
    judge_error: str | None = None
    exported_status: str | None = None
    exported_at: datetime | None = None
    export_outcomes: str | None = None
    result_rank: int = 0
    failure: str | None = None
    scores: str | None = None
    answer: str | None = None
    verdict: str | None = None
    verdict_rung: str | None = None
    sandbox_seconds: float | None = None
    sealed: bool = False

    def merge(self, later: _RunPatch) -> None:
        """Fold a patch of a later event into this one (same rules as the SQL upsert)."""
        for name in _FIRST_WINS:
            if getattr(self, name) is None:
                setattr(self, name, getattr(later, name))
        self.case_id = self.case_id or later.case_id
        self.attempt = max(self.attempt, later.attempt)
        self.sealed = self.sealed or later.sealed
        if later.result_rank > self.result_rank:
            self.result_rank = later.result_rank
            for name in _RESULT:
                setattr(self, name, getattr(later, name))

    def values(self) -> tuple[Any, ...]:
        """Column values in `_RUN_COLUMNS` order."""
        return tuple(getattr(self, name) for name, _ in _RUN_COLUMNS)


def _run_patch(
    event: CaseRequested | CaseExecuted | CaseCollected | CaseJudged | CaseExported, run_id: str
) -> _RunPatch:
    """The stage columns one event sets, and its result when it carries one."""
    patch = _RunPatch(run_id=run_id, batch_id=event.batch_id, case_id=event.case_id or "", attempt=event.attempt)
    if isinstance(event, CaseRequested):
        patch.requested_status, patch.requested_at = "requested", event.ts
        patch.trial = event.trial
        patch.harness = f"{event.harness.id}@{event.harness.version}"
        patch.case_id = patch.case_id or event.case.id
        return patch
    if isinstance(event, CaseExported):
        patch.exported_status, patch.exported_at = event.status, event.ts
        patch.export_outcomes = _json(event.outcomes)
        return patch
    if isinstance(event, CaseExecuted):
        patch.executed_status, patch.executed_at = event.status, event.ts
    elif isinstance(event, CaseCollected):
        patch.collected_status, patch.collected_at = "collected", event.ts
    else:
        patch.judged_status, patch.judged_at = event.status, event.ts
        patch.judge_error = event.judge_error
    result = event.result
    patch.result_rank = RESULT_RANK[event.type]
    patch.trial = result.trial
    patch.harness = result.harness
    patch.case_id = patch.case_id or result.case_id
    patch.failure = _json(result.failure) if result.failure is not None else None
    patch.scores = _json(result.scores)
    patch.answer = result.answer
    patch.sandbox_seconds = result.timings.sandbox_seconds
    objective = objective_metrics_of(event.case.graders) if event.case is not None else frozenset()
    cancelled = isinstance(event, CaseExecuted) and event.status == "cancelled"
    decided = decide(result.scores, failure=result.failure, cancelled=cancelled, objective_metrics=objective)
    patch.verdict, patch.verdict_rung = decided.outcome, decided.rung
    return patch


class Fold:
    """What a chunk of events changes in `batches` and `runs`, merged in Python (pure)."""

    __slots__ = ("cancelled", "counts", "fates", "finalized", "requested", "runs")

    def __init__(self) -> None:
        self.fates: list[tuple[Any, ...]] = []
        self.requested: list[tuple[Any, ...]] = []
        self.counts: defaultdict[str, _Counts] = defaultdict(_Counts)
        self.runs: dict[str, _RunPatch] = {}
        self.cancelled: list[tuple[Any, ...]] = []
        self.finalized: list[tuple[Any, ...]] = []

    def add(self, event: Event) -> None:
        """Fold in the next event (events are added in sequence order)."""
        batch_id = event.batch_id
        if isinstance(event, ObservationFate):
            self.fates.append(
                (
                    event.suite_id or "",
                    event.observation_id,
                    event.fate,
                    event.reason,
                    event.detail,
                    event.trace_id,
                    event.target,
                    event.ts,
                )
            )
            return
        if isinstance(event, CaseJudged) and batch_id is not None and batch_id.startswith(ONLINE_BATCH_PREFIX):
            suite_id = batch_id[len(ONLINE_BATCH_PREFIX) :]
            self.fates.append((suite_id, event.case_id or "", "judged", "judged", None, None, None, event.ts))
        if isinstance(event, BatchRequested):
            if batch_id is None:
                return
            spec = event.spec
            self.requested.append(
                (
                    batch_id,
                    spec.suite.id,
                    event.submitted_by,
                    spec.supersede_key,
                    _json(spec),
                    max(1, spec.policy.trials),
                    expected_runs(event),
                    event.ts,
                )
            )
        elif isinstance(event, BatchCancelled):
            if batch_id is not None:
                self.cancelled.append((batch_id, event.reason, event.by, event.superseded_by))
        elif isinstance(event, BatchFinalized):
            if batch_id is not None:
                self.finalized.append(
                    (
                        batch_id,
                        event.status,
                        _json(event.summary),
                        _json(event.export),
                        _json(event.error) if event.error is not None else None,
                        event.ts,
                    )
                )
        elif isinstance(event, CaseRequested | CaseExecuted | CaseCollected | CaseJudged | CaseExported):
            run_id = run_id_of(event)
            if run_id is None:
                return
            patch = _run_patch(event, run_id)
            if run_id in self.runs:
                self.runs[run_id].merge(patch)
            else:
                self.runs[run_id] = patch
            if batch_id is not None:
                self._count(self.counts[batch_id], event)

    @staticmethod
    def _count(
        counts: _Counts, event: CaseRequested | CaseExecuted | CaseCollected | CaseJudged | CaseExported
    ) -> None:
        if isinstance(event, CaseRequested):
            counts.requested += 1
        elif isinstance(event, CaseExecuted):
            counts.executed += 1
            counts.failed += event.status == "failed"
            counts.cancelled += event.status == "cancelled"
        elif isinstance(event, CaseCollected):
            counts.collected += 1
        elif isinstance(event, CaseJudged):
            counts.judged += 1
            counts.judge_errors += event.judge_error is not None
        else:
            counts.exported += 1


def fold(events: Iterable[Event]) -> Fold:
    """The fold of `events` (in sequence order)."""
    folded = Fold()
    for event in events:
        folded.add(event)
    return folded


async def apply_fold(conn: Connection, folded: Fold, *, sealed_runs: Collection[str] = ()) -> None:
    """Write a fold to `batches` and `runs`, and mark the runs of `sealed_runs` sealed."""
    if folded.requested:
        await conn.executemany(_BATCH_REQUESTED, folded.requested)
    if folded.counts:
        await conn.executemany(_BATCH_COUNTS, [c.row(b) for b, c in sorted(folded.counts.items())])
    unfolded: list[str] = []
    for run_id in sealed_runs:
        if run_id in folded.runs:
            folded.runs[run_id].sealed = True
        else:  # all its stages stored but unsealed (by an older recorder): settled by any later event of it
            unfolded.append(run_id)
    if folded.runs:
        rows = [folded.runs[run_id].values() for run_id in sorted(folded.runs)]
        await conn.execute(_RUN_UPSERT, *[list(column) for column in zip(*rows, strict=True)])
    if unfolded:
        await conn.execute("UPDATE runs SET sealed = true WHERE run_id = ANY($1::text[])", sorted(unfolded))
    if folded.cancelled:
        await conn.executemany(_BATCH_CANCELLED, folded.cancelled)
    if folded.finalized:
        await conn.executemany(_BATCH_FINALIZED, folded.finalized)
    if folded.fates:
        await conn.executemany(_ONLINE_FATE, folded.fates)


async def project(conn: Connection, events: Iterable[Event]) -> None:
    """Apply `events` (newly stored, in sequence order) to `batches` and `runs`."""
    await apply_fold(conn, fold(events))
