"""The scorecard shows every mean and rate with its 95 % interval, the unbiased pass@k per k and the
flaky cases — from a summary the aggregate computed — and a summary without intervals (a batch
finalized before they existed) as before."""

from __future__ import annotations

from datetime import UTC, datetime

import pytest

from evalbus.cli.scorecard import render_scorecard
from evalbus_api.views import BatchView
from evalbus_contracts import Measured
from evalbus_gateway.aggregate import RunOutcome, summarize

pytestmark = pytest.mark.unit


def outcome(case: str, trial: int, passed: bool, cost: float) -> RunOutcome:
    return RunOutcome(
        run_id=f"evb-b1-{case}-t{trial}",
        case_id=case,
        trial=trial,
        executed_status="succeeded",
        judged_status="judged",
        exported_status="exported",
        scores=(
            Measured(grader_id="a", metric="answer_match", value=float(passed), passed=passed),
            Measured(grader_id="c", metric="cost_usd", value=cost),
        ),
    )


def test_scorecard_with_intervals_pass_at_k_and_flaky_cases() -> None:
    # case-0 and case-1 flaky, case-2 always passes, case-3 never
    plan = {
        "case-0": (True, False, True),
        "case-1": (False, False, True),
        "case-2": (True,) * 3,
        "case-3": (False,) * 3,
    }
    runs = [outcome(c, t, p, 0.01 * t) for c, trials in plan.items() for t, p in enumerate(trials, start=1)]
    summary = summarize(runs)
    view = BatchView(
        batch_id="b1",
        status="succeeded",
        counts=summary.counts,
        total_runs=12,
        trials=3,
        suite_id="tiny",
        summary=summary,
        finalized_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    lines = render_scorecard(view, [], {}).splitlines()
    assert lines[2] == "METRIC        COUNT  MEAN   95% CI       PASS RATE  95% CI      UNMEASURED"
    assert lines[3] == "answer_match     12  0.500  0.254–0.746      50.0%  25.4–74.6%"
    cost = lines[4].split()
    assert cost[:3] == ["cost_usd", "12", "0.020"]
    assert cost[4] == "-"
    low, high = (float(x) for x in cost[3].split("–"))
    assert 0.01 < low < 0.02 < high < 0.03
    assert "verdicts  6 passed, 6 failed, 0 without a verdict (pass rate 50.0%, 95% CI 25.4–74.6%)" in lines
    pass_line = next(line for line in lines if line.startswith("pass@k"))
    assert pass_line.startswith("pass@k    pass@1 0.500 [")
    assert pass_line.endswith("pass@3 0.750 [0.301–0.954] over 4 cases")
    unbiased = next(line for line in lines if line.strip().startswith("unbiased:"))
    assert "pass@1 0.500 [" in unbiased
    assert "pass@2 0.667 [" in unbiased  # (1 + 2/3 + 1 + 0) / 4: two draws of three hold a pass
    assert "pass@3 0.750 [" in unbiased
    assert "flaky     2 of 4 cases passed and failed across trials: case-0, case-1" in lines
