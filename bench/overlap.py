"""Overlap benchmark: does a batch stream through execution and judging, and is the sandbox
released the moment the agent is done?

Workload (issue 3, benchmark 1): 40 cases; a Python command harness that runs 1.0 s and prints an
answer; two `sleep` judges × 2.0 s each (`bench.plugins`); 4 compute slots (`DISPATCHER_SLOTS`);
judge limit 8 (`JUDGE_CONCURRENCY=8` and the `judge-cases` consumer's `max_ack_pending` = 8, set
once every service has started: each one re-applies the contract's 4 when it starts). All
five services run as processes against a nats-server and a PostgreSQL database of the benchmark's
own; the batch is published as `batch.requested` straight onto the bus and the makespan runs from
that publish to the last `case.exported`.

Printed: the makespan; the streaming lower bound max(⌈N/S⌉·H + J·T, H + N·J·T/L) — the last case
cannot finish before its execution wave plus its own judging, nor the batch before the judge lanes
have done N·J·T seconds of judging starting after the first harness — 21 s for these numbers (the
ideal schedule with cases leaving the slots in waves of 4 needs 22 s); their ratio (goal ≤ 1.15); the mean sandbox hold over the mean harness time from the `case.executed`
events' `result.timings` (goal ≤ 1.05); and the same workload in BARRIER mode (the judge consumer
paused until every case is ready, then resumed) for comparison.

Trace variants (issue 4, `--trace job|control-plane`, or `--all` for none + barrier + both): the
harness also exports OTLP spans to a real MLflow server (`x-mlflow-experiment-id`), and every
case's trace is pulled back — by the dispatcher after release (`job`) or by the collector
(`control-plane`). The same goals apply, and every case's trace must be collected.

Goals, for every streaming run (the barrier run is a comparison): makespan / bound ≤ 1.15
(`--ratio-goal`), mean sandbox hold / mean harness time ≤ 1.05 (`--hold-goal`), no failed case,
every judge score measured. Prints a short table and the goals, then one JSON line (only the JSON
line with --json; the goals are in it as data, `"goals"` and `"ok"`). With --check it exits 1,
naming the missed goals on stderr, when any is missed; without, it exits 0. Smaller workloads for
a quick run: `--cases 8 --harness-s 0.5 --judge-s 0.5` (the bound follows the numbers).

    uv run python bench/overlap.py [--trace none|job|control-plane] [--all] [--no-barrier] [--cases 40]
        [--harness-s 1] [--judges 2] [--judge-s 2] [--slots 4] [--judge-limit 8] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import heapq
import math
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/overlap.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import msgspec
from bench._consumers import AckPendingProbe, consumer_limit, pause, resume
from bench._goals import Goal, add_check_flag, goal, goal_notes, verdict
from bench._infra import Infra, pipeline_stack, quiet_logs, running
from bench._report import fmt, report
from bench._stats import mean
from bench._watch import BatchWatch
from bench._workload import batch_request

from evalbus.testing.platforms import PlatformServer, start_mlflow
from evalbus_contracts import (
    CaseExecuted,
    CaseJudged,
    CommandHarness,
    LlmCall,
    Measured,
    RegisteredJudge,
    TraceSpec,
)
from evalbus_contracts.specs import CollectMode
from evalbus_contracts.streams import JUDGE_CASES
from evalbus_runtime import Publisher, connect

TRACE_MODES = ("none", "job", "control-plane")

PLAIN_AGENT = """\
import os, time
T0 = time.monotonic()
time.sleep(max(0.0, float(os.environ["BENCH_HARNESS_S"]) - (time.monotonic() - T0)))
print("4")
"""
"""The harness: runs `BENCH_HARNESS_S` seconds and prints the answer."""

TRACE_AGENT = """\
import time
T0 = time.monotonic()
import hashlib, os, random
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor
from opentelemetry.sdk.trace.id_generator import IdGenerator


class RunTraceId(IdGenerator):
    # evalbus id correlation: trace id = first 32 hex digits of sha256(run id)
    def __init__(self, run_id):
        self.trace_id = int(hashlib.sha256(run_id.encode()).hexdigest()[:32], 16)

    def generate_span_id(self):
        return random.getrandbits(64) or 1

    def generate_trace_id(self):
        return self.trace_id


