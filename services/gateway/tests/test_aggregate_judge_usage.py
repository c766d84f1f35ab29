"""The batch summary's `judge_usage` and the scorecard's cost line (pure): model-judge tokens and
dollars added up from the judge scores' own usage, apart from the agent's cost; a call of unknown
cost is counted as unpriced, never as 0 dollars."""

from __future__ import annotations

import pytest

from evalbus.cli.scorecard import cost_line
from evalbus_contracts import BatchSummary, JudgeUsage, JudgeUsageSummary, Measured, MetricSummary, Unmeasured
from evalbus_gateway.aggregate import RunOutcome, judge_usage, summarize

pytestmark = pytest.mark.unit


def judge_score(judge_id: str, usage: JudgeUsage | None) -> Measured:
    return Measured(grader_id=judge_id, metric=f"judge:{judge_id}", source="judge", value=1.0, passed=True, usage=usage)


def test_usage_adds_up_and_unpriced_calls_are_counted_apart() -> None:
    priced = JudgeUsage(model="m", input_tokens=100, output_tokens=20, cost_usd=0.002, cost_source="price")
    unpriced = JudgeUsage(model="m", input_tokens=50, output_tokens=10)
    runs = [
        RunOutcome(run_id="r1", case_id="c1", executed_status="succeeded", scores=(judge_score("q", priced),)),
        RunOutcome(run_id="r2", case_id="c2", executed_status="succeeded", scores=(judge_score("q", unpriced),)),
        RunOutcome(
            run_id="r3",
            case_id="c3",
            executed_status="succeeded",
            scores=(judge_score("q", priced), judge_score("rule", None)),
        ),
    ]
    usage = summarize(runs).judge_usage
    assert usage is not None
    assert usage.cost_usd == pytest.approx(0.004)
    assert (usage.calls, usage.input_tokens, usage.output_tokens, usage.unpriced_calls) == (3, 250, 50, 1)
    assert judge_usage([judge_score("rule", None)]) is None  # no model was called: nothing to show
    only_unpriced = judge_usage([judge_score("q", unpriced)])
    assert only_unpriced is not None
    assert (only_unpriced.cost_usd, only_unpriced.unpriced_calls) == (None, 1)  # unmeasured, not $0
    # a grader's score never counts as the judges' cost
    grader = Unmeasured(grader_id="g", metric="g", reason="grader_error", usage=priced)
    assert judge_usage([grader]) is None


def test_the_scorecard_shows_the_agents_cost_beside_the_judges() -> None:
    agent = MetricSummary(metric="cost_usd", count=4, mean=0.25)
    both = BatchSummary(
        metrics=(agent,),
        judge_usage=JudgeUsageSummary(calls=4, input_tokens=400, output_tokens=80, cost_usd=0.0123, unpriced_calls=1),
    )
    assert cost_line(both) == (
        "cost      agent $1.0000 (cost_usd over 4 runs)  judges $0.0123 (4 model calls, 1 without a price, "
        "400 in / 80 out tokens)"
    )
    unmeasured = BatchSummary(judge_usage=JudgeUsageSummary(calls=1, input_tokens=5, output_tokens=1))
    assert cost_line(unmeasured) == "cost      judges cost unmeasured (no price; 1 model call, 5 in / 1 out tokens)"
    assert cost_line(BatchSummary()) is None
