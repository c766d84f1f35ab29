"""The judge stage: which events are judged, skipped or ignored, in what order, and how errors land."""

from __future__ import annotations

import asyncio
from typing import Literal

import msgspec
import pytest

from evalbus_contracts import (
    CaseCollected,
    CaseExecuted,
    CaseFailure,
    CaseJudged,
    CaseObserved,
    CasePlan,
    CaseResult,
    CaseSpec,
    ContainsJudge,
    ExactJudge,
    Infra,
    Invalid,
    JudgeSpec,
    Measured,
    Message,
    NumericJudge,
    RegexJudge,
    RegisteredJudge,
    Score,
    Span,
    Unmeasured,
    decode_event,
    encode,
)
from evalbus_judge import Judge, JudgeContext, JudgeMachineryError, JudgeRegistry, judge_event
from evalbus_judge.apply import observation_retry_delay, unreadable_payload
from evalbus_judge.context import verdict

pytestmark = pytest.mark.unit

GRADER_SCORE = Measured(grader_id="am", metric="answer_match", value=1.0, passed=True)
TRACE = (
    Infra(scope="placement", event="accepted", message="accepted"),
    Message(t=0.1, role="user", text="What is 6 x 7?"),
    Span(t=0.2, name="judge:old", attributes={"score": "1"}),
    Message(t=1.0, role="assistant", text="The answer is 42."),
    Infra(scope="placement", event="released", message="released"),
)


def result(answer: str | None = "The answer is 42.", failure: CaseFailure | None = None) -> CaseResult:
    return CaseResult(
        case_id="c1",
        run_id="evb-b1-c1",
        harness="h@1",
        answer=answer,
        trace=TRACE,
        scores=(GRADER_SCORE,),
        failure=failure,
    )


CASE = CaseSpec(id="c1", input="What is 6 x 7?", expected="42")


def executed(
    judges: tuple[JudgeSpec, ...],
    *,
    status: Literal["succeeded", "failed", "cancelled"] = "succeeded",
    res: CaseResult | None = None,
    trace_complete: bool = True,
    batch_id: str = "b1",
) -> CaseExecuted:
    return CaseExecuted(
        batch_id=batch_id,
        case_id="c1",
        run_id="evb-b1-c1",
        attempt=2,
        status=status,
        result=res or result(),
        plan=CasePlan(judges=judges, suite_id="s1", labels={"team": "a"}),
        case=CASE,
        trace_complete=trace_complete,
    )


class Recorder:
    """Custom judges that record when they run and whether two ever overlap."""

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.contexts: list[JudgeContext] = []
        self.active = 0
        self.max_active = 0

    def factory(self, spec: RegisteredJudge) -> Judge:
        recorder = self
        yields = int(spec.params.get("yields", "0"))

        class Recording:
            async def judge(self, ctx: JudgeContext) -> Score:
                recorder.active += 1
                recorder.max_active = max(recorder.max_active, recorder.active)
                recorder.calls.append(spec.id)
                recorder.contexts.append(ctx)
                for _ in range(yields):  # give other tasks every chance to interleave
                    await asyncio.sleep(0)
                recorder.active -= 1
                return verdict(spec.id, True, "recorded")

        return Recording()


def registry_with(recorder: Recorder | None = None) -> JudgeRegistry:
    registry = JudgeRegistry()
    if recorder is not None:
        registry.register("record", recorder.factory)
    return registry


def metrics(judged: CaseJudged | None) -> list[str]:
    assert judged is not None
    return [s.metric for s in judged.result.scores]


# ---------------------------------------------------------------- which events


async def test_incomplete_trace_is_ignored() -> None:
    event = executed((ExactJudge(id="e"),), trace_complete=False)
    assert await judge_event(event, registry_with()) is None


@pytest.mark.parametrize(
    ("status", "failure", "answer"),
    [
        ("failed", CaseFailure(stage="dispatch", failure_class="infra", code="no_capacity", message="m"), None),
        ("failed", CaseFailure(stage="install", failure_class="config", code="bad_image", message="m"), None),
        ("failed", CaseFailure(stage="run", failure_class="harness", code="spawn_failed", message="m"), None),
        ("failed", CaseFailure(stage="run", failure_class="cancelled", code="cancelled", message="m"), "partial"),
        ("cancelled", None, None),
        ("cancelled", None, "an answer from before the cancel"),
    ],
)
async def test_case_without_outcome_is_skipped(
    status: Literal["failed", "cancelled"], failure: CaseFailure | None, answer: str | None
) -> None:
    recorder = Recorder()
    res = result(answer=answer, failure=failure)
    event = executed((RegisteredJudge(id="r", name="record"),), status=status, res=res)
    judged = await judge_event(event, registry_with(recorder))
    assert judged is not None
    assert judged.status == "skipped"
    assert judged.result == res
    assert recorder.calls == []
    assert judged.judge_error is None