run_id = os.environ["EVALBUS_RUN_ID"]
provider = TracerProvider(resource=Resource.create({"service.name": "bench-agent"}), id_generator=RunTraceId(run_id))
provider.add_span_processor(BatchSpanProcessor(OTLPSpanExporter()))
tracer = provider.get_tracer("bench-agent")
with tracer.start_as_current_span("agent") as root:
    root.set_attribute("evalbus.run_id", run_id)
    root.set_attribute("openinference.span.kind", "AGENT")
    root.set_attribute("input.value", "What is 2 + 2?")
    with tracer.start_as_current_span("chat bench-model") as llm:
        llm.set_attribute("openinference.span.kind", "LLM")
        llm.set_attribute("llm.model_name", "bench-model")
        llm.set_attribute("llm.token_count.prompt", 42)
        llm.set_attribute("llm.token_count.completion", 7)
        llm.set_attribute("llm.cost.total", 0.0012)
        llm.set_attribute("llm.output_messages.0.message.role", "assistant")
        llm.set_attribute("llm.output_messages.0.message.content", "4")
    with tracer.start_as_current_span("calculator") as tool:
        tool.set_attribute("openinference.span.kind", "TOOL")
        tool.set_attribute("tool.name", "calculator")
        tool.set_attribute("input.value", '{"expression": "2+2"}')
        tool.set_attribute("output.value", "4")
    root.set_attribute("output.value", "4")
