"""Live benchmark: how fast the live views are, and what watching a batch costs it (issue 7).

1. fan-out — 100 SSE clients (`--clients`) on one batch's event stream while its events are
   published at 1,000 events/s (`--rate`) for 10 s (`--seconds`, after a 1 s warm-up left out of
   the figures): publish → client latency at every client, through
   - the bare relay (`bench/_sse.py`): a minimal aiohttp server with one core NATS subscription
     on the batch's subjects, writing each message to each client as it comes — the strongest
     simple implementation, the baseline;
   - the gateway's `GET /v1/batches/{id}/events`, the real gateway as a process.
   Both against a nats-server and database of their own, one after the other with the gateway
   running (its recorder stores both batches: the same background work in both). The events are
   a realistic batch's (`bench.recorder.workload`: each run's requested, executed, judged and
   exported, 0.5–2 KB), each event id stamped with its publish moment (`_sse.stamp`); the clients
   are one process of raw asyncio connections (`_sse.swarm`). Printed: p50/p99/p99.9/max of both,
   the ratio, frames/s delivered to all clients by each and their ratio (gateway ÷ relay), CPU
   seconds of server, nats-server and clients, and the gateway's own word on its fan-out
   (`/metrics`: shared subscriptions and clients while the swarm is connected, clients cut for
   lagging): every client of the batch follows one shared subscription (`live.fanout`).
2. log latency — a harness printing timestamped lines at a steady rate (50/s for 10 s) runs
   through the real dispatcher (all five services as processes); one client follows
   `GET /v1/runs/{run}/logs/stream` and takes, for every line written after its stream opened,
   write → arrival (the reference polls every 2–3 s; the dispatcher's tee flushes every 250 ms).
3. cost of being watched — the overlap benchmark's scenario (`bench/overlap.py`: 40 cases, 1 s
   harness, 2 sleep judges × 2 s, 4 slots, judge limit 8) on the same stack, twice: as overlap
   runs it (unwatched, its quiet harness), then with a harness that also prints 20 lines/s
   (`--chatter`) through the live tee and 10 SSE watchers per run (`--watchers`; half on
   `/logs/stream`, half on `/trajectory/live/stream`, each opened when the run is requested and
   read to its `end`). The watched run is judged by overlap's goals with this issue's limits.

Goals: fan-out p99 ≤ 25 ms through the gateway (the relay's p99 and the ratio printed with it),
every event at every client once, the gateway's frames/s ≥ 0.8 × the relay's in the same run, one
shared subscription for the batch; log p99 ≤ 500 ms and every line once; watched makespan ≤ 1.06 ×
overlap's streaming bound, mean sandbox hold ≤ 1.05 × mean harness time, no failed case, every
judge score, every watcher to its `end`. Prints a table and the goals, then one JSON line (only the
JSON line with --json; the goals are in it as data). With --check it exits 1, naming the missed
goals on stderr, when any is missed. A quick run:

    uv run python bench/live.py --clients 20 --seconds 3 --log-seconds 3 --cases 8 --harness-s 0.5 --judge-s 0.5

    uv run python bench/live.py [--only fanout|log|watched ...] [--clients 100] [--rate 1000] [--seconds 10]
        [--warmup-s 1] [--log-rate 50] [--log-seconds 10] [--cases 40] [--harness-s 1] [--judges 2]
        [--judge-s 2] [--slots 4] [--judge-limit 8] [--watchers 10] [--chatter 20] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import math
import os
import sys
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/live.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import msgspec
from bench import _sse
from bench._cpu import CpuMeter
from bench._goals import Goal, add_check_flag, goal, goal_notes, verdict
from bench._infra import Infra, pipeline_stack, quiet_logs, running
from bench._report import fmt, report
from bench._stats import percentile
from bench._watch import BatchWatch
from bench._workload import RULE_JUDGE, batch_request, case_ids
from bench.overlap import Params, harness_for, run_goals, summarize
from bench.recorder import workload

from evalbus.infra.ports import free_port
from evalbus.testing.stack import ServiceStack
from evalbus_contracts import CommandHarness, RegisteredJudge, batch_run_id, subjects
from evalbus_contracts.events import EventBase
from evalbus_runtime import Publisher, connect

FANOUT_P99_MS = 25.0
FANOUT_FRAMES_RATIO = 0.8
LOG_P99_MS = 500.0
WATCHED_RATIO = 1.06
HOLD_RATIO = 1.05
PARTS = ("fanout", "log", "watched")

TICKER = """\
import os, time
time.sleep(float(os.environ["BENCH_LEAD_S"]))
rate, n = float(os.environ["BENCH_RATE"]), int(os.environ["BENCH_LINES"])
t0 = time.monotonic()
for i in range(n):
    time.sleep(max(0.0, t0 + i / rate - time.monotonic()))
    print(f"tick {i} {time.monotonic_ns()}", flush=True)
