"""Fan-out, the retry rule and the cancelled-batch short-circuit (pure)."""

from __future__ import annotations

import pytest

from evalbus_contracts import (
    BatchPolicy,
    BatchRequested,
    BatchSpec,
    CaseExecuted,
    CaseFailure,
    CasePlan,
    CaseRequested,
    CaseResult,
    CaseSpec,
    CommandHarness,
    ExactJudge,
    JsonlSink,
    SuiteSpec,
    decode_event,
    encode,
    expected_runs,
)
from evalbus_contracts.results import FailureClass, FailureStage
from evalbus_dispatcher import cancelled_execution, fan_out, next_attempt, should_retry

pytestmark = pytest.mark.unit

HARNESS = CommandHarness(id="agent", version="2", command=("agent",))


def batch(*case_ids: str, trials: int = 1, retries: int = 1, batch_id: str | None = "b42") -> BatchRequested:
    cases = tuple(CaseSpec(id=cid, input=f"input {i} of {cid}") for i, cid in enumerate(case_ids))
    spec = BatchSpec(
        suite=SuiteSpec(id="suite-a", cases=cases),
        harness=HARNESS,
        judges=(ExactJudge(id="exact"),),
        sinks=(JsonlSink(path="/tmp/{batch}.jsonl"),),
        policy=BatchPolicy(trials=trials, retries=retries),
        labels={"team": "x"},
    )
    return BatchRequested(batch_id=batch_id, spec=spec, submitted_by="alice")


def test_one_request_per_case_without_trial_numbers() -> None:
    reqs = fan_out(batch("c1", "c2"))
    assert [(r.case_id, r.run_id, r.trial) for r in reqs] == [
        ("c1", "evb-b42-c1", None),
        ("c2", "evb-b42-c2", None),
    ]
    first = reqs[0]
    assert first.batch_id == "b42"
    assert first.attempt == 1
    assert first.case.input == "input 0 of c1"
    assert first.harness == HARNESS
    assert first.plan == CasePlan(
        judges=(ExactJudge(id="exact"),),
        sinks=(JsonlSink(path="/tmp/{batch}.jsonl"),),
        retries=1,
        trials=1,
        labels={"team": "x"},
        suite_id="suite-a",
        submitted_by="alice",
    )
    assert decode_event(encode(first)) == first


def test_trials_number_runs_one_to_k() -> None:
    reqs = fan_out(batch("c1", "c2", trials=3))
    assert [r.run_id for r in reqs] == [
        "evb-b42-c1-t1", "evb-b42-c1-t2", "evb-b42-c1-t3",
        "evb-b42-c2-t1", "evb-b42-c2-t2", "evb-b42-c2-t3",
    ]  # fmt: skip
    assert [r.trial for r in reqs] == [1, 2, 3, 1, 2, 3]
    assert {r.plan.trials for r in reqs} == {3}
    assert len({r.event_id for r in reqs}) == 6


def test_duplicate_case_ids_are_deduplicated_first_wins() -> None:
    reqs = fan_out(batch("c1", "c2", "c1", trials=2))
    assert [(r.case_id, r.trial) for r in reqs] == [("c1", 1), ("c1", 2), ("c2", 1), ("c2", 2)]
    assert reqs[0].case.input == "input 0 of c1"


@pytest.mark.parametrize("trials", [0, 1, 2, 5])
@pytest.mark.parametrize("case_ids", [("c1",), ("c1", "c2", "c1"), tuple(f"c{i % 7}" for i in range(30))])
def test_the_fan_out_makes_exactly_the_runs_every_count_expects(case_ids: tuple[str, ...], trials: int) -> None:
    """The dispatcher's fan-out and the gateway's counts (finalisation, views, re-judges) share
    one rule, `evalbus_contracts.expected_runs`: if they drifted, batches would never finalize."""
    req = batch(*case_ids, trials=trials)
    assert len(fan_out(req)) == expected_runs(req.spec) == len(set(case_ids)) * max(1, trials)
    assert len({r.run_id for r in fan_out(req)}) == expected_runs(req.spec)


def test_fan_out_is_deterministic_in_run_ids() -> None:
    req = batch("a", "b", trials=2)
    assert [r.run_id for r in fan_out(req)] == [r.run_id for r in fan_out(req)]


def test_a_batch_without_id_cannot_fan_out() -> None:
    with pytest.raises(ValueError, match="batch id"):
        fan_out(batch("c1", batch_id=None))


def executed_with(stage: FailureStage, cls: FailureClass, *, retryable: bool) -> CaseExecuted:
    req = fan_out(batch("c1"))[0]
    failure = CaseFailure(stage=stage, failure_class=cls, code="x", message="m", retryable=retryable)
    result = CaseResult(case_id="c1", run_id=req.run_id or "", harness="agent@2", failure=failure)
    return CaseExecuted(batch_id="b42", case_id="c1", run_id=req.run_id, status="failed", result=result, plan=req.plan)


@pytest.mark.parametrize(
    ("stage", "cls", "retryable", "attempt", "retries", "expected"),
    [
        ("dispatch", "infra", True, 1, 1, True),
        ("dispatch", "infra", True, 2, 1, False),
        ("dispatch", "infra", True, 2, 3, True),
        ("dispatch", "infra", True, 1, 0, False),
        ("run", "infra", True, 1, 1, True),
        ("dispatch", "infra", False, 1, 1, False),
        ("run", "agent", True, 1, 1, False),
        ("dispatch", "config", True, 1, 1, False),
        ("collect", "infra", True, 1, 1, False),
    ],
)
def test_should_retry(
    stage: FailureStage, cls: FailureClass, retryable: bool, attempt: int, retries: int, expected: bool
) -> None:
    assert should_retry(executed_with(stage, cls, retryable=retryable), attempt, retries) is expected


def test_success_is_never_retried() -> None:
    req = fan_out(batch("c1"))[0]
    ok = CaseExecuted(
        batch_id="b42",
        case_id="c1",
        run_id=req.run_id,
        status="succeeded",
        result=CaseResult(case_id="c1", run_id="r", harness="h"),
        plan=req.plan,
    )
    assert should_retry(ok, 1, 5) is False


def test_next_attempt_keeps_the_run() -> None:
    req = fan_out(batch("c1"))[0]
    again = next_attempt(req)
    assert isinstance(again, CaseRequested)
    assert (again.run_id, again.case, again.attempt) == (req.run_id, req.case, 2)
    assert again.event_id != req.event_id


@pytest.mark.parametrize("reason", ["cancelled", "superseded"])
def test_cancelled_execution(reason: str) -> None:
    req = fan_out(batch("c1", trials=2))[1]
    executed = cancelled_execution(req, reason)  # type: ignore[arg-type]
    assert executed.status == "cancelled"
    assert (executed.batch_id, executed.case_id, executed.run_id) == ("b42", "c1", "evb-b42-c1-t2")
    assert executed.result.trial == 2
    assert executed.result.scores == ()
    assert executed.plan == req.plan
    assert executed.case == req.case
    failure = executed.result.failure
    assert failure is not None
    assert (failure.stage, failure.failure_class, failure.code) == ("dispatch", "cancelled", reason)
    assert should_retry(executed, 1, 3) is False
    assert decode_event(encode(executed)) == executed
