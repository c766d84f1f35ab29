"""The trace event union: what a run did, in order, as evidence for graders, judges and viewers.

Every event carries `t`, seconds since the run's start, and optional span ids so platform
traces keep their shape. The union is tagged on `kind`.
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

from evalbus_contracts.objects import ObjectRef


class _TraceBase(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind", omit_defaults=True):
    t: float = 0.0
    """Seconds since the run started (the harness's clock)."""
    span_id: str | None = None
    """Span id (hex) when the event came from a platform trace."""
    parent_id: str | None = None
    """Parent span id (hex), if any."""
    duration_ms: float | None = None
    """Duration of the step in milliseconds, when known."""


class Message(_TraceBase, frozen=True, kw_only=True, tag="message"):
    """A conversation message; the last assistant message is the run's answer."""

    role: Literal["user", "assistant", "system"]
    """Who spoke."""
    text: str
    """What was said."""


class LlmCall(_TraceBase, frozen=True, kw_only=True, tag="llm_call"):
    """One model call."""

    model: str
    """Model name as the provider reports it."""
    input_tokens: int | None = None
    """Prompt tokens."""
    output_tokens: int | None = None
    """Completion tokens."""
    cost_usd: float | None = None
    """Cost of the call in US dollars."""
    latency_ms: float | None = None
    """Wall time of the call in milliseconds."""


class ToolCall(_TraceBase, frozen=True, kw_only=True, tag="tool_call"):
    """The agent asked for a tool."""

    id: str
    """Call id, matching the `tool_result`."""
    name: str
    """Tool name."""
    args: dict[str, Any] = msgspec.field(default_factory=dict)
    """Arguments as the agent passed them (opaque JSON object)."""


class ToolResult(_TraceBase, frozen=True, kw_only=True, tag="tool_result"):
    """A tool answered."""

    id: str
    """Call id of the `tool_call` this answers."""
    ok: bool = True
    """Whether the tool succeeded."""
    output: str = ""
    """Tool output (text)."""


class EnvAction(_TraceBase, frozen=True, kw_only=True, tag="env_action"):
    """An action on the environment (a click, a file write...)."""

    action: str
    """What was done."""
    detail: str | None = None
    """Free-form detail."""


class Error(_TraceBase, frozen=True, kw_only=True, tag="error"):
    """Something went wrong during the run (it may still have produced an answer)."""

    message: str
    """Human-readable error."""


class Log(_TraceBase, frozen=True, kw_only=True, tag="log"):
    """Output of the harness process (the stderr tail for harnesses without a trace)."""

    stream: Literal["stdout", "stderr"]
    """Which stream."""
    text: str
    """The text (tails are capped at 16 KB)."""


class Artifact(_TraceBase, frozen=True, kw_only=True, tag="artifact"):
    """A file the run produced, stored in the object store, referenced by name and digest.

    A harness declares one by printing this event with `ref` set to a path relative to its workdir
    (and no `sha256`): the dispatcher stores the file before the sandbox is released and rewrites
    the event with the object's `ref` (`<bucket>/<object name>`), `sha256` and `size`."""

    name: str
    """Artifact name."""
    ref: str
    """Object-store name (`<bucket>/<object name>`); in a harness's declaration, the file's path
    relative to the workdir."""
    sha256: str | None = None
    """SHA-256 of the bytes (lower-case hex); readers verify it."""
    size: int | None = None
    """Length in bytes, once stored."""
    media_type: str | None = None
    """MIME type."""
    role: str | None = None
    """What the artifact is for (screenshot, stdout...)."""


def artifact_object(event: Artifact) -> ObjectRef | None:
    """The object a stored artifact names (None for a declaration not yet stored)."""
    if event.sha256 is None or event.size is None or "/" not in event.ref:
        return None
    bucket, _, name = event.ref.partition("/")
    return ObjectRef(bucket=bucket, name=name, size=event.size, sha256=event.sha256)


class Span(_TraceBase, frozen=True, kw_only=True, tag="span"):
    """A platform span that maps to no richer kind."""

    name: str
    """Span name."""
    attributes: dict[str, str] = msgspec.field(default_factory=dict)
    """Span attributes, stringified."""


class Infra(_TraceBase, frozen=True, kw_only=True, tag="infra"):
    """Infrastructure evidence: placement and lifecycle marks (accepted, started, released...)."""

    scope: Literal["placement", "service"]
    """Placement of the sandbox, or a service of its topology."""
    event: str | None = None
    """Short machine name of the mark (`accepted`, `started`, `released`...)."""
    message: str = ""
    """Human-readable text."""
    unit: str | None = None
    """Backend unit (process group, allocation, pod)."""
    node: str | None = None
    """Node the unit ran on."""
    service: str | None = None
    """Service name for scope `service`."""


TraceEvent = Message | LlmCall | ToolCall | ToolResult | EnvAction | Error | Log | Artifact | Span | Infra
"""Any trace event, discriminated on `kind`."""

TRACE_KINDS: tuple[str, ...] = (
    "message",
    "llm_call",
    "tool_call",
    "tool_result",
    "env_action",
    "error",
    "log",
    "artifact",
    "span",
    "infra",
)


class SpanData(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    """One OpenTelemetry span as received (OTLP ingest), before it is mapped to trace events."""

    trace_id: str
    """Trace id, 32 lower-case hex digits."""
    span_id: str
    """Span id, 16 lower-case hex digits."""
    parent_id: str | None = None
    """Parent span id (None: a root span)."""
    name: str = ""
    """Span name."""
    start_ns: int = 0
    """Start, Unix nanoseconds."""
    end_ns: int | None = None
    """End, Unix nanoseconds (None: not ended when exported)."""
    attributes: dict[str, Any] = msgspec.field(default_factory=dict)
    """Span attributes (OTLP values as JSON: text, numbers, booleans, lists of those)."""
    error: bool = False
    """The span's status is ERROR."""
    status_message: str | None = None
    """Status message, when any."""
