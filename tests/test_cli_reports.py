"""The CI reports of `evalbus run`: JUnit XML (a test case per run and per gate, failures, errors
and skips where CI readers look for them, consistent counts) and the Markdown summary.

The XML is checked against the structure of the JUnit schema CI readers accept (Ant's, as
Jenkins and GitLab read it): `testsuites` > `testsuite` (name, tests, failures, errors, skipped,
time) > `testcase` (name, classname, time) with at most one of `failure` / `error` (message, type)
/ `skipped`, counts that add up. No XSD validator is installed here, so the rules are written out.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from datetime import UTC, datetime

import pytest

from evalbus.cli.reports import junit_xml, summary_markdown
from evalbus_api.views import BatchView, RunView
from evalbus_contracts import CaseFailure, Measured, Unmeasured
from evalbus_gateway.aggregate import RunOutcome, summarize
from evalbus_grading.gates import GateResult

pytestmark = pytest.mark.unit

SUITE_ATTRIBUTES = {"name", "tests", "failures", "errors", "skipped", "time"}
CASE_ATTRIBUTES = {"name", "classname", "time"}
OUTCOMES = {"failure", "error", "skipped"}


def check_junit(text: str) -> ET.Element:
    """Parse `text` and assert the JUnit structure; the root."""
    assert text.startswith('<?xml version="1.0" encoding="UTF-8"?>\n')
    root = ET.fromstring(text)
    assert root.tag == "testsuites"
    assert {"name", "tests", "failures", "errors", "skipped", "time"} <= set(root.attrib)
    totals = dict.fromkeys(("tests", "failures", "errors", "skipped"), 0)
    for suite in root:
        assert suite.tag == "testsuite"
        assert set(suite.attrib) >= SUITE_ATTRIBUTES
        cases = list(suite)
        assert all(c.tag == "testcase" for c in cases)
        counts = {"tests": len(cases), "failures": 0, "errors": 0, "skipped": 0}
        for case in cases:
            assert set(case.attrib) >= CASE_ATTRIBUTES
            float(case.attrib["time"])
            outcomes = [child for child in case if child.tag in OUTCOMES]
            assert len(outcomes) <= 1, ET.tostring(case)
            assert {child.tag for child in case} <= OUTCOMES | {"system-out"}
            for child in outcomes:
                if child.tag in ("failure", "error"):
                    assert child.attrib.get("message")
                    assert child.attrib.get("type")
                counts[{"failure": "failures", "error": "errors", "skipped": "skipped"}[child.tag]] += 1
        for key, value in counts.items():
            assert int(suite.attrib[key]) == value, (suite.attrib["name"], key)
            totals[key] += value
        float(suite.attrib["time"])
    for key, value in totals.items():
        assert int(root.attrib[key]) == value, key
    return root


def run_view(case: str, verdict: str | None, answer: str | None, **kw: object) -> RunView:
    ok = verdict == "pass"
    return RunView(
        run_id=f"evb-b1-{case}",
        case_id=case,
        stage="exported",
        batch_id="b1",
        verdict=verdict,  # type: ignore[arg-type]
        verdict_rung="objective" if verdict else None,
        answer=answer,
        sandbox_seconds=0.25,
        scores=(
            Measured(grader_id="a", metric="answer_match", value=float(ok), passed=ok),
            Unmeasured(grader_id="j", metric="judge:rubric", reason="unsupported"),
        ),
        **kw,  # type: ignore[arg-type]
    )


RUNS = [
    run_view("c1", "pass", "4"),
    run_view("c2", "fail", "Sydney"),
    run_view(
        "c3",
        None,
        None,
        failure=CaseFailure(stage="run", failure_class="agent", code="timeout", message="killed after 30 s"),
    ),
    run_view("c4", None, "?"),
]
EXPECTED = {"c1": "4", "c2": "Canberra", "c3": "x", "c4": "y"}
GATES = [
    GateResult(gate="verdicts.pass_rate >= 0.8", passed=False, measured=0.5, detail="measured 0.5 (needs >= 0.8)"),
    GateResult(gate="metric.answer_match.count >= 1", passed=True, measured=4.0, detail="measured 4 (needs >= 1)"),
]


def view() -> BatchView:
    outcomes = [
        RunOutcome(
            run_id=r.run_id,
            case_id=r.case_id,
            executed_status="succeeded",
            judged_status="judged",
            exported_status="exported",
            scores=r.scores,
        )
        for r in RUNS[:2]
    ]
    summary = summarize(outcomes)
    return BatchView(
        batch_id="b1",
        status="succeeded",
        counts=summary.counts,
        suite_id="tiny",
        summary=summary,
        finalized_at=datetime(2026, 1, 1, tzinfo=UTC),
    )


def test_junit_has_a_case_per_run_and_per_gate() -> None:
    root = check_junit(junit_xml(view(), RUNS, EXPECTED, GATES))
    assert root.attrib["name"] == "evalbus tiny b1"
    cases_suite, gates_suite = list(root)
    assert (cases_suite.attrib["name"], gates_suite.attrib["name"]) == ("cases", "gates")
    assert {k: cases_suite.attrib[k] for k in ("tests", "failures", "errors", "skipped")} == {
        "tests": "4",
        "failures": "1",
        "errors": "1",
        "skipped": "1",
    }
    assert cases_suite.attrib["time"] == "1.000"
    by_name = {c.attrib["name"]: c for c in cases_suite}
    assert by_name["c1"].attrib["classname"] == "tiny"
    assert list(by_name["c1"]) == []
    failure = by_name["c2"].find("failure")
    assert failure is not None
    assert failure.attrib["message"] == "verdict fail (objective): answer 'Sydney', expected 'Canberra'"
    assert failure.text == "answer_match: 0 fail\njudge:rubric: unmeasured (unsupported)"
    error = by_name["c3"].find("error")
    assert error is not None
    assert (error.attrib["type"], error.attrib["message"]) == ("timeout", "timeout (agent, run): killed after 30 s")
    assert by_name["c4"].find("skipped") is not None
    gate_cases = list(gates_suite)
    assert [c.attrib["name"] for c in gate_cases] == [g.gate for g in GATES]
    gate_failure = gate_cases[0].find("failure")
    assert gate_failure is not None
    assert gate_failure.attrib["message"] == "measured 0.5 (needs >= 0.8)"
    assert gates_suite.attrib["failures"] == "1"
    assert root.attrib["tests"] == "6"


def test_junit_without_gates_has_only_the_cases_and_escapes_what_it_quotes() -> None:
    runs = [run_view("c<&>", "fail", 'a "quoted" <answer> & more')]
    text = junit_xml(view(), runs, {"c<&>": "b"}, None)
    root = check_junit(text)
    assert [s.attrib["name"] for s in root] == ["cases"]
    failure = root.find("testsuite/testcase/failure")
    assert failure is not None
    assert "'a \"quoted\" <answer> & more'" in failure.attrib["message"]


def test_markdown_summary() -> None:
    text = summary_markdown(view(), RUNS, EXPECTED, GATES)
    lines = text.splitlines()
    assert lines[0] == "## evalbus: tiny — batch `b1` succeeded"
    assert "**Gates: 1 of 2 passed**" in lines
    assert "| **FAIL** | `verdicts.pass_rate >= 0.8` | measured 0.5 (needs >= 0.8) |" in lines
    assert "| pass | `metric.answer_match.count >= 1` | measured 4 (needs >= 1) |" in lines
    assert any(
        line.startswith("**Verdicts:** 1 passed, 1 failed, 0 without a verdict — pass rate 50.0% (95% CI ")
        for line in lines
    )
    assert any(line.startswith("| `answer_match` | 2 | 0.500 | ") for line in lines)
    assert "**Failed cases (2 of 4)**" in lines
    assert "| c2 | 'Sydney' | 'Canberra' | verdict fail (objective) |" in lines
    assert "| c3 | - | 'x' | timeout (agent) |" in lines
    assert "Gates" not in summary_markdown(view(), RUNS, EXPECTED, None)
