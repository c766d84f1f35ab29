"""Throughput benchmark: zero-latency cases through dispatcher → judge → exporter → recorder, next
to a bare nats-py 3-stage relay measured in the same run.

Workload (issue 3, benchmark 2): 20,000 cases in one `batch.requested` (published straight onto the
bus); the harness is a trivial command (`/bin/echo 4`: still one process spawn, workdir and
process group per case on the local backend), the judge an exact-match rule, no sink; all five
services as processes on a nats-server and a PostgreSQL database of the benchmark's own. The bare
relay is `bench/_relay.py`'s, as in `bench/chassis.py`: the strongest simple nats-py 3-stage relay
(credit-based pulls like the chassis', 256 messages in flight per stage, forward undecoded, ack on
the PubAck), on a nats-server of its own so the recorder does not see its messages.

Measured, in order:
1. relay — cases/s of the bare 3-stage relay.
2. pipeline — the batch end to end: cases/s from the publish to the last `case.exported`, the
   time to `batch.finalized` (recorder and finalisation included), each stage's own rate
   (first to last event of that stage) and the executed → exported latency.
3. backend — what one case costs the local backend alone (provision, spawn, wait, release) at the
   dispatcher's slot count, in this process: the ceiling the harness spawn puts on the pipeline.
4. downstream — the harness factored out: `case.executed` events published directly (as the
   dispatcher emits them) through judge → exporter (→ recorder), cases/s; with the contract's
   global limits (judge-cases max_ack_pending 4, exporter-cases 2) and, for comparison, with
   those limits raised to 1,000.
5. paced — p50/p99 publish-to-exported at a paced 500 cases/s: `case.requested` (through the
   dispatcher, process spawn included) and `case.executed` (harness factored out).

`--harness worker` runs the same workload with a warm worker harness instead (issue 9): the
zero-latency Python agent of `examples/worker_agent.py` (a user message, a calculator tool call and
its result through the SDK's `ctx`, the answer) served by `--slots` long-lived worker processes over
the worker protocol, one case at a time each, every case still in its own workdir; "backend" is
then the local backend serving cases on its warm workers.

Case workdirs go to a tmpfs folder by default (`--workdir-root`, the dispatcher's
`DISPATCHER_WORKDIR_ROOT`; `system` for the system temp folder): on this machine's temp folder
(ext4 mounted with `discard`) creating and deleting a workdir costs about 6 ms, on tmpfs 0.04 ms —
the default would measure the disk, not evalbus.

Goals, command harness: pipeline ≥ 1,000 cases/s; pipeline ≥ 0.5 × the bare relay measured in this
run; pipeline ≥ 0.85 × the local backend's own rate at the dispatcher's slot count, in this run (the
spawn is the ceiling; the rest of the pipeline should cost little on top); p99 ≤ 50 ms at a paced
500 cases/s through the dispatcher. Worker harness: pipeline ≥ 1,200 cases/s (at least LangSmith's
in-memory `evaluate` on this machine, while durable, recorded and exported), pipeline ÷ bare relay
reported (≥ 0.5), the same p99 goal. Prints a short table and the goals, then one JSON line (only
the JSON line with --json; the goals are in it as data, `"goals"` and `"ok"`). With --check it
exits 1, naming the missed goals on stderr, when any is missed; without, it exits 0.

    uv run python bench/throughput.py [--harness command|worker] [--cases 20000] [--rate 500]
        [--paced-seconds 10] [--slots 32 (command) / 4 (worker)] [--backend-cases 1000] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import shutil
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/throughput.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._consumers import consumer_limit, drained, set_consumer
from bench._cpu import CpuMeter, stack_pids
from bench._goals import add_check_flag, goal, goal_notes, verdict
from bench._infra import Infra, pipeline_stack, quiet_logs, running
from bench._relay import run_mode
from bench._report import fmt, report
from bench._stats import mean, percentile
from bench._watch import BatchWatch
from bench._workload import RULE_JUDGE, ZERO_HARNESS, batch_request, sample_events, with_dataset

from evalbus_contracts import CaseExecuted, CasePlan, CaseRequested, CaseSpec, HarnessSpec
from evalbus_contracts.events import EventBase
from evalbus_contracts.streams import EXPORTER_CASES, GATEWAY_RECORDER, JUDGE_CASES
from evalbus_dispatcher.backends.local import LocalBackend
from evalbus_runtime import Publisher, connect

STAGES = ("case.requested", "case.executed", "case.judged", "case.exported")
RAISED_LIMIT = 1000
WORKER_AGENT = Path(__file__).resolve().parents[1] / "examples" / "worker_agent.py"
WORKER_HARNESS = HarnessSpec(kind="worker", id="worker-agent", python=f"{WORKER_AGENT}:solve", timeout_s=60.0)
"""The zero-latency warm worker harness: the SDK's example agent (no model call)."""


