"""Scale-out: what judge replicas buy on a latency-bound judge, and what R3 streams cost.

Workload (issue 11, `bench/scaleout.py`):

1. **Judge replicas.** A batch of `--cases` cases (a `cat` harness: the agent costs nothing) judged
   by the `sleep` plugin judge (`bench.plugins`: `--judge-s` seconds per case without using the
   CPU, like a judge waiting on a remote model), with `JUDGE_CONCURRENCY=--judge-concurrency` per
   replica, on a fresh stack with 1, 2 and 3 judge replicas. The judging rate is the cases judged
   over the time from the first `case.executed` (the first case a judge could take) to the last
   `case.judged`. Goal: the rate with R replicas ≥ 0.9 ×
   R × the rate with one (`--linear-goal`), all measured in this run.
2. **R3 against R1.** The same batch with a rule judge (`exact`), once on a single nats-server with
   R1 streams and once on a 3-node cluster with R3 streams (`STREAM_REPLICAS=3`), one replica of
   every service: the end-to-end rate (`batch.requested` published → last `case.exported`) and
   their ratio, printed (no goal: it is the price of surviving a node).

    uv run python bench/scaleout.py [--cases 240] [--judge-s 0.25] [--judge-concurrency 4]
        [--r3-cases 1000] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/scaleout.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._goals import add_check_flag, goal, goal_notes, verdict
from bench._infra import REPO_ROOT, Infra, pipeline_stack, quiet_logs, running
from bench._report import fmt, report
from bench._watch import BatchWatch
from bench._workload import batch_request

from evalbus.infra.nats import start_nats_cluster
from evalbus.testing.stack import SERVICES, ServiceStack
from evalbus_contracts import CommandHarness, ExactJudge, JudgeSpec, RegisteredJudge
from evalbus_runtime import Publisher, connect

CAT = CommandHarness(id="cat", command=("cat",))


async def run_batch(nats_url: str, n_cases: int, judges: tuple[JudgeSpec, ...], timeout_s: float) -> BatchWatch:
    """Publish one batch of `n_cases` and wait until every case is exported."""
    batch_id = f"so-{uuid.uuid4().hex[:10]}"
    nc = await connect(nats_url, "bench-scaleout")
    try:
        watch = await BatchWatch(nc, batch_id).start()
        pub = Publisher(nc)
        await pub.start()
        watch.times["published"] = {"batch": time.monotonic()}
        await pub.publish_event(batch_request(batch_id, n_cases, CAT, judges))
        await watch.wait_for("case.exported", n_cases, timeout_s)
        await watch.stop()
        await pub.stop()
    finally:
        await nc.close()
    return watch


async def judge_replicas(infra: Infra, args: argparse.Namespace, replicas: int) -> dict[str, Any]:
    """The judging rate of `replicas` judge replicas on the latency-bound judge."""
    stack = pipeline_stack(
        infra,
        f"judges-{replicas}-{uuid.uuid4().hex[:6]}",
        service_env={
            "dispatcher": {"DISPATCHER_SLOTS": "8"},
            "judge": {"JUDGE_CONCURRENCY": str(args.judge_concurrency), "JUDGE_PLUGINS": "bench.plugins:register"},
        },
    )
    # every judge replica gets the judge's settings (the stack keys them by name)
    for k in range(2, replicas + 1):
        stack.service_env[f"judge@{k}"] = dict(stack.service_env["judge"])
    await asyncio.to_thread(stack.start_all, [*SERVICES, *(f"judge@{k}" for k in range(2, replicas + 1))])
    async with running(stack):
        judge = RegisteredJudge(id="remote", name="sleep", params={"seconds": repr(args.judge_s)})
        bound_s = args.cases * args.judge_s / (replicas * args.judge_concurrency)
        watch = await run_batch(infra.nats_url, args.cases, (judge,), timeout_s=10 * bound_s + 120)
    window = watch.last("case.judged") - watch.first("case.executed")  # judging can start at the first
    return {
        "replicas": replicas,
        "judged_per_s": args.cases / window if window > 0 else None,
        "ideal_per_s": replicas * args.judge_concurrency / args.judge_s,
        "window_s": window,
    }


async def replication(infra: Infra, args: argparse.Namespace, *, r3: bool) -> dict[str, Any]:
    """End-to-end rate of a rule-judged batch on R1 (one node) or R3 (a 3-node cluster)."""
    name = f"{'r3' if r3 else 'r1'}-{uuid.uuid4().hex[:6]}"
    if r3:
        nodes = await asyncio.to_thread(start_nats_cluster, infra.workdir / f"{name}-nats", 3)
        url = ",".join(n.url for n in nodes)
        workdir = infra.workdir / name
        workdir.mkdir(parents=True)
        stack = ServiceStack(
            nats_url=url,
            database_url=await infra.new_database(),
            workdir=workdir,
            env={"PYTHONPATH": str(REPO_ROOT), "LOG_LEVEL": "WARNING", "LOG_FORMAT": "text", "STREAM_REPLICAS": "3"},
            service_env={"dispatcher": {"DISPATCHER_SLOTS": "8"}},
        )
    else:
        nodes = []
        url = infra.nats_url
        infra.database_url = await infra.new_database()
        stack = pipeline_stack(infra, name, service_env={"dispatcher": {"DISPATCHER_SLOTS": "8"}})
    try:
        await asyncio.to_thread(stack.start_all)
        async with running(stack):
            watch = await run_batch(url, args.r3_cases, (ExactJudge(id="exact"),), timeout_s=900)
    finally:
        for node in nodes:
            node.stop()
    elapsed = watch.last("case.exported") - watch.times["published"]["batch"]
    return {
        "streams": "R3 (3 nodes)" if r3 else "R1 (1 node)",
        "cases_per_s": args.r3_cases / elapsed,
        "seconds": elapsed,
    }


async def main(args: argparse.Namespace) -> dict[str, Any]:
    quiet_logs()
    async with Infra(database=True, prefix="evalbus-bench-scaleout-") as infra:
        judges = [await judge_replicas(infra, args, r) for r in (1, 2, 3)]
        r1 = await replication(infra, args, r3=False)
        r3 = await replication(infra, args, r3=True)
    one = judges[0]["judged_per_s"]
    goals = []
    for row in judges[1:]:
        rate = row["judged_per_s"]
        ratio = rate / (row["replicas"] * one) if rate and one else None
        row["vs_linear"] = ratio
        goals.append(
            goal(
                f"{row['replicas']} judge replicas / ({row['replicas']} x one)",
                ratio,
                ">=",
                args.linear_goal,
                "one replica's rate, same run",
            )
        )
    judges[0]["vs_linear"] = 1.0
    return {
        "benchmark": "scaleout",
        "params": {
            "cases": args.cases,
            "judge_s": args.judge_s,
            "judge_concurrency": args.judge_concurrency,
            "r3_cases": args.r3_cases,
        },
        "judges": judges,
        "replication": [r1, r3],
        "r3_over_r1": r3["cases_per_s"] / r1["cases_per_s"],
        "goals": goals,
        "ok": all(g.passed for g in goals),
    }


def cli() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--cases", type=int, default=240)
    parser.add_argument("--judge-s", type=float, default=0.25)
    parser.add_argument("--judge-concurrency", type=int, default=4)
    parser.add_argument("--r3-cases", type=int, default=1000)
    parser.add_argument("--linear-goal", type=float, default=0.9)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    add_check_flag(parser)
    args = parser.parse_args()
    out = asyncio.run(main(args))
    table = [("run", "rate /s", "ideal /s", "x linear")]
    for row in out["judges"]:
        table.append(
            (
                f"{row['replicas']} judge replica(s)",
                fmt(row["judged_per_s"]),
                fmt(row["ideal_per_s"]),
                fmt(row["vs_linear"], digits=3),
            )
        )
    for row in out["replication"]:
        table.append((f"end to end, {row['streams']}", fmt(row["cases_per_s"]), "-", "-"))
    notes = [*goal_notes(out["goals"]), f"R3 / R1 end-to-end rate: {out['r3_over_r1']:.3f}"]
    report(out, table, notes, args.json)
    sys.exit(verdict("scaleout", out["goals"], check=args.check))


if __name__ == "__main__":
    cli()