@pytest.mark.parametrize(
    ("failure", "answer"),
    [
        (CaseFailure(stage="run", failure_class="agent", code="exit_nonzero", message="m"), "42"),
        (CaseFailure(stage="collect", failure_class="infra", code="collect_failed", message="m"), "42"),
        (CaseFailure(stage="grade", failure_class="infra", code="grader_crashed", message="m"), None),
    ],
)
async def test_failure_that_left_an_outcome_is_judged(failure: CaseFailure, answer: str | None) -> None:
    event = executed((ContainsJudge(id="c"),), status="failed", res=result(answer=answer, failure=failure))
    judged = await judge_event(event, registry_with())
    assert judged is not None
    assert judged.status == "judged"
    assert metrics(judged) == ["answer_match", "judge:c"]


# ---------------------------------------------------------------- judging


async def test_judges_run_sequentially_in_selection_order_after_graders() -> None:
    recorder = Recorder()
    judges: tuple[JudgeSpec, ...] = (
        RegisteredJudge(id="slow", name="record", params={"yields": "50"}),
        NumericJudge(id="num"),
        RegisteredJudge(id="fast", name="record"),
        ExactJudge(id="exact"),
        ContainsJudge(id="has42"),
        RegexJudge(id="rx", pattern=r"answer is \d+"),
        RegisteredJudge(id="unknown", name="not-registered"),
    )
    registry = registry_with(recorder)
    first = await judge_event(executed(judges), registry)
    assert first is not None
    assert metrics(first) == [
        "answer_match",
        "judge:slow",
        "judge:num",
        "judge:fast",
        "judge:exact",
        "judge:has42",
        "judge:rx",
        "judge:unknown",
    ]
    assert recorder.calls == ["slow", "fast"]
    assert recorder.max_active == 1
    scores = first.result.scores
    assert [s.passed for s in scores[1:7] if isinstance(s, Measured)] == [True, True, True, False, True, True]
    unknown = scores[7]
    assert isinstance(unknown, Unmeasured)
    assert (unknown.reason, unknown.retryable) == ("unsupported", False)
    assert first.status == "judged"
    assert first.judge_error is None
    again = await judge_event(executed(judges), registry)
    assert again is not None
    assert again.result.scores == first.result.scores


async def test_many_cases_in_parallel_keep_per_case_order() -> None:
    recorder = Recorder()
    judges: tuple[JudgeSpec, ...] = tuple(
        RegisteredJudge(id=f"j{i}", name="record", params={"yields": str(10 - i)}) for i in range(5)
    )
    registry = registry_with(recorder)
    results = await asyncio.gather(*(judge_event(executed(judges), registry) for _ in range(8)))
    for judged in results:
        assert metrics(judged)[1:] == [f"judge:j{i}" for i in range(5)]


async def test_ids_plan_case_and_attempt_are_carried_forward() -> None:
    event = executed((ExactJudge(id="e"),))
    judged = await judge_event(event, registry_with())
    assert judged is not None
    assert (judged.batch_id, judged.case_id, judged.run_id, judged.attempt) == ("b1", "c1", "evb-b1-c1", 2)
    assert judged.plan == event.plan
    assert judged.case == CASE
    assert judged.event_id != event.event_id
    assert judged.subject() == "case.judged.b1.c1"
    assert judged.msg_id() == "case.judged:evb-b1-c1"
    assert judged.result.trace == event.result.trace  # the stored trace is not filtered
    assert decode_event(encode(judged)) == judged


async def test_judges_see_the_trace_without_infra_or_earlier_judge_spans() -> None:
    recorder = Recorder()
    await judge_event(executed((RegisteredJudge(id="r", name="record"),)), registry_with(recorder))
    (ctx,) = recorder.contexts
    assert [type(e).__name__ for e in ctx.trace] == ["Message", "Message"]
    assert (ctx.case_input, ctx.expected, ctx.answer) == ("What is 6 x 7?", "42", "The answer is 42.")


