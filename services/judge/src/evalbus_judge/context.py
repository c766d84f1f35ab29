"""What a judge sees (`JudgeContext`), the `Judge` port every implementation satisfies, and the
constructors of the scores judges return (metric `judge:<id>`, source `judge`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from evalbus_contracts import (
    CaseResult,
    Infra,
    Invalid,
    Measured,
    Message,
    PromptSnapshot,
    Score,
    Span,
    TraceEvent,
    Unmeasured,
    UnmeasuredReason,
)

DETAIL_LIMIT = 2000
"""Longest `detail` a judge score carries, in characters."""


@dataclass(frozen=True, slots=True)
class JudgeContext:
    """Everything a judge may look at for one case."""

    run_id: str
    """Run id of the case (or observation) being judged."""
    case_input: str | None
    """The task given to the agent (the case input, else the first user message of the trace)."""
    expected: str | None
    """The expected answer, when the case or observation has one."""
    answer: str | None
    """The agent's final answer (`result.answer`, else a prompt snapshot, else the last assistant message)."""
    trace: tuple[TraceEvent, ...]
    """The trace without infra events and without earlier `judge:*` spans."""
    result: CaseResult
    """The full result as executed (scores so far, snapshot, timings)."""

    @classmethod
    def of(cls, result: CaseResult, *, case_input: str | None, expected: str | None) -> JudgeContext:
        """Build the context for `result`, filling the input and answer from the trace when absent."""
        trace = judge_trace(result.trace)
        return cls(
            run_id=result.run_id,
            case_input=case_input if case_input is not None else first_user_message(trace),
            expected=expected,
            answer=final_answer(result),
            trace=trace,
            result=result,
        )


class Judge(Protocol):
    """A judge: one score for one case. Its own failures are returned as `Unmeasured`, not raised."""

    async def judge(self, ctx: JudgeContext) -> Score:
        """Score the case in `ctx`."""
        ...


def judge_trace(trace: tuple[TraceEvent, ...]) -> tuple[TraceEvent, ...]:
    """The trace a judge sees: no infra marks (they are about the platform, not the agent) and no
    `judge:*` spans (a judge must not grade an earlier judge)."""
    return tuple(
        e for e in trace if not isinstance(e, Infra) and not (isinstance(e, Span) and e.name.startswith("judge:"))
    )


def final_answer(result: CaseResult) -> str | None:
    """The run's answer: `result.answer`, else a prompt snapshot's output, else the last assistant message."""
    if result.answer is not None:
        return result.answer
    if isinstance(result.snapshot, PromptSnapshot):
        return result.snapshot.output
    for event in reversed(result.trace):
        if isinstance(event, Message) and event.role == "assistant":
            return event.text
    return None


def first_user_message(trace: tuple[TraceEvent, ...]) -> str | None:
    """Text of the first user message, the task of an observation that carries no case."""
    for event in trace:
        if isinstance(event, Message) and event.role == "user":
            return event.text
    return None


def judge_metric(judge_id: str) -> str:
    """The metric a judge's score is recorded under."""
    return f"judge:{judge_id}"


def clip(text: str, limit: int = DETAIL_LIMIT) -> str:
    """`text` cut to `limit` characters, marking the cut."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def measured(judge_id: str, value: float, *, passed: bool | None, detail: str | None = None) -> Measured:
    """A measured judge score."""
    return Measured(
        grader_id=judge_id,
        metric=judge_metric(judge_id),
        source="judge",
        value=value,
        passed=passed,
        detail=None if detail is None else clip(detail),
    )


def verdict(judge_id: str, passed: bool, detail: str) -> Measured:
    """A pass/fail rule score: value 1.0 when it passes, 0.0 when it does not."""
    return measured(judge_id, 1.0 if passed else 0.0, passed=passed, detail=detail)


def unmeasured(
    judge_id: str,
    reason: UnmeasuredReason,
    detail: str,
    *,
    retryable: bool = False,
    attempts: int | None = None,
) -> Unmeasured:
    """An honest non-measurement by a judge."""
    return Unmeasured(
        grader_id=judge_id,
        metric=judge_metric(judge_id),
        source="judge",
        reason=reason,
        retryable=retryable,
        attempts=attempts,
        detail=clip(detail),
    )


def invalid(judge_id: str, detail: str) -> Invalid:
    """A judge output that breaks the score contract."""
    return Invalid(grader_id=judge_id, metric=judge_metric(judge_id), source="judge", detail=clip(detail))
