"""The batch spec's own rules, as data: what msgspec's types cannot express (unique ids, ranges,
regexes that compile, judge ids without `:`, gates that parse), each problem at the JSON path of
the offending value. Pure, so the CLI checks a suite file before it sends it and the gateway turns
the same problems into its 400.
"""

from __future__ import annotations

import re
from collections.abc import Sequence

import msgspec

from evalbus_contracts import BatchSpec, CaseSpec, CommandGrader, JudgeSpec, RegexJudge, TextMetricGrader
from evalbus_contracts.specs import harness_problems, lane_problem
from evalbus_contracts.streams import DATASETS
from evalbus_grading.gates import gate_problems

MAX_TRIALS = 100
"""Most trials a batch may ask for per case."""
MAX_RETRIES = 10
"""Most retries a batch may ask for per run."""
MAX_ID_LENGTH = 256
"""Longest id (suite, case, grader, judge, harness, supersede key; and any id in a path)."""
CONTROL_CHARS = re.compile(r"[\x00-\x1f\x7f]")
"""Control characters: never part of an id (PostgreSQL cannot even store NUL in text)."""


class SpecProblem(msgspec.Struct, frozen=True):
    """One broken rule of a batch spec."""

    field: str
    """JSON path of the offending value."""
    message: str
    """What is wrong."""


def _regex_problem(pattern: str, field: str, *, groups: int = 0) -> SpecProblem | None:
    try:
        compiled = re.compile(pattern)
    except re.error as e:
        return SpecProblem(field, f"regex does not compile: {e}")
    if compiled.groups < groups:
        return SpecProblem(field, f"regex needs at least {groups} capture group(s)")
    return None


def _id_problem(value: str, field: str, what: str) -> SpecProblem | None:
    if not value.strip():
        return SpecProblem(field, f"{what} must not be empty")
    if len(value) > MAX_ID_LENGTH:
        return SpecProblem(field, f"{what} is longer than {MAX_ID_LENGTH} characters")
    if CONTROL_CHARS.search(value):
        return SpecProblem(field, f"{what} must not contain control characters")
    return None


def suite_id_problem(value: str, field: str) -> SpecProblem | None:
    """The problem of a suite id (empty, too long), if any."""
    return _id_problem(value, field, "suite id")


def judges_problems(judges: Sequence[JudgeSpec], at: str) -> list[SpecProblem]:
    """Every rule a list of judges breaks (ids unique, non-empty, without ':'; regexes compile)."""
    out: list[SpecProblem | None] = []
    seen_judges: set[str] = set()
    for k, judge in enumerate(judges):
        j_at = f"{at}[{k}]"
        out.append(_id_problem(judge.id, f"{j_at}.id", "judge id"))
        if ":" in judge.id:
            out.append(SpecProblem(f"{j_at}.id", "a judge id must not contain ':'"))
        if judge.id in seen_judges:
            out.append(SpecProblem(f"{j_at}.id", f"duplicate judge id {judge.id!r}"))
        seen_judges.add(judge.id)
        if isinstance(judge, RegexJudge) and judge.pattern is not None:
            out.append(_regex_problem(judge.pattern, f"{j_at}.pattern"))
    return [p for p in out if p is not None]


def case_problems(case: CaseSpec, at: str, seen_cases: set[str]) -> list[SpecProblem]:
    """Every rule one case breaks, its fields named under `at`; `seen_cases` holds the ids of the
    cases before it (this one's is added)."""
    out: list[SpecProblem | None] = [_id_problem(case.id, f"{at}.id", "case id")]
    if case.id in seen_cases:
        out.append(SpecProblem(f"{at}.id", f"duplicate case id {case.id!r}"))
    seen_cases.add(case.id)
    if case.timeout_s is not None and case.timeout_s <= 0:
        out.append(SpecProblem(f"{at}.timeout_s", "must be greater than 0"))
    if case.lane is not None:
        lane = lane_problem(case.lane)
        if lane is not None:
            out.append(SpecProblem(f"{at}.lane", lane))
    seen_graders: set[str] = set()
    for j, grader in enumerate(case.graders):
        g_at = f"{at}.graders[{j}]"
        out.append(_id_problem(grader.id, f"{g_at}.id", "grader id"))
        if grader.id in seen_graders:
            out.append(SpecProblem(f"{g_at}.id", f"duplicate grader id {grader.id!r} in case {case.id!r}"))
        seen_graders.add(grader.id)
        if isinstance(grader, CommandGrader) and grader.pass_pattern is not None:
            out.append(_regex_problem(grader.pass_pattern, f"{g_at}.pass_pattern"))
        if isinstance(grader, TextMetricGrader):
            out.append(_regex_problem(grader.pattern, f"{g_at}.pattern", groups=1))
    return [p for p in out if p is not None]


def batch_spec_problems(spec: BatchSpec) -> list[SpecProblem]:
    """Every rule `spec` breaks, in document order (empty: valid)."""
    out: list[SpecProblem | None] = []
    suite = spec.suite
    out.append(_id_problem(suite.id, "$.suite.id", "suite id"))
    if suite.dataset_ref is not None:
        if suite.cases:
            out.append(SpecProblem("$.suite.cases", "give the cases inline or as suite.dataset_ref, not both"))
        if suite.dataset_ref.bucket != DATASETS.bucket:
            out.append(SpecProblem("$.suite.dataset_ref.bucket", f"datasets are uploaded to {DATASETS.bucket!r}"))
    elif not suite.cases:
        out.append(SpecProblem("$.suite.cases", "a batch needs at least one case"))
    seen_cases: set[str] = set()
    for i, case in enumerate(suite.cases):
        out.extend(case_problems(case, f"$.suite.cases[{i}]", seen_cases))
    harness = spec.harness
    out.append(_id_problem(harness.id, "$.harness.id", "harness id"))
    out.extend(SpecProblem(field, message) for field, message in harness_problems(harness))
    if harness.timeout_s <= 0:
        out.append(SpecProblem("$.harness.timeout_s", "must be greater than 0"))
    out.extend(judges_problems(spec.judges, "$.judges"))
    policy = spec.policy
    if not 1 <= policy.trials <= MAX_TRIALS:
        out.append(SpecProblem("$.policy.trials", f"must be between 1 and {MAX_TRIALS}"))
    if not 0 <= policy.retries <= MAX_RETRIES:
        out.append(SpecProblem("$.policy.retries", f"must be between 0 and {MAX_RETRIES}"))
    if policy.concurrency < 0:
        out.append(SpecProblem("$.policy.concurrency", "must be 0 (no batch limit) or more"))
    elif policy.concurrency > 0:
        # Refused rather than silently ignored: sandboxes are bounded by the dispatchers' compute
        # slots; a per-batch limit across replicas is not built yet.
        out.append(SpecProblem("$.policy.concurrency", "a per-batch sandbox limit is not supported yet: use 0"))
    if spec.supersede_key is not None:
        out.append(_id_problem(spec.supersede_key, "$.supersede_key", "supersede key"))
    out.extend(SpecProblem(field, message) for field, message in gate_problems(spec.gates, "$.gates"))
    return [p for p in out if p is not None]
