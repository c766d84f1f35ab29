"""Fan-out (pure): one `case.requested` per case × trial of a requested batch."""

from __future__ import annotations

from evalbus_contracts import BatchRequested, CasePlan, CaseRequested, CaseSpec, batch_run_id


def plan_of(req: BatchRequested) -> CasePlan:
    """What every case of the batch carries forward for the later stages."""
    spec = req.spec
    return CasePlan(
        judges=spec.judges,
        sinks=spec.sinks,
        retries=spec.policy.retries,
        trials=max(1, spec.policy.trials),
        labels=dict(spec.labels),
        suite_id=spec.suite.id,
        submitted_by=req.submitted_by,
    )


def unique_cases(cases: tuple[CaseSpec, ...]) -> list[CaseSpec]:
    """The cases with repeated ids dropped (the first one wins)."""
    seen: set[str] = set()
    out: list[CaseSpec] = []
    for case in cases:
        if case.id not in seen:
            seen.add(case.id)
            out.append(case)
    return out


def fan_out(req: BatchRequested) -> list[CaseRequested]:
    """The batch's runs, case by case, trial by trial (trials numbered 1..k only when k > 1).

    Run ids are derived (`evb-<batch>-<case>[-t<trial>]`), so a redelivered batch fans out to
    the same runs and JetStream's duplicate window drops the repeats.
    """
    if not req.batch_id:
        raise ValueError("a batch request needs a batch id")
    plan = plan_of(req)
    trials: list[int | None] = list(range(1, plan.trials + 1)) if plan.trials > 1 else [None]
    return [
        CaseRequested(
            batch_id=req.batch_id,
            case_id=case.id,
            run_id=batch_run_id(req.batch_id, case.id, trial),
            trial=trial,
            case=case,
            harness=req.spec.harness,
            plan=plan,
        )
        for case in unique_cases(req.spec.suite.cases)
        for trial in trials
    ]
