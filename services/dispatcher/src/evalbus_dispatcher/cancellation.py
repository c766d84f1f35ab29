"""The cancelled-batch short-circuit (pure): a case of a cancelled or superseded batch is not run,
but still gets its `case.executed`, so every case passes every stage."""

from __future__ import annotations

from typing import Literal

from evalbus_contracts import CaseExecuted, CaseFailure, CaseRequested, CaseResult, CaseTimings, utcnow
from evalbus_dispatcher.execute import run_id_of


def cancelled_execution(
    req: CaseRequested, reason: Literal["cancelled", "superseded"], *, detail: str | None = None
) -> CaseExecuted:
    """`case.executed` with status `cancelled` for a case that will not run."""
    run_id = run_id_of(req)
    message = detail or f"the batch was {reason} before this case started"
    result = CaseResult(
        case_id=req.case.id,
        run_id=run_id,
        harness=f"{req.harness.id}@{req.harness.version}",
        trial=req.trial,
        failure=CaseFailure(stage="dispatch", failure_class="cancelled", code=reason, message=message),
        timings=CaseTimings(executed_at=utcnow()),
    )
    return CaseExecuted(
        batch_id=req.batch_id,
        case_id=req.case_id or req.case.id,
        run_id=run_id,
        attempt=req.attempt,
        status="cancelled",
        result=result,
        plan=req.plan,
        case=req.case,
    )