provider.shutdown()
time.sleep(max(0.0, float(os.environ["BENCH_HARNESS_S"]) - (time.monotonic() - T0)))
print("4")
"""
"""The traced harness: imports the OpenTelemetry SDK, exports an agent / LLM / tool trace to the
OTLP endpoint of the environment (flushed before it exits), and runs `BENCH_HARNESS_S` seconds in
all when the imports and the export take less than that (on 2 busy cores they may not: the measured
harness time is what the hold ratio divides by)."""


@dataclass(frozen=True)
class Params:
    """The workload."""

    cases: int
    harness_s: float
    judges: int
    judge_s: float
    slots: int
    judge_limit: int

    @property
    def judging_s(self) -> float:
        """Judging time of one case (judges run one after another within a case)."""
        return self.judges * self.judge_s

    def bound(self) -> tuple[float, float, float]:
        """(bound, execution-side term, judging-side term) of the streaming lower bound."""
        execution = math.ceil(self.cases / self.slots) * self.harness_s + self.judging_s
        judging = self.harness_s + self.cases * self.judging_s / self.judge_limit
        return max(execution, judging), execution, judging

    def formula(self) -> str:
        b, e, j = self.bound()
        n, s, h, jt, lim = self.cases, self.slots, self.harness_s, self.judging_s, self.judge_limit
        return (
            f"max(⌈N/S⌉·H + J·T, H + N·J·T/L) = max(⌈{n}/{s}⌉·{h:g} + {jt:g}, {h:g} + {n}·{jt:g}/{lim})"
            f" = max({e:g}, {j:g}) = {b:g} s"
        )

    def schedule_bound(self) -> float:
        """Makespan of the ideal streaming schedule with these discrete numbers: cases leave the
        slots in waves of S every H seconds and take the earliest free of L judge lanes."""
        lanes = [0.0] * self.judge_limit
        end = 0.0
        for i in range(self.cases):
            ready = (i // self.slots + 1) * self.harness_s
            free = heapq.heappop(lanes)
            done = max(ready, free) + self.judging_s
            heapq.heappush(lanes, done)
            end = max(end, done)
        return end


def harness_for(params: Params, trace: str, mlflow: PlatformServer | None, experiment: str | None) -> CommandHarness:
    """The plain harness, or the traced one exporting to MLflow with the given collect mode."""
    env = {"BENCH_HARNESS_S": repr(params.harness_s)}
    if trace == "none":
        return CommandHarness(
            id="sleep", command=(sys.executable, "agent.py"), files={"agent.py": PLAIN_AGENT}, env=env
        )
    assert mlflow is not None
    assert experiment is not None
    collect: CollectMode = "job" if trace == "job" else "control-plane"
    env.update(
        OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=f"{mlflow.url}/v1/traces",
        OTEL_EXPORTER_OTLP_TRACES_HEADERS=f"x-mlflow-experiment-id={experiment}",
    )
    return CommandHarness(
        id="sleep-traced",
        command=(sys.executable, "agent.py"),
        files={"agent.py": TRACE_AGENT},
        env=env,
        trace=TraceSpec(kind="mlflow", endpoint=mlflow.url, collect=collect, correlate="id", experiment=experiment),
    )


async def new_experiment(base: str) -> str:
    """A fresh MLflow experiment id."""
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{base}/api/2.0/mlflow/experiments/create", json={"name": f"bench-{uuid.uuid4().hex}"}) as r,
    ):
        r.raise_for_status()
        return str((await r.json())["experiment_id"])


async def one_run(
    infra: Infra, params: Params, *, trace: str, barrier: bool, mlflow: PlatformServer | None
) -> dict[str, Any]:
    """Start a fresh stack, run the batch once, return its measurements."""
    mode = "barrier" if barrier else "stream"
    batch_id = f"ov-{trace}-{mode}-{uuid.uuid4().hex[:8]}"
    stack = pipeline_stack(
        infra,
        batch_id,
        service_env={
            "dispatcher": {"DISPATCHER_SLOTS": str(params.slots)},
            "judge": {
                "JUDGE_CONCURRENCY": str(params.judge_limit),
                "JUDGE_GLOBAL_LIMIT": str(params.judge_limit),
                "JUDGE_PLUGINS": "bench.plugins:register",
            },
        },
    )
    experiment = await new_experiment(mlflow.url) if mlflow is not None and trace != "none" else None
    harness = harness_for(params, trace, mlflow, experiment)
    judges = tuple(
        RegisteredJudge(id=f"sleep{k + 1}", name="sleep", params={"seconds": repr(params.judge_s)})
        for k in range(params.judges)
    )
    request = batch_request(batch_id, params.cases, harness, judges)
    ready_stage = "case.collected" if trace == "control-plane" else "case.executed"
    timeout_s = 6 * params.bound()[0] + 120
    await asyncio.to_thread(stack.start_all)
    async with running(stack):
        nc = await connect(infra.nats_url, "bench-overlap")
        js = nc.jetstream()
        try:
            # The judge applies JUDGE_GLOBAL_LIMIT to its consumer when it starts.
            limit_at_start = await consumer_limit(js, JUDGE_CASES)
            judge_cases = msgspec.structs.replace(JUDGE_CASES, max_ack_pending=limit_at_start)
            limit_in_run = limit_at_start
            if barrier:
                await pause(js, JUDGE_CASES)
            watch = await BatchWatch(nc, batch_id, decode=frozenset({"case.executed", "case.judged"})).start()
            pub = Publisher(nc)
            await pub.start()
            barrier_at: float | None = None
            async with AckPendingProbe(js, JUDGE_CASES, period_s=0.1) as probe:
                t0 = time.monotonic()
                await pub.publish_event(request)
                if barrier:
                    await watch.wait_for(ready_stage, params.cases, timeout_s)
                    barrier_at = time.monotonic() - t0
                    await resume(js, judge_cases)
                await watch.wait_for("case.exported", params.cases, timeout_s)
                with_finalized = True
                try:
                    await watch.wait_for("batch.finalized", 1, 60.0)
                except TimeoutError:
                    with_finalized = False
            await watch.stop()
            await pub.stop()
        finally:
            await nc.close()
    return summarize(params, watch, t0, trace=trace, mode=mode, barrier_at=barrier_at, peak=probe.peak) | {
        "judge_max_ack_pending_after_start": limit_at_start,
        "judge_max_ack_pending_in_run": limit_in_run,
        "finalized_s": (watch.last("batch.finalized") - t0) if with_finalized else None,
    }


def summarize(
    params: Params, watch: BatchWatch, t0: float, *, trace: str, mode: str, barrier_at: float | None, peak: int
) -> dict[str, Any]:
    """The run's figures from the events it saw."""
    executed = [e for e in watch.events.get("case.executed", []) if isinstance(e, CaseExecuted)]
    judged = [e for e in watch.events.get("case.judged", []) if isinstance(e, CaseJudged)]
    sandbox = [e.result.timings.sandbox_seconds for e in executed]
    harness = [e.result.timings.harness_seconds for e in executed]
    per_case = [s / h for s, h in zip(sandbox, harness, strict=True) if h > 0]
    judge_scores = sum(
        1
        for e in judged
        for s in e.result.scores
        if s.source == "judge" and isinstance(s, Measured) and s.value >= params.judge_s * 0.99
    )
    traced = sum(1 for e in judged if any(isinstance(t, LlmCall) for t in e.result.trace))
    bound, _, _ = params.bound()
    makespan = watch.last("case.exported") - t0
    return {
        "trace": trace,
        "mode": mode,
        "makespan_s": makespan,
        "bound_s": bound,
        "ratio": makespan / bound,
        "executed_last_s": watch.last("case.executed") - t0,
        "first_exported_s": watch.first("case.exported") - t0,
        "barrier_at_s": barrier_at,
        "sandbox_mean_s": mean(sandbox),
        "harness_mean_s": mean(harness),
        "hold_ratio": mean(sandbox) / mean(harness) if harness else float("nan"),
        "hold_ratio_max": max(per_case, default=float("nan")),
        "failed_cases": sum(1 for e in executed if e.status != "succeeded"),
        "judge_scores_measured": judge_scores,
        "traces_collected": traced,
        "judge_peak_in_flight": peak,
    }


