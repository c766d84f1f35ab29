"""The pure parts of `evalbus run` / `rejudge` / `tail`: the suite file loader (every problem named
by its field path, harness paths resolved next to the suite), the progress fold and its drawing
(in place on a terminal, periodic lines elsewhere), and the scorecard."""

from __future__ import annotations

import io
from datetime import UTC, datetime
from pathlib import Path

import pytest

from evalbus.cli import main
from evalbus.cli.progress import BatchProgress, ProgressDisplay, bar, plain_line, stage_lines
from evalbus.cli.run import run_error_codes, run_errors
from evalbus.cli.scorecard import render_scorecard
from evalbus.cli.suite_file import SpecFileError, load_judges, load_suite
from evalbus.cli.tail import event_line
from evalbus_api.client import SseEvent
from evalbus_api.views import BatchView, RunView
from evalbus_contracts import (
    BatchFinalized,
    BatchSummary,
    CaseExecuted,
    CaseFailure,
    CaseResult,
    ContainsJudge,
    ExportSummary,
    JsonlSink,
    Measured,
    MetricSummary,
    RegexJudge,
    SinkOutcome,
    StageCounts,
    TrialSummary,
    VerdictSummary,
    encode,
)
from evalbus_gateway.testing import BatchScript, batch_spec

pytestmark = pytest.mark.unit

SUITE = """
suite:
  id: tiny
  cases:
  - id: c1
    input: What is 2 + 2?
    expected: '4'
    graders:
    - kind: answer-match
      id: answer
harness:
  kind: command
  id: agent
  command: [python3, agent.py, --flag, missing.py]
judges:
- kind: exact
  id: exact
sinks:
- kind: jsonl
  path: out/{batch}.jsonl
"""


# ---------------------------------------------------------------- the suite file


def write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


def problems_of(path: Path) -> list[tuple[str, str]]:
    with pytest.raises(SpecFileError) as info:
        load_suite(path)
    return info.value.problems


def test_suite_loads_and_resolves_harness_files_next_to_it(tmp_path: Path) -> None:
    folder = tmp_path / "suites"
    folder.mkdir()
    (folder / "agent.py").write_text("print('4')\n")
    spec = load_suite(write(folder / "suite.yaml", SUITE))
    assert spec.suite.id == "tiny"
    assert spec.harness.command == ("python3", str((folder / "agent.py").resolve()), "--flag", "missing.py")
    [sink] = spec.sinks
    assert isinstance(sink, JsonlSink)
    assert sink.path == "out/{batch}.jsonl"  # the exporter resolves it in its export folder
    assert spec.judges[0].id == "exact"


@pytest.mark.parametrize(
    ("text", "field", "fragment"),
    [
        ("suite: [unclosed", "$", "line 1"),
        ("- just a list", "$", "expected a mapping"),
        (SUITE.replace("id: c1", "id: 12"), "$.suite.cases[0].id", "Expected `str`"),
        (SUITE.replace("kind: answer-match", "kind: answer-matcher"), "$.suite.cases[0].graders[0].kind", "Invalid"),
        (SUITE.replace("  command: [python3, agent.py, --flag, missing.py]\n", ""), "$.harness.command", "missing"),
        (SUITE.replace("- kind: exact\n  id: exact", "- kind: exact\n  id: 'a:b'"), "$.judges[0].id", "':'"),
        (SUITE + "policy:\n  trials: 0\n", "$.policy.trials", "between"),
    ],
    ids=["yaml-syntax", "not-a-mapping", "wrong-type", "unknown-grader", "missing-field", "judge-id", "trials"],
)
def test_suite_problems_name_the_field(tmp_path: Path, text: str, field: str, fragment: str) -> None:
    [(got_field, message)] = problems_of(write(tmp_path / "suite.yaml", text))
    assert got_field == field
    assert fragment in message


def test_every_rule_a_suite_breaks_is_reported(tmp_path: Path) -> None:
    text = SUITE.replace("judges:", "policy:\n  trials: 0\njudges:\n- kind: exact\n  id: exact")
    fields = [f for f, _ in problems_of(write(tmp_path / "suite.yaml", text))]
    assert fields == ["$.judges[1].id", "$.policy.trials"]


def test_unreadable_suite_is_a_problem_at_the_root(tmp_path: Path) -> None:
    [(field, message)] = problems_of(tmp_path / "absent.yaml")
    assert field == "$"
    assert "cannot read" in message


