"""Reports of a finalized batch for CI (pure): JUnit XML (`evalbus run --junit FILE`) and a
Markdown summary for a CI job page (`--summary-md FILE`, e.g. `$GITHUB_STEP_SUMMARY`).

JUnit: one `<testsuite name="cases">` with a `<testcase>` per run (case × trial) — a `fail`
verdict is a `<failure>` (the rung that decided, the answer against the expected one), a run
that failed to execute an `<error>` (its failure code and class), a run without a verdict for
another reason `<skipped>` — and one `<testsuite name="gates">` with a `<testcase>` per gate (a
failed gate is a `<failure>` whose message says what it measured). Counts and times are on every
suite and on `<testsuites>`, as Jenkins, GitLab and the Ant schema expect.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Mapping, Sequence

from evalbus.cli.scorecard import clip, number, number_range, percent, percent_range
from evalbus_api.views import BatchView, RunView
from evalbus_contracts import BatchSummary, Measured, Score, Unmeasured
from evalbus_grading.gates import GateResult

MAX_CASES_IN_SUMMARY = 20
"""Failed cases listed in the Markdown summary; the rest are counted."""


def _case_name(run: RunView) -> str:
    return run.case_id + (f" #{run.trial}" if run.trial is not None else "")


def _suite(parent: ET.Element, name: str, cases: list[ET.Element]) -> ET.Element:
    suite = ET.SubElement(parent, "testsuite", name=name)
    suite.extend(cases)
    counts = {
        "tests": len(cases),
        "failures": sum(1 for c in cases if c.find("failure") is not None),
        "errors": sum(1 for c in cases if c.find("error") is not None),
        "skipped": sum(1 for c in cases if c.find("skipped") is not None),
    }
    seconds = sum(float(c.get("time", "0")) for c in cases)
    for key, value in counts.items():
        suite.set(key, str(value))
    suite.set("time", f"{seconds:.3f}")
    return suite


def _score_line(score: Score) -> str:
    if isinstance(score, Measured):
        verdict = "" if score.passed is None else (" pass" if score.passed else " fail")
        return f"{score.metric}: {score.value:g}{verdict}"
    if isinstance(score, Unmeasured):
        return f"{score.metric}: unmeasured ({score.reason})"
    return f"{score.metric}: invalid"


def _run_case(run: RunView, suite_id: str, expected: Mapping[str, str | None]) -> ET.Element:
    case = ET.Element("testcase", classname=suite_id, name=_case_name(run), time=f"{run.sandbox_seconds or 0.0:.3f}")
    if run.failure is not None:
        f = run.failure
        error = ET.SubElement(
            case, "error", message=f"{f.code} ({f.failure_class}, {f.stage}): {f.message}", type=f.code
        )
        error.text = f.log_tail or f.message
    elif run.verdict == "fail":
        message = f"verdict fail ({run.verdict_rung or 'no rung'}): answer {clip(run.answer, 200)}, "
        message += f"expected {clip(expected.get(run.case_id), 200)}"
        failure = ET.SubElement(case, "failure", message=message, type="verdict")
        failure.text = "\n".join(_score_line(s) for s in run.scores)
    elif run.verdict is None:
        ET.SubElement(case, "skipped", message="no verdict (nothing decisive was measured)")
    return case


def _gate_case(result: GateResult) -> ET.Element:
    case = ET.Element("testcase", classname="gates", name=result.gate, time="0.000")
    if not result.passed:
        ET.SubElement(case, "failure", message=result.detail or "failed", type="gate")
    else:
        out = ET.SubElement(case, "system-out")
        out.text = result.detail
    return case


def junit_xml(
    view: BatchView,
    runs: Sequence[RunView],
    expected: Mapping[str, str | None],
    gates: Sequence[GateResult] | None,
) -> str:
    """The JUnit XML document (`gates` None: not checked, no gates suite)."""
    suite_id = view.suite_id or "suite"
    root = ET.Element("testsuites", name=f"evalbus {suite_id} {view.batch_id}")
    suites = [_suite(root, "cases", [_run_case(r, suite_id, expected) for r in sorted(runs, key=lambda r: r.run_id)])]
    if gates is not None:
        suites.append(_suite(root, "gates", [_gate_case(g) for g in gates]))
    for key in ("tests", "failures", "errors", "skipped"):
        root.set(key, str(sum(int(s.get(key, "0")) for s in suites)))
    root.set("time", f"{sum(float(s.get('time', '0')) for s in suites):.3f}")
    ET.indent(root)
    return '<?xml version="1.0" encoding="UTF-8"?>\n' + ET.tostring(root, encoding="unicode") + "\n"


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def summary_markdown(
    view: BatchView,
    runs: Sequence[RunView],
    expected: Mapping[str, str | None],
    gates: Sequence[GateResult] | None,
) -> str:
    """The Markdown summary: status, metrics with intervals, verdicts, gates, failed cases."""
    summary = view.summary or BatchSummary()
    lines = [f"## evalbus: {view.suite_id or 'batch'} — batch `{view.batch_id}` {view.status}", ""]
    if gates is not None:
        passed = sum(1 for g in gates if g.passed)
        lines += [f"**Gates: {passed} of {len(gates)} passed**", "", "| | gate | measured |", "|---|---|---|"]
        lines += [f"| {'pass' if g.passed else '**FAIL**'} | `{_cell(g.gate)}` | {_cell(g.detail)} |" for g in gates]
        lines.append("")
    v = summary.verdicts
    rate = f" — pass rate {percent(v.pass_rate)}" if v.pass_rate is not None else ""
    if v.pass_rate_ci is not None:
        rate += f" (95% CI {percent_range(v.pass_rate_ci)})"
    lines += [f"**Verdicts:** {v.passed} passed, {v.failed} failed, {v.no_verdict} without a verdict{rate}", ""]
    if summary.metrics:
        lines += ["| metric | n | mean | 95% CI | pass rate | 95% CI | unmeasured |", "|---|--:|--:|---|--:|---|---|"]
        for m in summary.metrics:
            unmeasured = ", ".join(f"{reason} {n}" for reason, n in sorted(m.unmeasured.items()))
            lines.append(
                f"| `{_cell(m.metric)}` | {m.count} | {number(m.mean)} | {number_range(m.mean_ci)} | "
                f"{percent(m.pass_rate)} | {percent_range(m.pass_rate_ci)} | {unmeasured} |"
            )
        lines.append("")
    if summary.trials is not None:
        t = summary.trials
        lines.append(f"**Trials:** pass@1 {number(t.pass_at_1)}, pass@{t.k} {number(t.pass_at_k)}, {t.flaky} flaky")
        lines.append("")
    failed = sorted((r for r in runs if r.verdict == "fail" or r.failure is not None), key=lambda r: r.run_id)
    if failed:
        lines += [f"**Failed cases ({len(failed)} of {len(runs)})**", "", "| case | answer | expected | why |"]
        lines.append("|---|---|---|---|")
        for run in failed[:MAX_CASES_IN_SUMMARY]:
            why = (
                f"{run.failure.code} ({run.failure.failure_class})"
                if run.failure is not None
                else f"verdict fail ({run.verdict_rung or 'no rung'})"
            )
            lines.append(
                f"| {_cell(_case_name(run))} | {_cell(clip(run.answer))} | {_cell(clip(expected.get(run.case_id)))} "
                f"| {_cell(why)} |"
            )
        if len(failed) > MAX_CASES_IN_SUMMARY:
            lines.append(f"\n… and {len(failed) - MAX_CASES_IN_SUMMARY} more")
        lines.append("")
    return "\n".join(lines)
