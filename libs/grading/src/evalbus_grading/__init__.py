"""evalbus grading: the graders shared by the dispatcher (before and after release) and the
collector (deferred observation graders).

Two kinds: compute graders run commands in the sandbox (`Sandbox` protocol) and must finish
before it is released; observation graders are pure functions of the evidence (answer, trace,
expected). A grader never raises: failures are `unmeasured` scores.
"""

from evalbus_grading.compute import (
    SCORE_PATTERN,
    ComputeGrader,
    ExecResult,
    Sandbox,
    grade_compute_one,
    score_command,
    score_script,
    score_tests_pass,
)
from evalbus_grading.evidence import Evidence
from evalbus_grading.metrics import metric_of
from evalbus_grading.observation import (
    ObservationGrader,
    grade_answer_match,
    grade_cost,
    grade_latency,
    grade_observation,
    grade_steps,
    grade_text_metric,
    normalize_text,
)
from evalbus_grading.phases import (
    grade_compute,
    grade_observations,
    in_grader_order,
    partition,
    unmeasured_scores,
)

__all__ = [
    "SCORE_PATTERN",
    "ComputeGrader",
    "Evidence",
    "ExecResult",
    "ObservationGrader",
    "Sandbox",
    "grade_answer_match",
    "grade_compute",
    "grade_compute_one",
    "grade_cost",
    "grade_latency",
    "grade_observation",
    "grade_observations",
    "grade_steps",
    "grade_text_metric",
    "in_grader_order",
    "metric_of",
    "normalize_text",
    "partition",
    "score_command",
    "score_script",
    "score_tests_pass",
    "unmeasured_scores",
]
