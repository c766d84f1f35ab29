"""The `compare` text, the gates block of `run` and its exit codes, without servers: a comparison
computed by `evalbus_grading.compare` rendered as the command prints it, `--gate` expressions
checked before submission, and `report_outcome` deciding threshold gates from a summary."""

from __future__ import annotations

import io
from datetime import UTC, datetime
from typing import Literal

import msgspec
import pytest

from evalbus.cli import build_parser
from evalbus.cli.compare import render_comparison
from evalbus.cli.follow import Outcome
from evalbus.cli.gates import (
    EXIT_GATE_FAILED,
    GateOptionError,
    gate_lines,
    report_outcome,
    with_gate_options,
)
from evalbus.cli.progress import BatchProgress
from evalbus_api.client import GatewayClient
from evalbus_api.views import BatchView
from evalbus_contracts import Measured
from evalbus_gateway.aggregate import RunOutcome, summarize
from evalbus_gateway.testing import batch_spec
from evalbus_grading.compare import CaseRun, compare
from evalbus_grading.gates import GateResult

pytestmark = pytest.mark.unit


def case_run(batch: str, case: str, ok: bool) -> CaseRun:
    verdict: Literal["pass", "fail"] = "pass" if ok else "fail"
    return CaseRun(
        run_id=f"evb-{batch}-{case}",
        case_id=case,
        answer="right" if ok else "wrong",
        verdict=verdict,
        scores=(
            Measured(grader_id="a", metric="answer_match", value=float(ok), passed=ok),
            Measured(grader_id="c", metric="cost_usd", value=0.001),
        ),
    )


def test_compare_text_shows_the_metrics_and_the_regressed_cases_with_both_answers() -> None:
    cases = [f"c{i:02d}" for i in range(12)]
    comparison = compare(
        "bbase",
        [case_run("bbase", c, True) for c in cases],
        "bcand",
        [case_run("bcand", c, i >= 8) for i, c in enumerate(cases)] + [case_run("bcand", "extra", True)],
    )
    lines = render_comparison(comparison).splitlines()
    assert lines[0] == "candidate bcand  against base bbase"
    assert lines[1] == (
        "cases     8 regressed, 0 improved, 4 unchanged, 0 without a verdict on a side, 0 only in base, "
        "1 only in candidate"
    )
    assert lines[3].split() == ["METRIC", "N", "BASE", "CANDIDATE", "DELTA", "95%", "CI", "TEST", "P", "Q", "CHANGE"]
    verdicts = lines[4].split()
    assert verdicts[:5] == ["verdicts", "12", "100.0%", "33.3%", "-66.7pp"]
    assert verdicts[-4:] == ["mcnemar", "0.0078", "0.0117", "REGRESSED"]  # q: 0.0078 x 3 metrics / rank 2
    cost = lines[6].split()
    assert cost[:5] == ["cost_usd", "12", "0.001", "0.001", "+0.000"]
    assert cost[-5:] == ["wilcoxon", "1.0000", "1.0000", "not", "significant"]
    assert "significant (q < 0.05): verdicts regressed, answer_match regressed" in lines
    assert "regressed cases (8)" in lines
    header = next(line for line in lines if line.strip().startswith("CASE"))
    assert header.split() == ["CASE", "BASE", "CANDIDATE", "NO", "LONGER", "PASSES"]
    c00 = next(line for line in lines if line.strip().startswith("c00"))
    assert c00.split() == ["c00", "pass", "'right'", "fail", "'wrong'", "answer_match"]
    assert "only in candidate: extra" in lines


def test_batches_of_other_suites_with_no_case_in_common_say_so() -> None:
    comparison = msgspec.structs.replace(
        compare("bbase", [case_run("bbase", "q1", True)], "bcand", [case_run("bcand", "other", False)]),
        base_suite="demo-tools",
        candidate_suite="starter",
    )
    lines = render_comparison(comparison).splitlines()
    assert "note      the batches ran different suites (demo-tools, starter): cases pair by id" in lines
    assert "nothing to compare: no case is in both batches" in lines
    assert not any(line.startswith("no significant change") for line in lines)


def test_gate_options_are_checked_before_submission_and_added_to_the_spec() -> None:
    spec = batch_spec()
    gated = with_gate_options(spec, ["verdicts.pass_rate >= 0.8", "no_significant_regression: verdicts"])
    assert gated.gates == ("verdicts.pass_rate >= 0.8", "no_significant_regression: verdicts")
    assert with_gate_options(spec, []) is spec
    with pytest.raises(GateOptionError) as refused:
        with_gate_options(spec, ["verdicts.pass_rate >= 0.8", "verdicts.rate > 1"])
    assert refused.value.expression == "verdicts.rate > 1"
    assert "verdicts has no 'rate'" in refused.value.message
    args = build_parser().parse_args(["run", "s.yaml", "--gate", "a >= 1", "--gate", "b <= 2"])
    assert args.gate == ["a >= 1", "b <= 2"]


def test_gate_lines() -> None:
    results = [
        GateResult(gate="verdicts.pass_rate >= 0.8", passed=True, measured=0.8, detail="measured 0.8 (needs >= 0.8)"),
        GateResult(gate="metric.latency_s.mean <= 1", passed=False, detail="metric latency_s was not measured"),
    ]
    assert gate_lines(results) == [
        "gates     1 of 2 passed",
        "  PASS  verdicts.pass_rate >= 0.8   measured 0.8 (needs >= 0.8)",
        "  FAIL  metric.latency_s.mean <= 1  metric latency_s was not measured",
    ]


def outcome(status: Literal["succeeded", "failed"], passes: list[bool]) -> Outcome:
    runs = [
        RunOutcome(
            run_id=f"r{i}",
            case_id=f"c{i}",
            executed_status="succeeded",
            judged_status="judged",
            exported_status="exported",
            scores=(Measured(grader_id="a", metric="answer_match", value=float(ok), passed=ok),),
        )
        for i, ok in enumerate(passes)
    ]
    summary = summarize(runs)
    view = BatchView(
        batch_id="b1",
        status=status,
        counts=summary.counts,
        total_runs=len(runs),
        suite_id="s",
        summary=summary,
        finalized_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    return Outcome(view=view, runs=[], progress=BatchProgress("b1", len(runs)))


async def test_report_outcome_exit_codes() -> None:
    client = GatewayClient("http://127.0.0.1:9", "unused")  # threshold gates never call it
    try:
        out = io.StringIO()
        good = outcome("succeeded", [True, True, True, False])
        assert await report_outcome(client, good, ("verdicts.pass_rate >= 0.75",), json_output=False, out=out) == 0
        assert "  PASS  verdicts.pass_rate >= 0.75  measured 0.75 (needs >= 0.75)" in out.getvalue()

        out = io.StringIO()
        gates = ("verdicts.pass_rate >= 0.8", "metric.answer_match.count >= 4")
        assert await report_outcome(client, good, gates, json_output=True, out=out) == EXIT_GATE_FAILED
        [line] = out.getvalue().splitlines()
        assert '"gates": [{"gate": "verdicts.pass_rate >= 0.8", "passed": false' in line

        out = io.StringIO()
        failed = outcome("failed", [True])
        assert await report_outcome(client, failed, ("verdicts.pass_rate >= 0.8",), json_output=False, out=out) == 1
        assert out.getvalue().endswith("gates     not checked: the batch finalized failed\n")

        out = io.StringIO()
        assert await report_outcome(client, good, (), json_output=True, out=out) == 0
        assert '"gates"' not in out.getvalue()
    finally:
        await client.close()