print("4")
"""
"""The log harness: after a lead time (for the client to connect), `BENCH_LINES` lines at
`BENCH_RATE` per second, each with its index and the moment it was written."""

CHATTY_AGENT = """\
import os, time
T0 = time.monotonic()
H, rate = float(os.environ["BENCH_HARNESS_S"]), float(os.environ["BENCH_CHATTER"])
i = 0
while rate > 0 and time.monotonic() - T0 + 1 / rate < H:
    time.sleep(max(0.0, T0 + i / rate - time.monotonic()))
    print(f"step {i}: thinking about 2 + 2", flush=True)
    i += 1
time.sleep(max(0.0, H - (time.monotonic() - T0)))
print("4")
"""
"""The watched run's harness: overlap's (runs `BENCH_HARNESS_S` seconds, answers 4), printing
`BENCH_CHATTER` lines per second while it runs."""


# ---------------------------------------------------------------- 1. fan-out


async def paced(nc: Any, events: Sequence[EventBase], rate: float) -> dict[str, float]:
    """Publish `events` at `rate`/s (a late one goes at once), each stamped as it goes out."""
    pub = Publisher(nc)
    t0 = time.monotonic()
    for k, event in enumerate(events):
        delay = t0 + k / rate - time.monotonic()
        if delay > 0:
            await asyncio.sleep(delay)
        await pub.publish_nowait(msgspec.structs.replace(event, event_id=_sse.stamp(k)))
    await nc.flush()
    elapsed = time.monotonic() - t0
    return {"published": len(events), "seconds": elapsed, "rate": len(events) / elapsed if elapsed else math.nan}


async def read_ready(proc: asyncio.subprocess.Process, what: str, timeout_s: float = 60.0) -> None:
    """Until `proc` prints `ready`."""
    assert proc.stdout is not None
    line = await asyncio.wait_for(proc.stdout.readline(), timeout_s)
    if line.strip() != b"ready":
        raise RuntimeError(f"{what} did not start: {line!r}")


async def spawn(*args: str, env: dict[str, str] | None = None) -> asyncio.subprocess.Process:
    """`bench/_sse.py` with `args`, its stdin and stdout piped, stderr to ours."""
    return await asyncio.create_subprocess_exec(
        sys.executable,
        _sse.__file__,
        *args,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        env={**os.environ, **(env or {})},
    )


async def stop(proc: asyncio.subprocess.Process) -> None:
    """Terminate a helper process (it has no state to keep)."""
    if proc.returncode is None:
        proc.terminate()
        with contextlib.suppress(ProcessLookupError):
            await asyncio.wait_for(proc.wait(), 10)


async def gateway_metrics(url: str, *names: str) -> dict[str, float]:
    """The values of unlabelled `names` on the gateway's `/metrics` (NaN when missing)."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    values = dict.fromkeys(names, math.nan)
    for line in text.splitlines():
        name, _, value = line.partition(" ")
        if name in values:
            values[name] = float(value)
    return values


