"""A run's verdict by the authority ladder (pure).

The rungs are checked in order; the first rung with at least one *countable* score decides:

1. `ground_truth`: metric `tests_pass`. The first such score in score order decides.
2. `objective`: `answer_match`, `url_matches`, `dom_contains`, plus the metrics of the case's
   `command` and `script-score` graders (passed as `objective_metrics`, see
   `objective_metrics_of`). All countable scores of the rung must pass.
3. `judge`: `judge` and `judge:<id>`. All must pass. Deeper metrics (`judge:<id>:<criterion>`)
   never decide.
4. `fallback`: any other metric with pass/fail. All must pass.

A score is countable only when it is `measured` and carries `pass`. Observational metrics
(`cost_usd`, `latency_s`, `tool_calls`) never decide, even with a budget. A run cancelled, or
failed at the `dispatch`, `install` or `run` stage, has no verdict (an infrastructure failure is
not the agent's fail). A `collect` failure keeps the verdict of the scores that were measured
(the compute-bound ones); its missing observations are unmeasured and so do not count.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Literal

import msgspec

from evalbus_contracts import CaseFailure, CommandGrader, GraderSpec, Measured, Score, ScriptScoreGrader

Rung = Literal["ground_truth", "objective", "judge", "fallback"]
"""Which rung of the ladder decided."""
Outcome = Literal["pass", "fail"]
"""A verdict."""

GROUND_TRUTH_METRICS: frozenset[str] = frozenset({"tests_pass"})
"""Rung 1."""
OBJECTIVE_METRICS: frozenset[str] = frozenset({"answer_match", "url_matches", "dom_contains"})
"""Rung 2 (with the case's command / script-score metrics)."""
OBSERVATIONAL_METRICS: frozenset[str] = frozenset({"cost_usd", "latency_s", "tool_calls"})
"""Metrics that never decide."""
NO_VERDICT_STAGES: frozenset[str] = frozenset({"dispatch", "install", "run"})
"""Failure stages that leave a run without a verdict."""


class Verdict(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """The ladder's answer for one run."""

    outcome: Outcome | None = None
    """`pass`, `fail`, or None (no verdict)."""
    rung: Rung | None = None
    """The rung that decided."""
    metrics: tuple[str, ...] = ()
    """The metrics of the scores that decided."""
    reason: str | None = None
    """Why there is no verdict: `cancelled`, `failure:<stage>`, `nothing_decisive`."""


def is_judge_metric(metric: str) -> bool:
    """`judge` or `judge:<id>` (a deciding judge metric); `judge:<id>:<sub>` is not."""
    if metric == "judge":
        return True
    head, sep, rest = metric.partition(":")
    return head == "judge" and bool(sep) and bool(rest) and ":" not in rest


def is_judge_detail_metric(metric: str) -> bool:
    """`judge:<id>:<criterion>` and deeper: reported, never deciding."""
    return metric.startswith("judge:") and not is_judge_metric(metric)


def objective_metrics_of(graders: Iterable[GraderSpec]) -> frozenset[str]:
    """Metric names of a case's `command` and `script-score` graders (objective checks)."""
    return frozenset(g.metric for g in graders if isinstance(g, CommandGrader | ScriptScoreGrader))


def _countable(scores: Iterable[Score]) -> list[Measured]:
    return [s for s in scores if isinstance(s, Measured) and s.passed is not None]


def _all_pass(rung: Rung, scores: Sequence[Measured]) -> Verdict:
    ok = all(s.passed for s in scores)
    return Verdict(outcome="pass" if ok else "fail", rung=rung, metrics=tuple(s.metric for s in scores))


def decide(
    scores: Iterable[Score],
    *,
    failure: CaseFailure | None = None,
    cancelled: bool = False,
    objective_metrics: frozenset[str] = frozenset(),
) -> Verdict:
    """The verdict of one run from its scores (in score order) and its failure, if any."""
    if cancelled or (failure is not None and failure.failure_class == "cancelled"):
        return Verdict(reason="cancelled")
    if failure is not None and failure.stage in NO_VERDICT_STAGES:
        return Verdict(reason=f"failure:{failure.stage}")
    countable = [s for s in _countable(scores) if s.metric not in OBSERVATIONAL_METRICS]

    ground = [s for s in countable if s.metric in GROUND_TRUTH_METRICS]
    if ground:
        first = ground[0]
        return Verdict(outcome="pass" if first.passed else "fail", rung="ground_truth", metrics=(first.metric,))

    objective_set = OBJECTIVE_METRICS | (objective_metrics - GROUND_TRUTH_METRICS)
    objective = [s for s in countable if s.metric in objective_set]
    if objective:
        return _all_pass("objective", objective)

    judges = [s for s in countable if is_judge_metric(s.metric)]
    if judges:
        return _all_pass("judge", judges)

    fallback = [
        s
        for s in countable
        if s.metric not in objective_set
        and s.metric not in GROUND_TRUTH_METRICS
        and not is_judge_metric(s.metric)
        and not is_judge_detail_metric(s.metric)
    ]
    if fallback:
        return _all_pass("fallback", fallback)
    return Verdict(reason="nothing_decisive")
