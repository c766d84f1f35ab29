"""An assembled trace → one `obs.received` observation (pure).

The spans are mapped to trace events by the same GenAI / OpenInference mapping batches use
(`evalbus_traces.mapping`); the root span's `input.value` / `output.value` (or the GenAI
equivalents, through the mapping's lookup) become the observation's input and output; its metadata
is the resource attributes and the root span's short attributes (what online targets and filters
match on: `service.name`, `deployment.environment`, `gen_ai.agent.name`...).
"""

from __future__ import annotations

from collections.abc import Iterable

from evalbus_contracts import Message, ObservationReceived, SpanData
from evalbus_traces.mapping import SpanRecord, map_spans

METADATA_VALUE_CAP = 256
"""Longest attribute value copied into an observation's metadata (characters)."""


def _record(span: SpanData) -> SpanRecord:
    return SpanRecord(
        span_id=span.span_id,
        name=span.name,
        start_ns=span.start_ns,
        end_ns=span.end_ns,
        trace_id=span.trace_id,
        parent_id=span.parent_id,
        attributes=dict(span.attributes),
        error=span.error,
        status_message=span.status_message,
    )


def root_of(spans: Iterable[SpanData]) -> SpanData | None:
    """The root span: the earliest span without a parent in the trace."""
    listed = list(spans)
    ids = {s.span_id for s in listed}
    roots = [s for s in listed if s.parent_id is None or s.parent_id not in ids]
    return min(roots, key=lambda s: (s.start_ns, s.span_id)) if roots else None


def observation_of(
    target: str, trace_id: str, spans: Iterable[SpanData], resource: dict[str, str]
) -> ObservationReceived:
    """The observation of one assembled trace (its id is the trace id)."""
    listed = list(spans)
    trace = tuple(map_spans(_record(s) for s in listed))
    messages = [e for e in trace if isinstance(e, Message)]
    user = next((m.text for m in messages if m.role == "user"), None)
    answer = next((m.text for m in reversed(messages) if m.role == "assistant"), None)
    metadata = {k: v for k, v in resource.items() if len(v) <= METADATA_VALUE_CAP}
    root = root_of(listed)
    if root is not None:
        for key, value in root.attributes.items():
            if isinstance(value, str | int | float | bool) and key not in metadata:
                text = (
                    value if isinstance(value, str) else str(value).lower() if isinstance(value, bool) else str(value)
                )
                if len(text) <= METADATA_VALUE_CAP:
                    metadata[key] = text
        metadata.setdefault("root.name", root.name)
    return ObservationReceived(
        target=target,
        observation_id=trace_id,
        trace_id=trace_id,
        input=user,
        output=answer,
        trace=trace,
        metadata=metadata,
    )
