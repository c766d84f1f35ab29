"""Recorder benchmark: events/s into the PostgreSQL event store, through the gateway's recorder stage.

Workload (issue 3, benchmark 3): one batch of R runs, each with its four case events (requested,
executed, judged, exported; ~0.5–2 KB JSON, a short agent trace and scores), plus the
`batch.requested` — 4R + 1 events in stream order, stage by stage in windows of 100 runs, so runs
settle and are sealed (hash-chained) as the recording goes, and the last event completes the batch.
A fresh database on the server of `DATABASE_URL` when set, else on the embedded server.

1. stage — the events through the gateway's recorder stage as a real process: all events are
   published onto CASES while the `gateway-recorder` consumer is paused, then it is resumed and
   timed until it has nothing pending or unacknowledged — consume, decode, group commit (seals and
   the finalisation included), ack: events/s (the rate the goal is judged on), and from the
   gateway's `/metrics` its transactions, their mean size and the seconds spent in them.
2. store — the same number of events (another batch id) with `evalbus_gateway.store.record`
   called directly, one transaction per batch of `--batch-size` messages (the recorder's default
   1,000), one at a time as the recorder's write batcher does: events/s and the p50/p99 time of
   one transaction. A reference figure (the ceiling of the database side), not a goal.

Goals: ≥ 10,000 events/s through the recorder stage; every event stored and every run sealed, on
both paths, and the batch finalized by the stage. Prints a short table and the goals, then one
JSON line (only the JSON line with --json; the goals are in it as data, `"goals"` and `"ok"`).
With --check it exits 1, naming the missed goals on stderr, when any is missed; without, it exits
0. `--gateway-env KEY=VALUE` passes settings to the gateway process (e.g.
`GATEWAY_RECORDER_CONCURRENCY=4096`) to try the recorder's knobs.

    uv run python bench/recorder.py [--events 40001] [--batch-size 1000] [--gateway-env K=V ...]
        [--no-stage] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/recorder.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import asyncpg
from bench._consumers import consumer_limit, drained, pause, resume
from bench._cpu import CpuMeter
from bench._goals import Goal, add_check_flag, goal, goal_notes, verdict
from bench._infra import Infra, pipeline_stack, quiet_logs, running
from bench._report import fmt, report
from bench._stats import percentile
from bench._workload import RULE_JUDGE, ZERO_HARNESS, batch_request, case_ids, sample_events

from evalbus_contracts import CasePlan, decode_event, encode
from evalbus_contracts.events import EventBase
from evalbus_contracts.streams import GATEWAY_RECORDER
from evalbus_dispatcher.fanout import plan_of
from evalbus_gateway.database import create_pool
from evalbus_gateway.store import RecordedMessage, migrate, record
from evalbus_runtime import Publisher, connect

GOAL_EVENTS_PER_S = 10_000.0
"""The recorder goal (issue 3), judged through the stage."""
WINDOW = 100
"""Runs per stage window: the stream holds 100 requested, then their 100 executed, and so on."""


def workload(batch_id: str, runs: int) -> list[EventBase]:
    """The batch's events in stream order."""
    request = batch_request(batch_id, runs, ZERO_HARNESS, RULE_JUDGE)
    plan: CasePlan = plan_of(request)
    per_run = [sample_events(batch_id, case_id, plan, ZERO_HARNESS) for case_id in case_ids(runs)]
    out: list[EventBase] = [request]
    for start in range(0, runs, WINDOW):
        window = per_run[start : start + WINDOW]
        for stage in range(4):
            out.extend(events[stage] for events in window)
    return out


async def store_direct(database_url: str, events: list[EventBase], batch_size: int, meter: CpuMeter) -> dict[str, Any]:
    """`store.record` in batches of `batch_size`, one transaction at a time."""
    messages = []
    for seq, event in enumerate(events, start=1):
        data = encode(event)
        messages.append(RecordedMessage(seq, event.subject(), data, decode_event(data)))
    pool = await create_pool(database_url, min_size=1, max_size=2)
    try:
        await migrate(pool)
        durations: list[float] = []
        inserted = sealed = 0
        complete: set[str] = set()
        meter.start()
        t0 = time.monotonic()
        for k in range(0, len(messages), batch_size):
            started = time.monotonic()
            outcome = await record(pool, messages[k : k + batch_size])
            durations.append(time.monotonic() - started)
            inserted += outcome.inserted
            sealed += len(outcome.sealed_runs)
            complete.update(outcome.complete_batches)
        elapsed = time.monotonic() - t0
        meter.stop()
    finally:
        await pool.close()
    return {
        "events": len(messages),
        "seconds": elapsed,
        "events_per_s": len(messages) / elapsed,
        "inserted": inserted,
        "sealed_runs": sealed,
        "batch_complete": bool(complete),
        "transactions": len(durations),
        "transaction_p50_ms": 1000 * percentile(durations, 0.5),
        "transaction_p99_ms": 1000 * percentile(durations, 0.99),
        "cpu_ms_per_1k_events": {k: 1000 * v for k, v in meter.per_case_ms(len(messages)).items()},
    }