async def metered(meter: CpuMeter, work: Awaitable[dict[str, Any]], cases: int) -> dict[str, Any]:
    """Run `work` while `meter` measures; add CPU ms per case by component and the cores' busy share."""
    meter.start()
    out = await work
    meter.stop()
    return out | {"cpu_ms_per_case": meter.per_case_ms(cases), "cpu_busy": meter.utilisation()}


# ---------------------------------------------------------------- 1. the bare relay


async def relay(infra: Infra, n: int) -> dict[str, float]:
    """The bare nats-py relay (`bench/_relay.py`) on a nats-server of its own."""
    server = infra.new_nats("nats-relay")
    logdir = infra.workdir / "relay"
    logdir.mkdir(exist_ok=True)
    try:
        return await run_mode(server.url, "bare", n, None, logdir)
    finally:
        server.stop()


# ---------------------------------------------------------------- 2. the pipeline


async def pipeline(infra: Infra, n: int, timeout_s: float, harness: HarnessSpec) -> dict[str, Any]:
    """One batch of `n` zero-latency cases, from `batch.requested` to `batch.finalized`."""
    batch_id = f"tp-{uuid.uuid4().hex[:8]}"
    request = batch_request(batch_id, n, harness, RULE_JUDGE)
    nc = await connect(infra.nats_url, "bench-throughput")
    try:
        watch = await BatchWatch(nc, batch_id).start()
        pub = Publisher(nc)
        await pub.start()
        request = await with_dataset(nc.jetstream(), request)
        t0 = time.monotonic()
        await pub.publish_event(request)
        await watch.wait_for("case.exported", n, timeout_s)
        finalized: float | None = None
        try:
            await watch.wait_for("batch.finalized", 1, max(60.0, n / 500))
            finalized = watch.last("batch.finalized") - t0
        except TimeoutError:
            pass
        await watch.stop()
        await pub.stop()
    finally:
        await nc.close()
    makespan = watch.last("case.exported") - t0
    rates = {}
    for stage in STAGES:
        times = watch.times.get(stage, {})
        span = max(times.values()) - min(times.values()) if len(times) > 1 else float("nan")
        rates[stage] = {
            "first_s": min(times.values()) - t0,
            "last_s": max(times.values()) - t0,
            "per_s": (len(times) - 1) / span if span > 0 else float("nan"),
        }
    executed, exported = watch.times.get("case.executed", {}), watch.times["case.exported"]
    downstream = [exported[k] - executed[k] for k in exported if k in executed]
    return {
        "cases": n,
        "makespan_s": makespan,
        "cases_per_s": n / makespan,
        "finalized_s": finalized,
        "stages": rates,
        "executed_to_exported_p50_ms": 1000 * percentile(downstream, 0.5),
        "executed_to_exported_p99_ms": 1000 * percentile(downstream, 0.99),
    }


# ---------------------------------------------------------------- 3. the local backend alone


async def backend_alone(n: int, concurrency: int, harness: HarnessSpec, root: Path | None) -> dict[str, Any]:
    """Cases/s of the local backend alone (provision, run the harness, snapshot, release), with the
    mean time of each step; a worker harness's workers are started (and timed) before the clock."""
    backend = LocalBackend(slots=concurrency, root=root)
    if harness.kind == "worker":
        await asyncio.gather(*(warm_up(backend, harness, f"w{i}") for i in range(concurrency)))
    gate = asyncio.Semaphore(concurrency)
    plan = CasePlan(judges=RULE_JUDGE, suite_id="bench")
    steps: dict[str, list[float]] = {"provision": [], "run": [], "snapshot": [], "release": [], "case": []}

    async def nothing(_stream: str, _line: str) -> None:
        return None

    async def one(i: int) -> None:
        req = CaseRequested(
            batch_id="backend",
            case_id=f"c{i}",
            run_id=f"evb-backend-c{i}",
            case=CaseSpec(id=f"c{i}", input="What is 2 + 2?", expected="4"),
            harness=harness,
            plan=plan,
        )
        async with gate:
            t = [time.monotonic()]
            sandbox = await backend.provision(req)
            t.append(time.monotonic())
            try:
                run = await sandbox.run_harness(nothing)
                t.append(time.monotonic())
                await sandbox.snapshot(run.stdout)
                t.append(time.monotonic())
            finally:
                await sandbox.release()
            t.append(time.monotonic())
            for k, name in enumerate(("provision", "run", "snapshot", "release")):
                steps[name].append(t[k + 1] - t[k])
            steps["case"].append(t[-1] - t[0])

    t0 = time.monotonic()
    try:
        await asyncio.gather(*(one(i) for i in range(n)))
        elapsed = time.monotonic() - t0
    finally:
        await backend.close()
    return {
        "cases": n,
        "concurrency": concurrency,
        "cases_per_s": n / elapsed,
        "step_mean_ms": {name: 1000 * mean(values) for name, values in steps.items()},
    }