async def fanout_one(
    args: argparse.Namespace, stack: ServiceStack, nats_url: str, nats_pid: int, server: str
) -> dict[str, Any]:
    """One implementation (`relay` or `gateway`) under the fan-out workload."""
    batch_id = f"lv-{server}-{uuid.uuid4().hex[:8]}"
    stamped = args.rate * (args.warmup_s + args.seconds)
    events = workload(batch_id, max(1, math.ceil(stamped / 4)))
    request, rest = events[0], events[1:]
    warmup = round(args.rate * args.warmup_s)
    nc = await connect(nats_url, "bench-live-fanout")
    helper: asyncio.subprocess.Process | None = None
    swarm: asyncio.subprocess.Process | None = None
    fan: dict[str, float] = {}
    try:
        pub = Publisher(nc)
        await pub.publish_event(request)
        await pub.stop()
        if server == "relay":
            port = free_port()
            helper = await spawn("relay", nats_url, str(port), *subjects.batch_filter(batch_id))
            await read_ready(helper, "the relay")
            url, token, pid = f"http://127.0.0.1:{port}/events", "", helper.pid
        else:
            url = f"{stack.gateway_url}/v1/batches/{batch_id}/events"
            token, pid = stack.admin_token, stack.procs["gateway"].process.pid
        swarm = await spawn("swarm", url, str(args.clients), str(len(rest)), str(warmup), env={_sse.TOKEN_ENV: token})
        await read_ready(swarm, "the client swarm", timeout_s=120)
        await asyncio.sleep(0.5)  # the last connections' consumers settle before the clock starts
        if server == "gateway":
            fan = await gateway_metrics(stack.gateway_url, *_FAN_METRICS[:2])
        meter = CpuMeter({"server": pid, "nats-server": nats_pid, "clients": swarm.pid}).start()
        sent = await paced(nc, rest, args.rate)
        assert swarm.stdout is not None
        assert swarm.stdin is not None
        try:
            line = await asyncio.wait_for(swarm.stdout.readline(), args.drain_s)
        except TimeoutError:
            swarm.stdin.write(b"stop\n")
            await swarm.stdin.drain()
            line = await asyncio.wait_for(swarm.stdout.readline(), 60)
        meter.stop()
        seen = msgspec.json.decode(line, type=_sse.SwarmResult)
        if server == "gateway":
            fan |= await gateway_metrics(stack.gateway_url, _FAN_METRICS[2])
    finally:
        for proc in (swarm, helper):
            if proc is not None:
                await stop(proc)
        await nc.close()
    return {
        "server": server,
        "batch_id": batch_id,
        "publish": sent,
        **msgspec.structs.asdict(seen),
        "cpu_s": {**meter.seconds, "clients": seen.cpu_s},
        "wall_s": meter.wall_s,
        **({"fanout_metrics": {k.removeprefix("evalbus_gateway_sse_"): v for k, v in fan.items()}} if fan else {}),
    }


_FAN_METRICS = (
    "evalbus_gateway_sse_subscriptions",
    "evalbus_gateway_sse_watchers",
    "evalbus_gateway_sse_lagging_total",
)
"""The gateway's fan-out gauges (read while the swarm is connected) and its lagging counter (after)."""


async def fanout(args: argparse.Namespace, infra: Infra) -> dict[str, Any]:
    """The relay, then the gateway, on a nats-server and database of their own."""
    nats = infra.new_nats("nats-fanout")
    stack = pipeline_stack(infra, "fanout")
    stack.nats_url = nats.url
    stack.database_url = await infra.new_database()
    await asyncio.to_thread(stack.start, "gateway")
    async with running(stack):
        runs = {s: await fanout_one(args, stack, nats.url, nats.process.pid, s) for s in ("relay", "gateway")}
    relay, gateway = runs["relay"], runs["gateway"]
    return {
        "clients": args.clients,
        "rate": args.rate,
        "seconds": args.seconds,
        "warmup_s": args.warmup_s,
        "relay": relay,
        "gateway": gateway,
        "p99_ratio": gateway["p99_ms"] / relay["p99_ms"] if relay["p99_ms"] else math.nan,
        "frames_ratio": gateway["frames_per_s"] / relay["frames_per_s"] if relay["frames_per_s"] else math.nan,
    }


