"""Poison flood: malformed messages on every consumed subject while a batch runs.

Workload (issue 13, "Poison floods"): a batch of `--cases` cases (a Python harness running
`--harness-s` seconds, an exact judge, `--slots` compute slots) runs on a fresh stack of the five
real services, once clean and once while `--per-subject` (1,000) malformed payloads are published on
every kind of subject a service consumes on CASES (`batch.requested`, `batch.cancelled`,
`batch.finalized`, `case.requested`, `case.executed`, `case.collected`, `case.judged`,
`case.exported`, `case.observed`; each on a poison batch of its own, never the measured one), the
flood starting with the batch. Repeated `--repeats` times, alternating clean and flood, medians.

Goals: every poison message dead-lettered with its reason by every service whose durable consumer
receives its subject (`evalbus_contracts.streams.CONSUMERS`: 9,000 messages make 20,000 dead
letters) — exact counts, read from the DLQ stream; no consumer wedged (every CASES consumer idle
afterwards); the batch's makespan under the flood ≤ 1.10 × the clean makespan measured in the same
run (`--ratio-goal`); nothing of the poison in the event store.

    uv run python bench/poison.py [--cases 40] [--harness-s 0.5] [--slots 4] [--per-subject 1000]
        [--repeats 1] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/poison.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncpg
from bench._goals import add_check_flag, goal, goal_notes, verdict
from bench._infra import Infra, pipeline_stack, quiet_logs, running
from bench._report import fmt, report
from bench._watch import BatchWatch
from bench._workload import batch_request
from nats.js.api import StreamInfo

from evalbus_contracts import CommandHarness, ExactJudge
from evalbus_contracts.streams import CONSUMERS
from evalbus_contracts.subjects import subject_matches
from evalbus_runtime import Publisher, connect

AGENT = """\
import os, sys, time
sys.stdin.read()
time.sleep(float(os.environ["BENCH_HARNESS_S"]))
print("4")
"""

SUBJECT_KINDS = (
    "batch.requested",
    "batch.cancelled",
    "batch.finalized",
    "case.requested",
    "case.executed",
    "case.collected",
    "case.judged",
    "case.exported",
    "case.observed",
)
"""Every kind of subject on the CASES stream a service consumes."""


def poison_subject(kind: str, token: str, i: int) -> str:
    return f"{kind}.{token}{i}" if kind.startswith("batch.") else f"{kind}.{token}.p{i}"


def consumers_of(subject: str) -> list[str]:
    """Services whose durable consumer on CASES receives `subject` (service = durable prefix)."""
    return sorted(
        {
            c.durable.split("-", 1)[0]
            for c in CONSUMERS
            if c.stream == "CASES" and any(subject_matches(f, subject) for f in c.filter_subjects)
        }
    )


def expected_letters(token: str, per_subject: int) -> Counter[str]:
    """Dead letters per service for the flood."""
    want: Counter[str] = Counter()
    for kind in SUBJECT_KINDS:
        for service in consumers_of(poison_subject(kind, token, 0)):
            want[service] += per_subject
    return want


async def flood(nc: Any, token: str, per_subject: int) -> int:
    """Publish the poison (core publishes, stored by CASES); returns how many were sent."""
    sent = 0
    for i in range(per_subject):
        for kind in SUBJECT_KINDS:
            subject = poison_subject(kind, token, i)
            await nc.publish(subject, f"not json: {subject} {{".encode(), headers={"Nats-Msg-Id": f"poison:{subject}"})
            sent += 1
        if i % 100 == 99:
            await nc.flush()
    await nc.flush()
    return sent


async def dead_letters(js: Any) -> Counter[str]:
    """Messages per `dlq.<service>` subject in the DLQ stream."""
    try:
        info: StreamInfo = await js.stream_info("DLQ", subjects_filter="dlq.>")
    except Exception:
        return Counter()
    subjects = info.state.subjects or {}
    return Counter({subject.split(".", 1)[1]: int(n) for subject, n in subjects.items()})


async def idle(js: Any) -> bool:
    infos = await js.consumers_info("CASES")
    return all(i.num_ack_pending == 0 and i.num_pending == 0 for i in infos)


async def wait_until(check: Any, timeout_s: float, what: str) -> float:
    """Seconds until `check()` holds (TimeoutError naming `what` otherwise)."""
    began = time.monotonic()
    while not await check():
        if time.monotonic() - began > timeout_s:
            raise TimeoutError(f"{what} after {timeout_s:.0f}s")
        await asyncio.sleep(0.1)
    return time.monotonic() - began


async def one_run(infra: Infra, args: argparse.Namespace, *, poisoned: bool) -> dict[str, Any]:
    batch_id = f"pf-{'flood' if poisoned else 'clean'}-{uuid.uuid4().hex[:8]}"
    stack = pipeline_stack(infra, batch_id, service_env={"dispatcher": {"DISPATCHER_SLOTS": str(args.slots)}})
    harness = CommandHarness(
        id="sleep",
        command=(sys.executable, "agent.py"),
        files={"agent.py": AGENT},
        env={"BENCH_HARNESS_S": repr(args.harness_s)},
    )
    request = batch_request(batch_id, args.cases, harness, (ExactJudge(id="exact"),))
    token = f"poison{uuid.uuid4().hex[:8]}"
    await asyncio.to_thread(stack.start_all)
    async with running(stack):
        nc = await connect(infra.nats_url, "bench-poison")
        js = nc.jetstream()
        try:
            before = await dead_letters(js)
            watch = await BatchWatch(nc, batch_id).start()
            pub = Publisher(nc)
            await pub.start()
            t0 = time.monotonic()
            await pub.publish_event(request)
            sent = await flood(nc, token, args.per_subject) if poisoned else 0
            flood_s = time.monotonic() - t0
            await watch.wait_for("case.exported", args.cases, 600.0)
            makespan = watch.last("case.exported") - t0
            await watch.wait_for("batch.finalized", 1, 120.0)
            want = expected_letters(token, args.per_subject) if poisoned else Counter()

            async def all_lettered() -> bool:
                got = await dead_letters(js) - before
                return all(got[s] >= n for s, n in want.items())

            letters_s = await wait_until(all_lettered, 600.0, "every poison message dead-lettered")
            idle_s = await wait_until(lambda: idle(js), 300.0, "every CASES consumer idle")
            got = await dead_letters(js) - before
            await watch.stop()
            await pub.stop()
        finally:
            await nc.close()
    conn = await asyncpg.connect(infra.database_url)
    try:
        in_store = int(await conn.fetchval("SELECT count(*) FROM events WHERE subject LIKE $1", f"%{token}%"))
        recorded = int(await conn.fetchval("SELECT count(*) FROM events WHERE batch_id = $1", batch_id))
    finally:
        await conn.close()
    return {
        "mode": "flood" if poisoned else "clean",
        "makespan_s": makespan,
        "flood_publish_s": flood_s if poisoned else None,
        "poison_sent": sent,
        "dead_letters": dict(got),
        "dead_letters_expected": dict(want),
        "letters_done_s": letters_s,
        "idle_after_s": idle_s,
        "poison_in_store": in_store,
        "batch_events_recorded": recorded,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    quiet_logs()
    runs: list[dict[str, Any]] = []
    async with Infra(database=True, prefix="evalbus-bench-poison-") as infra:
        for _ in range(args.repeats):
            runs.append(await one_run(infra, args, poisoned=False))
            runs.append(await one_run(infra, args, poisoned=True))
    clean = statistics.median(r["makespan_s"] for r in runs if r["mode"] == "clean")
    flooded = statistics.median(r["makespan_s"] for r in runs if r["mode"] == "flood")
    floods = [r for r in runs if r["mode"] == "flood"]
    exact = all(r["dead_letters"] == r["dead_letters_expected"] for r in floods)
    ratio = flooded / clean if clean > 0 else None
    goals = [
        goal(
            "flood makespan / clean makespan",
            ratio,
            "<=",
            args.ratio_goal,
            "the clean run of the same workload, same run (medians)",
        ),
        goal(
            "dead letters as expected",
            1.0 if exact else 0.0,
            "==",
            1.0,
            "every poison message once per consuming service",
        ),
        goal("poison events in the store", float(sum(r["poison_in_store"] for r in runs)), "==", 0, "exact"),
        goal(
            "batch events recorded",
            float(min(r["batch_events_recorded"] for r in runs)),
            ">=",
            float(4 * args.cases + 2),
            "requested, executed, judged, exported per case + batch requested, finalized",
        ),
    ]
    return {
        "benchmark": "poison",
        "params": {
            "cases": args.cases,
            "harness_s": args.harness_s,
            "slots": args.slots,
            "per_subject": args.per_subject,
            "subject_kinds": len(SUBJECT_KINDS),
            "repeats": args.repeats,
        },
        "clean_makespan_s": clean,
        "flood_makespan_s": flooded,
        "ratio": ratio,
        "runs": runs,
        "goals": goals,
        "ok": all(g.passed for g in goals),
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cases", type=int, default=40)
    parser.add_argument("--harness-s", type=float, default=0.5)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--per-subject", type=int, default=1000)
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--ratio-goal", type=float, default=1.10)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    add_check_flag(parser)
    args = parser.parse_args()
    out = asyncio.run(main(args))
    table = [("run", "makespan s", "poison sent", "dead letters", "expected", "all lettered after s", "idle after s")]
    for r in out["runs"]:
        table.append(
            (
                r["mode"],
                fmt(r["makespan_s"]),
                str(r["poison_sent"]),
                str(sum(r["dead_letters"].values())),
                str(sum(r["dead_letters_expected"].values())),
                fmt(r["letters_done_s"]),
                fmt(r["idle_after_s"]),
            )
        )
    notes = [*goal_notes(out["goals"]), f"dead letters per service (flood): {out['runs'][-1]['dead_letters']}"]
    report(out, table, notes, args.json)
    sys.exit(verdict("poison", out["goals"], check=args.check))


if __name__ == "__main__":
    cli()
