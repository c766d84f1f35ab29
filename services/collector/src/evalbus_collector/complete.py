"""Completing a `control-plane` case: pull its platform trace, append it, grade the observation
graders the dispatcher deferred (the same partition rule and grader code), build `case.collected`.

A missing trace never discards what the sandbox produced: an empty pull (after the retries of
`collect_trace`) appends an `error` event naming the correlation key; a dead endpoint does the same
once the caller gives up retrying; a missing secret makes the deferred graders visibly
`unmeasured: missing_secret` — there is no unauthenticated pull.

In `control-plane` mode the dispatcher leaves the trace as the harness printed it, so the final
answer is made explicit here, as the dispatcher does in `job` mode: when the completed trace has
no assistant message and the run has an answer, the answer is appended as one.
"""

from __future__ import annotations

import msgspec

from evalbus_contracts import CaseCollected, CaseExecuted, Error, GraderSpec, Infra, Message, Score, TraceEvent
from evalbus_grading import Evidence, grade_observations, in_grader_order, unmeasured_scores
from evalbus_traces import CollectOutcome


def deferred_graders(event: CaseExecuted) -> list[GraderSpec]:
    """The graders the dispatcher left to the collector, in grader order."""
    graders = event.case.graders if event.case is not None else ()
    wanted = set(event.deferred_graders)
    return [g for g in graders if g.id in wanted]


def complete(event: CaseExecuted, outcome: CollectOutcome | None, *, degraded: str | None = None) -> CaseCollected:
    """`case.collected` for `event` given what the pull gave (None: no pull possible)."""
    result = event.result
    added: list[TraceEvent] = []
    if outcome is not None:
        # Platform spans are timed from the trace's first span: put them on the run's clock, from
        # the dispatcher's `started` mark, like the events the harness printed.
        offset = _started_t(result.trace)
        added.extend(msgspec.structs.replace(e, t=e.t + offset) for e in outcome.events)
        if outcome.error_event is not None:
            added.append(outcome.error_event)
    if degraded is not None:
        added.append(Error(t=_end(result.trace), message=degraded))
    trace = with_final_answer((*result.trace, *added), result.answer)
    graders = deferred_graders(event)
    expected = event.case.expected if event.case is not None else None
    new_scores: tuple[Score, ...]
    if outcome is not None and outcome.status == "missing_secret":
        new_scores = unmeasured_scores(graders, "missing_secret", outcome.error or "trace secret is not set")
    else:
        new_scores = grade_observations(graders, Evidence(answer=result.answer, trace=trace, expected=expected))
    all_graders = event.case.graders if event.case is not None else ()
    completed = msgspec.structs.replace(
        result, trace=trace, scores=in_grader_order(all_graders, result.scores, new_scores)
    )
    return CaseCollected(
        batch_id=event.batch_id,
        case_id=event.case_id,
        run_id=event.run_id,
        attempt=event.attempt,
        result=completed,
        plan=event.plan,
        case=event.case,
    )


def with_final_answer(trace: tuple[TraceEvent, ...], answer: str | None) -> tuple[TraceEvent, ...]:
    """The trace, with `answer` appended as the last assistant message when it has none."""
    if not answer or any(isinstance(e, Message) and e.role == "assistant" for e in trace):
        return trace
    return (*trace, Message(role="assistant", text=answer, t=_end(trace)))


def _started_t(trace: tuple[TraceEvent, ...]) -> float:
    return next((e.t for e in trace if isinstance(e, Infra) and e.event == "started"), 0.0)


def _end(trace: tuple[TraceEvent, ...]) -> float:
    return max((e.t for e in trace), default=0.0)