# ---------------------------------------------------------------- 2. log latency


async def follow_log(http: aiohttp.ClientSession, stack: ServiceStack, run_id: str, lines: int) -> dict[str, Any]:
    """Follow the run's log stream to its end: each line's write → arrival, once it is live."""
    url = f"{stack.gateway_url}/v1/runs/{run_id}/logs/stream"
    seen = bytearray(lines)
    latencies: list[float] = []
    duplicates = from_tail = 0
    status = None
    async with _sse.open_stream(http, url, stack.admin_token, timeout_s=120) as response:
        opened = time.monotonic_ns()
        async for now, event in _sse.read_frames(response):
            if event.event == "end":
                status = msgspec.json.decode(event.data).get("status")
                break
            if event.event != "log":
                continue
            for line in msgspec.json.decode(event.data)["text"].splitlines():
                word, _, rest = line.partition(" ")
                if word != "tick":
                    continue
                index, _, written = rest.partition(" ")
                i = int(index)
                if seen[i]:
                    duplicates += 1
                    continue
                seen[i] = 1
                if int(written) < opened:
                    from_tail += 1  # written before the stream opened: the tail, not live
                else:
                    latencies.append((now - int(written)) / 1e6)
    return {
        "lines": lines,
        "received": sum(seen),
        "duplicates": duplicates,
        "from_tail": from_tail,
        "samples": len(latencies),
        "p50_ms": percentile(latencies, 0.5),
        "p99_ms": percentile(latencies, 0.99),
        "max_ms": max(latencies, default=math.nan),
        "end_status": status,
    }


async def log_latency(args: argparse.Namespace, stack: ServiceStack, nc: Any) -> dict[str, Any]:
    """One case of the ticking harness through the stack, followed by one log client."""
    batch_id = f"lv-log-{uuid.uuid4().hex[:8]}"
    lines = round(args.log_rate * args.log_seconds)
    harness = CommandHarness(
        id="ticker",
        command=(sys.executable, "agent.py"),
        files={"agent.py": TICKER},
        env={"BENCH_LEAD_S": repr(args.log_lead_s), "BENCH_RATE": repr(args.log_rate), "BENCH_LINES": str(lines)},
        timeout_s=args.log_lead_s + args.log_seconds + 60,
    )
    request = batch_request(batch_id, 1, harness, RULE_JUDGE)
    run_id = batch_run_id(batch_id, case_ids(1)[0])
    watch = await BatchWatch(nc, batch_id).start()
    pub = Publisher(nc)
    try:
        async with aiohttp.ClientSession() as http:
            follow = asyncio.ensure_future(follow_log(http, stack, run_id, lines))
            await pub.publish_event(request)
            out = await asyncio.wait_for(follow, args.log_lead_s + args.log_seconds + 120)
        await watch.wait_for("batch.finalized", 1, 60)
    finally:
        await pub.stop()
        await watch.stop()
    return {"run_id": run_id, "rate": args.log_rate, "seconds": args.log_seconds, **out}


# ---------------------------------------------------------------- 3. the cost of being watched


async def watch_run(http: aiohttp.ClientSession, stack: ServiceStack, run_id: str, channel: str) -> int:
    """Read one live stream of the run to its `end`; the frames it carried (-1: no `end`)."""
    url = f"{stack.gateway_url}/v1/runs/{run_id}/{channel}"
    frames = 0
    async with _sse.open_stream(http, url, stack.admin_token, timeout_s=120, retry_s=0.25) as response:
        async for _, event in _sse.read_frames(response):
            if event.event == "end":
                return frames
            frames += 1
    return -1


