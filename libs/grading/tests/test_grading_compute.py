"""Compute graders over a real shell sandbox: tests-pass, command, script-score, timeouts, errors."""

from __future__ import annotations

from pathlib import Path

import pytest

from evalbus_contracts import CommandGrader, Measured, ScriptScoreGrader, TestsPassGrader, Unmeasured
from evalbus_contracts.scores import Score
from evalbus_grading import ComputeGrader, Sandbox, grade_compute_one

pytestmark = pytest.mark.integration


def measured(score: Score) -> Measured:
    assert isinstance(score, Measured), score
    return score


@pytest.mark.parametrize(("command", "passed"), [("test -f done.txt", True), ("test -f missing.txt", False)])
async def test_tests_pass_is_exit_zero(shell: Sandbox, tmp_path: Path, command: str, passed: bool) -> None:
    (tmp_path / "done.txt").write_text("x")
    score = measured(await grade_compute_one(TestsPassGrader(id="tp", command=command), shell))
    assert (score.metric, score.passed, score.value) == ("tests_pass", passed, 1.0 if passed else 0.0)


async def test_command_pattern_decides_over_exit_code(shell: Sandbox) -> None:
    grader = CommandGrader(id="c", command="echo 'all 12 OK'; exit 3", pass_pattern=r"\d+ OK", metric="lint")
    score = measured(await grade_compute_one(grader, shell))
    assert (score.metric, score.passed) == ("lint", True)
    missing = CommandGrader(id="c", command="echo fine", pass_pattern="OK")
    assert measured(await grade_compute_one(missing, shell)).passed is False


@pytest.mark.parametrize(("exit_code", "expect", "passed"), [(0, 0, True), (2, 2, True), (1, 0, False)])
async def test_command_exit_code_without_pattern(shell: Sandbox, exit_code: int, expect: int, passed: bool) -> None:
    grader = CommandGrader(id="c", command=f"exit {exit_code}", expect_exit=expect)
    score = measured(await grade_compute_one(grader, shell))
    assert (score.metric, score.passed) == ("command", passed)


async def test_command_bad_pattern_is_grader_error(shell: Sandbox) -> None:
    score = await grade_compute_one(CommandGrader(id="c", command="true", pass_pattern="(oops"), shell)
    assert isinstance(score, Unmeasured)
    assert score.reason == "grader_error"


@pytest.mark.parametrize(
    ("stdout", "value", "passed"),
    [
        ("SCORE=0.75", 0.75, True),
        ("warming up\nSCORE=0.6\nSCORE=0.1", 0.6, True),
        ("SCORE=-1.5", -1.5, False),
        ("SCORE=0.59", 0.59, False),
        ("no score printed", 0.0, False),
        ("SCORE=1.2.3", 0.0, False),
    ],
)
async def test_script_score(shell: Sandbox, stdout: str, value: float, passed: bool) -> None:
    grader = ScriptScoreGrader(id="ss", command=f"printf '%s\\n' '{stdout}'")
    score = measured(await grade_compute_one(grader, shell))
    assert (score.metric, score.value, score.passed) == ("score", value, passed)


async def test_script_score_custom_threshold_and_metric(shell: Sandbox) -> None:
    grader = ScriptScoreGrader(id="ss", command="echo SCORE=3", metric="reward", pass_threshold=5)
    score = measured(await grade_compute_one(grader, shell))
    assert (score.metric, score.value, score.passed) == ("reward", 3.0, False)


@pytest.mark.parametrize(
    "grader",
    [
        TestsPassGrader(id="g", command="sleep 30", timeout_s=0.3),
        CommandGrader(id="g", command="sleep 30", timeout_s=0.3),
        ScriptScoreGrader(id="g", command="sleep 30; echo SCORE=1", timeout_s=0.3),
    ],
)
async def test_timeout_is_grader_timeout(shell: Sandbox, grader: ComputeGrader) -> None:
    score = await grade_compute_one(grader, shell)
    assert isinstance(score, Unmeasured)
    assert score.reason == "grader_timeout"
    assert score.grader_id == "g"


async def test_exception_is_grader_error_never_raised(broken_sandbox: Sandbox) -> None:
    score = await grade_compute_one(TestsPassGrader(id="tp", command="true"), broken_sandbox)
    assert isinstance(score, Unmeasured)
    assert score.reason == "grader_error"
    assert score.metric == "tests_pass"
    assert "sandbox went away" in (score.detail or "")
