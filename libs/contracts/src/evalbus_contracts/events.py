"""Every event on the bus. Each carries an event id, its type tag, a schema version, a UTC
timestamp and the batch / case / run / attempt ids it concerns.

`subject()` and `msg_id()` are pure: the subject it is published on and its `Nats-Msg-Id`
(`<type>:<run id>` for run events, `<type>:<batch id>` for batch events), so a redelivered
stage cannot emit twice inside the duplicate window, and `stage_output_key` names the output a
redelivery looks for on the stream after it.
"""

from __future__ import annotations

import os
import random
from datetime import UTC, datetime
from typing import ClassVar, Literal

import msgspec

from evalbus_contracts import subjects as s
from evalbus_contracts.placement import PlacementSample
from evalbus_contracts.results import CaseResult
from evalbus_contracts.specs import BatchSpec, CaseSpec, HarnessSpec, JudgeSpec, OnlineSuiteSpec, SinkSpec
from evalbus_contracts.summary import BatchError, BatchSummary, ExportSummary, SinkOutcome
from evalbus_contracts.trace import Infra, SpanData, TraceEvent

_ids = random.Random(os.urandom(32))
os.register_at_fork(after_in_child=lambda: _ids.seed(os.urandom(32)))


def new_event_id() -> str:
    """A fresh event id: 128 random bits as 32 hex digits (the shape of a UUID4's hex).

    Drawn from a generator seeded from the OS once per process (and again in a forked child), not
    from the OS per id: an id must be unique, not unpredictable, and `uuid.uuid4()` (a system call
    and a UUID object per id) was the dispatcher's largest single cost after sockets."""
    return f"{_ids.getrandbits(128):032x}"


def utcnow() -> datetime:
    """Now, timezone-aware UTC."""
    return datetime.now(UTC)


class _Event(msgspec.Struct, frozen=True, kw_only=True, tag_field="type"):
    SCHEMA_VERSION: ClassVar[int] = 1

    event_id: str = msgspec.field(default_factory=new_event_id)
    """Unique id of this event."""
    v: int = 1
    """Schema version of this event type."""
    ts: datetime = msgspec.field(default_factory=utcnow)
    """When the event was built (UTC)."""
    batch_id: str | None = None
    """Batch this event belongs to."""
    case_id: str | None = None
    """Case id."""
    run_id: str | None = None
    """Run id."""
    attempt: int = 1
    """Execution attempt (retries of retryable failures increase it)."""

    @property
    def type(self) -> str:
        """The event type tag."""
        return str(type(self).__struct_config__.tag)

    def subject(self) -> str:
        """Subject this event is published on."""
        raise NotImplementedError

    def msg_id(self) -> str:
        """`Nats-Msg-Id` for deduplication."""
        key = self.run_id or self.batch_id or self.event_id
        return f"{self.type}:{key}"