async def recorder_writes(port: int) -> dict[str, float]:
    """The gateway's own count of recorder transactions, the messages they held and the seconds
    spent in them (its `/metrics`; the process recorded nothing else)."""
    wanted = {
        "evalbus_recorder_batch_messages_count": "transactions",
        "evalbus_recorder_batch_messages_sum": "messages",
        "evalbus_recorder_write_seconds_sum": "seconds",
    }
    out = dict.fromkeys(wanted.values(), 0.0)
    async with aiohttp.ClientSession() as http, http.get(f"http://127.0.0.1:{port}/metrics") as r:
        r.raise_for_status()
        for line in (await r.text()).splitlines():
            name, _, value = line.partition(" ")
            if name in wanted:
                out[wanted[name]] = float(value)
    return out


async def stage(
    infra: Infra, events: list[EventBase], batch_id: str, timeout_s: float, gateway_env: dict[str, str]
) -> dict[str, Any]:
    """The gateway's recorder stage as a process (on a database of its own: the store keys
    messages by stream sequence): publish everything while its consumer is paused, resume, time
    until it drained."""
    database_url = await infra.new_database()
    stack = pipeline_stack(infra, "gateway", service_env={"gateway": gateway_env})
    stack.database_url = database_url
    await asyncio.to_thread(stack.start, "gateway")
    async with running(stack):
        meter = CpuMeter(
            {
                "gateway": stack.procs["gateway"].process.pid,
                "nats-server": infra.nats.process.pid if infra.nats else None,
            }
            | {"postgres": infra.postgres_pid()}
        )
        nc = await connect(infra.nats_url, "bench-recorder")
        js = nc.jetstream()
        try:
            limit = await consumer_limit(js, GATEWAY_RECORDER)
            await pause(js, GATEWAY_RECORDER)
            pub = Publisher(nc)
            await pub.start()
            t_pub = time.monotonic()
            for k in range(0, len(events), 1000):
                await pub.publish_events(events[k : k + 1000])
            publish_s = time.monotonic() - t_pub
            await pub.stop()
            meter.start()
            t0 = time.monotonic()
            await resume(js, GATEWAY_RECORDER)
            while not await drained(js, GATEWAY_RECORDER):
                if time.monotonic() - t0 > timeout_s:
                    raise TimeoutError(f"the recorder did not drain in {timeout_s}s")
                await asyncio.sleep(0.02)
            elapsed = time.monotonic() - t0
            meter.stop()
        finally:
            await nc.close()
        writes = await recorder_writes(stack.procs["gateway"].port)
    conn = await asyncpg.connect(database_url)
    try:
        stored = int(
            await conn.fetchval(
                "SELECT count(*) FROM events WHERE batch_id = $1 AND type <> 'batch.finalized'", batch_id
            )
        )
        finalized = bool(
            await conn.fetchval(
                "SELECT count(*) FROM events WHERE batch_id = $1 AND type = 'batch.finalized'", batch_id
            )
        )
        seals = int(await conn.fetchval("SELECT count(*) FROM seals WHERE batch_id = $1", batch_id))
        rejected = {
            str(r["reason"]): int(r["n"])
            for r in await conn.fetch(
                "SELECT reason, count(*) AS n FROM rejections WHERE batch_id = $1 GROUP BY reason", batch_id
            )
        }
    finally:
        await conn.close()
    return {
        "events": len(events),
        "seconds": elapsed,
        "events_per_s": len(events) / elapsed,
        "stored": stored,
        "sealed_runs": seals,
        "finalized": finalized,
        "rejected": rejected,
        "publish_s": publish_s,
        "transactions": writes["transactions"],
        "mean_transaction_messages": writes["messages"] / writes["transactions"] if writes["transactions"] else None,
        "writing_s": writes["seconds"],
        "recorder_max_ack_pending": limit,
        "cpu_ms_per_1k_events": {k: 1000 * v for k, v in meter.per_case_ms(len(events)).items()},
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    runs = max(1, (args.events - 1) // 4)
    out: dict[str, Any] = {
        "benchmark": "recorder",
        "runs": runs,
        "events": 4 * runs + 1,
        "batch_size": args.batch_size,
        "load_avg_before": os.getloadavg()[0],
    }
    gateway_env = dict(kv.split("=", 1) for kv in args.gateway_env)
    if gateway_env:
        out["gateway_env"] = gateway_env
    async with Infra(database=True) as infra:
        out["database"] = infra.database_source
        if not args.no_stage:
            batch = f"rst-{uuid.uuid4().hex[:8]}"
            out["stage"] = await stage(infra, workload(batch, runs), batch, max(300.0, runs / 100), gateway_env)
        batch = f"rec-{uuid.uuid4().hex[:8]}"
        meter = CpuMeter({"postgres": infra.postgres_pid()})
        out["store"] = await store_direct(infra.database_url, workload(batch, runs), args.batch_size, meter)
    out["load_avg_after"] = os.getloadavg()[0]
    out["goals"] = goals(out)
    out["ok"] = all(g.passed for g in out["goals"])
    return out


def goals(out: dict[str, Any]) -> list[Goal]:
    """The recorder goal (through the stage) and the completeness of both paths."""
    events, runs, store = out["events"], out["runs"], out["store"]
    stage_rate = out["stage"]["events_per_s"] if "stage" in out else None
    found = [
        goal(
            "recorder stage events/s",
            stage_rate,
            ">=",
            GOAL_EVENTS_PER_S,
            "through the gateway's recorder stage: consume → batch → commit → ack, paused consumer to drained "
            f"(store.record called directly: {store['events_per_s']:.0f}, a reference)",
        )
    ]
    if "stage" in out:
        st = out["stage"]
        found += [
            goal("stage events stored", st["stored"], "==", events, "every event of the batch in the events table"),
            goal("stage runs sealed", st["sealed_runs"], "==", runs, "every run hash-chained"),
            goal("stage batch finalized", float(st["finalized"]), "==", 1, "batch.finalized recorded"),
        ]
    found += [
        goal("store events inserted", store["inserted"], "==", events, "store.record direct: every event inserted"),
        goal("store runs sealed", store["sealed_runs"], "==", runs, "store.record direct: every run hash-chained"),
    ]
    return found


def table(out: dict[str, Any]) -> tuple[list[tuple[str, ...]], list[str]]:
    """The rows and notes printed without --json."""
    s = out["store"]
    rows: list[tuple[str, ...]] = [("path", "events/s", "seconds", "note")]
    if "stage" in out:
        st = out["stage"]
        rows.append(
            (
                "recorder stage (goal)",
                fmt(st["events_per_s"], digits=0),
                fmt(st["seconds"], " s"),
                f"gateway process from a paused consumer to drained; {st['stored']} stored, {st['sealed_runs']} sealed"
                + (", batch finalized" if st["finalized"] else ", NOT finalized")
                + f"; {st['transactions']:.0f} transactions of {fmt(st['mean_transaction_messages'], digits=0)} on average,"
                f" {fmt(st['writing_s'], ' s')} in them",
            )
        )
    rows.append(
        (
            "store.record (reference)",
            fmt(s["events_per_s"], digits=0),
            fmt(s["seconds"], " s"),
            f"{s['transactions']} transactions of ≤ {out['batch_size']}: p50 {fmt(s['transaction_p50_ms'], ' ms', 1)}, "
            f"p99 {fmt(s['transaction_p99_ms'], ' ms', 1)}; {s['sealed_runs']} runs sealed",
        )
    )
    notes = [
        f"{out['events']} events ({out['runs']} runs × 4 + batch.requested), database: {out['database']}"
        + (f", gateway {out['gateway_env']}" if "gateway_env" in out else "")
        + f". Load average {out['load_avg_before']:.1f} before, {out['load_avg_after']:.1f} after",
        "CPU ms per 1,000 events: "
        + (
            "stage " + ", ".join(f"{k} {v:.0f}" for k, v in out["stage"]["cpu_ms_per_1k_events"].items()) + "; "
            if "stage" in out
            else ""
        )
        + "store "
        + ", ".join(f"{k} {v:.0f}" for k, v in s["cpu_ms_per_1k_events"].items()),
        *goal_notes(out["goals"]),
    ]
    return rows, notes


def cli() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=40_001, help="events in all (4 per run + 1)")
    parser.add_argument("--batch-size", type=int, default=1000, help="messages per store.record transaction")
    parser.add_argument(
        "--gateway-env",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting of the gateway process (repeatable), e.g. GATEWAY_RECORDER_CONCURRENCY=4096",
    )
    parser.add_argument("--no-stage", action="store_true", help="skip the recorder-stage measurement")
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    add_check_flag(parser)
    args = parser.parse_args()
    if args.check and args.no_stage:
        parser.error("--check judges the recorder goal through the stage: it cannot be used with --no-stage")
    if any("=" not in kv for kv in args.gateway_env):
        parser.error("--gateway-env takes KEY=VALUE")
    quiet_logs()
    out = asyncio.run(main(args))
    rows, notes = table(out)
    report(out, rows, notes, args.json)
    sys.exit(verdict("recorder", out["goals"], check=args.check))


if __name__ == "__main__":
    cli()
