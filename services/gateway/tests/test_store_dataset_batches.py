"""A batch whose cases are in an uploaded dataset, through the event store: its expected runs come
from the gateway's index (the spec holds no cases), and finalisation decides verdicts with the
dataset's objective metrics exactly as it does for the same cases inline."""

from __future__ import annotations

import uuid
from typing import Any

import asyncpg
import pytest

from evalbus_contracts import (
    BatchRequested,
    BatchSpec,
    CaseExecuted,
    CaseExported,
    CaseJudged,
    CasePlan,
    CaseRequested,
    CaseResult,
    CaseSpec,
    CommandGrader,
    CommandHarness,
    DatasetIndex,
    Event,
    Measured,
    ObjectRef,
    SinkOutcome,
    SuiteSpec,
    batch_run_id,
    encode,
)
from evalbus_gateway.store import RecordedMessage, finalize_batch, get_batch, record

pytestmark = pytest.mark.integration

HARNESS = CommandHarness(id="echo", command=("echo",))
CASES = tuple(
    CaseSpec(id=f"c{i}", input="x", graders=(CommandGrader(id="tests", command="true", metric="tests_ok"),))
    for i in range(3)
)


def events(spec: BatchSpec) -> list[Event]:
    """The batch's events: every case's objective check fails while its judge passes."""
    batch_id = f"b{uuid.uuid4().hex[:8]}"
    out: list[Event] = [BatchRequested(batch_id=batch_id, spec=spec, submitted_by="alice")]
    plan = CasePlan(sinks=spec.sinks)
    for case in CASES:
        ids: dict[str, Any] = {
            "batch_id": batch_id,
            "case_id": case.id,
            "run_id": batch_run_id(batch_id, case.id, None),
        }
        scores = (
            Measured(grader_id="tests", metric="tests_ok", value=0.0, passed=False),
            Measured(grader_id="j", metric="judge:j", value=1.0, passed=True, source="judge"),
        )
        result = CaseResult(case_id=case.id, run_id=ids["run_id"], harness="echo@1", scores=scores)
        out += [
            CaseRequested(**ids, case=case, harness=HARNESS, plan=plan),
            CaseExecuted(**ids, status="succeeded", result=result, plan=plan, case=case),
            CaseJudged(**ids, status="judged", result=result, plan=plan, case=case),
            CaseExported(**ids, status="exported", outcomes=(SinkOutcome(sink="jsonl", status="ok"),)),
        ]
    return out


async def test_a_dataset_batch_finalizes_like_the_same_cases_inline(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    inline = BatchSpec(suite=SuiteSpec(id="s", cases=CASES), harness=HARNESS)
    ref = ObjectRef(bucket="datasets", name="ds-x", size=10, sha256="0" * 64)
    index = DatasetIndex(cases=len(CASES), objective_metrics=("tests_ok",))
    by_ref = BatchSpec(suite=SuiteSpec(id="s", dataset_ref=ref, dataset_index=index), harness=HARNESS)
    summaries = []
    seq = 0
    for spec in (inline, by_ref):
        batch = events(spec)
        messages = []
        for event in batch:
            seq += 1
            messages.append(RecordedMessage(seq, event.subject(), encode(event), event))
        batch_id = batch[0].batch_id or ""
        await record(pool, messages[:1])
        view = await get_batch(pool, batch_id)
        assert view is not None
        assert view.total_runs == len(CASES)
        out = await record(pool, messages[1:])
        assert out.complete_batches == (batch_id,)
        summaries.append((await finalize_batch(pool, batch_id)).summary.verdicts)
    # The objective rung decides (the failed check), not the passing judge, in both.
    assert summaries[0] == summaries[1]
    assert (summaries[1].passed, summaries[1].failed) == (0, len(CASES))
