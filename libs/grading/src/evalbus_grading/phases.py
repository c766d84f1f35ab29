"""The two grading phases and the score order across them.

Compute graders run in the sandbox before it is released; observation graders run afterwards
(possibly in another service). The partition rule is `evalbus_contracts.needs_compute`, so the
dispatcher and the collector always agree on it. Scores are reported in grader order, whatever
phase produced them.
"""

from __future__ import annotations

from collections import defaultdict, deque
from collections.abc import Iterable, Sequence

from evalbus_contracts import GraderSpec, Score, Unmeasured, UnmeasuredReason, needs_compute
from evalbus_grading.compute import ComputeGrader, Sandbox, grade_compute_one
from evalbus_grading.evidence import Evidence
from evalbus_grading.metrics import metric_of
from evalbus_grading.observation import ObservationGrader, grade_observation


def partition(
    graders: Iterable[GraderSpec],
) -> tuple[tuple[ComputeGrader, ...], tuple[ObservationGrader, ...]]:
    """Split graders into (needs the sandbox, observation only), each in grader order."""
    compute: list[ComputeGrader] = []
    observation: list[ObservationGrader] = []
    for grader in graders:
        if needs_compute(grader):
            compute.append(grader)  # type: ignore[arg-type]  # needs_compute is the kind check
        else:
            observation.append(grader)  # type: ignore[arg-type]
    return tuple(compute), tuple(observation)


async def grade_compute(graders: Iterable[GraderSpec], sandbox: Sandbox) -> tuple[Score, ...]:
    """Run the compute graders among `graders`, one after another (they share the workdir)."""
    compute, _ = partition(graders)
    return tuple([await grade_compute_one(grader, sandbox) for grader in compute])


def grade_observations(graders: Iterable[GraderSpec], evidence: Evidence) -> tuple[Score, ...]:
    """Grade the observation-only graders among `graders` over the evidence."""
    _, observation = partition(graders)
    return tuple(grade_observation(grader, evidence) for grader in observation)


def unmeasured_scores(
    graders: Iterable[GraderSpec],
    reason: UnmeasuredReason,
    detail: str,
    *,
    retryable: bool = False,
) -> tuple[Score, ...]:
    """Placeholder scores for graders that could not run (e.g. the trace could not be pulled)."""
    return tuple(
        Unmeasured(grader_id=g.id, metric=metric_of(g), reason=reason, detail=detail, retryable=retryable)
        for g in graders
    )


def in_grader_order(graders: Sequence[GraderSpec], *phases: Iterable[Score]) -> tuple[Score, ...]:
    """Merge scores from any number of phases back into grader order.

    Scores are matched to graders by `grader_id` (repeated ids match in turn); a score whose
    grader is not in `graders` is kept, after the others, in the order given — never dropped.
    """
    arrival = [score for scores in phases for score in scores]
    pending: defaultdict[str, deque[int]] = defaultdict(deque)
    for index, score in enumerate(arrival):
        pending[score.grader_id].append(index)
    order: list[int] = []
    for grader in graders:
        queue = pending.get(grader.id)
        if queue:
            order.append(queue.popleft())
    placed = set(order)
    order.extend(i for i in range(len(arrival)) if i not in placed)
    return tuple(arrival[i] for i in order)
