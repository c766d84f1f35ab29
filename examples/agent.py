"""The demo agent: a small tool-using agent that evalbus runs as a command harness.

It reads its task on stdin, plans with a deterministic local "planner" (reported as `llm_call`
events with token counts and a cost, so cost graders have something to add up — no model is
called), uses tools (calculator, string tools, a tiny knowledge base), and prints its answer.
Every step is an `EVALBUS_EVENT {json}` line on stdout, which the dispatcher turns into the run's
trace; progress goes to stderr. It also writes `answer.txt` so sandbox graders can check it.

It gets some tasks wrong on purpose, so the scorecard has something to show:
- its knowledge base has a stale entry (the capital of Australia);
- its letter counter counts a doubled letter once ("how many l's in 'balloon'?");
- it rounds percentages to whole numbers even when asked for one decimal.

OTLP export: when `OTEL_EXPORTER_OTLP_TRACES_ENDPOINT` or `OTEL_EXPORTER_OTLP_ENDPOINT` is set and
opentelemetry-sdk is importable, the agent exports its steps as OTLP spans instead of printing them
(a harness with a platform trace gets its trace from the platform, so printing the steps as well
would count each one twice). The SDK reads the standard variables itself (endpoint, headers, and
`OTEL_RESOURCE_ATTRIBUTES`, where the dispatcher puts `evalbus.run_id`); the run id is also set on
the root span (Phoenix keeps span attributes only), and the trace id is the first 32 hex digits of
SHA-256(run id), so `correlate: id` finds it (`correlate: tag` works too). Spans carry the steps'
real times and OpenInference attributes: an AGENT root (task in, answer out), one LLM span per
planner call (model, tokens, cost), one TOOL span per tool call (arguments, output, error status).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from importlib.util import find_spec
from typing import Any

START = time.monotonic()
START_NS = time.time_ns()
PRICE_PER_1K = {"input": 0.00015, "output": 0.0006}  # what the demo pretends its planner costs
MODEL = "demo-planner-1"
OTLP_EXPORTER_MODULE = "opentelemetry.exporter.otlp.proto.http.trace_exporter"
_steps: list[dict[str, Any]] = []


def now() -> float:
    return round(time.monotonic() - START, 6)


def emit(kind: str, **fields: Any) -> None:
    event = {"kind": kind, "t": now(), **fields}
    _steps.append(event)
    if not OTLP:  # with OTLP export the platform trace is the trace
        print("EVALBUS_EVENT " + json.dumps(event), flush=True)


def log(text: str) -> None:
    print(f"[agent] {text}", file=sys.stderr, flush=True)


def otlp_wanted() -> bool:
    """Whether an OTLP endpoint is configured and the SDK is importable."""
    if not (os.environ.get("OTEL_EXPORTER_OTLP_TRACES_ENDPOINT") or os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")):
        return False
    try:
        found = all(find_spec(m) is not None for m in ("opentelemetry.sdk.trace", OTLP_EXPORTER_MODULE))
    except ModuleNotFoundError:
        found = False
    if not found:
        log("opentelemetry-sdk not importable: no OTLP export, steps are printed")
    return found


OTLP = otlp_wanted()


def plan(task: str, thought: str) -> None:
    """One 'model call' of the planner: tokens ~ words, cost from the price table."""
    t0 = time.monotonic()
    input_tokens = max(1, len(task.split()) * 4 // 3 + 40)
    output_tokens = max(1, len(thought.split()) * 4 // 3)
    cost = input_tokens / 1000 * PRICE_PER_1K["input"] + output_tokens / 1000 * PRICE_PER_1K["output"]
    emit(
        "llm_call",
        model=MODEL,
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        cost_usd=round(cost, 8),
        latency_ms=round((time.monotonic() - t0) * 1000 + 1.0, 3),
    )


_call_ids = iter(range(1, 1_000_000))


def use(tool: str, fn: Callable[..., Any], **args: Any) -> Any:
    call_id = f"call-{next(_call_ids)}"
    emit("tool_call", id=call_id, name=tool, args=args)
    try:
        out = fn(**args)
    except Exception as e:  # noqa: BLE001 - a tool error is part of the trace
        emit("tool_result", id=call_id, ok=False, output=f"{type(e).__name__}: {e}")
        raise
    emit("tool_result", id=call_id, ok=True, output=str(out))
    return out


# ------------------------------------------------------------------ tools

_ALLOWED = re.compile(r"^[\d\s+\-*/().]+$")


def calculator(expression: str) -> float:
    if not _ALLOWED.match(expression):
        raise ValueError(f"not arithmetic: {expression!r}")
    return float(eval(expression, {"__builtins__": {}}, {}))  # noqa: S307 - digits and operators only


def reverse(text: str) -> str:
    return text[::-1]


def count_letter(word: str, letter: str) -> int:
    # Deliberate bug: runs of the same letter count once ("balloon" has 2 l's, this says 1).
    return len(re.findall(f"{re.escape(letter)}+", word))


KNOWLEDGE = {
    "france": "Paris",
    "japan": "Tokyo",
    "australia": "Sydney",  # deliberately stale/wrong: the capital is Canberra
    "canada": "Ottawa",
    "kenya": "Nairobi",
    "brazil": "Brasília",
    "norway": "Oslo",
}


def lookup_capital(country: str) -> str:
    return KNOWLEDGE[country.lower()]


def sort_numbers(numbers: list[float]) -> list[float]:
    return sorted(numbers)


# ------------------------------------------------------------------ the agent


def fmt(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else f"{x:g}"


def solve(task: str) -> str:
    text = task.strip()
    low = text.lower()
    if m := re.search(r"what is ([\d\s+\-*/().]+)\??$", low):
        plan(text, "Use the calculator on the expression.")
        return fmt(use("calculator", calculator, expression=m.group(1).strip()))
    if m := re.search(r"reverse the word '([^']+)'", low):
        plan(text, "Reverse the word with the string tool.")
        return str(use("reverse", reverse, text=m.group(1)))
    if m := re.search(r"how many ([a-z])'s are in '([^']+)'", low):
        plan(text, "Count the letter with the counter tool.")
        return str(use("count_letter", count_letter, word=m.group(2), letter=m.group(1)))
    if m := re.search(r"capital of ([a-z ]+)\??$", low):
        plan(text, "Look the country up in the knowledge base.")
        return str(use("lookup_capital", lookup_capital, country=m.group(1).strip()))
    if m := re.search(r"sort these numbers: ([\d\s,.\-]+)$", low):
        plan(text, "Parse the numbers and sort them ascending.")
        numbers = [float(x) for x in m.group(1).split(",") if x.strip()]
        return ", ".join(fmt(x) for x in use("sort_numbers", sort_numbers, numbers=numbers))
    if m := re.search(r"what is ([\d.]+)% of ([\d.]+)", low):
        plan(text, "Multiply, then round.")
        value = use("calculator", calculator, expression=f"{m.group(1)} * {m.group(2)} / 100")
        return fmt(round(value))  # deliberate: rounds to a whole number even when a decimal is asked
    plan(text, "I do not know how to do this task.")
    return "I don't know"


def wall_ns(t: float) -> int:
    """Unix nanoseconds of a step time (seconds since the agent started)."""
    return START_NS + int(t * 1e9)


def export_otel(run_id: str, task: str, answer: str) -> None:
    """Export the recorded steps as OTLP spans (see the module docstring)."""
    if not OTLP:
        return
    import hashlib
    import random

    from opentelemetry import trace
    from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor
    from opentelemetry.sdk.trace.id_generator import IdGenerator
    from opentelemetry.trace import Status, StatusCode

    class RunTraceId(IdGenerator):
        """Trace id = SHA-256(run id)[:32]: evalbus's id correlation."""

        def generate_span_id(self) -> int:
            return random.getrandbits(64) or 1

        def generate_trace_id(self) -> int:
            return int(hashlib.sha256(run_id.encode()).hexdigest()[:32], 16)

    provider = TracerProvider(
        resource=Resource.create({"service.name": "evalbus-demo-agent"}), id_generator=RunTraceId()
    )
    # one export of every span at shutdown; endpoint and headers come from the environment
    provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
    tracer = provider.get_tracer("evalbus-demo-agent")
    root = tracer.start_span(
        "agent",
        start_time=START_NS,
        attributes={
            "openinference.span.kind": "AGENT",
            "evalbus.run_id": run_id,
            "input.value": task,
            "output.value": answer,
        },
    )
    inside = trace.set_span_in_context(root)
    results = {s["id"]: s for s in _steps if s["kind"] == "tool_result"}
    for step in _steps:
        if step["kind"] == "llm_call":
            start = wall_ns(step["t"]) - int(step["latency_ms"] * 1e6)
            span = tracer.start_span(
                "plan",
                context=inside,
                start_time=start,
                attributes={
                    "openinference.span.kind": "LLM",
                    "llm.model_name": step["model"],
                    "llm.token_count.prompt": step["input_tokens"],
                    "llm.token_count.completion": step["output_tokens"],
                    "llm.token_count.total": step["input_tokens"] + step["output_tokens"],
                    "llm.cost.total": step["cost_usd"],
                },
            )
            span.end(end_time=wall_ns(step["t"]))
        elif step["kind"] == "tool_call":
            result = results.get(step["id"], {})
            span = tracer.start_span(
                step["name"],
                context=inside,
                start_time=wall_ns(step["t"]),
                attributes={
                    "openinference.span.kind": "TOOL",
                    "tool.name": step["name"],
                    "tool_call.id": step["id"],
                    "input.value": json.dumps(step["args"]),
                    "output.value": str(result.get("output", "")),
                },
            )
            if result.get("ok") is False:
                span.set_status(Status(StatusCode.ERROR, str(result.get("output", ""))))
            span.end(end_time=wall_ns(result.get("t", step["t"])))
    errors = [s["message"] for s in _steps if s["kind"] == "error"]
    if errors:
        root.set_status(Status(StatusCode.ERROR, errors[-1]))
    root.end()
    provider.shutdown()


def main() -> None:
    task = sys.stdin.read()
    run_id = os.environ.get("EVALBUS_RUN_ID", "local")
    log(f"run {run_id}: {task.strip()[:80]}")
    emit("message", role="user", text=task.strip())
    try:
        answer = solve(task)
    except Exception as e:  # noqa: BLE001 - the agent answers even when a tool failed
        emit("error", message=f"{type(e).__name__}: {e}")
        answer = "error"
    emit("message", role="assistant", text=answer)
    with open("answer.txt", "w") as f:
        f.write(answer + "\n")
    log(f"answer: {answer}")
    export_otel(run_id, task.strip(), answer)
    print("EVALBUS_RESULT " + json.dumps({"answer": answer}), flush=True)


if __name__ == "__main__":
    main()
