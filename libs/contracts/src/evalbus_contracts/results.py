"""What a stage knows about a run: its result, its failure, its trace reference, its snapshot."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

from evalbus_contracts.objects import ObjectRef
from evalbus_contracts.placement import PlacementSample
from evalbus_contracts.scores import Score
from evalbus_contracts.specs import Correlate, PlatformKind
from evalbus_contracts.trace import Infra, TraceEvent

FailureStage = Literal["dispatch", "install", "run", "collect", "grade", "judge", "export"]
"""Where a run failed."""
FailureClass = Literal["infra", "config", "harness", "agent", "cancelled"]
"""Whose fault: the platform, the spec, the harness, the agent; or the batch was cancelled."""


class _Data(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


class Placement(_Data, frozen=True, kw_only=True):
    """Where the sandbox ran, captured when the failure happened."""

    unit: str | None = None
    """Backend unit (process group id, allocation, pod)."""
    node: str | None = None
    """Node name."""
    events: tuple[Infra, ...] = ()
    """Infra marks up to the failure (the backend's event feed: accepted, waiting, started, placed,
    exited...)."""
    dispatcher: str | None = None
    """Id of the dispatcher replica that held the sandbox."""
    resources: PlacementSample | None = None
    """The last resource sample of the sandbox (its exit, when the harness had exited): pid, memory,
    CPU, age, exit code or signal, OOM verdict."""


class CaseFailure(_Data, frozen=True, kw_only=True):
    """Why a run produced no (complete) outcome; a failure is data, never a lost exception."""

    stage: FailureStage
    """Stage that failed."""
    failure_class: FailureClass = msgspec.field(name="class")
    """Whose fault."""
    code: str
    """Stable machine code (`timeout`, `spawn_failed`, `exit_nonzero`, `collect_failed`...)."""
    message: str
    """Human-readable explanation."""
    retryable: bool = False
    """Whether running again may succeed."""
    placement: Placement | None = None
    """Placement evidence at failure time."""
    log_tail: str | None = None
    """The end of the process output at failure time, control lines removed, at most 16 KiB:
    stderr first, then (when both streams have output) as much of stdout's end as fits."""

    def never_ran(self) -> bool:
        """Whether the harness never ran: the run failed before it (dispatch, install: no sandbox,
        an unschedulable case, a missing secret) or could not start it (`spawn_failed`: a missing
        program, a spec error; `worker_start_failed`: a warm worker that exited before it was
        ready, an import error, say). Such a run says nothing of the agent: it is not graded, and
        a batch none of whose runs ran fails (`no_run_executed`)."""
        return self.stage in ("dispatch", "install") or self.code in NEVER_STARTED_CODES

    def run_error(self) -> bool:
        """Whether the run failed for a reason that is not the agent's (the platform, the spec, the
        harness: `--fail-on-run-errors`), rather than the agent answering badly, timing out or
        exiting non-zero."""
        return self.failure_class in ("infra", "config", "harness")


NEVER_STARTED_CODES = frozenset({"spawn_failed", "worker_start_failed"})
"""Run failure codes of a harness that never got the case."""


class TraceRef(_Data, frozen=True, kw_only=True):
    """Where a run's platform trace can be pulled from (the secret by name only)."""

    kind: PlatformKind
    """Platform."""
    endpoint: str
    """Platform base URL."""
    run_id: str
    """Correlation key."""
    correlate: Correlate = "id"
    """`id` or `tag` correlation."""
    auth_secret: str | None = None
    """Secret *name*."""
    experiment: str | None = None
    """MLflow experiment."""
    project: str | None = None
    """Project (Phoenix, LangSmith, Langfuse)."""
    service: str | None = None
    """OpenTelemetry service name."""
    mapping: dict[str, str] = msgspec.field(default_factory=dict)
    """Span attribute overrides."""


class _Snapshot(_Data, frozen=True, kw_only=True, tag_field="kind"):
    pass


