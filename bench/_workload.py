"""Benchmark workloads: a batch request, a realistic run's four case events, the zero-latency
harness and judge."""

from __future__ import annotations

from collections.abc import Sequence

import msgspec
from nats.js import JetStreamContext

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
    CaseTimings,
    CommandHarness,
    ExactJudge,
    JudgeSpec,
    LlmCall,
    Measured,
    Message,
    PromptSnapshot,
    SuiteSpec,
    ToolCall,
    ToolResult,
    batch_run_id,
    utcnow,
)
from evalbus_contracts.codec import encode
from evalbus_contracts.events import EventBase
from evalbus_contracts.objects import DatasetIndex
from evalbus_contracts.streams import DATASETS
from evalbus_runtime.objects import put_object

INLINE_MAX_BYTES = 256 * 1024
"""A benchmark batch larger than this (encoded) goes out as the gateway would send it: its cases
as an uploaded dataset the event names (a stock nats-server refuses events over 1 MB)."""


def case_ids(n_cases: int) -> list[str]:
    """Case ids `c0000…` of a benchmark batch (zero-padded so they sort in order)."""
    width = max(4, len(str(n_cases - 1)))
    return [f"c{i:0{width}d}" for i in range(n_cases)]


def batch_request(
    batch_id: str,
    n_cases: int,
    harness: CommandHarness,
    judges: Sequence[JudgeSpec],
    *,
    expected: str = "4",
) -> BatchRequested:
    """A `batch.requested` of `n_cases` small cases (ids `c0000…`), as the gateway would publish it."""
    cases = tuple(
        CaseSpec(id=case_id, input="What is 2 + 2? Answer with a number only.", expected=expected)
        for case_id in case_ids(n_cases)
    )
    spec = BatchSpec(suite=SuiteSpec(id="bench", cases=cases), harness=harness, judges=tuple(judges))
    return BatchRequested(batch_id=batch_id, spec=spec, submitted_by="bench")


async def with_dataset(js: JetStreamContext, request: BatchRequested) -> BatchRequested:
    """`request` itself when it fits in an event; else its cases put in the `datasets` bucket (one
    `CaseSpec` per line, as `POST /v1/datasets` stores them) and named by `suite.dataset_ref`, with
    the index the gateway would write once it has validated them (the bench's cases carry no
    graders, so no objective metrics)."""
    suite = request.spec.suite
    if len(encode(request)) <= INLINE_MAX_BYTES:
        return request
    lines = b"".join(encode(case) + b"\n" for case in suite.cases)
    ref = await put_object(js, DATASETS, f"bench/{request.batch_id}.jsonl", lines)
    index = DatasetIndex(cases=len({case.id for case in suite.cases}))
    named = msgspec.structs.replace(suite, cases=(), dataset_ref=ref, dataset_index=index)
    return msgspec.structs.replace(request, spec=msgspec.structs.replace(request.spec, suite=named))


def sample_events(batch_id: str, case_id: str, plan: CasePlan, harness: CommandHarness) -> list[EventBase]:
    """One run's case.requested, case.executed, case.judged and case.exported, shaped like the
    pipeline's own (a short agent trace, grader and judge scores)."""
    run_id = batch_run_id(batch_id, case_id)
    case = CaseSpec(id=case_id, input="What is 2 + 2? Answer with a number only.", expected="4")
    now = utcnow()
    trace = (
        Message(t=0.0, role="user", text=case.input),
        LlmCall(t=0.01, model="bench-model", input_tokens=42, output_tokens=7, cost_usd=0.0012, duration_ms=8.0),
        ToolCall(t=0.02, id="t1", name="calculator", args={"expression": "2+2"}),
        ToolResult(t=0.03, id="t1", output="4"),
        Message(t=0.04, role="assistant", text="4"),
    )
    result = CaseResult(
        case_id=case_id,
        run_id=run_id,
        harness=f"{harness.id}@{harness.version}",
        answer="4",
        exit_code=0,
        trace=trace,
        scores=(Measured(grader_id="am", metric="answer_match", value=1.0, passed=True),),
        snapshot=PromptSnapshot(output="4"),
        timings=CaseTimings(
            queued_at=now, started_at=now, released_at=now, executed_at=now, sandbox_seconds=0.01, harness_seconds=0.01
        ),
    )
    judged = msgspec.structs.replace(
        result,
        scores=(
            *result.scores,
            Measured(grader_id="exact", metric="judge:exact", source="judge", value=1.0, passed=True),
        ),
    )
    return [
        CaseRequested(batch_id=batch_id, case_id=case_id, run_id=run_id, case=case, harness=harness, plan=plan),
        CaseExecuted(
            batch_id=batch_id, case_id=case_id, run_id=run_id, status="succeeded", result=result, plan=plan, case=case
        ),
        CaseJudged(
            batch_id=batch_id, case_id=case_id, run_id=run_id, status="judged", result=judged, plan=plan, case=case
        ),
        CaseExported(batch_id=batch_id, case_id=case_id, run_id=run_id, status="skipped"),
    ]


ZERO_HARNESS = CommandHarness(id="echo", command=("/bin/echo", "4"), timeout_s=60.0)
"""The zero-latency harness: a trivial command (still one process spawn per case)."""
RULE_JUDGE: tuple[JudgeSpec, ...] = (ExactJudge(id="exact"),)
"""The zero-latency judge: an exact-match rule."""
