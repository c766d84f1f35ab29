"""A small instrumented agent for the live tests: exports real OTLP spans with opentelemetry-sdk.

Configured only through the environment, like an agent under evaluation:
- `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT`, `OTEL_EXPORTER_OTLP_TRACES_HEADERS`, `OTEL_RESOURCE_ATTRIBUTES`
  (the dispatcher injects `evalbus.run_id=<run>` there) — read by the SDK itself;
- `EVALBUS_RUN_ID`: set as an attribute of the root span too (Phoenix keeps span attributes only);
- `AGENT_TRACE_ID`: `run` mints the trace id from the run id (sha256, id correlation), `random`
  lets the SDK mint its own (tag correlation).
Spans: an AGENT root, an LLM call (model, tokens, cost, output message) and a TOOL call, all with
OpenInference attributes. Exits 1 when the exporter reports a failure.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time
from collections.abc import Sequence

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator


class RunTraceId(IdGenerator):
    """Trace id = first 32 hex digits of SHA-256(run id): evalbus's id-correlation rule."""

    def __init__(self, run_id: str) -> None:
        self._trace_id = int(hashlib.sha256(run_id.encode()).hexdigest()[:32], 16)

    def generate_span_id(self) -> int:
        return random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self._trace_id


class Checked(SpanExporter):
    """Wraps the OTLP exporter and remembers whether any export failed."""

    def __init__(self, inner: SpanExporter) -> None:
        self.inner = inner
        self.failed = False

    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        result = self.inner.export(spans)
        self.failed |= result is not SpanExportResult.SUCCESS
        return result

    def shutdown(self) -> None:
        self.inner.shutdown()


def main() -> int:
    run_id = os.environ["EVALBUS_RUN_ID"]
    ids = RunTraceId(run_id) if os.environ.get("AGENT_TRACE_ID", "run") == "run" else RandomIdGenerator()
    provider = TracerProvider(resource=Resource.create({"service.name": "otlp-agent"}), id_generator=ids)
    exporter = Checked(OTLPSpanExporter())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("otlp-agent")
    question = "What is 6*7?"
    with tracer.start_as_current_span("agent") as root:
        root.set_attribute("evalbus.run_id", run_id)
        root.set_attribute("openinference.span.kind", "AGENT")
        root.set_attribute("input.value", question)
        with tracer.start_as_current_span("chat gpt-test") as llm:
            llm.set_attribute("openinference.span.kind", "LLM")
            llm.set_attribute("llm.model_name", "gpt-test")
            llm.set_attribute("llm.token_count.prompt", 42)
            llm.set_attribute("llm.token_count.completion", 7)
            llm.set_attribute("llm.token_count.total", 49)
            llm.set_attribute("llm.cost.total", 0.0012)
            llm.set_attribute("llm.output_messages.0.message.role", "assistant")
            llm.set_attribute("llm.output_messages.0.message.content", "I will use the calculator.")
            time.sleep(0.01)
        with tracer.start_as_current_span("calculator") as tool:
            tool.set_attribute("openinference.span.kind", "TOOL")
            tool.set_attribute("tool.name", "calculator")
            tool.set_attribute("input.value", '{"expression": "6*7"}')
            tool.set_attribute("output.value", "42")
            time.sleep(0.01)
        root.set_attribute("output.value", "42")
    provider.shutdown()
    return 1 if exporter.failed else 0


if __name__ == "__main__":
    sys.exit(main())
