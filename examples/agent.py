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

If `OTEL_EXPORTER_OTLP_ENDPOINT` is set and opentelemetry-sdk is importable, it also exports its
steps as OTLP spans (OpenInference attributes, `evalbus.run_id` on the resource and root span).
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from collections.abc import Callable
from typing import Any

START = time.monotonic()
PRICE_PER_1K = {"input": 0.00015, "output": 0.0006}  # what the demo pretends its planner costs
MODEL = "demo-planner-1"
_steps: list[dict[str, Any]] = []


def now() -> float:
    return round(time.monotonic() - START, 6)


def emit(kind: str, **fields: Any) -> None:
    event = {"kind": kind, "t": now(), **fields}
    _steps.append(event)
    print("EVALBUS_EVENT " + json.dumps(event), flush=True)


def log(text: str) -> None:
    print(f"[agent] {text}", file=sys.stderr, flush=True)


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


def export_otel(run_id: str, task: str, answer: str) -> None:
    endpoint = os.environ.get("OTEL_EXPORTER_OTLP_ENDPOINT")
    if not endpoint:
        return
    try:
        from opentelemetry import trace
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
        from opentelemetry.sdk.resources import Resource
        from opentelemetry.sdk.trace import TracerProvider
        from opentelemetry.sdk.trace.export import SimpleSpanProcessor
    except ImportError:
        log("opentelemetry-sdk not importable: no OTLP export")
        return
    headers = dict(
        kv.split("=", 1) for kv in os.environ.get("OTEL_EXPORTER_OTLP_HEADERS", "").split(",") if "=" in kv
    )
    provider = TracerProvider(resource=Resource.create({"service.name": "evalbus-demo-agent"}))
    provider.add_span_processor(
        SimpleSpanProcessor(OTLPSpanExporter(endpoint=endpoint.rstrip("/") + "/v1/traces", headers=headers))
    )
    tracer = provider.get_tracer("evalbus-demo-agent")
    with tracer.start_as_current_span("agent", attributes={
        "openinference.span.kind": "AGENT", "evalbus.run_id": run_id, "input.value": task, "output.value": answer,
    }):
        for step in _steps:
            if step["kind"] == "llm_call":
                with tracer.start_as_current_span("plan", attributes={
                    "openinference.span.kind": "LLM", "llm.model_name": step["model"],
                    "llm.token_count.prompt": step["input_tokens"],
                    "llm.token_count.completion": step["output_tokens"],
                    "llm.cost.total": step["cost_usd"],
                }):
                    pass
            elif step["kind"] == "tool_call":
                with trace.use_span(tracer.start_span(step["name"], attributes={
                    "openinference.span.kind": "TOOL", "tool.name": step["name"],
                    "input.value": json.dumps(step["args"]),
                }), end_on_exit=True):
                    pass
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