async def overlap_run(
    args: argparse.Namespace, params: Params, stack: ServiceStack, nc: Any, *, watched: bool
) -> dict[str, Any]:
    """Overlap's streaming scenario once on `stack`: quiet and unwatched, or chatty and watched."""
    label = "watched" if watched else "unwatched"
    batch_id = f"lv-{label}-{uuid.uuid4().hex[:8]}"
    if watched:
        harness = CommandHarness(
            id="sleep-chatty",
            command=(sys.executable, "agent.py"),
            files={"agent.py": CHATTY_AGENT},
            env={"BENCH_HARNESS_S": repr(params.harness_s), "BENCH_CHATTER": repr(args.chatter)},
        )
    else:
        harness = harness_for(params, "none", None, None)
    judges = tuple(
        RegisteredJudge(id=f"sleep{k + 1}", name="sleep", params={"seconds": repr(params.judge_s)})
        for k in range(params.judges)
    )
    request = batch_request(batch_id, params.cases, harness, judges)
    timeout_s = 6 * params.bound()[0] + 120
    watch = await BatchWatch(nc, batch_id, decode=frozenset({"case.executed", "case.judged"})).start()
    pub = Publisher(nc)
    watchers: list[asyncio.Future[int]] = []
    channels = ("logs/stream", "trajectory/live/stream")
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as http:
        try:
            t0 = time.monotonic()
            await pub.publish_event(request)
            if watched:
                watchers = [
                    asyncio.ensure_future(watch_run(http, stack, batch_run_id(batch_id, case), channels[k % 2]))
                    for case in case_ids(params.cases)
                    for k in range(args.watchers)
                ]
            await watch.wait_for("case.exported", params.cases, timeout_s)
            finalized = True
            try:
                await watch.wait_for("batch.finalized", 1, 60.0)
            except TimeoutError:
                finalized = False
            done, pending = await asyncio.wait(watchers, timeout=30) if watchers else (set(), set())
            for task in pending:
                task.cancel()
        finally:
            await watch.stop()
            await pub.stop()
    ended = [t.result() for t in done if t.exception() is None and t.result() >= 0]
    out = summarize(params, watch, t0, trace=label, mode="stream", barrier_at=None, peak=0)
    return out | {
        "finalized_s": (watch.last("batch.finalized") - t0) if finalized else None,
        "chatter_per_s": args.chatter if watched else 0.0,
        "watchers": len(watchers),
        "watchers_ended": len(ended),
        "watcher_frames": sum(ended),
        "watcher_errors": sorted({repr(t.exception()) for t in done if t.exception() is not None})[:3],
    }


# ---------------------------------------------------------------- the run


def params_of(args: argparse.Namespace) -> Params:
    return Params(
        cases=args.cases,
        harness_s=args.harness_s,
        judges=args.judges,
        judge_s=args.judge_s,
        slots=args.slots,
        judge_limit=args.judge_limit,
    )


async def pipeline_parts(args: argparse.Namespace, infra: Infra, parts: Sequence[str]) -> dict[str, Any]:
    """Log latency and the overlap runs, on one stack of the five services."""
    params = params_of(args)
    stack = pipeline_stack(
        infra,
        "pipeline",
        service_env={
            "dispatcher": {"DISPATCHER_SLOTS": str(params.slots)},
            "judge": {
                "JUDGE_CONCURRENCY": str(params.judge_limit),
                "JUDGE_GLOBAL_LIMIT": str(params.judge_limit),
                "JUDGE_PLUGINS": "bench.plugins:register",
            },
        },
    )
    out: dict[str, Any] = {}
    await asyncio.to_thread(stack.start_all)
    async with running(stack):
        nc = await connect(infra.nats_url, "bench-live")
        try:
            if "log" in parts:
                out["log"] = await log_latency(args, stack, nc)
            if "watched" in parts:
                runs = [await overlap_run(args, params, stack, nc, watched=w) for w in (False, True)]
                out["overlap"] = {"bound_s": params.bound()[0], "formula": params.formula(), "runs": runs}
        finally:
            await nc.close()
    return out


