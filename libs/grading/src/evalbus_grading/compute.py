"""Compute graders: commands run in the sandbox, before it is released.

They are written against the `Sandbox` protocol (run a shell command in the case's workdir), so
any backend's handle can serve them. Each returns exactly one score and never raises: a command
that times out is `unmeasured` (`grader_timeout`), any other error `unmeasured` (`grader_error`).
"""

from __future__ import annotations

import asyncio
import math
import re
from dataclasses import dataclass
from typing import Protocol

from evalbus_contracts import CommandGrader, Measured, Score, ScriptScoreGrader, TestsPassGrader, Unmeasured
from evalbus_grading.metrics import metric_of

ComputeGrader = TestsPassGrader | CommandGrader | ScriptScoreGrader
"""The grader kinds that need the sandbox."""

SCORE_PATTERN = re.compile(r"SCORE=([-\d.]+)")
"""What a script-score command prints; the first match counts."""

EXEC_GRACE_S = 15.0
"""Extra seconds a sandbox gets past a grader's timeout to report its own timeout."""


@dataclass(frozen=True, slots=True)
class ExecResult:
    """The outcome of one command run in a sandbox."""

    exit_code: int
    """Exit code (124 when the command was killed on timeout)."""
    stdout: str
    """Standard output (possibly capped by the backend)."""
    stderr: str
    """Standard error (possibly capped by the backend)."""
    timed_out: bool = False
    """The command was killed because it ran past its timeout."""


class Sandbox(Protocol):
    """Where compute graders run: a shell in the case's workdir."""

    async def exec(self, command: str, timeout_s: float) -> ExecResult:
        """Run `command` with a shell in the workdir; kill it after `timeout_s` seconds."""
        ...


def score_tests_pass(grader: TestsPassGrader, result: ExecResult) -> Score:
    """Ground truth: pass when the command exits 0 (value 1/0)."""
    passed = result.exit_code == 0
    return Measured(
        grader_id=grader.id,
        metric=metric_of(grader),
        value=1.0 if passed else 0.0,
        passed=passed,
        detail=f"exit {result.exit_code}",
    )


def score_command(grader: CommandGrader, result: ExecResult) -> Score:
    """Pass when stdout matches `pass_pattern`, or (without a pattern) on the expected exit code."""
    if grader.pass_pattern is not None:
        try:
            passed = re.search(grader.pass_pattern, result.stdout) is not None
        except re.error as e:
            return Unmeasured(
                grader_id=grader.id,
                metric=metric_of(grader),
                reason="grader_error",
                detail=f"bad pattern: {e}",
            )
        detail = "pattern matched" if passed else "pattern not found in stdout"
    else:
        passed = result.exit_code == grader.expect_exit
        detail = f"exit {result.exit_code} (expected {grader.expect_exit})"
    return Measured(
        grader_id=grader.id,
        metric=metric_of(grader),
        value=1.0 if passed else 0.0,
        passed=passed,
        detail=detail,
    )


def score_script(grader: ScriptScoreGrader, result: ExecResult) -> Score:
    """The number printed as `SCORE=<n>`; pass at or above the threshold. No score printed is 0."""
    match = SCORE_PATTERN.search(result.stdout)
    value: float | None = None
    if match is not None:
        try:
            value = float(match.group(1))
        except ValueError:
            value = None
        if value is not None and not math.isfinite(value):
            value = None
    if value is None:
        return Measured(
            grader_id=grader.id,
            metric=metric_of(grader),
            value=0.0,
            passed=False,
            detail=f"no SCORE=<number> in stdout (exit {result.exit_code})",
        )
    return Measured(
        grader_id=grader.id,
        metric=metric_of(grader),
        value=value,
        passed=value >= grader.pass_threshold,
        detail=f"threshold {grader.pass_threshold}",
    )


async def grade_compute_one(grader: ComputeGrader, sandbox: Sandbox) -> Score:
    """Run one compute grader in the sandbox; never raises."""
    metric = metric_of(grader)
    try:
        async with asyncio.timeout(grader.timeout_s + EXEC_GRACE_S):
            result = await sandbox.exec(grader.command, grader.timeout_s)
    except TimeoutError:
        return _timed_out(grader, metric)
    except Exception as e:  # a grader never raises: the error is the score
        return Unmeasured(grader_id=grader.id, metric=metric, reason="grader_error", detail=f"{type(e).__name__}: {e}")
    if result.timed_out:
        return _timed_out(grader, metric)
    match grader:
        case TestsPassGrader():
            return score_tests_pass(grader, result)
        case CommandGrader():
            return score_command(grader, result)
        case ScriptScoreGrader():
            return score_script(grader, result)


def _timed_out(grader: ComputeGrader, metric: str) -> Unmeasured:
    return Unmeasured(
        grader_id=grader.id,
        metric=metric,
        reason="grader_timeout",
        detail=f"command ran past {grader.timeout_s:g}s",
    )
