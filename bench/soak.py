"""Soak: a steady stream of cases through the full stack for a long time — does anything grow?

Workload (issue 13, "Soak"): `--rate` cases per second (default 28: 50,000 cases in 30 minutes)
for `--minutes` (default 30), as batches of `--batch` cases published on the bus at an even pace,
through the five real services on a nats-server and a PostgreSQL database of the soak's own (a
`cat` harness, so the agent costs nothing and the stack is what is measured, and an exact judge).
Every `--sample-s` (60) seconds it samples: the resident memory of every process (the five
services, nats-server, the embedded PostgreSQL when it is ours), the CASES stream's messages and
bytes, the event store's size, the p50/p99 of `case.requested` → `case.exported` for the cases
exported in that interval, and nats-server's Go heap from its profiler (`HeapAlloc`: live objects
and garbage not yet collected; `NextGC / 2`: what was live at the last collection, with Go's
default `GOGC` of 100; `HeapIdle - HeapReleased`: freed memory the runtime keeps; `Sys`), which
tells the server's growth in its own data from its collector's slack.

Goals: no process's RSS at the end above 1.2 × its RSS at the baseline sample (minute 5, or
`--baseline-min`); the last interval's p99 within 1.5 × the baseline interval's; nothing lost or
doubled (every case submitted exported exactly once, counted in the event store). Prints a table
per sample and the goals, then one JSON line; writes the samples as JSON and a PNG chart to
`bench/results/` (the chart needs matplotlib: `just soak` runs with the `bench` dependency group).

    uv run --group bench python bench/soak.py [--minutes 30] [--rate 28] [--batch 50]
        [--baseline-min 5] [--sample-s 60] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib
import json
import sys
import time
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/soak.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import asyncpg
from bench._cpu import rss_bytes
from bench._goals import add_check_flag, goal, goal_notes, verdict
from bench._infra import Infra, pipeline_stack, quiet_logs, running
from bench._report import fmt, report
from bench._stats import percentile
from bench._workload import batch_request
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from evalbus_contracts import CommandHarness, ExactJudge
from evalbus_runtime import Publisher, connect

RESULTS = Path(__file__).resolve().parent / "results"


@dataclass
class Arrivals:
    """Arrival times (monotonic) of every case's `case.requested` and `case.exported`, from core
    subscriptions opened before the first batch."""

    requested: dict[str, float] = field(default_factory=dict)
    exported: dict[str, float] = field(default_factory=dict)
    wanted: int = 0
    """Exported cases that set `all_out` (raised as batches are submitted)."""
    all_out: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self, nc: NatsClient) -> None:
        async def on_requested(msg: Msg) -> None:
            key = msg.subject.split(".", 2)[2]
            self.requested.setdefault(key, time.monotonic())

        async def on_exported(msg: Msg) -> None:
            key = msg.subject.split(".", 2)[2]
            self.exported.setdefault(key, time.monotonic())
            if len(self.exported) >= self.wanted:
                self.all_out.set()

        await nc.subscribe("case.requested.>", cb=on_requested, pending_msgs_limit=-1, pending_bytes_limit=-1)
        await nc.subscribe("case.exported.>", cb=on_exported, pending_msgs_limit=-1, pending_bytes_limit=-1)
        await nc.flush()

    def latencies(self, since: float, until: float) -> list[float]:
        """requested → exported of the cases exported in [since, until)."""
        return [t - self.requested[k] for k, t in self.exported.items() if since <= t < until and k in self.requested]


async def sample(
    infra: Infra, nc: NatsClient, pids: dict[str, int | None], arrivals: Arrivals, since: float, now: float, t0: float
) -> dict[str, Any]:
    info = await nc.jetstream().stream_info("CASES")
    # nats-py's StreamState drops `num_subjects`: the distinct subjects CASES holds (what
    # nats-server keeps an entry in memory for), read from the API's own answer.
    raw = await nc.request("$JS.API.STREAM.INFO.CASES", b"{}", timeout=5.0)
    subjects = int(json.loads(raw.data).get("state", {}).get("num_subjects", 0))
    live = await nc.jetstream().stream_info("LIVE")  # the runs in flight and those settled < 2 min ago
    conn = await asyncpg.connect(infra.database_url)
    try:
        events = int(await conn.fetchval("SELECT count(*) FROM events"))
        store_bytes = int(await conn.fetchval("SELECT pg_total_relation_size('events')"))
    finally:
        await conn.close()
    window = arrivals.latencies(since, now)
    prof = infra.nats.prof_port if infra.nats is not None else None
    return {
        "minute": round((now - t0) / 60.0, 2),
        "rss": {name: rss_bytes(pid) for name, pid in pids.items()},
        "stream_messages": int(info.state.messages),
        "stream_bytes": int(info.state.bytes),
        "stream_subjects": subjects,
        "live_messages": int(live.state.messages),
        "live_bytes": int(live.state.bytes),
        "events": events,
        "store_bytes": store_bytes,
        "exported_in_window": len(window),
        "p50_s": percentile(window, 0.5),
        "p99_s": percentile(window, 0.99),
        "nats_go": await go_memstats(prof) if prof is not None else {},
    }


GO_STATS = ("HeapAlloc", "HeapInuse", "HeapIdle", "HeapReleased", "NextGC", "Sys", "NumGC")


async def go_memstats(prof_port: int) -> dict[str, int]:
    """nats-server's `runtime.MemStats` as its profiler prints them (`# HeapAlloc = 123` lines at
    the end of `/debug/pprof/heap?debug=1`); empty when it does not answer."""
    try:
        async with (
            aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=10)) as http,
            http.get(f"http://127.0.0.1:{prof_port}/debug/pprof/heap?debug=1") as resp,
        ):
            text = await resp.text()
    except (aiohttp.ClientError, TimeoutError):
        return {}
    stats: dict[str, int] = {}
    for line in text.splitlines():
        name, _, value = line.removeprefix("# ").partition(" = ")
        if name in GO_STATS and value.strip().isdigit():
            stats[name] = int(value)
    return stats


async def main(args: argparse.Namespace) -> dict[str, Any]:
    quiet_logs()
    duration_s = args.minutes * 60.0
    interval_s = args.batch / args.rate
    harness = CommandHarness(id="cat", command=("cat",))
    samples: list[dict[str, Any]] = []
    submitted = 0
    async with Infra(database=True, prefix="evalbus-bench-soak-", nats_profiler=True) as infra:
        stack = pipeline_stack(infra, "soak", service_env={"dispatcher": {"DISPATCHER_SLOTS": str(args.slots)}})
        await asyncio.to_thread(stack.start_all)
        async with running(stack):
            pids: dict[str, int | None] = {name: sp.process.pid for name, sp in stack.procs.items()}
            pids["nats-server"] = infra.nats.process.pid if infra.nats else None
            if (postgres := infra.postgres_pid()) is not None:  # the embedded server, or a local DATABASE_URL one
                pids["postgres"] = postgres
            nc = await connect(infra.nats_url, "bench-soak")
            arrivals = Arrivals()
            await arrivals.start(nc)
            pub = Publisher(nc)
            await pub.start()
            t0 = time.monotonic()
            next_sample = t0 + args.sample_s
            last_sample = t0
            batches: list[str] = []
            try:
                k = 0
                while (now := time.monotonic()) - t0 < duration_s:
                    due = t0 + k * interval_s
                    if now >= due:
                        batch_id = f"soak-{k:06d}-{uuid.uuid4().hex[:6]}"
                        expected = str(k % 7)
                        request = batch_request(
                            batch_id, args.batch, harness, (ExactJudge(id="exact"),), expected=expected
                        )
                        await pub.publish_event(request)
                        batches.append(batch_id)
                        submitted += args.batch
                        arrivals.wanted = submitted
                        arrivals.all_out.clear()
                        k += 1
                    if now >= next_sample:
                        samples.append(await sample(infra, nc, pids, arrivals, last_sample, now, t0))
                        print(_line(samples[-1]), file=sys.stderr, flush=True)
                        last_sample, next_sample = now, next_sample + args.sample_s
                    await asyncio.sleep(max(0.0, min(t0 + k * interval_s, next_sample) - time.monotonic()))
                # the tail: every submitted case out, then one last sample
                if len(arrivals.exported) < submitted:
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(arrivals.all_out.wait(), 600)
                now = time.monotonic()
                samples.append(await sample(infra, nc, pids, arrivals, last_sample, now, t0) | {"tail": True})
                conn = await asyncpg.connect(infra.database_url)
                try:
                    stored = int(
                        await conn.fetchval("SELECT count(DISTINCT run_id) FROM events WHERE type = 'case.exported'")
                    )
                    doubled = int(
                        await conn.fetchval(
                            "SELECT count(*) - count(DISTINCT run_id) FROM events WHERE type = 'case.exported'"
                        )
                    )
                finally:
                    await conn.close()
            finally:
                await pub.stop()
                with contextlib.suppress(Exception):
                    await nc.close()
    return summarize(args, samples, submitted, len(arrivals.exported), doubled, stored)


def live_heap(s: dict[str, Any]) -> float | None:
    """nats-server's live heap at its last collection in sample `s` (`NextGC / 2`: Go's default
    `GOGC` of 100), None when its profiler did not answer."""
    go = s.get("nats_go") or {}
    return go["NextGC"] / 2 if "NextGC" in go else None


def _line(s: dict[str, Any]) -> str:
    rss = " ".join(f"{n}={(v or 0) / 2**20:.0f}M" for n, v in s["rss"].items() if v is not None)
    go, live = s.get("nats_go") or {}, live_heap(s)
    heap = (
        f"; nats heap {go['HeapAlloc'] / 2**20:.0f}M live {live / 2**20:.0f}M "
        f"kept {(go['HeapIdle'] - go['HeapReleased']) / 2**20:.0f}M"
        if live is not None and {"HeapAlloc", "HeapIdle", "HeapReleased"} <= go.keys()
        else ""
    )
    return (
        f"minute {s['minute']:6.2f}: p50 {s['p50_s']:.3f}s p99 {s['p99_s']:.3f}s, "
        f"{s['exported_in_window']} exported; {rss}{heap}"
    )


def summarize(
    args: argparse.Namespace, samples: list[dict[str, Any]], submitted: int, exported: int, doubled: int, stored: int
) -> dict[str, Any]:
    periodic = [s for s in samples if not s.get("tail")]
    base = next((s for s in periodic if s["minute"] >= args.baseline_min - 1e-9), periodic[0] if periodic else None)
    last = periodic[-1] if periodic else None
    goals = []
    growth: dict[str, float | None] = {}
    if base is not None and last is not None:
        for name, at_base in base["rss"].items():
            at_end = samples[-1]["rss"].get(name)
            growth[name] = (at_end / at_base) if at_base and at_end else None
            if at_base and at_end:
                goals.append(
                    goal(
                        f"RSS {name} end / minute {base['minute']:g}",
                        at_end / at_base,
                        "<=",
                        1.2,
                        "its own baseline sample",
                    )
                )
        p99_ratio = last["p99_s"] / base["p99_s"] if base["p99_s"] and base["p99_s"] == base["p99_s"] else None
        goals.append(
            goal(
                f"p99 minute {last['minute']:g} / minute {base['minute']:g}",
                p99_ratio,
                "<=",
                1.5,
                "the baseline interval",
            )
        )
    goals.append(
        goal("cases lost", float(submitted - stored), "==", 0, "runs exported in the store vs cases submitted")
    )
    goals.append(goal("cases doubled", float(doubled), "==", 0, "case.exported rows in the store beyond one per run"))
    return {
        "benchmark": "soak",
        "params": {
            "minutes": args.minutes,
            "rate": args.rate,
            "batch": args.batch,
            "slots": args.slots,
            "sample_s": args.sample_s,
            "baseline_min": args.baseline_min,
        },
        "submitted": submitted,
        "exported": exported,
        "stored_exported": stored,
        "rss_growth": growth,
        "samples": samples,
        "goals": goals,
        "ok": all(g.passed for g in goals),
    }


def write_results(out: dict[str, Any]) -> list[str]:
    """The samples as JSON and, when matplotlib is importable, a PNG chart; the paths written."""
    RESULTS.mkdir(exist_ok=True)
    stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
    written = []
    data = RESULTS / f"soak-{stamp}.json"
    data.write_text(json.dumps(out, default=str, indent=1))
    written.append(str(data))
    try:
        matplotlib = importlib.import_module("matplotlib")
        matplotlib.use("Agg")
        plt = importlib.import_module("matplotlib.pyplot")
    except ImportError:
        return [*written, "(no chart: matplotlib is not installed; `just soak` runs with it)"]
    samples = [s for s in out["samples"] if not s.get("tail")]
    minutes = [s["minute"] for s in samples]
    fig, (mem, lat) = plt.subplots(2, 1, figsize=(9, 7), sharex=True)
    for name in samples[0]["rss"] if samples else []:
        values = [(s["rss"].get(name) or 0) / 2**20 for s in samples]
        mem.plot(minutes, values, label=name)
    mem.set_ylabel("RSS (MiB)")
    mem.legend(fontsize="small", ncol=4)
    mem.set_title(f"soak: {out['params']['rate']} cases/s for {out['params']['minutes']} min")
    lat.plot(minutes, [s["p50_s"] for s in samples], label="p50")
    lat.plot(minutes, [s["p99_s"] for s in samples], label="p99")
    lat.set_ylabel("requested → exported (s)")
    lat.set_xlabel("minute")
    lat.legend(fontsize="small")
    chart = RESULTS / f"soak-{stamp}.png"
    fig.tight_layout()
    fig.savefig(chart, dpi=100)
    written.append(str(chart))
    return written


def cli() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--minutes", type=float, default=30.0)
    parser.add_argument("--rate", type=float, default=28.0, help="cases per second")
    parser.add_argument("--batch", type=int, default=50, help="cases per batch")
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--sample-s", type=float, default=60.0)
    parser.add_argument("--baseline-min", type=float, default=5.0)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    add_check_flag(parser)
    args = parser.parse_args()
    out = asyncio.run(main(args))
    written = write_results(out)
    names = list(out["samples"][0]["rss"]) if out["samples"] else []
    table = [
        (
            "minute",
            "p50 s",
            "p99 s",
            "exported",
            "stream MiB",
            "subjects",
            "LIVE MiB",
            "store MiB",
            *[f"{n} MiB" for n in names],
            "nats live MiB",
        )
    ]
    for s in out["samples"]:
        table.append(
            (
                f"{s['minute']:.1f}" + (" (tail)" if s.get("tail") else ""),
                fmt(s["p50_s"], digits=3),
                fmt(s["p99_s"], digits=3),
                str(s["exported_in_window"]),
                fmt(s["stream_bytes"] / 2**20, digits=1),
                str(s.get("stream_subjects", "")),
                fmt(s.get("live_bytes", 0) / 2**20, digits=1),
                fmt(s["store_bytes"] / 2**20, digits=1),
                *[fmt((s["rss"].get(n) or 0) / 2**20, digits=0) for n in names],
                fmt(live / 2**20, digits=0) if (live := live_heap(s)) is not None else "",
            )
        )
    notes = [*goal_notes(out["goals"]), *(f"written: {w}" for w in written)]
    out_small = {k: v for k, v in out.items() if k != "samples"} | {"samples": len(out["samples"])}
    report(out_small, table, notes, args.json)
    sys.exit(verdict("soak", out["goals"], check=args.check))


if __name__ == "__main__":
    cli()
