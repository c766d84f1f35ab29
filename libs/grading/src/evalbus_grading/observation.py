"""Observation-only graders: pure functions of the evidence (answer, trace, expected).

They never touch the sandbox, so they run after it is released — in the dispatcher (`job`
collect mode) or in the collector (`control-plane` mode). Each returns exactly one score and
never raises: an unexpected error becomes an `unmeasured` score with reason `grader_error`.
"""

from __future__ import annotations

import math
import re
import unicodedata

from evalbus_contracts import (
    AnswerMatchGrader,
    CostGrader,
    Infra,
    LatencyGrader,
    LlmCall,
    Measured,
    Score,
    StepsGrader,
    TextMetricGrader,
    ToolCall,
    Unmeasured,
)
from evalbus_grading.evidence import Evidence
from evalbus_grading.metrics import metric_of

ObservationGrader = AnswerMatchGrader | TextMetricGrader | StepsGrader | CostGrader | LatencyGrader
"""The grader kinds that only read observations."""

_WHITESPACE = re.compile(r"\s+")


def normalize_text(text: str) -> str:
    """Case-folded, punctuation removed, whitespace collapsed and stripped."""
    folded = text.casefold()
    no_punct = "".join(ch for ch in folded if not unicodedata.category(ch).startswith("P"))
    return _WHITESPACE.sub(" ", no_punct).strip()


def grade_answer_match(grader: AnswerMatchGrader, evidence: Evidence) -> Score:
    """The final answer against `expected`: exact, contains or normalized equality.

    An empty (or absent) expected answer fails: nothing can be matched against it.
    """
    metric = metric_of(grader)
    expected = evidence.expected
    if expected is None or expected == "":
        return _verdict(grader.id, metric, passed=False, detail="the case has no expected answer")
    answer = evidence.final_answer()
    if answer is None:
        return _verdict(grader.id, metric, passed=False, detail="the run produced no answer")
    if grader.mode == "exact":
        passed = answer == expected
    elif grader.mode == "contains":
        passed = expected in answer
    else:
        want = normalize_text(expected)
        if not want:
            return _verdict(grader.id, metric, passed=False, detail="the expected answer normalizes to nothing")
        passed = normalize_text(answer) == want
    return _verdict(grader.id, metric, passed=passed, detail=f"{grader.mode} match")


def grade_text_metric(grader: TextMetricGrader, evidence: Evidence) -> Score:
    """Group 1 of `pattern` in the final answer, as a number (an observation: no pass)."""
    metric = metric_of(grader)
    answer = evidence.final_answer()
    if answer is None:
        return _missing(grader.id, metric, "the run produced no answer")
    try:
        match = re.search(grader.pattern, answer)
    except re.error as e:
        return Unmeasured(grader_id=grader.id, metric=metric, reason="grader_error", detail=f"bad pattern: {e}")
    if match is None:
        return _missing(grader.id, metric, "pattern did not match the answer")
    if match.re.groups < 1:
        return Unmeasured(
            grader_id=grader.id, metric=metric, reason="grader_error", detail="pattern has no capture group"
        )
    value = _finite_float(match.group(1))
    if value is None:
        return _missing(grader.id, metric, f"captured {match.group(1)!r} is not a number")
    return Measured(grader_id=grader.id, metric=metric, value=value)


def grade_steps(grader: StepsGrader, evidence: Evidence) -> Score:
    """The number of `tool_call` events; passes when at most `max_steps` (if set)."""
    count = sum(1 for event in evidence.trace if isinstance(event, ToolCall))
    passed = None if grader.max_steps is None else count <= grader.max_steps
    return Measured(grader_id=grader.id, metric=metric_of(grader), value=float(count), passed=passed)


def grade_cost(grader: CostGrader, evidence: Evidence) -> Score:
    """The sum of `llm_call.cost_usd`; unmeasured when no call carries a cost.

    With `max_usd` set the score carries pass/fail; cost never decides a verdict either way.
    """
    metric = metric_of(grader)
    costs = [e.cost_usd for e in evidence.trace if isinstance(e, LlmCall) and e.cost_usd is not None]
    if not costs:
        return _missing(grader.id, metric, "no llm_call event carries a cost")
    total = math.fsum(costs)
    if not math.isfinite(total):
        return _missing(grader.id, metric, "llm_call costs are not finite")
    passed = None if grader.max_usd is None else total <= grader.max_usd
    return Measured(grader_id=grader.id, metric=metric, value=total, passed=passed)


def grade_latency(grader: LatencyGrader, evidence: Evidence) -> Score:
    """Seconds from the first to the last trace event (infra marks excluded: they are not the run)."""
    metric = metric_of(grader)
    times = [e.t for e in evidence.trace if not isinstance(e, Infra) and math.isfinite(e.t)]
    if not times:
        return _missing(grader.id, metric, "the trace has no timed events")
    value = max(times) - min(times)
    passed = None if grader.max_s is None else value <= grader.max_s
    return Measured(grader_id=grader.id, metric=metric, value=value, passed=passed)


def grade_observation(grader: ObservationGrader, evidence: Evidence) -> Score:
    """Grade one observation-only grader; never raises."""
    try:
        match grader:
            case AnswerMatchGrader():
                return grade_answer_match(grader, evidence)
            case TextMetricGrader():
                return grade_text_metric(grader, evidence)
            case StepsGrader():
                return grade_steps(grader, evidence)
            case CostGrader():
                return grade_cost(grader, evidence)
            case LatencyGrader():
                return grade_latency(grader, evidence)
    except Exception as e:  # a grader never raises: the error is the score
        return Unmeasured(
            grader_id=grader.id,
            metric=metric_of(grader),
            reason="grader_error",
            detail=f"{type(e).__name__}: {e}",
        )


def _verdict(grader_id: str, metric: str, *, passed: bool, detail: str) -> Measured:
    return Measured(grader_id=grader_id, metric=metric, value=1.0 if passed else 0.0, passed=passed, detail=detail)


def _missing(grader_id: str, metric: str, detail: str) -> Unmeasured:
    return Unmeasured(grader_id=grader_id, metric=metric, reason="missing_evidence", detail=detail)


def _finite_float(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        return None
    return value if math.isfinite(value) else None
