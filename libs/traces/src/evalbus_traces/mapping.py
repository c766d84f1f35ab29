"""Platform spans → evalbus trace events (pure, no I/O).

Every source turns its platform's span shape into `SpanRecord`s (ids in hex, times in Unix
nanoseconds, attributes flattened to dotted keys) and calls `map_spans`. Attributes follow the
OpenTelemetry GenAI semantic conventions and OpenInference:

| field | looked up in (first found wins; a harness `mapping` override is tried first) |
|---|---|
| kind | `openinference.span.kind`, `mlflow.spanType`, `gen_ai.operation.name`, else the presence of a tool name / model |
| model | `gen_ai.response.model`, `gen_ai.request.model`, `llm.model_name`, `mlflow.llm.model` |
| input_tokens | `gen_ai.usage.input_tokens`, `gen_ai.usage.prompt_tokens`, `llm.token_count.prompt`, `mlflow.chat.tokenUsage.input_tokens` |
| output_tokens | `gen_ai.usage.output_tokens`, `gen_ai.usage.completion_tokens`, `llm.token_count.completion`, `mlflow.chat.tokenUsage.output_tokens` |
| cost_usd | `llm.cost.total`, `gen_ai.usage.cost`, `gen_ai.usage.cost_usd` |
| tool_name | `gen_ai.tool.name`, `tool.name` |
| tool_id | `gen_ai.tool.call.id`, `tool_call.id`, `tool.id` (else the span id) |
| tool_args | `gen_ai.tool.call.arguments`, `tool.parameters`, `input.value` |
| tool_output | `gen_ai.tool.call.result`, `output.value` |
| input / output | `input.value` / `output.value` (the root span's become the user and final assistant messages) |

An LLM span gives an `llm_call` (plus an assistant `message` from `llm.output_messages.*` or
`gen_ai.output.messages`); a TOOL span a `tool_call` at its start and a `tool_result` at its end;
any other span a `span` event; an errored non-tool span also an `error`. `t` is the offset in
seconds from the earliest span's start; events are in time order (spans sorted by start).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from datetime import UTC, datetime, timedelta
from typing import Any, Literal

import msgspec

from evalbus_contracts.trace import Error, LlmCall, Message, Span, ToolCall, ToolResult, TraceEvent

SpanKind = Literal["llm", "tool", "other"]

MAPPING_FIELDS: tuple[str, ...] = (
    "kind",
    "model",
    "input_tokens",
    "output_tokens",
    "cost_usd",
    "tool_name",
    "tool_id",
    "tool_args",
    "tool_output",
    "input",
    "output",
)
"""Fields a harness `mapping` may point at an attribute of its own (attribute → field)."""

DEFAULT_ATTRIBUTES: dict[str, tuple[str, ...]] = {
    "kind": ("openinference.span.kind", "mlflow.spanType", "gen_ai.operation.name"),
    "model": ("gen_ai.response.model", "gen_ai.request.model", "llm.model_name", "mlflow.llm.model"),
    "input_tokens": (
        "gen_ai.usage.input_tokens",
        "gen_ai.usage.prompt_tokens",
        "llm.token_count.prompt",
        "mlflow.chat.tokenUsage.input_tokens",
    ),
    "output_tokens": (
        "gen_ai.usage.output_tokens",
        "gen_ai.usage.completion_tokens",
        "llm.token_count.completion",
        "mlflow.chat.tokenUsage.output_tokens",
    ),
    "cost_usd": ("llm.cost.total", "gen_ai.usage.cost", "gen_ai.usage.cost_usd"),
    "tool_name": ("gen_ai.tool.name", "tool.name"),
    "tool_id": ("gen_ai.tool.call.id", "tool_call.id", "tool.id"),
    "tool_args": ("gen_ai.tool.call.arguments", "tool.parameters", "input.value"),
    "tool_output": ("gen_ai.tool.call.result", "output.value"),
    "input": ("input.value",),
    "output": ("output.value",),
}
"""Default attribute lookups per field, in priority order."""

_LLM_KINDS = frozenset(
    {
        "llm",
        "chat_model",
        "chat",
        "text_completion",
        "generate_content",
        "completion",
        "embeddings",
        "embedding",
    }
)
_TOOL_KINDS = frozenset({"tool", "execute_tool", "function"})
_EPOCH = datetime(1970, 1, 1, tzinfo=UTC)
ATTRIBUTE_TEXT_CAP = 4000
"""Longest attribute value kept on a `span` event (characters)."""


class SpanRecord(msgspec.Struct, frozen=True, kw_only=True):
    """One platform span in a neutral shape."""

    span_id: str
    """Span id (hex, or the platform's id when it has no hex form)."""
    name: str
    """Span name."""
    start_ns: int
    """Start, Unix nanoseconds."""
    end_ns: int | None = None
    """End, Unix nanoseconds."""
    trace_id: str | None = None
    """Trace id (hex)."""
    parent_id: str | None = None
    """Parent span id."""
    attributes: dict[str, Any] = msgspec.field(default_factory=dict)
    """Attributes, flattened to dotted keys."""
    error: bool = False
    """The span's status is ERROR."""
    status_message: str | None = None
    """Status message, when any."""


def flatten_attributes(value: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    """Nested objects (and lists of objects) flattened to dotted keys: `{"a": {"b": 1}}` → `{"a.b": 1}`."""
    out: dict[str, Any] = {}
    for key, item in value.items():
        name = f"{prefix}{key}"
        if isinstance(item, Mapping):
            out.update(flatten_attributes(item, name + "."))
        elif isinstance(item, list) and item and all(isinstance(x, Mapping) for x in item):
            for i, x in enumerate(item):
                out.update(flatten_attributes(x, f"{name}.{i}."))
        else:
            out[name] = item
    return out


def iso_nanos(value: Any) -> int | None:
    """Unix nanoseconds of an ISO-8601 time (naive times are UTC)."""
    if not value:
        return None
    try:
        moment = datetime.fromisoformat(str(value))
    except ValueError:
        return None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=UTC)
    return ((moment - _EPOCH) // timedelta(microseconds=1)) * 1000


def resolve(attrs: Mapping[str, Any], key: str) -> Any:
    """`attrs[key]`, or the same dotted path through object-valued attributes (`{"a.b": {"c": 1}}`)."""
    if key in attrs:
        return attrs[key]
    head, _, rest = key.partition(".")
    while rest:
        value = attrs.get(head)
        if isinstance(value, Mapping):
            found = resolve(value, rest)
            if found is not None:
                return found
        step, _, rest = rest.partition(".")
        head = f"{head}.{step}"
    return None


def validate_mapping(mapping: Mapping[str, str]) -> list[str]:
    """Problems with a harness `mapping` (attribute → field); empty when it is valid."""
    return [
        f"mapping {attr!r} → {field!r}: unknown field (one of {', '.join(MAPPING_FIELDS)})"
        for attr, field in mapping.items()
        if field not in MAPPING_FIELDS
    ]


class _Lookup:
    """Attribute lookups for each field, with the harness overrides first."""

    def __init__(self, overrides: Mapping[str, str] | None) -> None:
        extra: dict[str, list[str]] = {}
        for attr, field in (overrides or {}).items():
            extra.setdefault(field, []).append(attr)
        self._order = {f: (*extra.get(f, ()), *DEFAULT_ATTRIBUTES.get(f, ())) for f in MAPPING_FIELDS}

    def get(self, attrs: Mapping[str, Any], field: str) -> Any:
        for key in self._order[field]:
            value = resolve(attrs, key)
            if value is not None and value != "":
                return value
        return None


def _as_int(value: Any) -> int | None:
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    try:
        return int(float(str(value)))
    except (TypeError, ValueError):
        return None


def _as_float(value: Any) -> float | None:
    if isinstance(value, bool):
        return None
    try:
        return float(value)
    except (TypeError, ValueError):
        return None


def _as_text(value: Any) -> str:
    if isinstance(value, str):
        return value
    return json.dumps(value, default=str, ensure_ascii=False)


def _maybe_json(value: Any) -> Any:
    if isinstance(value, str) and value[:1] in "{[":
        try:
            return json.loads(value)
        except ValueError:
            return value
    return value


def span_kind(span: SpanRecord, lookup: _Lookup) -> SpanKind:
    """What a span is: an LLM call, a tool call, or something else."""
    raw = lookup.get(span.attributes, "kind")
    if raw is not None:
        kind = str(raw).strip().strip('"').lower()
        if kind in _LLM_KINDS:
            return "llm"
        if kind in _TOOL_KINDS:
            return "tool"
        if kind not in {"", "unknown", "unset"}:
            return "other"
    if lookup.get(span.attributes, "tool_name") is not None:
        return "tool"
    if lookup.get(span.attributes, "model") is not None:
        return "llm"
    return "other"


def _messages(attrs: Mapping[str, Any], direction: Literal["input", "output"]) -> list[tuple[str, str]]:
    """(role, text) pairs from OpenInference flattened messages or GenAI JSON messages."""
    prefix = f"llm.{direction}_messages."
    found: dict[int, dict[str, str]] = {}
    for key, value in attrs.items():
        if not key.startswith(prefix):
            continue
        index, _, rest = key[len(prefix) :].partition(".")
        if not index.isdigit() or rest not in {"message.role", "message.content"}:
            continue
        found.setdefault(int(index), {})[rest.removeprefix("message.")] = _as_text(value)
    pairs = [(m.get("role", "assistant"), m["content"]) for _, m in sorted(found.items()) if "content" in m]
    if pairs:
        return pairs
    raw = _maybe_json(attrs.get(f"gen_ai.{direction}.messages"))
    if isinstance(raw, list):
        for item in raw:
            if not isinstance(item, Mapping):
                continue
            role = str(item.get("role", "assistant"))
            content = item.get("content")
            if content is None and isinstance(item.get("parts"), list):
                texts = [
                    str(p.get("content", ""))
                    for p in item["parts"]
                    if isinstance(p, Mapping) and p.get("type", "text") == "text"
                ]
                content = "".join(texts)
            if content is not None:
                pairs.append((role, _as_text(content)))
    return pairs


def _role(raw: str) -> Literal["user", "assistant", "system"]:
    role = raw.lower()
    if role in {"user", "human"}:
        return "user"
    if role == "system":
        return "system"
    return "assistant"


def _stringify(attrs: Mapping[str, Any]) -> dict[str, str]:
    return {k: _as_text(v)[:ATTRIBUTE_TEXT_CAP] for k, v in sorted(attrs.items())}


def map_spans(spans: Iterable[SpanRecord], overrides: Mapping[str, str] | None = None) -> list[TraceEvent]:
    """Trace events for a run's spans (any order in), in time order (out)."""
    ordered = sorted(spans, key=lambda s: (s.start_ns, s.span_id))
    if not ordered:
        return []
    lookup = _Lookup(overrides)
    t0 = ordered[0].start_ns
    ids = {s.span_id for s in ordered}
    events: list[TraceEvent] = []
    finals: list[TraceEvent] = []
    for span in ordered:
        t = (span.start_ns - t0) / 1e9
        end_t = ((span.end_ns or span.start_ns) - t0) / 1e9
        duration_ms = None if span.end_ns is None else max(0.0, (span.end_ns - span.start_ns) / 1e6)
        common: dict[str, Any] = {"span_id": span.span_id, "parent_id": span.parent_id}
        attrs = span.attributes
        is_root = span.parent_id is None or span.parent_id not in ids
        kind = span_kind(span, lookup)
        if is_root and kind == "other":
            text = lookup.get(attrs, "input")
            if text is not None:
                events.append(Message(t=t, role="user", text=_as_text(text), **common))
        if kind == "llm":
            model = lookup.get(attrs, "model")
            events.append(
                LlmCall(
                    t=t,
                    duration_ms=duration_ms,
                    model=str(model) if model is not None else "unknown",
                    input_tokens=_as_int(lookup.get(attrs, "input_tokens")),
                    output_tokens=_as_int(lookup.get(attrs, "output_tokens")),
                    cost_usd=_as_float(lookup.get(attrs, "cost_usd")),
                    latency_ms=duration_ms,
                    **common,
                )
            )
            outputs = _messages(attrs, "output")
            if not outputs:
                out = lookup.get(attrs, "output")
                outputs = [("assistant", _as_text(out))] if isinstance(out, str) else []
            events.extend(Message(t=end_t, role=_role(r), text=x, **common) for r, x in outputs)
            if span.error:
                events.append(Error(t=end_t, message=span.status_message or f"{span.name} failed", **common))
        elif kind == "tool":
            call_id = str(lookup.get(attrs, "tool_id") or span.span_id)
            name = lookup.get(attrs, "tool_name") or span.name
            args = _maybe_json(lookup.get(attrs, "tool_args"))
            if args is None:
                args = {}
            elif not isinstance(args, dict):
                args = {"input": args}
            events.append(ToolCall(t=t, duration_ms=duration_ms, id=call_id, name=str(name), args=args, **common))
            output = lookup.get(attrs, "tool_output")
            if span.error and output is None:
                output = span.status_message or ""
            events.append(
                ToolResult(
                    t=end_t,
                    id=call_id,
                    ok=not span.error,
                    output="" if output is None else _as_text(output),
                    **common,
                )
            )
        else:
            events.append(Span(t=t, duration_ms=duration_ms, name=span.name, attributes=_stringify(attrs), **common))
            if span.error:
                events.append(Error(t=end_t, message=span.status_message or f"{span.name} failed", **common))
        if is_root and kind == "other":
            text = lookup.get(attrs, "output")
            if text is not None:
                finals.append(Message(t=end_t, role="assistant", text=_as_text(text), **common))
    # stable: events of equal t keep span order (a tool_call before its own zero-length result);
    # the root's answer goes after everything at its time, so it stays the last assistant message
    keyed = [(e.t, 0, e) for e in events] + [(e.t, 1, e) for e in finals]
    return [e for _, _, e in sorted(keyed, key=lambda k: (k[0], k[1]))]
