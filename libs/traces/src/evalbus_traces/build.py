"""Factories: the source for a trace reference and the sink for a platform sink spec.

The caller owns the `aiohttp.ClientSession` (opened at start-up, closed at shutdown) and the
`SecretStore`; secrets are resolved when a request is made, never at build time, so a missing
secret surfaces as `MissingSecretError` from `pull` and as a failed outcome from `export`.
"""

from __future__ import annotations

import aiohttp

from evalbus_contracts.results import TraceRef
from evalbus_contracts.specs import PlatformSink
from evalbus_runtime.secrets import SecretStore
from evalbus_traces.ports import TraceSink, TraceSource
from evalbus_traces.sinks.langfuse import LangfuseTraceSink
from evalbus_traces.sinks.langsmith import LangsmithTraceSink
from evalbus_traces.sinks.mlflow import MlflowTraceSink
from evalbus_traces.sinks.otel import OtelTraceSink
from evalbus_traces.sinks.phoenix import PhoenixTraceSink
from evalbus_traces.sources.langfuse import LangfuseTraceSource
from evalbus_traces.sources.langsmith import LangsmithTraceSource
from evalbus_traces.sources.mlflow import MlflowTraceSource
from evalbus_traces.sources.otel import OtelTraceSource
from evalbus_traces.sources.phoenix import PhoenixTraceSource
from evalbus_traces.transport import DEFAULT_TIMEOUT_S


def build_source(
    ref: TraceRef, secrets: SecretStore, session: aiohttp.ClientSession, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> TraceSource:
    """The trace source for `ref.kind`."""
    match ref.kind:
        case "otel":
            return OtelTraceSource(session, secrets, timeout_s)
        case "mlflow":
            return MlflowTraceSource(session, secrets, timeout_s)
        case "phoenix":
            return PhoenixTraceSource(session, secrets, timeout_s)
        case "langfuse":
            return LangfuseTraceSource(session, secrets, timeout_s)
        case "langsmith":
            return LangsmithTraceSource(session, secrets, timeout_s)


def build_sink(
    spec: PlatformSink, secrets: SecretStore, session: aiohttp.ClientSession, *, timeout_s: float = DEFAULT_TIMEOUT_S
) -> TraceSink:
    """The trace sink for `spec.platform`."""
    match spec.platform:
        case "otel":
            return OtelTraceSink(spec, session, secrets, timeout_s)
        case "mlflow":
            return MlflowTraceSink(spec, session, secrets, timeout_s)
        case "phoenix":
            return PhoenixTraceSink(spec, session, secrets, timeout_s)
        case "langfuse":
            return LangfuseTraceSink(spec, session, secrets, timeout_s)
        case "langsmith":
            return LangsmithTraceSink(spec, session, secrets, timeout_s)
