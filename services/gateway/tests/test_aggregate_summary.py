"""The batch aggregate: means, pass rates, unmeasured tallies, verdicts, pass@k, export, status."""

from __future__ import annotations

import pytest

from evalbus_contracts import CaseFailure, Invalid, Measured, Score, SinkOutcome, Unmeasured
from evalbus_gateway.aggregate import RunOutcome, build_finalized, export_summary, final_status, summarize

pytestmark = pytest.mark.unit


def m(metric: str, value: float, passed: bool | None = None) -> Measured:
    return Measured(grader_id=metric, metric=metric, value=value, passed=passed)


def run(
    case: str,
    *scores: Score,
    trial: int | None = None,
    status: str = "succeeded",
    failure: CaseFailure | None = None,
    exported: str | None = "exported",
    judge_error: str | None = None,
    outcomes: tuple[SinkOutcome, ...] = (),
) -> RunOutcome:
    return RunOutcome(
        run_id=f"{case}-{trial}",
        case_id=case,
        trial=trial,
        executed_status=status,  # type: ignore[arg-type]
        judged_status="judged",
        exported_status=exported,  # type: ignore[arg-type]
        scores=scores,
        failure=failure,
        judge_error=judge_error,
        export_outcomes=outcomes,
    )


def test_metric_means_pass_rates_and_unmeasured_tally() -> None:
    runs = [
        run(
            "a",
            m("tests_pass", 1, True),
            m("cost_usd", 0.5),
            Unmeasured(grader_id="j", metric="judge:j", reason="unsupported"),
        ),
        run("b", m("tests_pass", 0, False), m("cost_usd", 1.5), Invalid(grader_id="j", metric="judge:j")),
        run(
            "c",
            m("tests_pass", 1, True),
            Unmeasured(grader_id="c", metric="cost_usd", reason="missing_evidence"),
            Unmeasured(grader_id="j", metric="judge:j", reason="unsupported"),
        ),
    ]
    summary = summarize(runs)
    by = {s.metric: s for s in summary.metrics}
    assert [s.metric for s in summary.metrics] == ["cost_usd", "judge:j", "tests_pass"]
    assert by["tests_pass"].count == 3
    assert by["tests_pass"].mean == pytest.approx(2 / 3)
    assert by["tests_pass"].pass_rate == pytest.approx(2 / 3)
    assert (by["cost_usd"].count, by["cost_usd"].mean, by["cost_usd"].pass_rate) == (2, 1.0, None)
    assert by["cost_usd"].unmeasured == {"missing_evidence": 1}
    assert (by["judge:j"].count, by["judge:j"].mean) == (0, None)
    assert by["judge:j"].unmeasured == {"contract_violation": 1, "unsupported": 2}
    assert (summary.verdicts.verdicted, summary.verdicts.passed, summary.verdicts.failed) == (3, 2, 1)
    assert summary.verdicts.pass_rate == pytest.approx(2 / 3)
    assert summary.trials is None


def test_cancelled_and_unexecuted_runs_are_left_out_of_metrics() -> None:
    runs = [
        run("a", m("tests_pass", 1, True)),
        run("b", m("tests_pass", 0, False), status="cancelled", exported="skipped"),
        run(
            "c",
            m("tests_pass", 0, False),
            failure=CaseFailure(stage="dispatch", failure_class="cancelled", code="c", message="c"),
        ),
        RunOutcome(run_id="d", case_id="d"),  # requested, never executed
    ]
    summary = summarize(runs)
    (tests_pass,) = summary.metrics
    assert (tests_pass.count, tests_pass.mean) == (1, 1.0)
    assert (summary.verdicts.verdicted, summary.verdicts.no_verdict) == (1, 3)
    c = summary.counts
    assert (c.requested, c.executed, c.judged, c.exported, c.cancelled, c.failed) == (4, 3, 3, 3, 2, 0)


def test_infra_failed_run_counts_in_metrics_but_has_no_verdict() -> None:
    fail = CaseFailure(stage="run", failure_class="infra", code="oom", message="killed")
    summary = summarize([run("a", m("tests_pass", 0, False), status="failed", failure=fail)])
    assert summary.metrics[0].count == 1
    assert summary.verdicts.no_verdict == 1
    assert summary.counts.failed == 1


