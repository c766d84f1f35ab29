"""Chassis benchmark: a 3-stage relay through the chassis' consumer loop versus a bare nats-py relay.

Both relays (`bench/_relay.py`) run the same pipeline on the same nats-server, each stage in its own
process, at most 256 messages in flight per stage: case.requested → case.executed → case.judged →
case.exported (real contract events, ~1 KB). The bare relay is the strongest simple nats-py
relay — credit-based pull requests like the chassis', each payload forwarded undecoded with a core
publish and `Nats-Msg-Id`, the input acked when its PubAck arrives, all in callbacks; the chassis
decodes each event, runs the handler, publishes the output with its headers, acks after the PubAck.

Goals:
- throughput: chassis events/s ≥ 0.7 × the bare relay's, both measured in this run (with
  `--repeats N` the two alternate N times and the medians are compared);
- latency: the chassis' p99 from publish to the last stage ≤ 30 ms at a paced 500 events/s.

Prints a short table and the goals, then one JSON line (only the JSON line with --json); the goals
are in it as data (`"goals"`: name, measured, goal, comparison, passed, basis; `"ok"`). With
--check it exits 1, naming the missed goals on stderr, when any is missed; without, it exits 0.

    uv run python bench/chassis.py [--events 20000] [--repeats 1] [--rate 500] [--paced-seconds 10] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/chassis.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._goals import add_check_flag, goal, goal_notes, verdict
from bench._infra import quiet_logs
from bench._relay import IN_FLIGHT, run_mode
from bench._report import fmt, report

from evalbus.infra.nats import start_nats

RATIO_GOAL = 0.7
P99_GOAL_MS = 30.0


async def main(args: argparse.Namespace) -> dict[str, Any]:
    bare: list[dict[str, float]] = []
    chassis: list[dict[str, float]] = []
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="evalbus-bench-") as tmp:
        server = start_nats(Path(tmp) / "nats")
        try:
            logdir = Path(tmp)
            for _ in range(args.repeats):  # alternate, so a burst of load elsewhere hits both
                bare.append(await run_mode(server.url, "bare", args.events, None, logdir))
                chassis.append(await run_mode(server.url, "chassis", args.events, None, logdir))
            paced = await run_mode(server.url, "chassis", int(args.rate * args.paced_seconds), args.rate, logdir)
        finally:
            server.stop()
    bare_rate = statistics.median(r["events_per_s"] for r in bare)
    chassis_rate = statistics.median(r["events_per_s"] for r in chassis)
    ratio = chassis_rate / bare_rate
    goals = [
        goal(
            "chassis / bare relay events/s",
            ratio,
            ">=",
            RATIO_GOAL,
            f"chassis {chassis_rate:.0f} / bare relay {bare_rate:.0f} events/s, the bare relay measured in this run",
        ),
        goal(
            f"chassis p99 ms at {args.rate:g}/s",
            paced["p99_ms"],
            "<=",
            P99_GOAL_MS,
            "publish to case.exported through 3 chassis stages, paced",
        ),
    ]
    return {
        "benchmark": "chassis",
        "events": args.events,
        "repeats": args.repeats,
        "in_flight_per_stage": IN_FLIGHT,
        "bare_events_per_s": bare_rate,
        "chassis_events_per_s": chassis_rate,
        "bare_runs_events_per_s": [r["events_per_s"] for r in bare],
        "chassis_runs_events_per_s": [r["events_per_s"] for r in chassis],
        "ratio": ratio,
        "paced_rate": args.rate,
        "paced_events": paced["events"],
        "paced_p50_ms": paced["p50_ms"],
        "paced_p99_ms": paced["p99_ms"],
        "load_avg_before": load_before,
        "load_avg_after": os.getloadavg()[0],
        "goals": goals,
        "ok": all(g.passed for g in goals),
    }


def table(out: dict[str, Any]) -> tuple[list[tuple[str, ...]], list[str]]:
    """The rows and notes printed without --json."""
    rows: list[tuple[str, ...]] = [
        ("relay", "events/s", "runs"),
        ("bare", fmt(out["bare_events_per_s"], digits=0), " ".join(fmt(r, digits=0) for r in out["bare_runs_events_per_s"])),
        ("chassis", fmt(out["chassis_events_per_s"], digits=0), " ".join(fmt(r, digits=0) for r in out["chassis_runs_events_per_s"])),
    ]  # fmt: skip
    notes = [
        f"{out['events']} events per run, medians of {out['repeats']}; paced {out['paced_rate']:g}/s "
        f"({out['paced_events']} events): p50 {fmt(out['paced_p50_ms'], ' ms')}, p99 {fmt(out['paced_p99_ms'], ' ms')}. "
        f"Load average {out['load_avg_before']:.1f} before, {out['load_avg_after']:.1f} after",
        *goal_notes(out["goals"]),
    ]
    return rows, notes


def cli() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000, help="events per throughput run")
    parser.add_argument("--repeats", type=int, default=1, help="bare/chassis throughput runs, alternating (medians)")
    parser.add_argument("--rate", type=float, default=500.0, help="paced rate of the latency run, events/s")
    parser.add_argument("--paced-seconds", type=float, default=10.0)
    parser.add_argument("--json", action="store_true", help="print one JSON line")
    add_check_flag(parser)
    args = parser.parse_args()
    quiet_logs()
    out = asyncio.run(main(args))
    rows, notes = table(out)
    report(out, rows, notes, args.json)
    sys.exit(verdict("chassis", out["goals"], check=args.check))


if __name__ == "__main__":
    cli()
