"""evalbus contracts: pure data shared by every service (events, specs, subjects, streams).

No I/O happens here. Change a contract only by adding fields with defaults; a breaking change
bumps the event's `v` and adds an upcast.
"""

from evalbus_contracts import subjects
from evalbus_contracts.codec import DecodeError, convert, decode, decode_event, encode, to_builtins
from evalbus_contracts.events import (
    EVENT_TYPES,
    BatchCancelled,
    BatchFinalized,
    BatchRequested,
    CaseCollected,
    CaseExecuted,
    CaseExported,
    CaseJudged,
    CaseObserved,
    CasePlan,
    CaseRequested,
    DeadLetter,
    Event,
    EventBase,
    InfraMark,
    LiveLog,
    LiveTrace,
    ObservationReceived,
    new_event_id,
    utcnow,
)
from evalbus_contracts.ids import InvalidIdError, batch_run_id, decode_token, encode_token, standalone_run_id
from evalbus_contracts.results import (
    BrowserSnapshot,
    CaseFailure,
    CaseResult,
    CaseTimings,
    OsUseSnapshot,
    Placement,
    PromptSnapshot,
    RepoSnapshot,
    Snapshot,
    TraceRef,
)
from evalbus_contracts.scores import Invalid, Measured, Score, Unmeasured, UnmeasuredReason
from evalbus_contracts.specs import (
    AnswerMatchGrader,
    BatchPolicy,
    BatchSpec,
    CaseSpec,
    CommandGrader,
    CommandHarness,
    ContainsJudge,
    CostGrader,
    EmbeddingJudge,
    ExactJudge,
    GraderSpec,
    HarnessSpec,
    JsonlSink,
    JsonSchemaJudge,
    JudgeSpec,
    LatencyGrader,
    ModelJudge,
    NumericJudge,
    PlatformSink,
    RegexJudge,
    RegisteredJudge,
    ScriptScoreGrader,
    SinkSpec,
    StepsGrader,
    SuiteSpec,
    TestsPassGrader,
    TextMetricGrader,
    TraceSpec,
    needs_compute,
)
from evalbus_contracts.streams import CONSUMERS, STREAMS, ConsumerDef, StreamDef
from evalbus_contracts.summary import (
    BatchError,
    BatchSummary,
    ExportSummary,
    MetricSummary,
    SinkOutcome,
    StageCounts,
    TrialSummary,
    VerdictSummary,
)
from evalbus_contracts.trace import (
    Artifact,
    EnvAction,
    Error,
    Infra,
    LlmCall,
    Log,
    Message,
    Span,
    ToolCall,
    ToolResult,
    TraceEvent,
)

__all__ = [
    "CONSUMERS", "EVENT_TYPES", "STREAMS", "AnswerMatchGrader", "Artifact", "BatchCancelled", "BatchError",
    "BatchFinalized", "BatchPolicy", "BatchRequested", "BatchSpec", "BatchSummary", "BrowserSnapshot",
    "CaseCollected", "CaseExecuted", "CaseExported", "CaseFailure", "CaseJudged", "CaseObserved", "CasePlan",
    "CaseRequested", "CaseResult", "CaseSpec", "CaseTimings", "CommandGrader", "CommandHarness", "ConsumerDef",
    "ContainsJudge", "CostGrader", "DeadLetter", "DecodeError", "EmbeddingJudge", "EnvAction", "Error", "Event",
    "EventBase", "ExactJudge", "ExportSummary", "GraderSpec", "HarnessSpec", "Infra", "InfraMark", "Invalid",
    "InvalidIdError", "JsonSchemaJudge", "JsonlSink", "JudgeSpec", "LatencyGrader", "LiveLog", "LiveTrace",
    "LlmCall", "Log", "Measured", "Message", "MetricSummary", "ModelJudge", "NumericJudge", "ObservationReceived",
    "OsUseSnapshot", "Placement", "PlatformSink", "PromptSnapshot", "RegexJudge", "RegisteredJudge",
    "RepoSnapshot", "Score", "ScriptScoreGrader", "SinkOutcome", "SinkSpec", "Snapshot", "Span", "StageCounts",
    "StepsGrader", "StreamDef", "SuiteSpec", "TestsPassGrader", "TextMetricGrader", "ToolCall", "ToolResult",
    "TraceEvent", "TraceRef", "TraceSpec", "TrialSummary", "Unmeasured", "UnmeasuredReason", "VerdictSummary",
    "batch_run_id", "convert", "decode", "decode_event", "decode_token", "encode", "encode_token", "needs_compute",
    "new_event_id", "standalone_run_id", "subjects", "to_builtins", "utcnow",
]
