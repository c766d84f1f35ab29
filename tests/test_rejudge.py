"""Re-judging end to end: the five services as real processes. A small batch runs once; `evalbus
rejudge` with another judge set creates a batch that finalizes with the new judges' scores and the
old grader scores, while nothing is executed again: no `case.requested` is published for it and
the harness (which counts its own invocations) is not started."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from pathlib import Path

import asyncpg
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.testing.stack import ServiceStack
from evalbus_contracts import (
    AnswerMatchGrader,
    BatchSpec,
    CaseSpec,
    CommandHarness,
    ContainsJudge,
    ExactJudge,
    Measured,
    RegexJudge,
    StepsGrader,
    SuiteSpec,
    encode_token,
    to_builtins,
)
from evalbus_runtime import connect

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

AGENT = Path(__file__).resolve().parents[1] / "examples" / "agent.py"
CASES = {"math-01": ("What is 17 * 23?", "391"), "capital-03": ("What is the capital of Australia?", "Canberra")}


def counting_spec(counter: Path) -> BatchSpec:
    """Two example cases; the harness appends its run id to `counter` before running the demo agent."""
    script = f'echo "$EVALBUS_RUN_ID" >> {counter}; exec python3 {AGENT}'
    graders = (AnswerMatchGrader(id="answer"), StepsGrader(id="steps"))
    return BatchSpec(
        suite=SuiteSpec(
            id="rejudge-e2e",
            cases=tuple(CaseSpec(id=c, input=i, expected=e, graders=graders) for c, (i, e) in CASES.items()),
        ),
        harness=CommandHarness(id="counting-agent", command=("sh", "-c", script), timeout_s=30),
        judges=(ExactJudge(id="exact"),),
    )


async def finish(stack: ServiceStack, batch_id: str) -> str:
    """Follow a batch's events to its end; its final status."""
    status = ""
    async with stack.client() as gw:
        async for event in gw.events(batch_id):
            if event.event == "end":
                status = json.loads(event.data)["status"]
    return status


async def requested_on_stream(nats_url: str, batch_id: str) -> int:
    nc: NatsClient = await connect(nats_url, "test-rejudge")
    try:
        info = await nc.jetstream().stream_info("CASES", subjects_filter=f"case.requested.{encode_token(batch_id)}.>")
    finally:
        await nc.close()
    return sum((info.state.subjects or {}).values())


async def recorded_types(database_url: str, batch_id: str) -> list[str]:
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch("SELECT type FROM events WHERE batch_id = $1 ORDER BY stream_seq", batch_id)
    finally:
        await conn.close()
    return [str(r["type"]) for r in rows]


async def test_rejudge_judges_again_without_executing(service_stack: ServiceStack, tmp_path: Path) -> None:
    stack = service_stack
    stack.start_all()
    counter = tmp_path / "invocations"
    async with stack.client() as gw:
        old = (await gw.submit(counting_spec(counter))).batch_id
    assert await finish(stack, old) == "succeeded"
    assert sorted(counter.read_text().split()) == sorted(f"evb-{old}-{c}" for c in CASES)
    async with stack.client() as gw:
        old_runs = {r.case_id: r for r in await gw.all_cases(old)}

    judges = [to_builtins(ContainsJudge(id="contains")), to_builtins(RegexJudge(id="digits", pattern=r"^\d+$"))]
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVALBUS_")}
    command = [sys.executable, "-m", "evalbus.cli", "rejudge", old, "--json", "--judges", json.dumps(judges)]
    command += ["--gateway", stack.gateway_url, "--token", stack.admin_token]
    done = await asyncio.to_thread(subprocess.run, command, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    [line] = done.stdout.splitlines()
    doc = json.loads(line)
    new = doc["batch_id"]
    assert new != old
    assert (doc["status"], doc["rejudge_of"]) == ("succeeded", old)
    metrics = {m["metric"]: m for m in doc["summary"]["metrics"]}
    assert "judge:exact" not in metrics
    assert metrics["judge:contains"]["count"] == 2
    assert metrics["judge:contains"]["pass_rate"] == 0.5
    assert metrics["judge:digits"]["pass_rate"] == 0.5
    assert doc["summary"]["counts"].get("requested", 0) == 0
    assert doc["summary"]["counts"]["exported"] == 2

    async with stack.client() as gw:
        new_runs = {r.case_id: r for r in await gw.all_cases(new)}
    assert set(new_runs) == set(CASES)
    for case_id, run in new_runs.items():
        before = old_runs[case_id]
        assert run.run_id == f"evb-{new}-{case_id}"
        assert run.answer == before.answer
        graders = [s for s in run.scores if s.source == "grader"]
        assert graders == [s for s in before.scores if s.source == "grader"]
        judged = [(s.metric, s.passed if isinstance(s, Measured) else None) for s in run.scores if s.source == "judge"]
        right = case_id == "math-01"
        assert judged == [("judge:contains", right), ("judge:digits", right)]

    # Nothing was executed again.
    assert sorted(counter.read_text().split()) == sorted(f"evb-{old}-{c}" for c in CASES)
    assert await requested_on_stream(stack.nats_url, new) == 0
    assert await requested_on_stream(stack.nats_url, old) == 2
    types = await recorded_types(stack.database_url, new)
    assert "case.requested" not in types
    assert sorted(types) == sorted(
        ["batch.requested", "batch.finalized"] + ["case.executed", "case.judged", "case.exported"] * 2
    )