async def warm_up(backend: LocalBackend, harness: HarnessSpec, case_id: str) -> None:
    """One case on `backend` (starts a worker; concurrent calls start one each)."""

    async def nothing(_stream: str, _line: str) -> None:
        return None

    req = CaseRequested(
        batch_id="warm",
        case_id=case_id,
        run_id=f"evb-warm-{case_id}",
        case=CaseSpec(id=case_id, input="What is 2 + 2?"),
        harness=harness,
        plan=CasePlan(judges=RULE_JUDGE, suite_id="bench"),
    )
    sandbox = await backend.provision(req)
    try:
        await sandbox.run_harness(nothing)
    finally:
        await sandbox.release()


async def backend_sweep(
    n: int, concurrencies: Sequence[int], harness: HarnessSpec, root: Path | None
) -> list[dict[str, Any]]:
    """`backend_alone` at each concurrency, with the CPU it cost this process (harnesses included)."""
    return [await metered(CpuMeter({}), backend_alone(n, c, harness, root), n) for c in concurrencies]


# ---------------------------------------------------------------- 4./5. driving case events directly


def executed_events(batch_id: str, n: int, prefix: str, harness: HarnessSpec) -> list[tuple[str, EventBase]]:
    """`n` `case.executed` events of a batch, as the dispatcher emits them (case token, event)."""
    plan = CasePlan(judges=RULE_JUDGE, suite_id="bench")
    out: list[tuple[str, EventBase]] = []
    for i in range(n):
        case_id = f"{prefix}{i}"
        event = sample_events(batch_id, case_id, plan, harness)[1]
        assert isinstance(event, CaseExecuted)
        out.append((case_id, event))
    return out


def requested_events(batch_id: str, n: int, prefix: str, harness: HarnessSpec) -> list[tuple[str, EventBase]]:
    """`n` `case.requested` events of a batch, as the fan-out emits them (case token, event)."""
    plan = CasePlan(judges=RULE_JUDGE, suite_id="bench")
    return [(f"{prefix}{i}", sample_events(batch_id, f"{prefix}{i}", plan, harness)[0]) for i in range(n)]


async def drive(
    url: str, batch_id: str, events: Sequence[tuple[str, EventBase]], rate: float | None, timeout_s: float
) -> dict[str, float]:
    """Publish `events` (at `rate`/s, or in windows as fast as possible) and time each case from its
    publish to its `case.exported`."""
    nc = await connect(url, "bench-drive")
    try:
        watch = await BatchWatch(nc, batch_id).start()
        pub = Publisher(nc)
        await pub.start()
        sent: dict[str, float] = {}
        publishes: list[asyncio.Future[Any]] = []
        t0 = time.monotonic()
        if rate is None:
            for k in range(0, len(events), 512):
                chunk = events[k : k + 512]
                now = time.monotonic()
                for case, _ in chunk:
                    sent[case] = now
                await pub.publish_events(ev for _, ev in chunk)
        else:
            for i, (case, ev) in enumerate(events):
                delay = t0 + i / rate - time.monotonic()
                if delay > 0:
                    await asyncio.sleep(delay)
                sent[case] = time.monotonic()
                publishes.append(asyncio.ensure_future(pub.publish_event(ev)))
        await watch.wait_for("case.exported", len(events), timeout_s)
        await asyncio.gather(*publishes)
        await watch.stop()
        await pub.stop()
    finally:
        await nc.close()
    exported = watch.times["case.exported"]
    latencies = [exported[c] - t for c, t in sent.items() if c in exported]
    elapsed = max(exported.values()) - t0
    return {
        "cases": len(events),
        "seconds": elapsed,
        "cases_per_s": len(events) / elapsed,
        "p50_ms": 1000 * percentile(latencies, 0.5),
        "p99_ms": 1000 * percentile(latencies, 0.99),
        "max_ms": 1000 * max(latencies),
    }


