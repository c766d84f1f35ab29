"""Rule-only re-judging through the judge service (issue 12: "rule judges are not held to a model
provider's concurrency").

Workload: `--cases` (7,000) `case.executed` events of one batch — an answer and an expected value,
three rule judges (exact, regex, contains), as a re-judge replays them — are stored on CASES while
the judge is stopped; then one judge replica (a real process, its defaults) starts and judges
them. The throughput is cases judged per second from its first `case.judged` to its last (start-up
left out). The same workload runs first with the old consumer limit — `JUDGE_MAX_IN_FLIGHT` 4 and
`JUDGE_CONCURRENCY` 8, what every judged case passed through before the provider limit moved out of
the consumer — on the same nats-server in the same run.

Goal: ≥ 1,000 cases/s with the defaults (the issue's figure, ≈ 560/s, was a re-judge through the
whole stack on the shared two cores); every case judged exactly once. Measured alone like this, the
judge already passed 2,111/s under the old limit of 4 in flight (2,217/s with the defaults): on
this machine the judge stage is not what held a rule-only re-judge to 560/s.

With `--through-stack` the same number of cases is also re-judged as a user does it: a finished
batch (a `cat` harness, the same rule judges) re-judged with `POST /v1/batches/{id}/rejudge`
through all five services, timed from the request to the new batch's end (goal ≥ 1,000 cases/s;
measured 1,104/s, 7,000 cases in 6.3 s, the judging inside it 3,140/s, on a quiet machine).

    uv run python bench/rejudge.py [--cases 7000] [--through-stack] [--json] [--check]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
import time
import uuid
from pathlib import Path
from typing import Any

if __package__ in (None, ""):  # run as `python bench/rejudge.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._goals import add_check_flag, goal, goal_notes, verdict
from bench._infra import Infra, pipeline_stack, quiet_logs, running
from bench._report import fmt, report
from nats.aio.msg import Msg

from evalbus_api.client import GatewayClient
from evalbus_api.views import BatchView
from evalbus_contracts import (
    BatchSpec,
    CaseExecuted,
    CasePlan,
    CaseResult,
    CaseSpec,
    CommandHarness,
    ContainsJudge,
    ExactJudge,
    RegexJudge,
    SuiteSpec,
    batch_run_id,
    encode_token,
)
from evalbus_runtime import Publisher, connect

JUDGES = (ExactJudge(id="exact"), RegexJudge(id="digits", pattern=r"^\d+$"), ContainsJudge(id="contains"))
"""Rule judges only: nothing for a provider to limit."""
PUBLISH_CHUNK = 500
"""Events published at once while the workload is stored."""


def executed(batch_id: str, n: int) -> CaseExecuted:
    case_id = f"c{n:05d}"
    run_id = batch_run_id(batch_id, case_id)
    answer = str(n * 7)
    return CaseExecuted(
        batch_id=batch_id,
        case_id=case_id,
        run_id=run_id,
        status="succeeded",
        result=CaseResult(case_id=case_id, run_id=run_id, harness="bench@1", answer=answer),
        plan=CasePlan(judges=JUDGES),
        case=CaseSpec(id=case_id, input=f"what is {n} * 7?", expected=answer),
    )


async def run_once(infra: Infra, name: str, cases: int, env: dict[str, str]) -> dict[str, Any]:
    """Store the workload, start a judge with `env`, time its judging; its figures."""
    batch_id = f"rejudge-{name}-{uuid.uuid4().hex[:6]}"
    nc = await connect(infra.nats_url, f"bench-rejudge-{name}")
    stack = pipeline_stack(infra, name, service_env={"judge": env})
    judged: set[str] = set()
    duplicates = 0
    first = last = 0.0
    done = asyncio.Event()

    async def on_judged(msg: Msg) -> None:
        nonlocal duplicates, first, last
        now = time.monotonic()
        if not judged:
            first = now
        if msg.subject in judged:
            duplicates += 1
        judged.add(msg.subject)
        last = now
        if len(judged) >= cases:
            done.set()

    sub = await nc.subscribe(f"case.judged.{encode_token(batch_id)}.>", cb=on_judged)
    try:
        async with running(stack):
            await asyncio.to_thread(stack.start, "judge")  # creates the streams and its consumer
            await asyncio.to_thread(stack.procs["judge"].process.terminate)
            await asyncio.to_thread(stack.procs["judge"].process.wait, 30)
            publisher = Publisher(nc)
            await publisher.start()
            events = [executed(batch_id, n) for n in range(cases)]
            for i in range(0, cases, PUBLISH_CHUNK):
                await publisher.publish_events(events[i : i + PUBLISH_CHUNK])
            await asyncio.to_thread(stack.start, "judge")
            await asyncio.wait_for(done.wait(), timeout=max(120.0, cases / 20))
            await asyncio.sleep(0.5)  # a late duplicate would land here
    finally:
        await sub.unsubscribe()
        await nc.close()
    span = last - first
    return {
        "name": name,
        "cases": cases,
        "judged": len(judged),
        "duplicates": duplicates,
        "seconds": span,
        "cases_per_s": (len(judged) - 1) / span if span > 0 else float("nan"),
        "env": env,
    }


async def through_stack(infra: Infra, cases: int) -> dict[str, Any]:
    """`POST /v1/batches/{id}/rejudge` of a finished batch through all five services: from the
    request to the new batch's `batch.finalized` (the gateway replays the recorded runs, the judge
    judges, the exporter exports, the recorder stores, the batch finalizes), and the judging span."""
    stack = pipeline_stack(infra, "e2e", service_env={"dispatcher": {"DISPATCHER_SLOTS": "8"}})
    spec = BatchSpec(
        suite=SuiteSpec(
            id="rejudge-e2e",
            cases=tuple(CaseSpec(id=f"c{n:05d}", input=str(n * 7), expected=str(n * 7)) for n in range(cases)),
        ),
        harness=CommandHarness(id="cat", command=("cat",)),
        judges=JUDGES,
    )
    nc = await connect(infra.nats_url, "bench-rejudge-e2e")
    await asyncio.to_thread(stack.start_all)
    try:
        async with running(stack), GatewayClient(stack.gateway_url, stack.admin_token, timeout_s=120) as gw:
            original = (await gw.submit(spec)).batch_id
            await _final(gw, original, timeout_s=max(300.0, cases / 10))
            arrivals: list[tuple[str, float]] = []

            async def on_judged(msg: Msg) -> None:  # every batch's: the new id is known only after
                arrivals.append((msg.subject, time.monotonic()))

            sub = await nc.subscribe("case.judged.>", cb=on_judged, pending_msgs_limit=-1, pending_bytes_limit=-1)
            await nc.flush()
            began = time.monotonic()
            again = (await gw.rejudge(original)).batch_id
            view = await _final(gw, again, timeout_s=max(300.0, cases / 10))
            finished = time.monotonic()
            await sub.unsubscribe()
    finally:
        await nc.close()
    prefix = f"case.judged.{encode_token(again)}."
    times = [t for subject, t in arrivals if subject.startswith(prefix)]
    judged = len(times)
    span = max(times) - min(times) if judged > 1 else 0.0
    return {
        "name": "through the stack",
        "cases": cases,
        "status": view.status,
        "judged": judged,
        "seconds": finished - began,
        "cases_per_s": cases / (finished - began),
        "judging_cases_per_s": (judged - 1) / span if span > 0 else float("nan"),
    }


async def _final(gw: GatewayClient, batch_id: str, *, timeout_s: float) -> BatchView:
    deadline = time.monotonic() + timeout_s
    async for event in gw.events(batch_id):
        if event.event == "end" or time.monotonic() > deadline:
            break
    return await gw.get(batch_id)


async def main(args: argparse.Namespace) -> int:
    quiet_logs()
    async with Infra(database=True, prefix="evalbus-bench-rejudge-") as infra:
        old = await run_once(infra, "old-limit", args.cases, {"JUDGE_MAX_IN_FLIGHT": "4", "JUDGE_CONCURRENCY": "8"})
        new = await run_once(infra, "defaults", args.cases, {})
        e2e = await through_stack(infra, args.cases) if args.through_stack else None
    goals = [
        goal("rule-only re-judge cases/s", new["cases_per_s"], ">=", 1000.0, "fixed (issue 12)"),
        goal("cases judged", float(new["judged"]), "==", float(args.cases), "every case of the batch"),
        goal("cases judged twice", float(new["duplicates"]), "==", 0.0, "exact"),
    ]
    if e2e is not None:
        goals += [
            goal(
                "re-judge through the stack cases/s", e2e["cases_per_s"], ">=", 1000.0, "request → finalized (issue 12)"
            ),
            goal("re-judged cases through the stack", float(e2e["judged"]), "==", float(args.cases), "exact"),
        ]
    out = {
        "benchmark": "rejudge",
        "cases": args.cases,
        "runs": [old, new],
        "through_stack": e2e,
        "speedup": new["cases_per_s"] / old["cases_per_s"],
        "goals": goals,
        "ok": all(g.passed for g in goals),
    }
    rows = [("run", "cases/s", "seconds", "judged", "twice")]
    for r in (old, new):
        rows.append(
            (r["name"], fmt(r["cases_per_s"], digits=0), fmt(r["seconds"]), str(r["judged"]), str(r["duplicates"]))
        )
    if e2e is not None:
        rows.append(
            (
                "rejudge through the stack (request → finalized)",
                fmt(e2e["cases_per_s"], digits=0),
                fmt(e2e["seconds"]),
                str(e2e["judged"]),
                "-",
            )
        )
        rows.append(
            ("  of which judging (first → last case.judged)", fmt(e2e["judging_cases_per_s"], digits=0), "-", "-", "-")
        )
    notes = [f"defaults / old limit: {out['speedup']:.2f}×", *goal_notes(goals)]
    report(out, rows, notes, args.json)
    return verdict("rejudge", goals, check=args.check)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", type=int, default=7000, help="cases re-judged per run")
    parser.add_argument(
        "--through-stack",
        action="store_true",
        help="also re-judge a finished batch of as many cases through all five services (POST /v1/batches/{id}/rejudge)",
    )
    parser.add_argument("--json", action="store_true", help="print only the JSON line")
    add_check_flag(parser)
    return parser.parse_args(argv)


if __name__ == "__main__":
    sys.exit(asyncio.run(main(parse())))
