"""The pipeline's "once per stage" check reads well and misses nothing (unit)."""

from __future__ import annotations

from collections import Counter

import pytest

from evalbus.testing.pipeline import Counts, count_problems, once_each

pytestmark = pytest.mark.unit


def test_exactly_once_is_no_problem_and_foreign_keys_are_ignored() -> None:
    want = once_each(["r1", "r2"])
    got: Counts = Counter(want)
    got[("r1", "trace.live")] = 3  # another event type: not counted
    assert count_problems("store", got, want) is None


def test_a_stage_event_of_a_run_outside_the_batch_is_extra() -> None:
    want = once_each(["r1"])
    got: Counts = Counter(want)
    got[("r9", "case.executed")] = 1
    problem = count_problems("store", got, want)
    assert problem is not None
    assert "extra [case.executed 1]: None:case.executed×1" in problem


def test_a_duplicate_and_a_loss_are_both_named_with_their_stage() -> None:
    want = once_each([f"r{i}" for i in range(20)], batch_events=False)
    got: Counts = Counter(want)
    got[("r3", "case.judged")] = 2
    del got[("r7", "case.exported")]
    problem = count_problems("CASES stream", got, want)
    assert problem is not None
    assert "missing [case.exported 1]: r7:case.exported×1" in problem
    assert "extra [case.judged 1]: r3:case.judged×1" in problem
    assert problem.startswith("CASES stream: 80 copies of 80 expected")


def test_many_missing_keys_are_summarised_not_listed() -> None:
    want = once_each([f"r{i:03d}" for i in range(100)])
    problem = count_problems("store", Counter(), want, show=3)
    assert problem is not None
    assert "(+399 more)" in problem
    assert "case.requested 100" in problem
    assert "batch.finalized 1" in problem
