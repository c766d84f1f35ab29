"""The judge stage: from a ready case event to its `case.judged` event.

Pure of the bus: the chassis decodes the message, calls `judge_event`, publishes what it returns
(nothing for a `case.executed` whose trace the collector still has to complete) and acks.

- A case that produced no outcome (cancelled, or failed at dispatch or install, or failed to run
  without an answer) is `skipped`, its result unchanged, so completion stays "every case exported".
- Otherwise the batch's judges run one after another in selection order, so scores land in a
  deterministic order after the grader scores. A judge's own failure — raised or returned — is an
  `unmeasured` score. Only an exception of the machinery around the judges (resolution, a
  `JudgeMachineryError`) is recorded as `judge_error`, which marks the batch `error.phase = "judges"`.
- An observation (`case.observed`, online evaluation) is judged the same way and published as a
  case of the pseudo-batch `online-<suite id>` with the observation id as case id and the event's
  run id; its `case` is synthesised from the first user message and the reference answer.
- An observation is judged once, whenever it is: so a judge that could not score it for a reason
  that may pass (an `unmeasured` score marked `retryable` — a provider answering 5xx or timing out
  past its own retries) does not make it judged-with-an-error. `observation_retry_delay` says
  when to judge it again (the service naks it with that delay: JetStream holds it meanwhile); only
  on its last delivery is the error recorded as its result.
- An observation of a suite with a daily budget (`budget_usd_per_day`) has its model judges called
  only while the suite's spend today is under it (`budget.py`); past it they are not called, its
  fate is `skipped: over_budget`, and its other judges still run (their case is judged, the model
  judges' scores `unmeasured: policy_skip`). A suite of model judges only is then not judged at all.
  What the calls cost is added to the day's spend. A batch's cases have no budget.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from typing import Literal

import msgspec

from evalbus_contracts import (
    CaseCollected,
    CaseExecuted,
    CaseJudged,
    CaseObserved,
    CasePlan,
    CaseResult,
    CaseSpec,
    Invalid,
    Measured,
    ObservationFate,
    Score,
    Unmeasured,
)
from evalbus_judge.budget import MICRO, Spend
from evalbus_judge.context import JudgeContext, first_user_message, judge_metric, unmeasured
from evalbus_judge.errors import JudgeMachineryError
from evalbus_judge.registry import JudgeRegistry, ResolvedJudge

log = logging.getLogger(__name__)

PRE_OUTCOME_STAGES = frozenset({"dispatch", "install"})
"""Failure stages that leave no outcome to judge."""
DEFAULT_JUDGE_TIMEOUT_S = 900.0
"""Longest one judge may take on one case before it is `unmeasured: grader_timeout`."""
OBSERVATION_RETRY_S = (2.0, 30.0)
"""First and longest wait before an observation is judged again after a retryable failure
(doubling per delivery: with 5 deliveries about 30 s of waits, past the model judge's own retries)."""

JudgedStatus = Literal["judged", "skipped"]
"""Status of a `case.judged` event."""
ReadyEvent = CaseExecuted | CaseCollected | CaseObserved
"""The events the judge stage consumes."""


@dataclass(frozen=True, slots=True)
class JudgeOutcome:
    """What judging one ready event yields."""

    judged: CaseJudged | None
    """The `case.judged` event (None: the collector will complete the case, or an observation
    none of whose judges could run within its suite's budget)."""
    fates: tuple[ObservationFate, ...] = ()
    """Observation fates decided here (`skipped: over_budget`)."""


@dataclass(frozen=True, slots=True)
class _Case:
    """A ready case, whatever event brought it."""

    batch_id: str
    case_id: str
    run_id: str
    attempt: int
    result: CaseResult
    plan: CasePlan
    case: CaseSpec | None
    judgeable: bool


def online_batch_id(suite_id: str) -> str:
    """The pseudo-batch an online suite's judged observations belong to."""
    return f"online-{suite_id}"


def has_outcome(result: CaseResult, *, cancelled: bool = False) -> bool:
    """Whether execution produced something to judge: not cancelled, not failed before running,
    and a run failure only when it still left an answer. Collect and grade failures keep the outcome."""
    if cancelled:
        return False
    failure = result.failure
    if failure is None:
        return True
    if failure.failure_class == "cancelled" or failure.stage in PRE_OUTCOME_STAGES:
        return False
    if failure.stage == "run":
        return result.answer is not None
    return True


def _ready_case(event: ReadyEvent) -> _Case | None:
    match event:
        case CaseExecuted() | CaseCollected():
            if isinstance(event, CaseExecuted) and not event.trace_complete:
                return None
            cancelled = isinstance(event, CaseExecuted) and event.status == "cancelled"
            return _Case(
                batch_id=_required(event.batch_id, "batch_id"),
                case_id=_required(event.case_id, "case_id"),
                run_id=event.run_id or event.result.run_id,
                attempt=event.attempt,
                result=event.result,
                plan=event.plan,
                case=event.case,
                judgeable=has_outcome(event.result, cancelled=cancelled),
            )
        case CaseObserved():
            task = first_user_message(event.result.trace)
            return _Case(
                batch_id=online_batch_id(event.suite_id),
                case_id=event.observation_id,
                run_id=event.run_id or event.result.run_id,
                attempt=event.attempt,
                result=event.result,
                plan=event.plan,
                case=CaseSpec(id=event.observation_id, input=task or "", expected=event.expected),
                judgeable=True,
            )


def _required(value: str | None, name: str) -> str:
    if not value:
        raise ValueError(f"a case event without {name} cannot be judged")
    return value


async def judge_event(
    event: ReadyEvent,
    registry: JudgeRegistry,
    *,
    judge_timeout_s: float | None = DEFAULT_JUDGE_TIMEOUT_S,
) -> CaseJudged | None:
    """The `case.judged` event for a ready case, or None for a `case.executed` the collector will
    complete (ignore and ack it). Raises only `ValueError` for an event without its ids (poison).
    No budget is applied (see `judge_ready`)."""
    return (await judge_ready(event, registry, judge_timeout_s=judge_timeout_s)).judged


async def judge_ready(
    event: ReadyEvent,
    registry: JudgeRegistry,
    *,
    spend: Spend | None = None,
    judge_timeout_s: float | None = DEFAULT_JUDGE_TIMEOUT_S,
) -> JudgeOutcome:
    """Judge a ready event, holding an observation's model judges to its suite's daily budget
    (read and counted in `spend`; None: no budget is applied). Raises `ValueError` for an event
    without its ids (poison) and `BudgetUnavailableError` when the spend cannot be read (retry)."""
    ready = _ready_case(event)
    if ready is None:
        return JudgeOutcome(None)
    if not ready.judgeable:
        return JudgeOutcome(_judged(ready, "skipped", ready.result, None))
    case_input = ready.case.input if ready.case is not None and ready.case.input else None
    expected = ready.case.expected if ready.case is not None else None
    scores: list[Score] = []
    fates: tuple[ObservationFate, ...] = ()
    judge_error: str | None = None
    try:
        resolved = registry.resolve(ready.plan.judges, batch_id=ready.batch_id)
    except Exception as e:
        log.exception("judge machinery failed on run %s", ready.run_id)
        resolved, judge_error = None, f"{type(e).__name__}: {e}"
    over: str | None = None
    if resolved is not None and spend is not None and isinstance(event, CaseObserved):
        over = await _over_budget(event, resolved.judges, spend)
    if resolved is not None and over is not None:
        budgeted = [j.judge_id for j in resolved.judges if _budgeted(j)]
        others = len(resolved.judges) > len(budgeted)
        detail = f"{over}; model judges not called: {', '.join(budgeted)}" + ("; the others ran" if others else "")
        assert isinstance(event, CaseObserved)
        fates = (_over_budget_fate(event, detail),)
        if not others:
            return JudgeOutcome(None, fates)
    try:
        if resolved is not None:
            ctx = JudgeContext.of(ready.result, case_input=case_input, expected=expected)
            for entry in resolved.judges:
                if over is not None and _budgeted(entry):
                    scores.append(unmeasured(entry.judge_id, "policy_skip", f"not called: {over}"))
                    continue
                scores.append(await run_judge(entry, ctx, timeout_s=judge_timeout_s))
    except Exception as e:
        # Not a judge's own failure: the machinery is broken, so the scores so far are kept and
        # the rest of the judges are not run; `judge_error` marks the batch `error.phase = judges`.
        log.exception("judge machinery failed on run %s", ready.run_id)
        judge_error = f"{type(e).__name__}: {e}"
    if spend is not None and isinstance(event, CaseObserved) and event.budget_usd_per_day is not None:
        await _count_spend(spend, event.suite_id, scores)
    result = msgspec.structs.replace(ready.result, scores=(*ready.result.scores, *scores))
    return JudgeOutcome(_judged(ready, "judged", result, judge_error), fates)


def unreadable_payload(event: ReadyEvent, reason: str) -> CaseJudged | None:
    """The `case.judged` of a ready case whose offloaded payload could not be read as its reference
    pins (tampered with, replaced or gone): nothing is judged on other bytes — every judge of the
    batch is `unmeasured: missing_evidence` with the reason, and `judge_error` makes it visible on
    the batch. None for an event the judge would not judge anyway. Raises `ValueError` like
    `judge_ready` for an event without its ids."""
    ready = _ready_case(event)
    if ready is None:
        return None
    detail = f"the run's payload could not be read: {reason}"
    scores = tuple(unmeasured(spec.id, "missing_evidence", detail) for spec in ready.plan.judges)
    result = msgspec.structs.replace(ready.result, scores=(*ready.result.scores, *scores))
    return _judged(ready, "judged", result, detail)


def _budgeted(entry: ResolvedJudge) -> bool:
    """A judge whose calls cost money (a model judge, an embedding judge on an endpoint)."""
    return entry.resolved and bool(getattr(entry.judge, "spends", False))


async def _over_budget(event: CaseObserved, judges: tuple[ResolvedJudge, ...], spend: Spend) -> str | None:
    """Why the observation's model judges may not be called today, or None while the budget has room."""
    budget = event.budget_usd_per_day
    if budget is None or not any(_budgeted(j) for j in judges):
        return None
    spent = await spend.spent(event.suite_id)
    if round(spent * MICRO) < round(budget * MICRO):  # compared in whole micro-dollars, as counted
        return None
    return f"the suite's daily budget is spent (${spent:.6g} of ${budget:.6g} today, UTC)"


def _over_budget_fate(event: CaseObserved, detail: str) -> ObservationFate:
    return ObservationFate(
        observation_id=event.observation_id,
        suite_id=event.suite_id,
        fate="skipped",
        reason="over_budget",
        detail=detail,
    )


async def _count_spend(spend: Spend, suite_id: str, scores: list[Score]) -> None:
    """Add what the scores' model calls cost to the suite's day; a failure is logged, not raised
    (the calls are made: judging them again would spend twice)."""
    cost = sum(s.usage.cost_usd for s in scores if s.usage is not None and s.usage.cost_usd is not None)
    if cost <= 0:
        return
    try:
        await spend.add(suite_id, cost)
    except Exception as e:
        log.warning("could not count %.6f USD against suite %s's budget: %s", cost, suite_id, e)


async def run_judge(entry: ResolvedJudge, ctx: JudgeContext, *, timeout_s: float | None) -> Score:
    """One judge on one case. Its own exceptions and overruns become `unmeasured` scores; a
    `JudgeMachineryError` propagates. The score is stamped with the judge's id, metric and source."""
    judge_id = entry.judge_id
    deadline = asyncio.timeout(timeout_s)
    try:
        async with deadline:
            score: object = await entry.judge.judge(ctx)
    except JudgeMachineryError:
        raise
    except TimeoutError as e:
        detail = f"judge took longer than {timeout_s:g} s" if deadline.expired() else f"timed out: {e}"
        return unmeasured(judge_id, "grader_timeout", detail, retryable=True)
    except Exception as e:
        log.warning("judge %s raised on run %s: %s", judge_id, ctx.run_id, type(e).__name__)
        return unmeasured(judge_id, "grader_error", f"{type(e).__name__}: {e}", retryable=True)
    if not isinstance(score, Measured | Unmeasured | Invalid):
        return Invalid(
            grader_id=judge_id,
            metric=judge_metric(judge_id),
            source="judge",
            detail=f"judge returned {type(score).__name__}, not a score",
        )
    return msgspec.structs.replace(score, grader_id=judge_id, metric=judge_metric(judge_id), source="judge")


def observation_retry_delay(
    event: ReadyEvent, judged: CaseJudged | None, *, num_delivered: int, max_deliver: int
) -> float | None:
    """Seconds after which to judge an observation again, or None to publish `judged` as it is:
    an observation (not a batch's case, whose errors are its data) with a retryable `unmeasured`
    judge score, on any delivery but its last (`max_deliver` < 1: unlimited)."""
    if not isinstance(event, CaseObserved) or judged is None or judged.judge_error is not None:
        return None
    if 0 < max_deliver <= num_delivered:
        return None
    retryable = any(isinstance(s, Unmeasured) and s.retryable and s.source == "judge" for s in judged.result.scores)
    if not retryable:
        return None
    first, longest = OBSERVATION_RETRY_S
    return float(min(longest, first * 2 ** max(0, num_delivered - 1)))


def _judged(ready: _Case, status: JudgedStatus, result: CaseResult, judge_error: str | None) -> CaseJudged:
    return CaseJudged(
        batch_id=ready.batch_id,
        case_id=ready.case_id,
        run_id=ready.run_id,
        attempt=ready.attempt,
        status=status,
        result=result,
        plan=ready.plan,
        case=ready.case,
        judge_error=judge_error,
    )