async def test_a_judge_error_is_an_unmeasured_score_and_judging_goes_on() -> None:
    def raising(spec: RegisteredJudge) -> Judge:
        class Raising:
            async def judge(self, ctx: JudgeContext) -> Score:
                raise KeyError("rubric")

        return Raising()

    registry = registry_with()
    registry.register("raising", raising)
    judges: tuple[JudgeSpec, ...] = (RegisteredJudge(id="bad", name="raising"), ExactJudge(id="after"))
    judged = await judge_event(executed(judges), registry)
    assert judged is not None
    assert judged.judge_error is None
    bad, after = judged.result.scores[1:]
    assert isinstance(bad, Unmeasured)
    assert (bad.reason, bad.retryable, bad.metric) == ("grader_error", True, "judge:bad")
    assert "KeyError" in (bad.detail or "")
    assert isinstance(after, Measured)


async def test_a_judge_that_returns_no_score_is_invalid_and_one_with_wrong_ids_is_stamped() -> None:
    def factory(spec: RegisteredJudge) -> Judge:
        class Odd:
            async def judge(self, ctx: JudgeContext) -> Score:
                if spec.params.get("mode") == "none":
                    return None  # type: ignore[return-value]
                return Measured(grader_id="whatever", metric="free-metric", value=0.5)

        return Odd()

    registry = registry_with()
    registry.register("odd", factory)
    judges: tuple[JudgeSpec, ...] = (
        RegisteredJudge(id="none", name="odd", params={"mode": "none"}),
        RegisteredJudge(id="free", name="odd"),
    )
    judged = await judge_event(executed(judges), registry)
    assert judged is not None
    none, free = judged.result.scores[1:]
    assert isinstance(none, Invalid)
    assert none.metric == "judge:none"
    assert free == Measured(grader_id="free", metric="judge:free", source="judge", value=0.5)


async def test_a_judge_that_overruns_is_grader_timeout() -> None:
    never = asyncio.Event()

    def hanging(spec: RegisteredJudge) -> Judge:
        class Hanging:
            async def judge(self, ctx: JudgeContext) -> Score:
                await never.wait()
                raise AssertionError("unreachable")

        return Hanging()

    registry = registry_with()
    registry.register("hang", hanging)
    judges: tuple[JudgeSpec, ...] = (RegisteredJudge(id="h", name="hang"), ExactJudge(id="after"))
    judged = await judge_event(executed(judges), registry, judge_timeout_s=0.05)
    assert judged is not None
    hung, after = judged.result.scores[1:]
    assert isinstance(hung, Unmeasured)
    assert (hung.reason, hung.retryable) == ("grader_timeout", True)
    assert isinstance(after, Measured)


async def test_an_error_escaping_the_machinery_sets_judge_error() -> None:
    def miswired(spec: RegisteredJudge) -> Judge:
        class Miswired:
            async def judge(self, ctx: JudgeContext) -> Score:
                raise JudgeMachineryError("ChatClient.start() was not called")

        return Miswired()

    registry = registry_with()
    registry.register("miswired", miswired)
    judges: tuple[JudgeSpec, ...] = (ExactJudge(id="first"), RegisteredJudge(id="m", name="miswired"))
    judged = await judge_event(executed(judges), registry)
    assert judged is not None
    assert judged.status == "judged"
    assert judged.judge_error == "JudgeMachineryError: ChatClient.start() was not called"
    assert metrics(judged) == ["answer_match", "judge:first"]


async def test_a_model_judge_on_an_unstarted_client_is_a_machinery_error() -> None:
    from evalbus_contracts import ModelJudge
    from evalbus_judge import ChatClient

    registry = JudgeRegistry(chat=ChatClient())
    judges: tuple[JudgeSpec, ...] = (ModelJudge(id="m", rubric="r", base_url="http://127.0.0.1:9/v1"),)
    judged = await judge_event(executed(judges), registry)
    assert judged is not None
    assert judged.judge_error is not None
    assert "start()" in judged.judge_error


async def test_no_judges_still_emits_judged() -> None:
    judged = await judge_event(executed(()), registry_with())
    assert judged is not None
    assert judged.status == "judged"
    assert judged.result == result()


async def test_case_collected_is_judged() -> None:
    event = CaseCollected(
        batch_id="b1",
        case_id="c1",
        run_id="evb-b1-c1",
        result=result(),
        plan=CasePlan(judges=(NumericJudge(id="n"),)),
        case=CASE,
    )
    judged = await judge_event(event, registry_with())
    assert judged is not None
    assert judged.status == "judged"
    assert metrics(judged) == ["answer_match", "judge:n"]