class CasePlan(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """What later stages need to know about the batch, carried with every case event so no
    service depends on cross-subject order or shared state."""

    judges: tuple[JudgeSpec, ...] = ()
    """Judges in selection order."""
    sinks: tuple[SinkSpec, ...] = ()
    """Export sinks."""
    retries: int = 1
    """Retries for retryable infrastructure failures."""
    trials: int = 1
    """Trials per case."""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    """Batch labels."""
    suite_id: str | None = None
    """Suite id."""
    submitted_by: str | None = None
    """Creator of the batch."""


# ---------------------------------------------------------------- batch events


class BatchRequested(_Event, frozen=True, kw_only=True, tag="batch.requested"):
    """The gateway accepted a batch."""

    spec: BatchSpec
    """The validated spec."""
    submitted_by: str
    """Principal that submitted it."""
    rejudge_of: str | None = None
    """Set for a re-judge: the batch whose `case.executed` events are replayed to the judges
    (the dispatcher executes nothing for it)."""
    request_digest: str | None = None
    """Set when the request carried an `Idempotency-Key`: the SHA-256 (hex) of its normalised spec,
    which a later request with the same key must match to get this batch back (else it is refused
    as a reused key). None on other requests, and on events written before the field existed."""

    def subject(self) -> str:
        return s.batch_subject(s.BATCH_REQUESTED, _req(self.batch_id, "batch id"))


class BatchCancelled(_Event, frozen=True, kw_only=True, tag="batch.cancelled"):
    """A batch stops starting cases; in-flight ones settle."""

    reason: Literal["cancelled", "superseded"]
    """User cancel or supersede."""
    by: str
    """Principal (or the superseding batch id)."""
    superseded_by: str | None = None
    """Batch that superseded this one."""

    def subject(self) -> str:
        return s.batch_subject(s.BATCH_CANCELLED, _req(self.batch_id, "batch id"))


class BatchFinalized(_Event, frozen=True, kw_only=True, tag="batch.finalized"):
    """Every case is exported; the aggregate is final."""

    status: Literal["succeeded", "failed", "cancelled", "superseded"]
    """Final status."""
    summary: BatchSummary
    """The aggregate."""
    export: ExportSummary = msgspec.field(default_factory=ExportSummary)
    """Export status."""
    error: BatchError | None = None
    """Why it failed."""

    def subject(self) -> str:
        return s.batch_subject(s.BATCH_FINALIZED, _req(self.batch_id, "batch id"))


# ---------------------------------------------------------------- case events


class _CaseEvent(_Event, frozen=True, kw_only=True):
    def subject(self) -> str:
        return s.case_subject(self.type, _req(self.batch_id, "batch id"), _req(self.case_id, "case id"))


EventKey = tuple[str, str]
"""An event's subject and `Nats-Msg-Id`: what finds its stored copy on the stream."""


def stage_output_key(kind: str, event: EventBase) -> EventKey | None:
    """The key of the `kind` event (`case.collected`, `case.judged`, `case.exported`, …) of the same
    batch run as `event`, the stage input it would be the output of: `case.judged` of a
    `case.executed` is on `case.judged.<batch>.<case>` with id `case.judged:<run>`. None for an
    event of no batch run (an observation, a batch event)."""
    if not isinstance(event, _CaseEvent) or not (event.batch_id and event.case_id and event.run_id):
        return None
    return s.case_subject(kind, event.batch_id, event.case_id), f"{kind}:{event.run_id}"


class CaseRequested(_CaseEvent, frozen=True, kw_only=True, tag="case.requested"):
    """One case × trial to execute."""

    trial: int | None = None
    """Trial number when trials > 1."""
    case: CaseSpec
    """The case."""
    harness: HarnessSpec
    """The agent."""
    plan: CasePlan
    """What later stages need."""

    @property
    def lane(self) -> str:
        """The lane it runs in: the case's own, else the harness's (`default` for a request written
        before lanes existed, which names neither)."""
        return self.case.lane or self.harness.lane or s.DEFAULT_LANE

    def subject(self) -> str:
        return s.case_requested_subject(_req(self.batch_id, "batch id"), _req(self.case_id, "case id"), self.lane)

    def msg_id(self) -> str:
        # A retry of a retryable infrastructure failure is a new request of the same run.
        base = f"{self.type}:{self.run_id}"
        return base if self.attempt == 1 else f"{base}:a{self.attempt}"


class CaseExecuted(_CaseEvent, frozen=True, kw_only=True, tag="case.executed"):
    """The sandbox ran and was released."""

    status: Literal["succeeded", "failed", "cancelled"]
    """Execution outcome."""
    result: CaseResult
    """Scores so far, trace, snapshot, failure, trace reference."""
    plan: CasePlan
    """Carried forward."""
    case: CaseSpec | None = None
    """The case (input, expected, graders), carried forward for graders and judges."""
    trace_complete: bool = True
    """False when the collector still has to pull the trace (`control-plane` collect)."""
    deferred_graders: tuple[str, ...] = ()
    """Ids of observation graders left to the collector."""
    rejudge_of: str | None = None
    """Original batch id when this is a re-judge replay."""
    output_tail: str | None = None
    """The end of the run's output (control lines removed, at most 16 KiB, as `CaseFailure.log_tail`),
    so its log outlives the LIVE stream; None when it printed nothing, or when its failure carries
    the same tail (`result.failure.log_tail`). Not carried forward to later stages."""


class CaseCollected(_CaseEvent, frozen=True, kw_only=True, tag="case.collected"):
    """The collector completed a deferred trace and graded what was deferred."""

    result: CaseResult
    """The completed result."""
    plan: CasePlan
    """Carried forward."""
    case: CaseSpec | None = None
    """The case (input, expected, graders), carried forward for graders and judges."""


class CaseJudged(_CaseEvent, frozen=True, kw_only=True, tag="case.judged"):
    """Judges applied (or skipped for a case without an outcome)."""

    status: Literal["judged", "skipped"]
    """Skipped when execution produced no outcome."""
    result: CaseResult
    """Result with judge scores appended in selection order."""
    plan: CasePlan
    """Carried forward."""
    case: CaseSpec | None = None
    """The case (input, expected, graders), carried forward for graders and judges."""
    judge_error: str | None = None
    """An error that escaped a judge (marks the batch `error.phase = judges`)."""


class CaseExported(_CaseEvent, frozen=True, kw_only=True, tag="case.exported"):
    """The case went to every sink (or there was none)."""

    status: Literal["exported", "partial", "failed", "skipped"]
    """Aggregate over sinks."""
    outcomes: tuple[SinkOutcome, ...] = ()
    """Per sink."""


class CaseObserved(_Event, frozen=True, kw_only=True, tag="case.observed"):
    """A sampled production observation, ready for the judges (online evaluation)."""

    suite_id: str
    """Online suite (target) it was sampled for."""
    observation_id: str
    """Observation id, unique per suite."""
    result: CaseResult
    """The observation as a case result."""
    plan: CasePlan
    """Judges to apply."""
    expected: str | None = None
    """Reference answer, if any."""
    budget_usd_per_day: float | None = None
    """The suite's daily model-judge budget when it was sampled (None: none)."""

    def subject(self) -> str:
        return s.case_subject(s.CASE_OBSERVED, self.suite_id, self.observation_id)

    def msg_id(self) -> str:
        return f"{self.type}:{self.suite_id}:{self.observation_id}"


# ---------------------------------------------------------------- live events (LIVE stream)


class LiveLog(_Event, frozen=True, kw_only=True, tag="live.log"):
    """A chunk of the harness's output while it runs."""

    seq: int
    """Chunk number within the run."""
    stream: Literal["stdout", "stderr"]
    """Which stream."""
    text: str
    """The chunk (event lines stripped)."""
    offset: int = 0
    """UTF-8 bytes of the run's live log (both streams, every attempt) before this chunk, so a
    reader can find where the last 64 KiB start without reading the whole ring."""
    execution: str | None = None
    """Id of this execution of the attempt (a redelivered attempt runs again under a new one)."""

    def subject(self) -> str:
        return s.live_subject(_req(self.run_id, "run id"), "log")

    def msg_id(self) -> str:
        return f"{self.type}:{self.run_id}:{self.attempt}:{_execution(self.execution)}{self.stream}:{self.seq}"


class LiveTrace(_Event, frozen=True, kw_only=True, tag="live.trace"):
    """Trace events of a running run, before it seals."""

    seq: int
    """Batch number within the run."""
    events: tuple[TraceEvent, ...]
    """The events, in order (the dispatcher sends those of one flush together, up to 64 KiB of
    their JSON per message, so the 2,000-message ring holds at least 2,000 events)."""
    execution: str | None = None
    """Id of this execution of the attempt (a redelivered attempt runs again under a new one)."""

    def subject(self) -> str:
        return s.live_subject(_req(self.run_id, "run id"), "trace")

    def msg_id(self) -> str:
        return f"{self.type}:{self.run_id}:{self.attempt}:{_execution(self.execution)}{self.seq}"


class InfraMark(_Event, frozen=True, kw_only=True, tag="live.infra"):
    """An infrastructure mark (accepted, waiting, started, placed, released), and the marks that
    followed it at once (`more`: the first marks of a run go out together, see `marks`)."""

    mark: Infra
    """The mark, as it also appears in the sealed trace."""
    more: tuple[Infra, ...] = ()
    """Marks that came right after `mark`, in order (a reader that knows only `mark` misses them)."""
    execution: str | None = None
    """Id of this execution of the attempt (a redelivered attempt runs again under a new one)."""
    seq: int = 0
    """Mark number within the execution (several `waiting` marks may follow each other)."""

    @property
    def marks(self) -> tuple[Infra, ...]:
        """Every mark of the message, in order."""
        return (self.mark, *self.more)

    def subject(self) -> str:
        return s.live_subject(_req(self.run_id, "run id"), "infra")

    def msg_id(self) -> str:
        return f"{self.type}:{self.run_id}:{self.attempt}:{_execution(self.execution)}{self.mark.event}:{self.seq}"


class LivePlacement(_Event, frozen=True, kw_only=True, tag="live.placement"):
    """A resource sample of a running run's sandbox (every few seconds, and once at exit)."""

    sample: PlacementSample
    """The sample."""
    execution: str | None = None
    """Id of this execution of the attempt (a redelivered attempt runs again under a new one)."""
    seq: int = 0
    """Sample number within the execution."""

    def subject(self) -> str:
        return s.live_subject(_req(self.run_id, "run id"), "placement")

    def msg_id(self) -> str:
        return f"{self.type}:{self.run_id}:{self.attempt}:{_execution(self.execution)}{self.seq}"


def _execution(execution: str | None) -> str:
    """The execution part of a live message id (empty for messages of older dispatchers)."""
    return "" if execution is None else f"{execution}:"


# ---------------------------------------------------------------- observations and dead letters


class ObservationReceived(_Event, frozen=True, kw_only=True, tag="obs.received"):
    """A production trace offered for online evaluation."""

    target: str
    """Online suite it is offered to."""
    observation_id: str
    """Unique id of the observation."""
    trace_id: str | None = None
    """OpenTelemetry trace id (32 hex), the sampling key."""
    input: str | None = None
    """What the user asked."""
    output: str | None = None
    """What the agent answered."""
    expected: str | None = None
    """Reference answer, when known."""
    trace: tuple[TraceEvent, ...] = ()
    """The production trace."""
    metadata: dict[str, str] = msgspec.field(default_factory=dict)
    """Free key/values."""

    def subject(self) -> str:
        return s.observation_subject(self.target)

    def msg_id(self) -> str:
        return f"{self.type}:{self.target}:{self.observation_id}"


class ObservationSpans(_Event, frozen=True, kw_only=True, tag="obs.spans"):
    """Spans of one trace from one OTLP export request, held on the bus until the collector has
    the whole trace (so an export answered 200 is never lost with a collector)."""

    target: str
    """`service.name` of the exporting application."""
    trace_id: str
    """The trace (32 hex)."""
    spans: tuple[SpanData, ...]
    """Its spans in this request."""
    resource: dict[str, str] = msgspec.field(default_factory=dict)
    """Resource attributes of the exporting application, as text."""
    received_ns: int = 0
    """When the collector received them, Unix nanoseconds (the receiving replica's clock: assembly
    judges time by JetStream's timestamps, not by this)."""
    trace_subject: bool = False
    """Published on the trace's own subject, `obs.spans.<target>.<trace>`, so any collector replica
    reads every batch of the trace from the stream (receivers since split-trace assembly). False:
    the older per-service subject `obs.spans.<target>`, assembled from the batches one replica holds."""

    def subject(self) -> str:
        return s.spans_subject(self.target, self.trace_id if self.trace_subject else None)

    def msg_id(self) -> str:
        return f"{self.type}:{self.trace_id}:{self.event_id}"


# ---------------------------------------------------------------- online suites and fates


class OnlineSuiteApplied(_Event, frozen=True, kw_only=True, tag="online.suite.applied"):
    """An online suite was defined or replaced (the last event on its subject holds)."""

    suite: OnlineSuiteSpec
    """The suite as validated."""
    by: str
    """Principal that applied it."""

    def subject(self) -> str:
        return s.online_suite_subject(self.suite.id)

    def msg_id(self) -> str:
        return f"{self.type}:{self.suite.id}:{self.event_id}"


class OnlineSuiteDeleted(_Event, frozen=True, kw_only=True, tag="online.suite.deleted"):
    """An online suite stops taking observations (judging already sampled ones goes on)."""

    suite_id: str
    """The suite."""
    by: str
    """Principal that deleted it."""

    def subject(self) -> str:
        return s.online_suite_subject(self.suite_id)

    def msg_id(self) -> str:
        return f"{self.type}:{self.suite_id}:{self.event_id}"


Fate = Literal["sampled", "skipped", "dropped", "late", "dead_lettered", "judged"]
"""What became of an observation for a suite."""

FateReason = Literal[
    "sampled",
    "no_suite",
    "not_target",
    "filtered",
    "not_sampled",
    "over_rate_cap",
    "over_budget",
    "invalid_trace_id",
    "too_large",
    "late_spans",
    "max_deliver",
    "poison",
    "judged",
]
"""Why: `sampled` / `judged` for those fates; skipped: `no_suite` (no online suite is defined),
`not_target` (the suite's service / agent / workflow differs), `filtered` (an attribute differs),
`not_sampled` (outside the suite's ratio), `over_rate_cap` (the suite's `rate_per_min` was
reached this minute), `over_budget` (the suite's `budget_usd_per_day` was spent: its model judges
were not called; its other judges still ran); dropped: `invalid_trace_id`, `too_large`; late:
`late_spans` (spans arrived after the trace was assembled; they are not judged);
dead_lettered: `max_deliver` (a service gave up on it after its deliveries) or `poison` (a service
could not read it)."""


class ObservationFate(_Event, frozen=True, kw_only=True, tag="online.fate"):
    """What became of one production observation for one online suite, and why: every
    observation that reaches evalbus gets at least one, so none disappears unaccounted."""

    observation_id: str
    """The observation (for OTLP ingest: the trace id)."""
    suite_id: str | None = None
    """The suite (None when no suite was defined: fate `skipped`, reason `no_suite`)."""
    trace_id: str | None = None
    """OpenTelemetry trace id (32 hex), when the observation has one."""
    target: str | None = None
    """The target the observation was offered to (its service name for OTLP ingest)."""
    fate: Fate
    """What became of it."""
    reason: FateReason
    """Why."""
    detail: str | None = None
    """More about the reason (the ratio it was sampled at, the attribute that differed...)."""

    def subject(self) -> str:
        return s.online_fate_subject(self.observation_id)

    def msg_id(self) -> str:
        return f"{self.type}:{self.suite_id or '-'}:{self.observation_id}:{self.fate}"


# ---------------------------------------------------------------- suites


class SuiteBaselineSet(_Event, frozen=True, kw_only=True, tag="suite.baseline.set"):
    """A suite's baseline batch was set (the last event on the suite's subject holds): comparisons
    and regression gates of the suite's batches compare against it unless told otherwise."""

    suite_id: str
    """The suite."""
    baseline: str
    """The baseline batch (finalized `succeeded`, of this suite)."""
    by: str
    """Principal that set it."""

    def subject(self) -> str:
        return s.suite_baseline_subject(self.suite_id)

    def msg_id(self) -> str:
        return f"{self.type}:{self.suite_id}:{self.event_id}"


LETTER_CUT_MARK = " more bytes: read the original at its stream sequence]"
"""How a dead letter's `payload` ends when it holds only the head of a message too big to copy
whole: `<head>... [<n> more bytes: read the original at its stream sequence]`."""


class DeadLetter(_Event, frozen=True, kw_only=True, tag="dlq"):
    """A message a service could not handle, with the reason and the raw payload."""

    service: str
    """Service that gave up."""
    reason: str
    """Why (decode error, poison decision, max deliveries exhausted)."""
    subject_: str = msgspec.field(name="subject")
    """Subject of the original message."""
    stream: str | None = None
    """Stream of the original message."""
    stream_seq: int | None = None
    """Stream sequence of the original message."""
    deliveries: int | None = None
    """Delivery count when it was given up."""
    payload: str = ""
    """Original payload (UTF-8, undecodable bytes replaced; only its head when the whole would not
    fit a message, see `payload_cut`)."""
    headers: dict[str, str] = msgspec.field(default_factory=dict)
    """Original headers."""

    def payload_cut(self) -> bool:
        """Whether `payload` is only the original's head (`LETTER_CUT_MARK`)."""
        return self.payload.endswith(LETTER_CUT_MARK)

    def subject(self) -> str:
        return s.dlq_subject(self.service)

    def msg_id(self) -> str:
        if self.stream_seq is None:
            return f"{self.type}:{self.service}:{self.event_id}"
        return f"{self.type}:{self.service}:{self.stream}:{self.stream_seq}"


Event = (
    BatchRequested
    | BatchCancelled
    | BatchFinalized
    | CaseRequested
    | CaseExecuted
    | CaseCollected
    | CaseJudged
    | CaseExported
    | CaseObserved
    | LiveLog
    | LiveTrace
    | InfraMark
    | LivePlacement
    | ObservationReceived
    | ObservationSpans
    | OnlineSuiteApplied
    | OnlineSuiteDeleted
    | ObservationFate
    | SuiteBaselineSet
    | DeadLetter
)
"""Any event, discriminated on `type`."""

EVENT_TYPES: tuple[type[_Event], ...] = (
    BatchRequested,
    BatchCancelled,
    BatchFinalized,
    CaseRequested,
    CaseExecuted,
    CaseCollected,
    CaseJudged,
    CaseExported,
    CaseObserved,
    LiveLog,
    LiveTrace,
    InfraMark,
    LivePlacement,
    ObservationReceived,
    ObservationSpans,
    OnlineSuiteApplied,
    OnlineSuiteDeleted,
    ObservationFate,
    SuiteBaselineSet,
    DeadLetter,
)

EventBase = _Event
"""Base class of every event (for typing)."""


def _req(value: str | None, what: str) -> str:
    if not value:
        raise ValueError(f"this event needs a {what} to build its subject")
    return value
