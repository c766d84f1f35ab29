"""An OpenTelemetry-instrumented agent for the trace-pipeline tests (a script, run by the dispatcher).

It knows nothing of evalbus beyond what any OTel agent sees: the SDK reads
`OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` / `OTEL_EXPORTER_OTLP_TRACES_HEADERS` (the harness's env) and
`OTEL_RESOURCE_ATTRIBUTES` (where the dispatcher injects `evalbus.run_id=<run>`) by itself. The run
id is also copied from `EVALBUS_RUN_ID` onto the root span, because Phoenix keeps span attributes
only. It reads its task on stdin, writes `answer.txt` (for a tests-pass grader) and prints its
answer on stdout; it prints no evalbus trace lines — the platform trace is its whole trace.

Knobs (harness env):
- `AGENT_TRACE_ID`: `run` (default) mints the trace id from the run id (SHA-256, id correlation);
  `random` lets the SDK mint its own (tag correlation);
- `AGENT_MESSAGES`: `1` (default) puts the answer on the spans (LLM output message, root
  `output.value`); `0` leaves every message out, so the platform trace has no assistant message.
Spans: an AGENT root, an LLM call (model, tokens, cost) and a TOOL call, with OpenInference
attributes. Exits 1 when the exporter reports a failure, so a lost trace is a failed run.
"""

from __future__ import annotations

import hashlib
import os
import random
import sys
import time
from collections.abc import Sequence
from pathlib import Path

from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor, SpanExporter, SpanExportResult
from opentelemetry.sdk.trace.id_generator import IdGenerator, RandomIdGenerator

ANSWER = "42"
"""What the agent answers (the tests ask it 6*7)."""


class RunTraceId(IdGenerator):
    """Trace id = the first 32 hex digits of SHA-256(run id): evalbus's id-correlation rule."""

    def __init__(self, run_id: str) -> None:
        self._trace_id = int(hashlib.sha256(run_id.encode()).hexdigest()[:32], 16)

    def generate_span_id(self) -> int:
        return random.getrandbits(64) or 1

    def generate_trace_id(self) -> int:
        return self._trace_id


class Checked(SpanExporter):
    """The OTLP exporter, remembering whether an export failed."""

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
    """Answer the task, exporting the spans of the work."""
    run_id = os.environ["EVALBUS_RUN_ID"]
    question = sys.stdin.read().strip()
    with_messages = os.environ.get("AGENT_MESSAGES", "1") == "1"
    ids = RunTraceId(run_id) if os.environ.get("AGENT_TRACE_ID", "run") == "run" else RandomIdGenerator()
    provider = TracerProvider(resource=Resource.create({"service.name": "pipeline-agent"}), id_generator=ids)
    exporter = Checked(OTLPSpanExporter())
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    tracer = provider.get_tracer("pipeline-agent")
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
            if with_messages:
                llm.set_attribute("llm.output_messages.0.message.role", "assistant")
                llm.set_attribute("llm.output_messages.0.message.content", "I will use the calculator.")
            time.sleep(0.01)
        with tracer.start_as_current_span("calculator") as tool:
            tool.set_attribute("openinference.span.kind", "TOOL")
            tool.set_attribute("tool.name", "calculator")
            tool.set_attribute("input.value", '{"expression": "6*7"}')
            tool.set_attribute("output.value", ANSWER)
            time.sleep(0.01)
        if with_messages:
            root.set_attribute("output.value", ANSWER)
    provider.shutdown()
    Path("answer.txt").write_text(ANSWER + "\n")
    print(ANSWER, flush=True)
    return 1 if exporter.failed else 0


if __name__ == "__main__":
    sys.exit(main())