def goals_of(args: argparse.Namespace, out: dict[str, Any]) -> list[Goal]:
    goals: list[Goal] = []
    if "fanout" in out:
        f = out["fanout"]
        g, r = f["gateway"], f["relay"]
        goals += [
            goal(
                "fan-out: p99 publish → client through the gateway (ms)",
                g["p99_ms"],
                "<=",
                FANOUT_P99_MS,
                f"issue 7, {f['clients']} clients at {f['rate']:g} events/s; bare relay p99 {r['p99_ms']:.2f} ms "
                f"in the same run, ratio {f['p99_ratio']:.2f}",
            ),
            goal(
                "fan-out: events delivered by the gateway",
                g["delivered"] - g["duplicates"],
                "==",
                g["expected"],
                "every stamped event to every client, once (events × clients)",
            ),
            goal(
                "fan-out: gateway frames/s ÷ bare relay frames/s",
                f["frames_ratio"],
                ">=",
                FANOUT_FRAMES_RATIO,
                f"same run; gateway {g['frames_per_s']:.0f}/s, relay {r['frames_per_s']:.0f}/s, "
                f"{f['clients']} clients on one batch",
            ),
            goal(
                "fan-out: shared subscriptions of the batch in the gateway",
                g.get("fanout_metrics", {}).get("subscriptions"),
                "==",
                1,
                f"one per subject set per process, whatever the clients "
                f"({g.get('fanout_metrics', {}).get('watchers', math.nan):g} connected)",
            ),
        ]
    if "log" in out:
        lg = out["log"]
        goals += [
            goal(
                "log: p99 harness write → SSE client (ms)",
                lg["p99_ms"],
                "<=",
                LOG_P99_MS,
                "issue 7 (the reference polls every 2–3 s; the tee flushes every 250 ms)",
            ),
            goal(
                "log: lines delivered",
                lg["received"] - lg["duplicates"],
                "==",
                lg["lines"],
                "every line written, once (tail and live together)",
            ),
        ]
    if "overlap" in out:
        params = params_of(args)
        watched = out["overlap"]["runs"][1]
        # overlap's goals of a streaming run; its harness exports no trace, so none is expected
        goals += [g for g in run_goals(params, [watched], WATCHED_RATIO, HOLD_RATIO) if "traces" not in g.name]
        goals.append(
            goal(
                "watched: watchers to their end",
                watched["watchers_ended"],
                "==",
                params.cases * args.watchers,
                "every SSE watcher read its run's stream to `end` (cases × watchers)",
            )
        )
    return goals


async def main(args: argparse.Namespace) -> dict[str, Any]:
    parts = list(args.only or PARTS)
    out: dict[str, Any] = {"benchmark": "live", "load_avg_start": os.getloadavg()}
    async with Infra(database=True) as infra:
        if "fanout" in parts:
            out["fanout"] = await fanout(args, infra)
        if "log" in parts or "watched" in parts:
            out |= await pipeline_parts(args, infra, parts)
        out["database"] = infra.database_source
    out["load_avg_end"] = os.getloadavg()
    out["goals"] = goals_of(args, out)
    out["ok"] = all(g.passed for g in out["goals"])
    return out