async def wait_recorder(url: str, timeout_s: float) -> float:
    """Seconds until the recorder's consumer has nothing pending or unacknowledged."""
    nc = await connect(url, "bench-recorder-wait")
    js = nc.jetstream()
    t0 = time.monotonic()
    try:
        while not await drained(js, GATEWAY_RECORDER):
            if time.monotonic() - t0 > timeout_s:
                raise TimeoutError(f"the recorder did not drain in {timeout_s}s")
            await asyncio.sleep(0.05)
    finally:
        await nc.close()
    return time.monotonic() - t0


async def set_limits(url: str, judge: int, exporter: int) -> dict[str, int]:
    """Set the judge and exporter consumers' global limits; return what the server then holds."""
    nc = await connect(url, "bench-limits")
    js = nc.jetstream()
    try:
        await set_consumer(js, JUDGE_CASES, max_ack_pending=judge)
        await set_consumer(js, EXPORTER_CASES, max_ack_pending=exporter)
        return {
            "judge_max_ack_pending": await consumer_limit(js, JUDGE_CASES),
            "exporter_max_ack_pending": await consumer_limit(js, EXPORTER_CASES),
        }
    finally:
        await nc.close()


# ---------------------------------------------------------------- main


def workdir_root(choice: str) -> Path | None:
    """Where case workdirs go: `tmpfs` (a folder in /dev/shm, when there is one), `system` (the
    system temp folder, the dispatcher's default: None) or a path."""
    if choice == "system":
        return None
    if choice == "tmpfs":
        shm = Path("/dev/shm")
        if not shm.is_dir():
            return None
        root = shm / f"evalbus-bench-{os.getpid()}"
    else:
        root = Path(choice)
    root.mkdir(parents=True, exist_ok=True)
    return root


async def main(args: argparse.Namespace) -> dict[str, Any]:
    root = workdir_root(args.workdir_root)
    try:
        return await measure(args, root)
    finally:
        if root is not None and args.workdir_root == "tmpfs":
            shutil.rmtree(root, ignore_errors=True)