def test_pass_at_1_and_pass_at_k_with_trials() -> None:
    runs = [
        run("a", m("tests_pass", 1, True), trial=1),
        run("a", m("tests_pass", 1, True), trial=2),
        run("a", m("tests_pass", 0, False), trial=3),
        run("b", m("tests_pass", 0, False), trial=1),
        run("b", m("tests_pass", 0, False), trial=2),
        run("b", m("tests_pass", 1, True), trial=3),
        run("c", m("tests_pass", 0, False), trial=1),
        run("c", m("tests_pass", 0, False), trial=2),
        run("c", trial=3, status="cancelled"),  # cancelled trial left out of c's fraction
    ]
    summary = summarize(runs)
    assert summary.trials is not None
    assert summary.trials.k == 3
    assert summary.trials.pass_at_1 == pytest.approx((2 / 3 + 1 / 3 + 0) / 3)
    assert summary.trials.pass_at_k == pytest.approx(2 / 3)
    assert summarize(runs, trials=1).trials is None


def test_export_summary() -> None:
    ok = SinkOutcome(sink="jsonl", status="ok")
    bad = SinkOutcome(sink="mlflow", status="failed", error="401 unauthorized")
    assert export_summary([run("a"), run("b", exported="skipped")], has_sinks=True).status == "succeeded"
    partial = export_summary([run("a"), run("b", exported="failed", outcomes=(bad,))], has_sinks=True)
    assert (partial.status, partial.exported, partial.failed) == ("partial", 1, 1)
    failed = export_summary(
        [run("a", exported="failed", outcomes=(ok, bad)), run("b", exported="failed")], has_sinks=True
    )
    assert (failed.status, failed.message) == ("failed", "401 unauthorized")
    assert export_summary([run("a", exported="skipped")], has_sinks=False).status == "skipped"
    assert export_summary([run("a", exported="partial", outcomes=(ok, bad))], has_sinks=True).status == "partial"


def test_final_status() -> None:
    assert final_status([run("a")], cancel_reason=None) == ("succeeded", None)
    status, error = final_status([run("a"), run("b", judge_error="judge crashed")], cancel_reason=None)
    assert status == "failed"
    assert error is not None
    assert (error.phase, error.message) == ("judges", "judge crashed")
    assert final_status([run("a", judge_error="x")], cancel_reason="superseded") == ("superseded", None)
    event = build_finalized("b1", [run("a", m("tests_pass", 1, True))], has_sinks=False, cancel_reason="cancelled")
    assert (event.batch_id, event.status, event.export.status) == ("b1", "cancelled", "skipped")
    assert event.summary.verdicts.passed == 1


def test_a_batch_none_of_whose_runs_ran_fails_with_the_reason() -> None:
    missing = CaseFailure(stage="run", failure_class="config", code="spawn_failed", message="cannot start 'agent'")
    no_sandbox = CaseFailure(stage="dispatch", failure_class="config", code="unschedulable", message="too big")
    crashed = CaseFailure(stage="run", failure_class="agent", code="exit_nonzero", message="harness exited with 1")
    status, error = final_status(
        [run("a", status="failed", failure=missing), run("b", status="failed", failure=no_sandbox)], cancel_reason=None
    )
    assert status == "failed"
    assert error is not None
    assert (error.code, error.phase) == ("no_run_executed", "dispatch")
    assert error.message == (
        "no run executed; 2 of 2 failed before their harness ran, e.g. spawn_failed: cannot start 'agent'"
    )
    # one run that ran (even badly) is a batch that ran: its agent failed, the batch did not
    ran = [run("a", status="failed", failure=missing), run("b", status="failed", failure=crashed)]
    assert final_status(ran, cancel_reason=None) == ("succeeded", None)
    assert final_status([run("a", status="failed", failure=missing)], cancel_reason="cancelled") == ("cancelled", None)
    assert final_status([], cancel_reason=None) == ("succeeded", None)
    assert missing.never_ran()
    assert no_sandbox.never_ran()
    assert not crashed.never_ran()
    assert missing.run_error()
    assert not crashed.run_error()


def test_a_run_that_never_ran_is_not_graded_but_counted_not_executed_under_every_metric() -> None:
    missing = CaseFailure(stage="run", failure_class="config", code="spawn_failed", message="cannot start 'agent'")
    runs = [
        run("a", m("answer_match", 1, True), m("judge:exact", 1, True)),
        run("b", m("answer_match", 0, False), m("judge:exact", 0, False)),
        run("c", status="failed", failure=missing),
        run("d", status="failed", failure=missing),
    ]
    summary = summarize(runs)
    by_metric = {s.metric: s for s in summary.metrics}
    assert set(by_metric) == {"answer_match", "judge:exact"}
    for metric in by_metric.values():
        assert (metric.count, metric.mean, metric.pass_rate) == (2, 0.5, 0.5)  # no zeros from c and d
        assert metric.unmeasured == {"not_executed": 2}
    assert (summary.verdicts.passed, summary.verdicts.failed, summary.verdicts.no_verdict) == (1, 1, 2)
