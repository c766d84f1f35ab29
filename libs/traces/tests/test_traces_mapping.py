"""Unit tests of the pure pieces: span → trace-event mapping (OpenInference, GenAI semconv,
MLflow's span JSON, harness overrides), deterministic ids and the OTLP export payload."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

import pytest

from evalbus_contracts.trace import Error, LlmCall, Message, Span, ToolCall, ToolResult
from evalbus_traces.ids import as_uuid, export_span_id, export_trace_id, export_uuid, trace_id_for
from evalbus_traces.mapping import SpanRecord, flatten_attributes, iso_nanos, map_spans, validate_mapping
from evalbus_traces.otlp import case_request, request_json
from evalbus_traces.ports import ExportContext
from evalbus_traces.sources.mlflow import mlflow_span

pytestmark = pytest.mark.unit

S = 1_000_000_000
T0 = 1_700_000_000 * S


def span(span_id: str, name: str, start: float, end: float, parent: str | None = None, **attrs: Any) -> SpanRecord:
    return SpanRecord(
        span_id=span_id,
        name=name,
        start_ns=T0 + int(start * S),
        end_ns=T0 + int(end * S),
        parent_id=parent,
        attributes=attrs,
    )


def test_openinference_agent_trace_in_time_order() -> None:
    spans = [  # deliberately out of order
        span(
            "t1",
            "calculator",
            0.5,
            0.7,
            "r",
            **{
                "openinference.span.kind": "TOOL",
                "tool.name": "calculator",
                "input.value": '{"x": 1}',
                "output.value": "42",
            },
        ),
        span(
            "r",
            "agent",
            0.0,
            1.0,
            None,
            **{
                "openinference.span.kind": "AGENT",
                "input.value": "q?",
                "output.value": "42",
            },
        ),
        span(
            "l1",
            "chat",
            0.1,
            0.4,
            "r",
            **{
                "openinference.span.kind": "LLM",
                "llm.model_name": "m1",
                "llm.token_count.prompt": 10,
                "llm.token_count.completion": "3",
                "llm.cost.total": 0.5,
                "llm.output_messages.0.message.role": "assistant",
                "llm.output_messages.0.message.content": "thinking",
            },
        ),
    ]
    events = map_spans(spans)
    kinds = [type(e).__name__ for e in events]
    assert kinds == ["Message", "Span", "LlmCall", "Message", "ToolCall", "ToolResult", "Message"]
    assert events[0] == Message(t=0.0, role="user", text="q?", span_id="r")
    llm = events[2]
    assert isinstance(llm, LlmCall)
    assert (llm.model, llm.input_tokens, llm.output_tokens, llm.cost_usd) == ("m1", 10, 3, 0.5)
    assert llm.t == pytest.approx(0.1)
    assert llm.duration_ms == pytest.approx(300.0)
    assert (llm.span_id, llm.parent_id) == ("l1", "r")
    assert events[3] == Message(t=0.4, role="assistant", text="thinking", span_id="l1", parent_id="r")
    call, result = events[4], events[5]
    assert isinstance(call, ToolCall)
    assert isinstance(result, ToolResult)
    assert (call.name, call.args, call.id) == ("calculator", {"x": 1}, "t1")
    assert (result.id, result.ok, result.output, result.t) == ("t1", True, "42", 0.7)
    assert events[-1] == Message(t=1.0, role="assistant", text="42", span_id="r")


def test_genai_semantic_conventions() -> None:
    spans = [
        span(
            "a",
            "chat gpt",
            0.0,
            0.2,
            None,
            **{
                "gen_ai.operation.name": "chat",
                "gen_ai.request.model": "gpt-4o",
                "gen_ai.response.model": "gpt-4o-2024",
                "gen_ai.usage.input_tokens": 5,
                "gen_ai.usage.output_tokens": 6,
                "gen_ai.output.messages": '[{"role": "assistant", "parts": [{"type": "text", "content": "hi"}]}]',
            },
        ),
        span(
            "b",
            "execute_tool search",
            0.3,
            0.5,
            None,
            **{
                "gen_ai.operation.name": "execute_tool",
                "gen_ai.tool.name": "search",
                "gen_ai.tool.call.id": "call_9",
                "gen_ai.tool.call.arguments": '{"q": "x"}',
                "gen_ai.tool.call.result": "found",
            },
        ),
    ]
    events = map_spans(spans)
    llm = next(e for e in events if isinstance(e, LlmCall))
    assert (llm.model, llm.input_tokens, llm.output_tokens) == ("gpt-4o-2024", 5, 6)  # response model wins
    assert Message(t=0.2, role="assistant", text="hi", span_id="a") in events
    call = next(e for e in events if isinstance(e, ToolCall))
    assert (call.id, call.name, call.args) == ("call_9", "search", {"q": "x"})
    result = next(e for e in events if isinstance(e, ToolResult))
    assert (result.id, result.output) == ("call_9", "found")


def test_kind_inferred_from_attributes_without_a_kind() -> None:
    events = map_spans(
        [
            span("a", "x", 0, 1, None, **{"llm.model_name": "m"}),
            span("b", "y", 2, 3, None, **{"tool.name": "t"}),
        ]
    )
    assert [type(e).__name__ for e in events] == ["LlmCall", "ToolCall", "ToolResult"]


def test_harness_overrides_take_priority() -> None:
    attrs = {"my.model": "custom", "llm.model_name": "default", "my.in": 11, "my.tool": "grep", "my.kind": "tool"}
    events = map_spans(
        [span("a", "s", 0, 1, None, **attrs)],
        {"my.kind": "kind", "my.tool": "tool_name"},
    )
    assert isinstance(events[0], ToolCall)
    assert events[0].name == "grep"
    events = map_spans([span("a", "s", 0, 1, None, **attrs)], {"my.model": "model", "my.in": "input_tokens"})
    assert isinstance(events[0], LlmCall)
    assert (events[0].model, events[0].input_tokens) == ("custom", 11)


def test_unknown_spans_become_span_events_with_string_attributes() -> None:
    events = map_spans(
        [
            span("b", "later", 2.5, 3, "a", n=3, flag=True, obj={"k": "v"}),
            span("a", "db query", 1.0, 2, None, **{"db.system": "postgresql"}),
        ]
    )
    assert [type(e).__name__ for e in events] == ["Span", "Span"]
    first, second = events
    assert isinstance(first, Span)
    assert isinstance(second, Span)
    assert (first.name, first.t, first.attributes) == ("db query", 0.0, {"db.system": "postgresql"})
    assert second.t == 1.5
    assert second.attributes == {"flag": "true", "n": "3", "obj": '{"k": "v"}'}


def test_errors_are_kept() -> None:
    spans = [
        SpanRecord(
            span_id="a",
            name="tool",
            start_ns=T0,
            end_ns=T0 + S,
            attributes={"tool.name": "rm"},
            error=True,
            status_message="permission denied",
        ),
        SpanRecord(span_id="b", name="step", start_ns=T0 + 2 * S, end_ns=T0 + 3 * S, error=True),
    ]
    events = map_spans(spans)
    result = next(e for e in events if isinstance(e, ToolResult))
    assert (result.ok, result.output) == (False, "permission denied")
    assert Error(t=3.0, message="step failed", span_id="b") in events


def test_empty_and_validation() -> None:
    assert map_spans([]) == []
    assert validate_mapping({"a": "model", "b": "tokens"}) == [
        "mapping 'b' → 'tokens': unknown field (one of kind, model, input_tokens, output_tokens, cost_usd, "
        "tool_name, tool_id, tool_args, tool_output, input, output)"
    ]


def test_flatten_and_times() -> None:
    assert flatten_attributes({"a": {"b": 1, "c": [{"d": 2}]}, "e": [1, 2]}) == {"a.b": 1, "a.c.0.d": 2, "e": [1, 2]}
    assert iso_nanos("2026-01-02T03:04:05.123456Z") == iso_nanos("2026-01-02T03:04:05.123456+00:00")
    assert iso_nanos("2026-01-02T03:04:05.123456") == 1767323045123456000
    assert iso_nanos("not a time") is None


def test_mlflow_span_json() -> None:
    raw = {
        "trace_id": "mWUkc+W3+Pzz1KTfNOcasA==",
        "span_id": "xI8yCglMhbQ=",
        "parent_span_id": "TqlQjrSplyM=",
        "name": "chat",
        "start_time_unix_nano": "1796054736881446408",
        "end_time_unix_nano": 1796054736891603759,
        "status": {"code": "STATUS_CODE_ERROR", "message": "boom"},
        "attributes": [
            {"key": "mlflow.spanType", "value": {"string_value": "CHAT_MODEL"}},
            {"key": "mlflow.llm.model", "value": {"string_value": "m2"}},
            {
                "key": "mlflow.chat.tokenUsage",
                "value": {
                    "kvlist_value": {
                        "values": [
                            {"key": "input_tokens", "value": {"int_value": "4"}},
                            {"key": "output_tokens", "value": {"int_value": 2}},
                        ]
                    }
                },
            },
        ],
    }
    record = mlflow_span(raw)
    assert record.span_id == "c48f320a094c85b4"
    assert record.parent_id == "4ea9508eb4a99723"
    assert record.trace_id == "99652473e5b7f8fcf3d4a4df34e71ab0"
    assert record.error
    [llm, error] = map_spans([record])
    assert isinstance(llm, LlmCall)
    assert (llm.model, llm.input_tokens, llm.output_tokens) == ("m2", 4, 2)
    assert error == Error(t=0.010157351, message="boom", span_id=record.span_id, parent_id=record.parent_id)


def test_ids_are_deterministic() -> None:
    assert trace_id_for("evb-b-c") == trace_id_for("evb-b-c") != trace_id_for("evb-b-d")
    assert len(trace_id_for("evb-b-c")) == 32
    hex32 = "0af7651916cd43dd8448eb211c80319c"
    assert trace_id_for(hex32.upper()) == hex32
    assert trace_id_for("tr-" + hex32) == hex32
    assert trace_id_for(as_uuid(hex32)) == hex32
    assert export_trace_id("r") != trace_id_for("r")
    assert len(export_span_id("r")) == 16
    assert export_span_id("r") != export_span_id("r", "step-1")
    assert export_uuid("r", "a") == export_uuid("r", "a") != export_uuid("r", "b")


def test_case_request_payload(kit: Any) -> None:
    case = kit.judged("evb-b1-case-1")
    ctx = ExportContext(batch_id="b1", suite_id="s", labels={"team": "x"})
    request = case_request(case, ctx, datetime(2030, 1, 1, tzinfo=UTC))
    body = request_json(request)
    [resource_spans] = body["resourceSpans"]
    resource = {a["key"]: a["value"] for a in resource_spans["resource"]["attributes"]}
    assert resource["evalbus.run_id"] == {"stringValue": "evb-b1-case-1"}
    spans = resource_spans["scopeSpans"][0]["spans"]
    root = spans[0]
    assert root["traceId"] == export_trace_id("evb-b1-case-1")
    assert root["spanId"] == export_span_id("evb-b1-case-1")
    assert root["status"]["code"] == 1  # integer enums in OTLP JSON
    attrs = {a["key"]: a["value"] for a in root["attributes"]}
    assert attrs["evalbus.score.judge:quality"] == {"doubleValue": 0.8}
    assert attrs["evalbus.score.judge:quality.pass"] == {"boolValue": True}
    assert "evalbus.score.judge:tone" not in attrs  # unmeasured scores are not exported
    assert attrs["evalbus.verdict"] == {"stringValue": "pass"}
    assert attrs["evalbus.label.team"] == {"stringValue": "x"}
    assert root["startTimeUnixNano"] == str(1767323045 * S)  # from the case timings, not "now"
    assert [s["name"] for s in spans[1:]] == ["llm gpt-test", "tool calculator"]
    assert all(s["parentSpanId"] == root["spanId"] for s in spans[1:])
    assert case_request(case, ctx, datetime(2031, 1, 1, tzinfo=UTC)) == request  # stable on redelivery
