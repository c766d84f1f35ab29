"""Rolling upgrade from an older build, under traffic: is a cross-version roll safe?

Workload (issue 11, "Rolling upgrades … proven"): two replicas of every service run an OLDER build
of evalbus (`--from`, a git revision, checked out into a worktree and run from its sources) on one
nats-server and database; batches (`--cases` cases each, the example agent's cheap `cat` harness
and a rule judge) are submitted every `--every-s` seconds through whichever gateway answers; and
one service after another — readers before writers: gateway, exporter, judge, collector,
dispatcher — has each old replica replaced by one of THIS build (new process ready, then the old
one SIGTERMed). Then every batch is read back through a gateway of this build.

Goals: every batch `succeeded`; every run exactly once per stage in the event store (0 lost, 0
duplicated); every trajectory sealed and intact; nothing dead-lettered.

    uv run python bench/upgrade.py [--from ec91e04] [--cases 8] [--every-s 1] [--json] [--check]

Needs the repository's history (a clone, not an archive). The older build runs on this
environment's dependencies, which works while its requirements are a subset of today's.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import uuid
from collections import Counter
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/upgrade.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asyncpg
from bench._goals import add_check_flag, goal, goal_notes, verdict
from bench._infra import REPO_ROOT, Infra, pipeline_stack, quiet_logs, running
from bench._report import report

from evalbus.testing.stack import SERVICES, ServiceStack
from evalbus_api.client import ApiRequestError, GatewayClient
from evalbus_contracts import BatchSpec, CaseSpec, CommandHarness, ExactJudge, SuiteSpec, batch_run_id
from evalbus_gateway.database import create_pool
from evalbus_gateway.store import verify_batch
from evalbus_runtime import connect

STAGES = ("case.requested", "case.executed", "case.judged", "case.exported")
ROLL_ORDER = ("gateway", "exporter", "judge", "collector", "dispatcher")
EXCLUSIVE_SINCE_2026_12_07 = ("exporter", "judge", "collector", "dispatcher")
"""The services whose case (and fan-out) consumers' ack wait went from 10 s to 4 s with their
exclusive stages."""


def old_build(revision: str, into: Path) -> dict[str, str]:
    """Check `revision` out into `into`; the PYTHONPATH that runs its services from there."""
    subprocess.run(
        ["git", "-C", str(REPO_ROOT), "worktree", "add", "--detach", str(into), revision],
        check=True,
        capture_output=True,
    )
    paths = [*sorted((into / "libs").glob("*/src")), *sorted((into / "services").glob("*/src")), into / "src"]
    return {"PYTHONPATH": os.pathsep.join(str(p) for p in paths)}


def remove_worktree(path: Path) -> None:
    subprocess.run(
        ["git", "-C", str(REPO_ROOT), "worktree", "remove", "--force", str(path)], check=False, capture_output=True
    )


def suite(cases: int) -> BatchSpec:
    return BatchSpec(
        suite=SuiteSpec(
            id="upgrade",
            cases=tuple(CaseSpec(id=f"c{i:02d}", input=f"a{i}", expected=f"a{i}") for i in range(cases)),
        ),
        harness=CommandHarness(id="cat", command=("cat",)),
        judges=(ExactJudge(id="exact"),),
    )


async def submit_anywhere(stack: ServiceStack, spec: BatchSpec) -> str:
    """Through whichever gateway replica answers, one idempotency key for every try."""
    key = uuid.uuid4().hex
    last: Exception | None = None
    for _ in range(5):
        for name, proc in list(stack.procs.items()):
            if not name.startswith("gateway") or proc.process.poll() is not None:
                continue
            async with GatewayClient(proc.url, stack.admin_token, timeout_s=10) as gw:
                try:
                    return (await gw.submit(spec, idempotency_key=key)).batch_id
                except ApiRequestError as e:
                    if e.status not in (0, 502, 503):
                        raise
                    last = e
        await asyncio.sleep(0.2)
    raise RuntimeError(f"no gateway took the batch: {last}")


async def replace(stack: ServiceStack, old: str, new: str, env: dict[str, str]) -> None:
    # a replica inherits its service's environment (the old build's PYTHONPATH): the new one is
    # this checkout's, as the bench itself runs it
    stack.service_env[new] = {"PYTHONPATH": os.environ.get("PYTHONPATH", ""), **env}
    await asyncio.to_thread(stack.start, new)
    await asyncio.to_thread(stack.kill, old, signal.SIGTERM)


async def main(args: argparse.Namespace) -> dict[str, Any]:
    quiet_logs()
    async with Infra(database=True, prefix="evalbus-bench-upgrade-") as infra:
        old_env = await asyncio.to_thread(old_build, args.from_rev, infra.workdir / "old-build")
        try:
            stack = pipeline_stack(infra, "upgrade")
            stack.env.pop("PYTHONPATH", None)
            for s in SERVICES:
                stack.service_env[s] = dict(old_env)
                stack.service_env[f"{s}@2"] = dict(old_env)
            await asyncio.to_thread(stack.start_all, [*SERVICES, *(f"{s}@2" for s in SERVICES)])
            async with running(stack):
                batches: list[str] = []
                rolled_out = asyncio.Event()

                async def traffic() -> None:
                    while not rolled_out.is_set():
                        batches.append(await submit_anywhere(stack, suite(args.cases)))
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(rolled_out.wait(), args.every_s)

                sender = asyncio.create_task(traffic())
                try:
                    for s in ROLL_ORDER:
                        # docs/deploy.md, "Upgrading": from a build before the exclusive case
                        # stages, the new case services keep the old 10 s ack wait while old
                        # replicas run (they touch what they hold only every 4 s)
                        env = {"ACK_WAIT_S": "10"} if s in EXCLUSIVE_SINCE_2026_12_07 else {}
                        await replace(stack, f"{s}@2", f"{s}@3", env)
                        await replace(stack, s, f"{s}@4", env)
                finally:
                    rolled_out.set()
                    await sender
                gateway = stack.procs["gateway@3"]
                results = []
                async with GatewayClient(gateway.url, stack.admin_token, timeout_s=60) as gw:
                    for batch_id in batches:
                        async for event in gw.events(batch_id):
                            if event.event == "end":
                                break
                        results.append((batch_id, (await gw.get(batch_id)).status))
                pool = await create_pool(infra.database_url, min_size=1, max_size=2)
                try:
                    checks = [await check(pool, batch_id, args.cases) for batch_id, _ in results]
                finally:
                    await pool.close()
                letters = await dead_letters(infra.nats_url, infra.database_url)
        finally:
            await asyncio.to_thread(remove_worktree, infra.workdir / "old-build")
    succeeded = sum(status == "succeeded" for _, status in results)
    lost = sum(c["lost"] for c in checks)
    duplicated = sum(c["duplicated"] for c in checks)
    sealed = sum(c["sealed"] for c in checks)
    goals = [
        goal("batches succeeded", float(succeeded), "==", float(len(results)), "every batch submitted"),
        goal("runs lost", float(lost), "==", 0, "exact (event store)"),
        goal("runs duplicated", float(duplicated), "==", 0, "exact (event store)"),
        goal("runs sealed and intact", float(sealed), "==", float(len(results) * args.cases), "verify_batch"),
        goal(
            "dead letters and refused events", float(letters), "==", 0, "the DLQ stream and the recorder's rejections"
        ),
    ]
    return {
        "benchmark": "upgrade",
        "from": args.from_rev,
        "batches": len(results),
        "cases": len(results) * args.cases,
        "replacements": 2 * len(ROLL_ORDER),
        "succeeded": succeeded,
        "lost": lost,
        "duplicated": duplicated,
        "sealed": sealed,
        "goals": goals,
        "ok": all(g.passed for g in goals),
    }


async def check(pool: Any, batch_id: str, cases: int) -> dict[str, int]:
    rows = await pool.fetch(
        "SELECT run_id, type, count(*) AS n FROM events WHERE batch_id = $1 GROUP BY run_id, type", batch_id
    )
    have = Counter({(r["run_id"], r["type"]): int(r["n"]) for r in rows if r["type"] in STAGES})
    runs = {batch_run_id(batch_id, f"c{i:02d}") for i in range(cases)}
    want = Counter({(r, s): 1 for r in runs for s in STAGES})
    verified = await verify_batch(pool, batch_id)
    return {
        "lost": sum((want - have).values()),
        "duplicated": sum((have - want).values()),
        "sealed": int(verified.ok_count),
    }


async def dead_letters(nats_url: str, database_url: str) -> int:
    """Messages in the DLQ stream plus events the recorder refused."""
    nc = await connect(nats_url, "bench-upgrade")
    try:
        letters = int((await nc.jetstream().stream_info("DLQ")).state.messages)
    finally:
        await nc.close()
    conn = await asyncpg.connect(database_url)
    try:
        return letters + int(await conn.fetchval("SELECT count(*) FROM rejections"))
    finally:
        await conn.close()


def cli() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--from", dest="from_rev", default="ec91e04", help="the older build (a git revision)")
    parser.add_argument("--cases", type=int, default=8)
    parser.add_argument("--every-s", type=float, default=1.0)
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    add_check_flag(parser)
    args = parser.parse_args()
    out = asyncio.run(main(args))
    table = [
        ("from", "batches", "cases", "replacements", "succeeded", "lost", "duplicated", "sealed"),
        tuple(
            str(out[k])
            for k in ("from", "batches", "cases", "replacements", "succeeded", "lost", "duplicated", "sealed")
        ),
    ]
    report(out, table, goal_notes(out["goals"]), args.json)
    sys.exit(verdict("upgrade", out["goals"], check=args.check))


if __name__ == "__main__":
    cli()
