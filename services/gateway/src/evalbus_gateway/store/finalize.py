"""Build a batch's `batch.finalized` event from the read models (the caller publishes it).

The I/O edge of `evalbus_gateway.aggregate`: it reads the batch's spec (trials, sinks, each case's
objective grader metrics), its cancel reason and its runs, and hands them to the pure
`build_finalized` (run in a worker thread).
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from evalbus_contracts import BatchFinalized, BatchSpec, CaseFailure, Score, SinkOutcome, decode
from evalbus_gateway.aggregate import RunOutcome, build_finalized
from evalbus_gateway.store.connections import snapshot
from evalbus_gateway.store.errors import BatchNotFoundError
from evalbus_grading.verdict import objective_metrics_of

if TYPE_CHECKING:
    import asyncpg

    from evalbus_gateway.store.connections import Database


def run_outcome(row: asyncpg.Record, objective: dict[str, frozenset[str]]) -> RunOutcome:
    """A `runs` row as the aggregate's input."""
    case_id = str(row["case_id"])
    return RunOutcome(
        run_id=row["run_id"],
        case_id=case_id,
        trial=row["trial"],
        requested=row["requested_status"] is not None,
        executed_status=row["executed_status"],
        collected=row["collected_status"] is not None,
        judged_status=row["judged_status"],
        exported_status=row["exported_status"],
        failure=None if row["failure"] is None else decode(row["failure"], CaseFailure),
        scores=() if row["scores"] is None else decode(row["scores"], tuple[Score, ...]),
        judge_error=row["judge_error"],
        export_outcomes=()
        if row["export_outcomes"] is None
        else decode(row["export_outcomes"], tuple[SinkOutcome, ...]),
        objective_metrics=objective.get(case_id, frozenset()),
    )


async def finalize_batch(db: Database, batch_id: str) -> BatchFinalized:
    """The `batch.finalized` event of a batch, from what the store holds now.

    Raises `BatchNotFoundError` when no `batch.requested` was recorded for it.
    """
    async with snapshot(db) as conn:
        batch = await conn.fetchrow(
            "SELECT spec::text AS spec, trials, cancel_reason FROM batches WHERE batch_id = $1", batch_id
        )
        if batch is None or batch["spec"] is None:
            raise BatchNotFoundError(batch_id)
        rows = await conn.fetch("SELECT * FROM runs WHERE batch_id = $1 ORDER BY run_id", batch_id)
    spec = decode(str(batch["spec"]), BatchSpec)
    objective = {case.id: objective_metrics_of(case.graders) for case in spec.suite.cases}
    if spec.suite.dataset_index is not None:
        # The cases are in the dataset object, not the spec: every run gets the dataset's objective
        # metrics (a case's own are a subset; docs/api.md#datasets).
        dataset_objective = frozenset(spec.suite.dataset_index.objective_metrics)
        objective = {str(r["case_id"]): dataset_objective for r in rows}
    runs = [run_outcome(r, objective) for r in rows]
    # In a thread: the bootstrap intervals of a large batch take a moment of CPU, which the event
    # loop (recording, serving) should not wait for.
    return await asyncio.to_thread(
        build_finalized,
        batch_id,
        runs,
        trials=batch["trials"],
        has_sinks=bool(spec.sinks),
        cancel_reason=batch["cancel_reason"],
    )