async def measure(args: argparse.Namespace, root: Path | None) -> dict[str, Any]:
    n = args.cases
    paced_n = int(args.rate * args.paced_seconds)
    timeout_s = max(300.0, n / 20)
    worker = args.harness == "worker"
    harness = WORKER_HARNESS if worker else ZERO_HARNESS
    slots = args.slots or (4 if worker else 32)
    out: dict[str, Any] = {
        "benchmark": "throughput",
        "harness": args.harness,
        "cases": n,
        "slots": slots,
        "workdir_root": str(root) if root is not None else tempfile.gettempdir(),
        "paced_rate": args.rate,
        "cores": os.cpu_count(),
    }
    out["load_avg_before"] = os.getloadavg()[0]
    async with Infra(database=True) as infra:
        out["database"] = infra.database_source
        out["relay"] = await relay(infra, n)
        dispatcher_env = {"DISPATCHER_SLOTS": str(slots)}
        if root is not None:
            dispatcher_env["DISPATCHER_WORKDIR_ROOT"] = str(root)
        stack = pipeline_stack(infra, "stack", service_env={"dispatcher": dispatcher_env})
        await asyncio.to_thread(stack.start_all)
        async with running(stack):
            url = infra.nats_url
            meter = CpuMeter(stack_pids(stack, infra))
            out["contract_limits"] = await set_limits(url, JUDGE_CASES.max_ack_pending, EXPORTER_CASES.max_ack_pending)
            # warm-up: every service has handled a case, the judge has resolved a rule judge
            await pipeline(infra, max(20, 4 * slots), timeout_s, harness)  # a worker harness: its workers start
            out["pipeline"] = await metered(meter, pipeline(infra, n, timeout_s, harness), n)
            out["pipeline"]["recorder_drain_after_s"] = await wait_recorder(url, timeout_s)
            batch = f"ds-{uuid.uuid4().hex[:6]}"
            work = drive(url, batch, executed_events(batch, n, "x", harness), None, timeout_s)
            out["downstream"] = await metered(meter, work, n)
            out["downstream"]["recorder_drain_after_s"] = await wait_recorder(url, timeout_s)
            batch = f"pe-{uuid.uuid4().hex[:6]}"
            work = drive(url, batch, executed_events(batch, paced_n, "p", harness), args.rate, timeout_s)
            out["paced_executed"] = await metered(meter, work, paced_n)
            batch = f"pr-{uuid.uuid4().hex[:6]}"
            work = drive(url, batch, requested_events(batch, paced_n, "q", harness), args.rate, timeout_s)
            out["paced_requested"] = await metered(meter, work, paced_n)
            await wait_recorder(url, timeout_s)
            slow_n = int(args.sustainable_rate * args.paced_seconds)
            batch = f"ps-{uuid.uuid4().hex[:6]}"
            work = drive(url, batch, requested_events(batch, slow_n, "s", harness), args.sustainable_rate, timeout_s)
            out["paced_requested_sustainable"] = await metered(meter, work, slow_n) | {"rate": args.sustainable_rate}
            await wait_recorder(url, timeout_s)
            out["raised_limits"] = await set_limits(url, RAISED_LIMIT, RAISED_LIMIT)
            batch = f"dr-{uuid.uuid4().hex[:6]}"
            work = drive(url, batch, executed_events(batch, n, "y", harness), None, timeout_s)
            out["downstream_raised"] = await metered(meter, work, n)
            out["downstream_raised"]["recorder_drain_after_s"] = await wait_recorder(url, timeout_s)
            batch = f"px-{uuid.uuid4().hex[:6]}"
            work = drive(url, batch, executed_events(batch, paced_n, "z", harness), args.rate, timeout_s)
            out["paced_executed_raised"] = await metered(meter, work, paced_n)
        concurrencies = sorted({1, slots} if worker else {1, 4, 16, slots})
        out["backend"] = await backend_sweep(min(n, args.backend_cases), concurrencies, harness, root)
    out["load_avg_after"] = os.getloadavg()[0]
    relay_rate = out["relay"]["events_per_s"]
    rate = out["pipeline"]["cases_per_s"]
    out["ratio_to_relay"] = rate / relay_rate
    paced = out["paced_requested"]
    at_slots = next(b for b in out["backend"] if b["concurrency"] == slots)["cases_per_s"]
    out["ratio_to_backend"] = rate / at_slots
    what = "warm workers" if worker else "process spawn"
    goals = [
        goal(
            "pipeline cases/s",
            rate,
            ">=",
            1200.0 if worker else 1000.0,
            f"{n} zero-latency cases ({args.harness} harness), publish to the last case.exported",
        ),
        goal(
            "pipeline / bare relay",
            rate / relay_rate,
            ">=",
            0.5,
            f"pipeline {rate:.0f} cases/s / bare 3-stage relay {relay_rate:.0f} events/s, measured in this run",
        ),
    ]
    if not worker:
        goals.append(
            goal(
                "pipeline / local backend alone",
                rate / at_slots,
                ">=",
                0.85,
                f"pipeline {rate:.0f} cases/s / the local backend alone at {slots} slots {at_slots:.0f} cases/s, "
                "measured in this run",
            )
        )
    goals.append(
        goal(
            f"p99 ms at {args.rate:g} cases/s",
            paced["p99_ms"],
            "<=",
            50.0,
            f"publish of case.requested to case.exported, through the dispatcher ({what} included)",
        )
    )
    out["goals"] = goals
    out["ok"] = all(g.passed for g in out["goals"])
    return out