class PromptSnapshot(_Snapshot, frozen=True, kw_only=True, tag="prompt"):
    """The final output of a prompt-style run."""

    output: str
    """The final answer."""


class RepoSnapshot(_Snapshot, frozen=True, kw_only=True, tag="repo"):
    """The workdir's changes after the run."""

    diff: str = ""
    """Unified diff (capped)."""
    changed_files: tuple[str, ...] = ()
    """Paths changed."""
    head_sha: str | None = None
    """Git head, when the workdir is a repository."""


class BrowserSnapshot(_Snapshot, frozen=True, kw_only=True, tag="browser"):
    """The browser at the end of the run."""

    url: str
    """Current URL."""
    dom_ref: str | None = None
    """Object-store name of the DOM."""
    screenshot_ref: str | None = None
    """Object-store name of the screenshot."""
    console: tuple[str, ...] = ()
    """Console lines."""


class OsUseSnapshot(_Snapshot, frozen=True, kw_only=True, tag="os-use"):
    """A desktop at the end of the run."""

    screenshot_ref: str | None = None
    """Object-store name of the screenshot."""
    windows: tuple[str, ...] = ()
    """Window titles."""


Snapshot = PromptSnapshot | RepoSnapshot | BrowserSnapshot | OsUseSnapshot
"""Any snapshot, discriminated on `kind`."""


class CaseTimings(_Data, frozen=True, kw_only=True):
    """When the run moved, for the sandbox-hold and streaming measurements."""

    queued_at: datetime | None = None
    """`case.requested` was accepted by a dispatcher."""
    started_at: datetime | None = None
    """The harness process started."""
    released_at: datetime | None = None
    """The compute slot was released."""
    executed_at: datetime | None = None
    """`case.executed` was built."""
    sandbox_seconds: float = 0.0
    """Seconds the compute slot was held."""
    harness_seconds: float = 0.0
    """Seconds the harness process ran."""


OffloadedField = Literal["answer", "trace", "snapshot"]
"""A field of a `CaseResult` that may be moved into its payload object."""


class ResultPayload(_Data, frozen=True, kw_only=True):
    """The large parts of a `CaseResult`, stored as one object (`CaseResult.payload`)."""

    answer: str | None = None
    """The final answer, when offloaded."""
    trace: tuple[TraceEvent, ...] = ()
    """The trace, in order, when offloaded."""
    snapshot: Snapshot | None = None
    """The environment at the end, when offloaded."""


class CaseResult(_Data, frozen=True, kw_only=True):
    """Everything known about one run after execution (and collection)."""

    case_id: str
    """Case id."""
    run_id: str
    """Run id."""
    harness: str
    """`id@version` of the harness."""
    trial: int | None = None
    """Trial number when trials > 1."""
    answer: str | None = None
    """The final answer."""
    exit_code: int | None = None
    """Harness exit code (124 on timeout)."""
    trace: tuple[TraceEvent, ...] = ()
    """The trace, in order."""
    scores: tuple[Score, ...] = ()
    """Grader scores in grader order, then judge scores in selection order."""
    snapshot: Snapshot | None = None
    """The environment at the end."""
    failure: CaseFailure | None = None
    """Set when the run failed."""
    trace_ref: TraceRef | None = None
    """Where the platform trace is, when the harness exports one."""
    timings: CaseTimings = msgspec.field(default_factory=CaseTimings)
    """Timings."""
    payload: ObjectRef | None = None
    """Where the parts of this result too large to ride in an event are: a `ResultPayload` (JSON)
    in the `artifacts` bucket, set when the encoded answer, trace and snapshot together exceed the
    producer's inline threshold. The fields named in `offloaded` are then empty here and complete
    in the object; a reader loads it and checks its size and SHA-256 (a mismatch is tampering,
    never a silent wrong answer)."""
    offloaded: tuple[OffloadedField, ...] = ()
    """Which fields are in `payload` instead of here."""
