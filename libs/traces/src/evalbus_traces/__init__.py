"""evalbus trace platforms: pull a run's trace (`TraceSource`) and export judged cases (`TraceSink`)
for otel, mlflow, langfuse, langsmith and phoenix; span → trace-event mapping; collection with the
flush-lag retry.

    source = build_source(ref, SecretStore(), session)
    outcome = await collect_trace(source, ref)          # never raises; errors are data
    sink = build_sink(platform_sink_spec, SecretStore(), session)
    outcomes = await sink.export(ctx, [judged_case(event, verdict)])   # never raises
"""

from evalbus_runtime.secrets import MissingSecretError
from evalbus_traces.build import build_sink, build_source
from evalbus_traces.collect import COLLECT_ATTEMPTS, COLLECT_DELAY_S, CollectOutcome, collect_trace, empty_message
from evalbus_traces.errors import (
    TraceConfigError,
    TraceError,
    TraceRejectedError,
    TraceSourceError,
    TraceUnavailableError,
)
from evalbus_traces.ids import export_span_id, export_trace_id, trace_id_for
from evalbus_traces.mapping import MAPPING_FIELDS, SpanRecord, map_spans, validate_mapping
from evalbus_traces.ports import ExportContext, JudgedCase, TraceSink, TraceSource, Verdict, judged_case

__all__ = [
    "COLLECT_ATTEMPTS",
    "COLLECT_DELAY_S",
    "MAPPING_FIELDS",
    "CollectOutcome",
    "ExportContext",
    "JudgedCase",
    "MissingSecretError",
    "SpanRecord",
    "TraceConfigError",
    "TraceError",
    "TraceRejectedError",
    "TraceSink",
    "TraceSource",
    "TraceSourceError",
    "TraceUnavailableError",
    "Verdict",
    "build_sink",
    "build_source",
    "collect_trace",
    "empty_message",
    "export_span_id",
    "export_trace_id",
    "judged_case",
    "map_spans",
    "trace_id_for",
    "validate_mapping",
]