def test_run_with_a_bad_suite_exits_2_naming_the_field(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    suite = write(tmp_path / "suite.yaml", SUITE.replace("id: c1", "id: [c1]"))
    assert main(["run", str(suite), "--gateway", "http://127.0.0.1:9", "--token", "t"]) == 2
    out, err = capsys.readouterr()
    assert out == ""
    assert "$.suite.cases[0].id" in err
    assert str(suite) in err


def test_judges_from_inline_json_a_file_or_a_suite(tmp_path: Path) -> None:
    inline = load_judges('[{"kind": "contains", "id": "c"}, {"kind": "regex", "id": "r", "pattern": "x"}]')
    assert inline == (ContainsJudge(id="c"), RegexJudge(id="r", pattern="x"))
    listed = write(tmp_path / "judges.yaml", "- kind: contains\n  id: c\n")
    assert load_judges(str(listed)) == (ContainsJudge(id="c"),)
    assert [j.id for j in load_judges(str(write(tmp_path / "suite.yaml", SUITE)))] == ["exact"]
    with pytest.raises(SpecFileError) as info:
        load_judges('[{"kind": "contains"}]')
    assert info.value.problems[0][0] == "$[0].id"
    with pytest.raises(SpecFileError) as info:
        load_judges(str(write(tmp_path / "bad.yaml", "judges:\n- kind: nope\n  id: x\n")))
    assert info.value.problems[0][0] == "$.judges[0].kind"
    with pytest.raises(SpecFileError):
        load_judges('{"kind": "contains", "id": "c"}')
    for missing in ("nofile.yaml", str(tmp_path / "gone" / "judges")):  # a path, not YAML text
        with pytest.raises(SpecFileError) as info:
            load_judges(missing)
        assert (info.value.source, info.value.problems) == (missing, [("$", "no such file")])


# ---------------------------------------------------------------- progress


def sse(event: object, seq: int) -> SseEvent:
    return SseEvent(seq, str(getattr(event, "type", "message")), encode(event).decode())


def script_progress(cases: tuple[str, ...] = ("c1", "c2", "c3")) -> tuple[BatchScript, BatchProgress]:
    script = BatchScript("b1", batch_spec(cases))
    return script, BatchProgress("b1")


def test_progress_counts_distinct_runs_per_stage() -> None:
    script, progress = script_progress()
    events = [script.requested(), *script.case_events("c1"), script.case_requested("c2"), script.executed("c2")]
    events.append(script.executed("c2"))  # a redelivery counts once
    for seq, event in enumerate(events, 1):
        progress.apply_sse(sse(event, seq))
    assert progress.total == 3
    assert [progress.count(s) for s in progress.stages()] == [2, 2, 1, 1]
    assert progress.stages() == ("requested", "executed", "judged", "exported")
    assert progress.expected == {"c1": None, "c2": None, "c3": None}
    before_end = (progress.ended, progress.status)
    assert before_end == (False, None)
    progress.apply_sse(sse(script.finalized("cancelled"), 99))
    progress.apply_sse(SseEvent(99, "end", '{"batch_id": "b1", "status": "cancelled"}'))
    assert progress.ended
    assert progress.status == "cancelled"


def test_progress_of_a_rejudge_hides_requested_and_shows_collected_when_deferred() -> None:
    script, progress = script_progress(("c1",))
    executed = script.executed("c1")
    rejudged = CaseExecuted(
        batch_id="b1",
        case_id="c1",
        run_id="evb-b1-c1",
        status="succeeded",
        result=executed.result,
        plan=executed.plan,
        trace_complete=False,
        rejudge_of="b0",
    )
    progress.apply(rejudged)
    assert progress.rejudge_of == "b0"
    assert progress.stages() == ("executed", "collected", "judged", "exported")


def test_undecodable_events_are_skipped() -> None:
    _, progress = script_progress()
    progress.apply_sse(SseEvent(1, "case.executed", "{not json"))
    assert progress.events == 0


def test_bars() -> None:
    assert bar(0, 4, 8) == "[........]"
    assert bar(2, 4, 8) == "[####....]"
    assert bar(9, 4, 8) == "[########]"
    assert bar(3, None, 4) == "[....]"
    _, progress = script_progress()
    assert stage_lines(progress, 10)[0] == "requested  [..........]  0/?"
    progress.apply(BatchScript("b1", batch_spec(("c1", "c2", "c3"))).requested())
    assert plain_line(progress, 1.25) == "[   1.2s] requested 0/3  executed 0/3  judged 0/3  exported 0/3"


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_plain_display_prints_periodic_lines_only_when_something_changed() -> None:
    script, progress = script_progress()
    out, clock = io.StringIO(), Clock()
    display = ProgressDisplay(out, tty=False, interval_s=2.0, clock=clock)
    progress.apply(script.requested())
    display.update(progress)
    assert out.getvalue().count("\n") == 1
    progress.apply(script.case_requested("c1"))
    clock.now += 1.0
    display.update(progress)  # too soon
    assert out.getvalue().count("\n") == 1
    clock.now += 1.5
    display.update(progress)
    clock.now += 5.0
    display.update(progress)  # nothing changed
    lines = out.getvalue().splitlines()
    assert lines == [
        "[   0.0s] requested 0/3  executed 0/3  judged 0/3  exported 0/3",
        "[   2.5s] requested 1/3  executed 0/3  judged 0/3  exported 0/3",
    ]
    for case in ("c1", "c2", "c3"):
        for event in script.case_events(case):
            progress.apply(event)
    clock.now += 0.1
    display.update(progress)  # too soon…
    display.finish(progress)  # …but the end is always drawn
    assert out.getvalue().splitlines()[-1] == "[   7.6s] requested 3/3  executed 3/3  judged 3/3  exported 3/3"
    display.finish(progress)
    assert len(out.getvalue().splitlines()) == 3
    assert "\x1b" not in out.getvalue()


def test_terminal_display_redraws_the_bars_in_place() -> None:
    script, progress = script_progress()
    out, clock = io.StringIO(), Clock()
    display = ProgressDisplay(out, tty=True, redraw_s=0.1, clock=clock)
    progress.apply(script.requested())
    display.update(progress)
    first = out.getvalue()
    assert first.count("\n") == 4
    assert "\x1b[4F" not in first
    for event in script.case_events("c1"):
        progress.apply(event)
    clock.now += 0.5
    display.update(progress)
    second = out.getvalue()[len(first) :]
    assert second.startswith("\x1b[4F")
    assert second.count("\x1b[2K") == 4
    assert "exported   [##########....................]  1/3" in second


def test_a_tick_draws_what_a_throttled_update_left_and_notes_a_stall_once() -> None:
    """Events arriving inside the throttle window were dropped for good: a judge down left the bars
    at 0 while every case executed. The follower's timer draws them, and says when nothing moves."""
    script, progress = script_progress()
    out, clock = io.StringIO(), Clock()
    display = ProgressDisplay(out, tty=False, interval_s=2.0, stall_s=30.0, clock=clock)
    progress.apply(script.requested())
    display.update(progress)
    for case in ("c1", "c2", "c3"):
        progress.apply(script.case_requested(case))
    clock.now += 0.5
    display.update(progress)  # too soon: not drawn…
    assert out.getvalue().count("\n") == 1
    clock.now += 2.0
    display.tick(progress)  # …until the timer comes by
    assert out.getvalue().splitlines()[-1] == "[   2.5s] requested 3/3  executed 0/3  judged 0/3  exported 0/3"
    clock.now += 27.0  # 29 s since the requests arrived
    display.tick(progress)
    assert "no stage has moved" not in out.getvalue()
    clock.now += 2.0  # 31 s
    display.tick(progress)
    display.tick(progress)
    assert out.getvalue().splitlines()[-1] == (
        "no stage has moved for 30 s: `evalbus status` shows whether every service is up"
    )
    assert out.getvalue().count("no stage has moved") == 1
    for event in script.case_events("c1"):
        progress.apply(event)
    clock.now += 3.0
    display.tick(progress)  # moved again: drawn, and a later stall is noted anew
    assert out.getvalue().splitlines()[-1].startswith("[  34.5s] requested 3/3  executed 1/3")
    clock.now += 31.0
    display.tick(progress)
    assert out.getvalue().count("no stage has moved") == 2


def test_a_terminal_notes_a_stall_under_its_bars() -> None:
    script, progress = script_progress()
    out, clock = io.StringIO(), Clock()
    display = ProgressDisplay(out, tty=True, redraw_s=0.1, stall_s=30.0, clock=clock)
    progress.apply(script.requested())
    display.update(progress)
    clock.now += 31.0
    display.tick(progress)
    last = out.getvalue().splitlines()[-1]
    assert last == "\x1b[2Kno stage has moved for 30 s: `evalbus status` shows whether every service is up"
    progress.apply(script.case_requested("c1"))
    clock.now += 1.0
    display.tick(progress)  # the next drawing replaces the note's line with a blank one
    assert out.getvalue().splitlines()[-1] == "\x1b[2K"


# ---------------------------------------------------------------- scorecard


def run_view(case_id: str, *, verdict: str | None, answer: str | None, failure: CaseFailure | None = None) -> RunView:
    return RunView(
        run_id=f"evb-b1-{case_id}",
        case_id=case_id,
        stage="exported",
        batch_id="b1",
        verdict=verdict,  # type: ignore[arg-type]
        verdict_rung="objective" if verdict else None,
        answer=answer,
        failure=failure,
        scores=(Measured(grader_id="answer", metric="answer_match", value=1.0 if verdict == "pass" else 0.0),),
        export_outcomes=(SinkOutcome(sink="jsonl", status="ok", url="file:///x/b1.jsonl"),),
    )


def test_scorecard_shows_metrics_verdicts_export_and_failed_cases() -> None:
    summary = BatchSummary(
        metrics=(
            MetricSummary(metric="answer_match", count=3, mean=1 / 3, pass_rate=1 / 3),
            MetricSummary(metric="cost_usd", count=3, mean=0.0000132),
            MetricSummary(metric="judge:rubric", count=0, unmeasured={"unsupported": 3}),
        ),
        verdicts=VerdictSummary(verdicted=2, passed=1, failed=1, no_verdict=1, pass_rate=0.5),
        counts=StageCounts(requested=3, executed=3, judged=3, exported=3, failed=1),
    )
    view = BatchView(
        batch_id="b1",
        status="succeeded",
        counts=summary.counts,
        total_runs=3,
        suite_id="tiny",
        summary=summary,
        export=ExportSummary(status="succeeded", exported=3),
        finalized_at=datetime(2026, 1, 1, tzinfo=UTC),
    )
    failure = CaseFailure(stage="run", failure_class="agent", code="timeout", message="killed after 30 s")
    runs = [
        run_view("c1", verdict="pass", answer="4"),
        run_view("c2", verdict="fail", answer="Sydney"),
        run_view("c3", verdict=None, answer=None, failure=failure),
    ]
    text = render_scorecard(view, runs, {"c1": "4", "c2": "Canberra", "c3": "x" * 60})
    lines = text.splitlines()
    assert lines[0] == "batch b1  suite tiny  3 runs  status succeeded"
    assert "METRIC        COUNT  MEAN      PASS RATE  UNMEASURED" in lines
    assert "answer_match      3  0.333         33.3%" in lines
    assert "cost_usd          3  1.32e-05          -" in lines
    assert "judge:rubric      0  -                 -  unsupported 3" in lines
    assert "verdicts  1 passed, 1 failed, 1 without a verdict (pass rate 50.0%)" in lines
    assert "export    succeeded: 3 exported, 0 failed  file:///x/b1.jsonl" in lines
    assert "status    succeeded" in lines
    assert "failed cases (2 of 3)" in lines
    c2 = next(line for line in lines if line.strip().startswith("c2"))
    assert "'Sydney'" in c2
    assert "'Canberra'" in c2
    assert "verdict fail (objective)" in c2
    c3 = next(line for line in lines if line.strip().startswith("c3"))
    assert "timeout (agent, run): killed after 30 s" in c3
    assert "…" in c3  # a long expected answer is shortened
    assert "pass@" not in text


def test_the_failed_cases_say_why_and_end_with_the_last_lines_of_their_logs() -> None:
    view = BatchView(
        batch_id="b1", status="failed", counts=StageCounts(requested=2), total_runs=2, summary=BatchSummary()
    )
    crashed = CaseFailure(
        stage="run", failure_class="agent", code="exit_nonzero", message="harness exited with 1",
        log_tail="starting\n\nTraceback (most recent call last):\n  File \"agent.py\", line 3\nNameError: name 'x'"
        + " is not defined in " + "m" * 200 + " module 'nofunc' has no attribute 'solve'\n",
    )  # fmt: skip
    missing = CaseFailure(
        stage="run",
        failure_class="config",
        code="spawn_failed",
        message="cannot start '/no/agent': [Errno 2] " + "x" * 90,
    )
    runs = [
        run_view("c1", verdict=None, answer=None, failure=crashed),
        run_view("c2", verdict=None, answer=None, failure=missing),
    ]
    lines = render_scorecard(view, runs, {}).splitlines()
    c1 = next(line for line in lines if line.strip().startswith("c1 "))
    assert c1.endswith("exit_nonzero (agent, run): harness exited with 1")
    c2 = next(line for line in lines if line.strip().startswith("c2 "))
    assert "spawn_failed (config, run): cannot start '/no/agent': [Errno 2] xxx" in c2
    assert c2.endswith("…")  # a long message is shortened
    at = lines.index("  c1: the last lines of its log (evalbus tail, GET /v1/runs/evb-b1-c1/logs)")
    assert lines[at + 1 : at + 4] == [  # the last three non-empty lines, in order
        "    | Traceback (most recent call last):",
        '    |   File "agent.py", line 3',
        "    | NameError: name 'x' is not defined in "
        + "m" * 40
        + " … "
        + "m" * 37
        + " module 'nofunc' has no attribute 'solve'",
    ]  # a long line keeps its end: what went wrong
    assert not any(line.startswith("  c2: the last lines") for line in lines)  # it left no log


def test_scorecard_shows_pass_at_k_with_trials_and_the_error_of_a_failed_batch() -> None:
    summary = BatchSummary(trials=TrialSummary(k=3, pass_at_1=0.5, pass_at_k=0.75))
    view = BatchView(
        batch_id="b2",
        status="cancelled",
        counts=StageCounts(),
        total_runs=6,
        trials=3,
        summary=summary,
        cancel_reason="cancelled",
        cancelled_by="alice",
    )
    text = render_scorecard(view, [], {})
    assert "6 runs (3 trials per case)" in text
    assert "pass@k    pass@1 0.500, pass@3 0.750" in text
    assert "status    cancelled (by alice)" in text
    assert "(no scores)" in text


def test_tail_lines() -> None:
    script = BatchScript("b1", batch_spec(("c1",)))
    executed = script.executed("c1", status="failed")
    failure = CaseFailure(stage="run", failure_class="harness", code="exit_nonzero", message="exit 3")
    failed = CaseExecuted(
        batch_id="b1",
        case_id="c1",
        run_id=executed.run_id,
        status="failed",
        result=CaseResult(case_id="c1", run_id=executed.result.run_id, harness="echo@1", failure=failure),
        plan=executed.plan,
        ts=datetime(2026, 1, 2, 3, 4, 5, 678000, tzinfo=UTC),
    )
    assert event_line(failed) == "03:04:05.678  case.executed    c1                   failed (exit_nonzero)"
    assert event_line(script.requested()).endswith("1 runs by alice")
    finalized = BatchFinalized(batch_id="b1", status="succeeded", summary=BatchSummary())
    assert event_line(finalized).endswith("batch.finalized  -                    succeeded")


def test_run_errors_are_the_failures_that_are_not_the_agents() -> None:
    spawn = CaseFailure(stage="run", failure_class="config", code="spawn_failed", message="cannot start")
    disk = CaseFailure(stage="run", failure_class="infra", code="disk_full", message="no space")
    protocol = CaseFailure(stage="run", failure_class="harness", code="worker_protocol", message="garbage")
    timeout = CaseFailure(stage="run", failure_class="agent", code="timeout", message="killed")
    runs = [
        run_view("c1", verdict=None, answer=None, failure=spawn),
        run_view("c2", verdict=None, answer=None, failure=disk),
        run_view("c3", verdict=None, answer=None, failure=spawn),
        run_view("c4", verdict="fail", answer=None, failure=timeout),
        run_view("c5", verdict="pass", answer="4"),
        run_view("c6", verdict=None, answer=None, failure=protocol),
    ]
    errors = run_errors(runs)
    assert [r.case_id for r in errors] == ["c1", "c2", "c3", "c6"]  # not the agent's timeout
    assert run_error_codes(errors) == "spawn_failed × 2, disk_full × 1, worker_protocol × 1"
