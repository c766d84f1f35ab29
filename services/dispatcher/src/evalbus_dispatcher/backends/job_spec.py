"""What a cluster job is told (pure): the runner's job spec for a case attempt, and the run's id in
a form orchestrators accept as a label or name part. Shared by the cluster backends."""

from __future__ import annotations

import hashlib
import re

from evalbus_contracts import CaseRequested, batch_run_id
from evalbus_contracts.runner import RunnerCheck, RunnerJob
from evalbus_contracts.specs import CommandGrader, ScriptScoreGrader, TestsPassGrader
from evalbus_dispatcher.errors import BackendError


def label_value(text: str) -> str:
    """`text` as a valid label value (≤ 63 characters of `[A-Za-z0-9._-]`, alphanumeric at both
    ends); a long or unsafe id keeps a readable head and a hash of the whole."""
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", text).strip("._-")
    if safe == text and len(safe) <= 63:
        return safe
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()[:12]
    head = safe[:50].rstrip("._-")
    return f"{head}-{digest}" if head else digest


def run_of(job: CaseRequested) -> str:
    """The request's run id (derived from its batch, case and trial when absent)."""
    if job.run_id:
        return job.run_id
    if job.batch_id is None:
        raise BackendError("a case request needs a run id or a batch id", code="no_run_id", failure_class="config",
                           retryable=False)  # fmt: skip
    return batch_run_id(job.batch_id, job.case.id, job.trial)


def runner_checks(job: CaseRequested) -> tuple[RunnerCheck, ...]:
    """The compute graders' commands, in grader order."""
    return tuple(
        RunnerCheck(command=g.command, timeout_s=g.timeout_s)
        for g in job.case.graders
        if isinstance(g, TestsPassGrader | CommandGrader | ScriptScoreGrader)
    )


def runner_job(job: CaseRequested, run_id: str, *, hold_s: float = 0.0) -> RunnerJob:
    """What the runner is told: the harness, without secret values (only the variables' names);
    `hold_s`: how long it keeps the job alive for the dispatcher to read declared files (0: not)."""
    harness = job.harness
    return RunnerJob(
        run_id=run_id,
        case_id=job.case.id,
        batch_id=job.batch_id,
        trial=job.trial or 1,
        attempt=job.attempt,
        command=harness.command,
        input=job.case.input,
        env=dict(harness.env),
        secret_vars=tuple(harness.secret_env),
        files=dict(harness.files),
        timeout_s=job.case.timeout_s or harness.timeout_s,
        checks=runner_checks(job),
        hold_s=hold_s,
    )
