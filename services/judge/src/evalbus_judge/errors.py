"""The judge package's exception root.

A judge's own failure is data (an `unmeasured` score); these exceptions are for the machinery
around the judges, and only they may escape a judge into `CaseJudged.judge_error`.
"""

from __future__ import annotations


class JudgeServiceError(Exception):
    """Root of every exception the judge package raises on purpose."""


class JudgeMachineryError(JudgeServiceError):
    """The machinery around the judges is broken (not started, miswired): the case is not judged
    honestly, so the error escapes the judge and marks the batch `error.phase = "judges"`."""
