"""OpenTelemetry: a span per handled message, `traceparent` carried in NATS headers, a trace per run.

Spans are exported only when an OTLP endpoint is configured; without one the propagation still
happens (an incoming `traceparent` is passed on to the outputs), at almost no cost.

Each run has its own trace. The event that opens a run (`case.requested`, every attempt) starts
it: a root span whose trace id is derived from the run id (`run_trace_id`), linked to the span that
published it (the batch's fan-out), so a 10,000-case batch is 10,000 small traces plus the batch's
own, not one trace of 80,000 spans. The derivation makes every attempt and every redelivery of a
run land in the same trace, and lets an operator find a run's trace from its id alone. Without an
exporter the header is still written (random span id, deterministic trace id) so logs correlate.
"""

from __future__ import annotations

import contextlib
import contextvars
import hashlib
import secrets
from collections.abc import Iterator, Mapping, MutableMapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_enabled = False
_inbound: contextvars.ContextVar[str | None] = contextvars.ContextVar("inbound_traceparent", default=None)
_next_trace_id: contextvars.ContextVar[int | None] = contextvars.ContextVar("next_trace_id", default=None)


def run_trace_id(run_id: str) -> str:
    """The trace id (32 hex digits) of a run's trace: the first 16 bytes of SHA-256 of its id."""
    digest = hashlib.sha256(f"evalbus-run:{run_id}".encode()).digest()[:16]
    return (digest if any(digest) else b"\x00" * 15 + b"\x01").hex()


def configure_tracing(service: str, endpoint: str | None) -> None:
    """Install an SDK tracer provider exporting to `endpoint` over OTLP/HTTP (no-op when None)."""
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    install_provider(service, BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")))


def install_provider(service: str, processor: object) -> None:
    """Install an SDK tracer provider with `processor` (a `SpanProcessor`) and turn spans on.
    The provider's id generator takes a run's derived trace id when one is asked for."""
    global _enabled
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import SpanProcessor, TracerProvider
    from opentelemetry.sdk.trace.id_generator import RandomIdGenerator

    class _RunTraceIds(RandomIdGenerator):
        def generate_trace_id(self) -> int:
            wanted = _next_trace_id.get()
            return wanted if wanted is not None else super().generate_trace_id()

    assert isinstance(processor, SpanProcessor)
    provider = TracerProvider(
        resource=Resource.create({"service.name": f"evalbus-{service}"}), id_generator=_RunTraceIds()
    )
    provider.add_span_processor(processor)
    trace.set_tracer_provider(provider)
    _enabled = True


@contextlib.contextmanager
def message_span(name: str, headers: Mapping[str, str] | None, attributes: Mapping[str, str]) -> Iterator[None]:
    """Run the block as the handling of one message: child of its `traceparent` when present."""
    parent = headers.get("traceparent") if headers else None
    # A contextvar set costs a context copy: only when there is a parent to pass on. Each message
    # runs in its own task, so nothing can leak in from another message when it is not set.
    token = _inbound.set(parent) if parent is not None else None
    try:
        if not _enabled:
            yield
            return
        ctx = _propagator.extract(carrier=dict(headers or {}))
        otel_token = otel_context.attach(ctx)
        try:
            tracer = trace.get_tracer("evalbus")
            with tracer.start_as_current_span(name, kind=trace.SpanKind.CONSUMER, attributes=dict(attributes)):
                yield
        finally:
            otel_context.detach(otel_token)
    finally:
        if token is not None:
            _inbound.reset(token)


def inject_traceparent(headers: MutableMapping[str, str]) -> None:
    """Add the current span's `traceparent` (or pass the inbound one on) to outgoing headers."""
    if "traceparent" in headers:
        return
    if _enabled:
        _propagator.inject(headers)
        if "traceparent" in headers:
            return
    inbound = _inbound.get()
    if inbound:
        headers["traceparent"] = inbound


def inject_run_traceparent(headers: MutableMapping[str, str], run_id: str, attributes: Mapping[str, str]) -> None:
    """Start the trace of run `run_id` and put its `traceparent` in `headers`: a root span with the
    run's derived trace id, linked to the current span (the publisher's), ended at once — every
    stage's span of the run is its descendant."""
    if "traceparent" in headers:
        return
    trace_id = run_trace_id(run_id)
    if not _enabled:
        headers["traceparent"] = f"00-{trace_id}-{secrets.token_hex(8)}-01"
        return
    current = trace.get_current_span().get_span_context()
    if not current.is_valid:
        inbound = _inbound.get()
        if inbound:
            current = trace.get_current_span(_propagator.extract({"traceparent": inbound})).get_span_context()
    links = [trace.Link(current)] if current.is_valid else []
    wanted = _next_trace_id.set(int(trace_id, 16))
    try:
        span = trace.get_tracer("evalbus").start_span(
            "run",
            context=otel_context.Context(),  # a root: no parent, only the link
            kind=trace.SpanKind.PRODUCER,
            attributes={"evalbus.run_id": run_id, **attributes},
            links=links,
        )
    finally:
        _next_trace_id.reset(wanted)
    span.end()
    _propagator.inject(headers, context=trace.set_span_in_context(span))


def current_trace_id() -> str | None:
    """The trace id of the message being handled (for logs), when it has one."""
    if _enabled:
        ctx = trace.get_current_span().get_span_context()
        if ctx.is_valid:
            return format(ctx.trace_id, "032x")
    inbound = _inbound.get()
    if inbound:
        parts = inbound.split("-")
        if len(parts) == 4 and len(parts[1]) == 32:
            return parts[1]
    return None