async def test_case_collected_without_outcome_is_skipped() -> None:
    failure = CaseFailure(stage="dispatch", failure_class="infra", code="lost", message="m")
    event = CaseCollected(
        batch_id="b1", case_id="c1", run_id="evb-b1-c1", result=result(None, failure), plan=CasePlan(), case=CASE
    )
    judged = await judge_event(event, registry_with())
    assert judged is not None
    assert judged.status == "skipped"


async def test_observation_is_judged_as_a_case_of_the_online_batch() -> None:
    recorder = Recorder()
    res = msgspec.structs.replace(result(), run_id="evb-run-obs-1", scores=())
    event = CaseObserved(
        run_id="evb-run-obs-1",
        suite_id="support.bot",
        observation_id="obs 1",
        result=res,
        plan=CasePlan(judges=(RegisteredJudge(id="r", name="record"), ContainsJudge(id="c"))),
        expected="42",
    )
    judged = await judge_event(event, registry_with(recorder))
    assert judged is not None
    assert (judged.batch_id, judged.case_id, judged.run_id) == ("online-support.bot", "obs 1", "evb-run-obs-1")
    assert judged.status == "judged"
    assert judged.case == CaseSpec(id="obs 1", input="What is 6 x 7?", expected="42")
    assert metrics(judged) == ["judge:r", "judge:c"]
    (ctx,) = recorder.contexts
    assert (ctx.case_input, ctx.expected) == ("What is 6 x 7?", "42")
    assert judged.subject() == "case.judged.online-support~2Ebot.obs~201"


async def test_event_without_ids_is_rejected() -> None:
    event = executed((ExactJudge(id="e"),), batch_id="")
    with pytest.raises(ValueError, match="batch_id"):
        await judge_event(event, registry_with())


# ---------------------------------------------------------------- retrying observations


def observed(judges: tuple[JudgeSpec, ...]) -> CaseObserved:
    res = msgspec.structs.replace(result(), run_id="evb-run-obs-2", scores=())
    return CaseObserved(
        run_id="evb-run-obs-2", suite_id="s", observation_id="obs-2", result=res, plan=CasePlan(judges=judges)
    )


class Flaky:
    """A judge whose score is chosen by the test: retryable unmeasured, or not."""

    def __init__(self, spec: RegisteredJudge) -> None:
        self.judge_id = spec.id
        self.retryable = spec.params.get("retryable") == "yes"

    async def judge(self, ctx: JudgeContext) -> Score:
        return Unmeasured(
            grader_id=self.judge_id, metric="x", reason="grader_error", detail="HTTP 500", retryable=self.retryable
        )


async def test_an_observation_a_judge_could_not_score_yet_is_judged_again_until_its_last_delivery() -> None:
    registry = JudgeRegistry()
    registry.register("flaky", Flaky)
    retryable = observed((ContainsJudge(id="c"), RegisteredJudge(id="f", name="flaky", params={"retryable": "yes"})))
    judged = await judge_event(retryable, registry)
    delays = [observation_retry_delay(retryable, judged, num_delivered=n, max_deliver=5) for n in range(1, 6)]
    assert delays == [2.0, 4.0, 8.0, 16.0, None]  # the last delivery records the error as the result
    assert observation_retry_delay(retryable, judged, num_delivered=40, max_deliver=-1) == 30.0

    # a final unmeasured score, or a batch's case, is recorded as it is
    final = observed((RegisteredJudge(id="f", name="flaky", params={"retryable": "no"}),))
    assert observation_retry_delay(final, await judge_event(final, registry), num_delivered=1, max_deliver=5) is None
    case = executed((RegisteredJudge(id="f", name="flaky", params={"retryable": "yes"}),))
    assert observation_retry_delay(case, await judge_event(case, registry), num_delivered=1, max_deliver=5) is None


# ---------------------------------------------------------------- an offloaded payload that cannot be read


def test_a_payload_that_cannot_be_read_fails_every_judge_visibly() -> None:
    judges = (ExactJudge(id="exact"), ContainsJudge(id="contains"))
    reason = "the object does not match its reference (tampered with or replaced): sha256 differs"
    judged = unreadable_payload(executed(judges, res=result(answer=None)), reason)
    assert judged is not None
    assert judged.status == "judged"
    assert judged.judge_error is not None
    assert reason in judged.judge_error
    added = judged.result.scores[1:]
    assert judged.result.scores[0] == GRADER_SCORE
    assert [s.metric for s in added] == ["judge:exact", "judge:contains"]
    assert all(isinstance(s, Unmeasured) and s.reason == "missing_evidence" for s in added)
    assert unreadable_payload(executed(judges, trace_complete=False), reason) is None
