"""A benchmark's goals as data, and the `--check` verdict on them.

Every goal compares one measured figure with a target: a ratio to a baseline measured in the same
run (`chassis / bare relay ≥ 0.7`), a bound printed with its formula (`makespan / bound ≤ 1.15`),
a fixed figure from the issue (`≥ 10,000 events/s`), or a count that must come out exact (every
event stored). Each script lists its goals in its JSON output (`"goals": [...]`, with `"ok"` their
conjunction) and under its table; with `--check` it exits 1, naming the missed ones, when any is
missed. A figure that could not be measured (NaN, None) misses its goal.
"""

from __future__ import annotations

import argparse
import math
import sys
from collections.abc import Sequence
from typing import Literal

import msgspec

Comparison = Literal[">=", "<=", "=="]
"""How the measured figure must compare with the goal."""


class Goal(msgspec.Struct, frozen=True, kw_only=True):
    """One goal of a benchmark run, judged."""

    name: str
    """What is measured, as the table and `--check` name it."""
    measured: float | None
    """The figure measured in this run (None: not measured)."""
    goal: float
    """The target it is compared with."""
    comparison: Comparison
    """`measured <comparison> goal` must hold."""
    passed: bool
    """Whether it held."""
    basis: str
    """Where the goal comes from: the baseline or formula it is relative to."""


def goal(name: str, measured: float | None, comparison: Comparison, target: float, basis: str) -> Goal:
    """Judge `measured` against `target`."""
    if measured is None or math.isnan(measured):
        passed = False
    elif comparison == ">=":
        passed = measured >= target
    elif comparison == "<=":
        passed = measured <= target
    else:
        passed = measured == target
    return Goal(name=name, measured=measured, goal=target, comparison=comparison, passed=passed, basis=basis)


_SYMBOL = {">=": "≥", "<=": "≤", "==": "="}


def describe(g: Goal) -> str:
    """`name: measured (goal ≥ target; basis) passed|MISSED` for the table and the verdict."""
    measured = "not measured" if g.measured is None or math.isnan(g.measured) else _number(g.measured)
    verdict = "passed" if g.passed else "MISSED"
    return f"{g.name}: {measured} (goal {_SYMBOL[g.comparison]} {_number(g.goal)}; {g.basis}) {verdict}"


def _number(value: float) -> str:
    """Whole numbers and figures from 1,000 up without decimals (40001, 23595, never 4e+04),
    smaller ones to 4 significant digits."""
    if abs(value) >= 1000 or value == int(value):
        return f"{value:.0f}"
    return f"{value:.4g}"


def goal_notes(goals: Sequence[Goal]) -> list[str]:
    """The lines printed under a benchmark's table."""
    return ["goals:", *(f"  {describe(g)}" for g in goals)]


def add_check_flag(parser: argparse.ArgumentParser) -> None:
    """The `--check` option every benchmark takes."""
    parser.add_argument(
        "--check", action="store_true", help="exit 1 (naming them on stderr) when any goal is missed; else exit 0"
    )


def verdict(benchmark: str, goals: Sequence[Goal], *, check: bool) -> int:
    """The exit status: 0, unless `check` and a goal was missed (then listed on stderr) → 1."""
    missed = [g for g in goals if not g.passed]
    if not check or not missed:
        return 0
    print(f"{benchmark}: {len(missed)} of {len(goals)} goals missed", file=sys.stderr)
    for g in missed:
        print(f"  {describe(g)}", file=sys.stderr)
    return 1
