"""OTLP in both directions (pure): reading OTLP attribute values, and writing a judged case as spans.

Reading: OTLP `AnyValue`s arrive as protobuf JSON (`stringValue`, MLflow's `string_value`, int64
as strings, base64 ids in MLflow's span JSON); `any_value` / `key_values` turn them into Python.

Writing: `case_request` builds one `ExportTraceServiceRequest` for a judged case — a root span
(OpenInference `CHAIN`, input and answer, `evalbus.*` ids, verdict and every measured score as
`evalbus.score.<metric>` attributes) and one child span per LLM call and tool call of its trace,
with deterministic ids (`ids.export_trace_id`). `evalbus.run_id` is both a resource attribute
(MLflow turns resource attributes into trace tags) and a root-span attribute (Phoenix keeps span
attributes only). Encoded as protobuf (`SerializeToString`) or OTLP JSON (`request_json`: hex ids).
"""

from __future__ import annotations

import base64
import binascii
import json
from collections.abc import Iterable, Mapping
from datetime import datetime
from typing import Any

from google.protobuf import json_format  # type: ignore[import-untyped]  # no types-protobuf in the dev group
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, InstrumentationScope, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan
from opentelemetry.proto.trace.v1.trace_pb2 import Status as OtlpStatus

from evalbus_contracts.trace import LlmCall, ToolCall, ToolResult
from evalbus_traces.ids import export_span_id, export_trace_id
from evalbus_traces.ports import ExportContext, JudgedCase

SCOPE_NAME = "evalbus.export"
"""Instrumentation scope of exported spans."""


# ---------------------------------------------------------------- reading


def any_value(value: Mapping[str, Any]) -> Any:
    """The Python value of an OTLP `AnyValue` in protobuf JSON (camelCase or snake_case keys)."""
    for key in ("stringValue", "string_value"):
        if key in value:
            return value[key]
    for key in ("boolValue", "bool_value"):
        if key in value:
            return bool(value[key])
    for key in ("intValue", "int_value"):
        if key in value:
            return int(value[key])
    for key in ("doubleValue", "double_value"):
        if key in value:
            return float(value[key])
    for key in ("arrayValue", "array_value"):
        if key in value:
            return [any_value(v) for v in value[key].get("values", [])]
    for key in ("kvlistValue", "kvlist_value"):
        if key in value:
            return key_values(value[key].get("values", []))
    for key in ("bytesValue", "bytes_value"):
        if key in value:
            return str(value[key])
    return None