def table(out: dict[str, Any]) -> tuple[list[tuple[str, ...]], list[str]]:
    """The rows and notes printed without --json."""
    p, d, dr = out["pipeline"], out["downstream"], out["downstream_raised"]
    pr, ps = out["paced_requested"], out["paced_requested_sustainable"]
    pe, px = out["paced_executed"], out["paced_executed_raised"]
    rows: list[tuple[str, ...]] = [
        ("measurement", "cases/s", "p50", "p99", "note"),
        ("bare relay (3 stages)", fmt(out["relay"]["events_per_s"], digits=0), "", "", "the baseline: bench/_relay.py's bare relay"),
        (f"pipeline, end to end ({out['harness']})", fmt(p["cases_per_s"], digits=0), "", "",
         f"{p['cases']} cases in {fmt(p['makespan_s'], ' s')}; finalized at {fmt(p['finalized_s'], ' s')}"),
    ]  # fmt: skip
    for stage, r in p["stages"].items():
        rows.append((f"  stage {stage}", fmt(r["per_s"], digits=0), "", "", f"{fmt(r['first_s'], ' s')} → {fmt(r['last_s'], ' s')}"))  # fmt: skip
    rows.append(("  executed → exported", "", fmt(p["executed_to_exported_p50_ms"], " ms", 1),
                 fmt(p["executed_to_exported_p99_ms"], " ms", 1), "inside the full run"))  # fmt: skip
    for b in out["backend"]:
        steps = ", ".join(f"{k} {v:.1f}" for k, v in b["step_mean_ms"].items())
        rows.append(
            (f"local backend alone ×{b['concurrency']}", fmt(b["cases_per_s"], digits=0), "", "", f"ms: {steps}")
        )
    rows += [
        ("downstream (no harness)", fmt(d["cases_per_s"], digits=0), "", "", "case.executed → judge → exporter, limits 4 / 2"),
        ("downstream, limits 1000", fmt(dr["cases_per_s"], digits=0), "", "", "the same with the global limits raised"),
        (f"paced {out['paced_rate']:g}/s case.requested", fmt(pr["cases_per_s"], digits=0), fmt(pr["p50_ms"], " ms", 1), fmt(pr["p99_ms"], " ms", 1), "through the dispatcher"),
        (f"paced {ps['rate']:g}/s case.requested", fmt(ps["cases_per_s"], digits=0), fmt(ps["p50_ms"], " ms", 1), fmt(ps["p99_ms"], " ms", 1), "through the dispatcher, a rate it sustains"),
        (f"paced {out['paced_rate']:g}/s case.executed", fmt(pe["cases_per_s"], digits=0), fmt(pe["p50_ms"], " ms", 1), fmt(pe["p99_ms"], " ms", 1), "harness factored out, limits 4 / 2"),
        (f"paced {out['paced_rate']:g}/s case.executed", fmt(px["cases_per_s"], digits=0), fmt(px["p50_ms"], " ms", 1), fmt(px["p99_ms"], " ms", 1), "harness factored out, limits 1000"),
    ]  # fmt: skip
    phases = [("pipeline", p), ("downstream", d), ("downstream 1k", dr), ("paced exec", pe), ("paced exec 1k", px)]
    phases += [(f"backend ×{b['concurrency']}", b) for b in out["backend"]]
    names = [n for n in p["cpu_ms_per_case"] if n != "total"] + ["total"]
    notes = [
        f"Load average {out['load_avg_before']:.1f} before, {out['load_avg_after']:.1f} after "
        f"(on {out['cores']} cores, shared)",
        "CPU ms per case by process (busy: CPU used by these processes / all cores' time):",
        "  " + "".join(f"{name[:12]:>13}" for name in ["phase", *names, "busy"]),
    ]
    for label, phase in phases:
        cpu = phase["cpu_ms_per_case"]
        cells = [fmt(cpu.get(name), digits=2) for name in names]
        notes.append("  " + "".join(f"{c:>13}" for c in [label[:12], *cells, fmt(phase["cpu_busy"], digits=2)]))
    notes += goal_notes(out["goals"])
    return rows, notes


def cli() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cases", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--paced-seconds", type=float, default=10.0)
    parser.add_argument(
        "--harness",
        choices=("command", "worker"),
        default="command",
        help="the zero-latency harness: a command (/bin/echo, a process per case) or a warm worker (the SDK's "
        "examples/worker_agent.py)",
    )
    parser.add_argument(
        "--slots", type=int, default=None, help="dispatcher compute slots (default 32 for command, 4 for worker)"
    )
    parser.add_argument("--backend-cases", type=int, default=1000, help="cases per backend-alone measurement")
    parser.add_argument(
        "--sustainable-rate",
        type=float,
        default=100.0,
        help="a paced rate the dispatcher keeps up with, for comparison",
    )
    parser.add_argument(
        "--workdir-root",
        default="tmpfs",
        help="where case workdirs go (DISPATCHER_WORKDIR_ROOT): tmpfs (a folder in /dev/shm, the default), system "
        "(the system temp folder) or a path",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    add_check_flag(parser)
    args = parser.parse_args()
    quiet_logs()
    out = asyncio.run(main(args))
    rows, notes = table(out)
    report(out, rows, notes, args.json)
    sys.exit(verdict("throughput", out["goals"], check=args.check))


if __name__ == "__main__":
    cli()