def run_goals(params: Params, streams: list[dict[str, Any]], ratio_goal: float, hold_goal: float) -> list[Goal]:
    """The goals of every streaming run: makespan against the bound, sandbox hold against the
    harness time, and every case executed, judged (and traced) in full."""
    formula = params.formula()
    out: list[Goal] = []
    for r in streams:
        t = r["trace"]
        out += [
            goal(f"{t}: makespan / bound", r["ratio"], "<=", ratio_goal, f"{r['makespan_s']:.2f} s / {formula}"),
            goal(
                f"{t}: sandbox hold / harness time",
                r["hold_ratio"],
                "<=",
                hold_goal,
                "mean sandbox_seconds / mean harness_seconds of the case.executed timings",
            ),
            goal(f"{t}: failed cases", r["failed_cases"], "==", 0, "every case executed successfully"),
            goal(
                f"{t}: judge scores measured",
                r["judge_scores_measured"],
                "==",
                params.cases * params.judges,
                "every judge measured every case (cases × judges)",
            ),
        ]
        if t != "none":
            out.append(goal(f"{t}: traces collected", r["traces_collected"], "==", params.cases, "one per case"))
    return out


async def main(args: argparse.Namespace) -> dict[str, Any]:
    params = Params(
        cases=args.cases,
        harness_s=args.harness_s,
        judges=args.judges,
        judge_s=args.judge_s,
        slots=args.slots,
        judge_limit=args.judge_limit,
    )
    traces = list(TRACE_MODES) if args.all else [args.trace]
    plan: list[tuple[str, bool]] = [(t, False) for t in traces]
    if not args.no_barrier and "none" in traces:
        plan.insert(traces.index("none") + 1, ("none", True))
    runs: list[dict[str, Any]] = []
    mlflow: PlatformServer | None = None
    async with Infra(database=True) as infra:
        try:
            if any(t != "none" for t in traces):
                mlflow = await asyncio.to_thread(start_mlflow, infra.workdir / "mlflow")
            for trace, barrier in plan:
                runs.append(await one_run(infra, params, trace=trace, barrier=barrier, mlflow=mlflow))
        finally:
            if mlflow is not None:
                mlflow.stop()
    bound, _, _ = params.bound()
    streams = [r for r in runs if r["mode"] == "stream"]
    goals = run_goals(params, streams, args.ratio_goal, args.hold_goal)
    return {
        "benchmark": "overlap",
        "params": {
            "cases": params.cases,
            "harness_s": params.harness_s,
            "judges": params.judges,
            "judge_s": params.judge_s,
            "slots": params.slots,
            "judge_limit": params.judge_limit,
        },
        "bound_s": bound,
        "bound_formula": params.formula(),
        "schedule_bound_s": params.schedule_bound(),
        "ratio_goal": args.ratio_goal,
        "hold_goal": args.hold_goal,
        "database": infra.database_source,
        "runs": runs,
        "goals": goals,
        "ok": all(g.passed for g in goals),
    }


def table(out: dict[str, Any]) -> tuple[list[tuple[str, ...]], list[str]]:
    """The rows and notes printed without --json."""
    rows: list[tuple[str, ...]] = [
        ("run", "makespan", "ratio", "executed", "hold/harness", "max hold", "judge peak", "traces", "finalized")
    ]
    for r in out["runs"]:
        rows.append(
            (
                f"{r['trace']}/{r['mode']}",
                fmt(r["makespan_s"], " s"),
                fmt(r["ratio"], digits=3),
                fmt(r["executed_last_s"], " s"),
                fmt(r["hold_ratio"], digits=3),
                fmt(r["hold_ratio_max"], digits=3),
                str(r["judge_peak_in_flight"]),
                str(r["traces_collected"]),
                fmt(r["finalized_s"], " s"),
            )
        )
    p = out["params"]
    notes = [
        f"workload: {p['cases']} cases, harness {p['harness_s']:g} s, {p['judges']} judges × {p['judge_s']:g} s, "
        f"{p['slots']} slots, judge limit {p['judge_limit']}",
        f"streaming lower bound: {out['bound_formula']} (ideal discrete schedule: {out['schedule_bound_s']:g} s)",
        *goal_notes(out["goals"]),
    ]
    return rows, notes


def cli() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--trace", choices=TRACE_MODES, default="none", help="trace collection variant (issue 4)")
    parser.add_argument("--all", action="store_true", help="run none (+ barrier), job and control-plane")
    parser.add_argument("--no-barrier", action="store_true", help="skip the barrier comparison")
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--harness-s", type=float, default=1.0)
    parser.add_argument("--judges", type=int, default=2)
    parser.add_argument("--judge-s", type=float, default=2.0)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--judge-limit", type=int, default=8)
    parser.add_argument("--ratio-goal", type=float, default=1.15)
    parser.add_argument("--hold-goal", type=float, default=1.05)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    add_check_flag(parser)
    args = parser.parse_args()
    quiet_logs()
    out = asyncio.run(main(args))
    rows, notes = table(out)
    report(out, rows, notes, args.json)
    sys.exit(verdict("overlap", out["goals"], check=args.check))


if __name__ == "__main__":
    cli()
