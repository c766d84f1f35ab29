"""OpenTelemetry: a span per handled message, `traceparent` carried in NATS headers.

Spans are exported only when an OTLP endpoint is configured; without one the propagation still
happens (an incoming `traceparent` is passed on to the outputs), at almost no cost.
"""

from __future__ import annotations

import contextlib
import contextvars
from collections.abc import Iterator, Mapping, MutableMapping

from opentelemetry import context as otel_context
from opentelemetry import trace
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

_propagator = TraceContextTextMapPropagator()
_enabled = False
_inbound: contextvars.ContextVar[str | None] = contextvars.ContextVar("inbound_traceparent", default=None)


def configure_tracing(service: str, endpoint: str | None) -> None:
    """Install an SDK tracer provider exporting to `endpoint` over OTLP/HTTP (no-op when None)."""
    global _enabled
    if not endpoint:
        return
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    provider = TracerProvider(resource=Resource.create({"service.name": f"evalbus-{service}"}))
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces")))
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
    if _enabled:
        _propagator.inject(headers)
        if "traceparent" in headers:
            return
    inbound = _inbound.get()
    if inbound:
        headers["traceparent"] = inbound
