"""Fan-out: one `case.requested` per case × trial of a requested batch.

`fan_out` is pure; `fan_out_batch` is its I/O edge, which first reads the cases of a batch whose
suite names an uploaded dataset (`suite.dataset_ref`) from the object store — streamed, the digest
checked before the last chunk is handed over, so a tampered dataset fans out nothing.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec
from nats.errors import Error as NatsError
from nats.js import JetStreamContext

from evalbus_contracts import BatchRequested, CasePlan, CaseRequested, CaseSpec, ObjectRef, batch_run_id, trial_numbers
from evalbus_runtime import Poison, Retry
from evalbus_runtime.objects import ObjectDigestError, ObjectMissingError, ObjectReadError, iter_lines, iter_object


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


def unique_cases(cases: Iterable[CaseSpec]) -> list[CaseSpec]:
    """The cases with repeated ids dropped (the first one wins)."""
    seen: set[str] = set()
    out: list[CaseSpec] = []
    for case in cases:
        if case.id not in seen:
            seen.add(case.id)
            out.append(case)
    return out


def fan_out(req: BatchRequested, cases: Iterable[CaseSpec] | None = None) -> list[CaseRequested]:
    """The batch's runs, case by case, trial by trial (trials numbered 1..k only when k > 1); the
    cases are the suite's inline ones unless given (read from its dataset).

    Run ids are derived (`evb-<batch>-<case>[-t<trial>]`), so a redelivered batch fans out to
    the same runs, and the consumer loop publishes only those the stream does not hold yet.
    """
    if not req.batch_id:
        raise ValueError("a batch request needs a batch id")
    plan = plan_of(req)
    trials = trial_numbers(plan.trials)
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
        for case in unique_cases(req.spec.suite.cases if cases is None else cases)
        for trial in trials
    ]


_CASE = msgspec.json.Decoder(CaseSpec)


async def dataset_cases(js: JetStreamContext, ref: ObjectRef) -> list[CaseSpec]:
    """The cases of an uploaded dataset (JSONL), streamed from its object; `ObjectDigestError` when
    the object is not the one `ref` pins. Decoded leniently, as events are: the gateway checked
    every line strictly when it was uploaded."""
    cases: list[CaseSpec] = []
    async for line in iter_lines(iter_object(js, ref)):
        if line.strip():
            cases.append(_CASE.decode(line))
    return cases


async def fan_out_batch(js: JetStreamContext, req: BatchRequested) -> list[CaseRequested]:
    """`fan_out`, reading the cases from the batch's dataset when it names one. A dataset that is
    gone, tampered with or unreadable is poison (dead-lettered with the reason); a read that stalled
    is retried."""
    ref = req.spec.suite.dataset_ref
    if ref is None:
        return fan_out(req)
    try:
        cases = await dataset_cases(js, ref)
    except (ObjectDigestError, ObjectMissingError) as e:
        raise Poison(f"the dataset of batch {req.batch_id} cannot be used: {e}") from e
    except msgspec.DecodeError as e:
        raise Poison(f"the dataset of batch {req.batch_id} holds a line that is not a case: {e}") from e
    except (ObjectReadError, NatsError) as e:
        raise Retry(f"reading the dataset of batch {req.batch_id} failed: {e}") from e
    return fan_out(req, cases)