def table(out: dict[str, Any]) -> tuple[list[tuple[str, ...]], list[str]]:
    """The rows and notes printed without --json."""
    rows: list[tuple[str, ...]] = [
        ("measure", "p50", "p99", "p99.9 / max", "delivered", "frames/s", "cpu s (server/nats/clients)")
    ]
    notes: list[str] = []
    if "fanout" in out:
        f = out["fanout"]
        for name in ("relay", "gateway"):
            r = f[name]
            cpu = r["cpu_s"]
            rows.append(
                (
                    f"fan-out {name}",
                    fmt(r["p50_ms"], " ms"),
                    fmt(r["p99_ms"], " ms"),
                    f"{fmt(r['p999_ms'], ' ms')} / {fmt(r['max_ms'], ' ms')}",
                    f"{r['delivered'] - r['duplicates']}/{r['expected']}",
                    fmt(r["frames_per_s"], digits=0),
                    "/".join(fmt(cpu.get(k), digits=1) for k in ("server", "nats-server", "clients")),
                )
            )
        fan = f["gateway"].get("fanout_metrics", {})
        notes.append(
            f"fan-out: {f['clients']} clients, {f['rate']:g} events/s for {f['seconds']:g} s after {f['warmup_s']:g} s "
            f"warm-up (published at {f['gateway']['publish']['rate']:.0f}/s); gateway p99 / relay p99 = "
            f"{f['p99_ratio']:.2f}, gateway frames/s / relay frames/s = {f['frames_ratio']:.2f}; the gateway held "
            f"{fan.get('subscriptions', math.nan):g} shared subscription(s) for {fan.get('watchers', math.nan):g} "
            f"clients, {fan.get('lagging_total', math.nan):g} cut for lagging"
        )
    if "log" in out:
        lg = out["log"]
        rows.append(
            (
                "log write → client",
                fmt(lg["p50_ms"], " ms"),
                fmt(lg["p99_ms"], " ms"),
                f"- / {fmt(lg['max_ms'], ' ms')}",
                f"{lg['received'] - lg['duplicates']}/{lg['lines']}",
                "",
                "",
            )
        )
        notes.append(
            f"log: {lg['rate']:g} lines/s for {lg['seconds']:g} s, {lg['samples']} live "
            f"({lg['from_tail']} came with the tail)"
        )
    if "overlap" in out:
        ov = out["overlap"]
        unwatched, watched = ov["runs"]
        rows.append(("overlap run", "makespan", "/ bound", "hold/harness", "failed", "watchers ended", ""))
        for r in ov["runs"]:
            rows.append(
                (
                    f"overlap {r['trace']}",
                    fmt(r["makespan_s"], " s"),
                    fmt(r["ratio"], digits=3),
                    fmt(r["hold_ratio"], digits=3),
                    str(r["failed_cases"]),
                    f"{r['watchers_ended']}/{r['watchers']}",
                    "",
                )
            )
        notes.append(
            f"overlap: bound {ov['formula']}; watched / unwatched makespan = "
            f"{watched['makespan_s'] / unwatched['makespan_s']:.3f} (printed, not judged)"
        )
    notes.append(f"load average {out['load_avg_start'][0]:.1f} at the start, {out['load_avg_end'][0]:.1f} at the end")
    notes += goal_notes(out["goals"])
    return rows, notes


def cli() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--only", nargs="+", choices=PARTS, help="run only these parts")
    parser.add_argument("--clients", type=int, default=100, help="SSE clients on the batch's event stream")
    parser.add_argument("--rate", type=float, default=1000.0, help="events/s published during the fan-out")
    parser.add_argument("--seconds", type=float, default=10.0, help="measured seconds of the fan-out")
    parser.add_argument("--warmup-s", type=float, default=1.0, help="fan-out seconds left out of the figures")
    parser.add_argument("--drain-s", type=float, default=15.0, help="wait after publishing for the last events")
    parser.add_argument("--log-rate", type=float, default=50.0, help="lines/s the log harness prints")
    parser.add_argument("--log-seconds", type=float, default=10.0)
    parser.add_argument("--log-lead-s", type=float, default=1.5, help="the log harness waits this long first")
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--harness-s", type=float, default=1.0)
    parser.add_argument("--judges", type=int, default=2)
    parser.add_argument("--judge-s", type=float, default=2.0)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--judge-limit", type=int, default=8)
    parser.add_argument("--watchers", type=int, default=10, help="SSE watchers per run in the watched run")
    parser.add_argument("--chatter", type=float, default=20.0, help="lines/s the watched run's harness prints")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    add_check_flag(parser)
    args = parser.parse_args()
    quiet_logs()
    out = asyncio.run(main(args))
    rows, notes = table(out)
    report(out, rows, notes, args.json)
    sys.exit(verdict("live", out["goals"], check=args.check))


if __name__ == "__main__":
    cli()