def key_values(items: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """A list of OTLP `KeyValue`s in protobuf JSON as a dict."""
    return {str(kv["key"]): any_value(kv.get("value") or {}) for kv in items if "key" in kv}


def b64_to_hex(value: str) -> str:
    """A protobuf-JSON (base64) id as hex; a value that already is hex is returned lower-cased."""
    if value and all(c in "0123456789abcdefABCDEF" for c in value) and len(value) in (16, 32):
        return value.lower()
    try:
        return base64.b64decode(value, validate=True).hex()
    except (binascii.Error, ValueError):
        return value


def unix_nanos(value: Any) -> int | None:
    """An int64 nanosecond time that protobuf JSON may have written as a string."""
    if value is None or value == "":
        return None
    try:
        return int(value)
    except (TypeError, ValueError):
        return None


# ---------------------------------------------------------------- writing


def _any(value: Any) -> AnyValue:
    if isinstance(value, bool):
        return AnyValue(bool_value=value)
    if isinstance(value, int):
        return AnyValue(int_value=value)
    if isinstance(value, float):
        return AnyValue(double_value=value)
    if isinstance(value, str):
        return AnyValue(string_value=value)
    return AnyValue(string_value=json.dumps(value, default=str, ensure_ascii=False))


def _attrs(values: Mapping[str, Any]) -> list[KeyValue]:
    return [KeyValue(key=k, value=_any(v)) for k, v in values.items() if v is not None]


def _ns(moment: datetime) -> int:
    return int(moment.timestamp() * 1e9)


def case_window(case: JudgedCase, now: datetime) -> tuple[int, int]:
    """Start and end (Unix ns) of the exported root span, stable across redeliveries."""
    timings = case.result.timings
    start_at = timings.started_at or timings.queued_at or case.judged_at or now
    start = _ns(start_at)
    end_at = timings.released_at or timings.executed_at
    last_t = max((e.t + (e.duration_ms or 0.0) / 1000.0 for e in case.result.trace), default=0.0)
    end = _ns(end_at) if end_at is not None else start + int(max(last_t, 0.001) * 1e9)
    return start, max(end, start)


def root_attributes(case: JudgedCase, ctx: ExportContext) -> dict[str, Any]:
    """Attributes of the exported root span: ids, input, answer, verdict, measured scores, labels."""
    result = case.result
    attrs: dict[str, Any] = {
        "openinference.span.kind": "CHAIN",
        "evalbus.run_id": result.run_id,
        "evalbus.batch_id": case.batch_id,
        "evalbus.case_id": result.case_id,
        "evalbus.harness": result.harness,
        "evalbus.suite_id": ctx.suite_id,
        "evalbus.trial": result.trial,
        "evalbus.verdict": case.verdict,
        "input.value": case.case.input if case.case is not None else None,
        "output.value": result.answer,
        "evalbus.expected": case.case.expected if case.case is not None else None,
    }
    for score in case.measured():
        attrs[f"evalbus.score.{score.metric}"] = float(score.value)
        if score.passed is not None:
            attrs[f"evalbus.score.{score.metric}.pass"] = score.passed
    for key, value in sorted(ctx.labels.items()):
        attrs[f"evalbus.label.{key}"] = value
    return attrs


def _child_spans(case: JudgedCase, trace_id: bytes, root_id: bytes, start: int) -> list[OtlpSpan]:
    results = {e.id: e for e in case.result.trace if isinstance(e, ToolResult)}
    spans: list[OtlpSpan] = []
    for index, event in enumerate(case.result.trace):
        begin = start + int(event.t * 1e9)
        if isinstance(event, LlmCall):
            end = begin + int((event.duration_ms or event.latency_ms or 0.0) * 1e6)
            attrs: dict[str, Any] = {
                "openinference.span.kind": "LLM",
                "llm.model_name": event.model,
                "gen_ai.request.model": event.model,
                "llm.token_count.prompt": event.input_tokens,
                "llm.token_count.completion": event.output_tokens,
                "llm.cost.total": event.cost_usd,
            }
            name, status = f"llm {event.model}", OtlpStatus.STATUS_CODE_UNSET
        elif isinstance(event, ToolCall):
            answer = results.get(event.id)
            end = start + int(answer.t * 1e9) if answer is not None else begin
            attrs = {
                "openinference.span.kind": "TOOL",
                "tool.name": event.name,
                "gen_ai.tool.name": event.name,
                "gen_ai.tool.call.id": event.id,
                "input.value": json.dumps(event.args, default=str),
                "output.value": answer.output if answer is not None else None,
            }
            failed = answer is not None and not answer.ok
            name = f"tool {event.name}"
            status = OtlpStatus.STATUS_CODE_ERROR if failed else OtlpStatus.STATUS_CODE_UNSET
        else:
            continue
        spans.append(
            OtlpSpan(
                trace_id=trace_id,
                span_id=bytes.fromhex(export_span_id(case.run_id, f"step-{index}")),
                parent_span_id=root_id,
                name=name,
                kind=OtlpSpan.SPAN_KIND_INTERNAL,
                start_time_unix_nano=begin,
                end_time_unix_nano=max(end, begin),
                attributes=_attrs(attrs),
                status=OtlpStatus(code=status),
            )
        )
    return spans


def case_request(
    case: JudgedCase, ctx: ExportContext, now: datetime, *, resource: Mapping[str, str] | None = None
) -> ExportTraceServiceRequest:
    """The OTLP request exporting one judged case (root span plus its LLM and tool steps)."""
    trace_id = bytes.fromhex(export_trace_id(case.run_id))
    root_id = bytes.fromhex(export_span_id(case.run_id))
    start, end = case_window(case, now)
    failed = case.result.failure is not None
    root = OtlpSpan(
        trace_id=trace_id,
        span_id=root_id,
        name=f"evalbus case {case.case_id}",
        kind=OtlpSpan.SPAN_KIND_INTERNAL,
        start_time_unix_nano=start,
        end_time_unix_nano=end,
        attributes=_attrs(root_attributes(case, ctx)),
        status=OtlpStatus(
            code=OtlpStatus.STATUS_CODE_ERROR if failed else OtlpStatus.STATUS_CODE_OK,
            message=case.result.failure.message[:500] if case.result.failure is not None else "",
        ),
    )
    resource_attrs: dict[str, Any] = {
        "service.name": "evalbus",
        "evalbus.run_id": case.run_id,
        "evalbus.batch_id": case.batch_id,
        **(resource or {}),
    }
    return ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=Resource(attributes=_attrs(resource_attrs)),
                scope_spans=[
                    ScopeSpans(
                        scope=InstrumentationScope(name=SCOPE_NAME),
                        spans=[root, *_child_spans(case, trace_id, root_id, start)],
                    )
                ],
            )
        ]
    )


def request_json(request: ExportTraceServiceRequest) -> dict[str, Any]:
    """OTLP/HTTP JSON of a request: camelCase fields, ids in hex (not protobuf's base64)."""
    body: dict[str, Any] = json_format.MessageToDict(request, use_integers_for_enums=True)
    for resource_spans in body.get("resourceSpans", []):
        for scope_spans in resource_spans.get("scopeSpans", []):
            for span in scope_spans.get("spans", []):
                for key in ("traceId", "spanId", "parentSpanId"):
                    if key in span:
                        span[key] = base64.b64decode(span[key]).hex()
    return body
