"""What a cluster job is told (pure): the runner's job spec for a case attempt, where its runner
publishes the live view itself (`RunnerNats`, the execution's `LiveHandoff`), and the run's id in a
form orchestrators accept as a label or name part. Shared by the cluster backends."""

from __future__ import annotations

import contextlib
import hashlib
import re
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from evalbus_contracts import CaseRequested, batch_run_id
from evalbus_contracts.runner import RunnerCheck, RunnerJob, RunnerLive
from evalbus_contracts.specs import CommandGrader, ScriptScoreGrader, TestsPassGrader
from evalbus_dispatcher.errors import BackendError
from evalbus_dispatcher.runner_auth import TOKEN_MARGIN_S, RunTokens


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


@dataclass(frozen=True, slots=True)
class RunnerNats:
    """Where the runners publish the live log and trace themselves (`DISPATCHER_RUNNER_NATS_URL`)
    and the tokens they log in with (`DISPATCHER_RUNNER_AUTH_SEED`)."""

    url: str
    """The NATS URL as reachable from inside the jobs."""
    tokens: RunTokens | None = None
    """Mints each job's run token (`DISPATCHER_RUNNER_AUTH_SEED`): its runner may publish that run's
    live log and trace only, until the job's longest life is over (None: the runners connect as
    the URL says, to a server that asks for no credentials)."""


class LiveHandoff(Protocol):
    """One execution's live view, as a runner continues it (the dispatcher's `LiveBus`)."""

    @property
    def execution(self) -> str:
        """The execution's id (in every live message)."""
        ...

    @property
    def offset(self) -> int:
        """Bytes of the run's live log published so far."""
        ...

    def clock(self) -> float:
        """Seconds on the run's clock now."""
        ...

    def runner_publishes(self) -> None:
        """The runner said it publishes the live log and trace itself: the dispatcher stops relaying them."""
        ...


class LiveHandoffs:
    """The live views of the runs this replica executes, by run id: what a cluster backend tells a
    runner that publishes the live view itself (`runner_live`)."""

    def __init__(self) -> None:
        self._by_run: dict[str, LiveHandoff] = {}

    @contextlib.contextmanager
    def holding(self, run_id: str, handoff: LiveHandoff) -> Iterator[None]:
        """`handoff` is the run's while the block runs."""
        self._by_run[run_id] = handoff
        try:
            yield
        finally:
            if self._by_run.get(run_id) is handoff:
                del self._by_run[run_id]

    def get(self, run_id: str) -> LiveHandoff | None:
        """The run's live view, when this replica executes it now."""
        return self._by_run.get(run_id)


def longest_life_s(job: CaseRequested, *, start_timeout_s: float, hold_s: float = 0.0) -> float:
    """The longest a case's job lives: waiting to start, the harness, the checks, the artifact hold,
    and two minutes for the rest (a Kubernetes Job's `activeDeadlineSeconds`, a run token's life)."""
    timeout = job.case.timeout_s or job.harness.timeout_s
    return start_timeout_s + timeout + sum(c.timeout_s for c in runner_checks(job)) + hold_s + 120.0


def runner_live(
    nats: RunnerNats | None, handoff: LiveHandoff | None, job: CaseRequested, *, life_s: float
) -> RunnerLive | None:
    """What the runner is told about publishing the live view itself (None: it does not): with run
    tokens, a token for the job's run valid `life_s` (`longest_life_s`) and `TOKEN_MARGIN_S` more."""
    if nats is None or not nats.url or handoff is None:
        return None
    token = nats.tokens.mint(run_of(job), life_s + TOKEN_MARGIN_S) if nats.tokens is not None else None
    return RunnerLive(
        nats_url=nats.url,
        token=token,
        execution=handoff.execution,
        offset=handoff.offset,
        t_offset=round(handoff.clock(), 6),
    )


def runner_job(job: CaseRequested, run_id: str, *, hold_s: float = 0.0, live: RunnerLive | None = None) -> RunnerJob:
    """What the runner is told: the harness, without secret values (only the variables' names);
    `hold_s`: how long it keeps the job alive for the dispatcher to read declared files (0: not);
    `live`: where it publishes the live view itself."""
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
        live=live,
    )
