"""`evalbus run` end to end: the five services as real processes, the command as a real
subprocess. A few cases of the example suite (the demo agent next to the suite file, so its
relative path is resolved) run to a scorecard whose counts match the cases; `--json` prints one
line and nothing else; a cancelled batch exits 1; `--no-wait` only submits."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from evalbus.testing.chat_server import ChatCompletionsServer
from evalbus.testing.stack import ServiceStack
from evalbus_contracts import encode

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
CASES = ("math-01", "capital-03", "count-02")
"""The agent answers the first right and the other two wrong (on purpose)."""


def small_suite(folder: Path, cases: tuple[str, ...] = CASES, **harness: Any) -> Path:
    """A suite of a few example cases in `folder`, with the demo agent copied next to it. The
    tests-pass grader is dropped, so the answer-match grader (objective) decides the verdict."""
    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(EXAMPLES / "agent.py", folder / "agent.py")
    doc = yaml.safe_load((EXAMPLES / "suite.yaml").read_text())
    chosen = [c for c in doc["suite"]["cases"] if c["id"] in cases]
    for case in chosen:
        case["graders"] = [g for g in case["graders"] if g["kind"] != "tests-pass"]
    doc["suite"]["cases"] = chosen
    doc["suite"]["id"] = "cli-run"
    doc["harness"].update(harness)
    doc["sinks"] = [{"kind": "jsonl", "path": "{batch}.jsonl"}]
    path = folder / "suite.yaml"
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


def cli_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVALBUS_")}
    env["EVALBUS_DIR"] = "/nonexistent-evalbus-dir"  # nothing may come from a local stack
    return env


async def evalbus(
    stack: ServiceStack, *args: str, cwd: Path, timeout_s: float = 120.0
) -> subprocess.CompletedProcess[str]:
    """Run the command (in a thread: the test's event loop stays free)."""
    command = [sys.executable, "-m", "evalbus.cli", *args, "--gateway", stack.gateway_url, "--token", stack.admin_token]
    return await asyncio.to_thread(
        subprocess.run, command, cwd=cwd, env=cli_env(), capture_output=True, text=True, timeout=timeout_s
    )


@pytest.fixture
def stack(service_stack: ServiceStack) -> ServiceStack:
    service_stack.start_all()
    return service_stack


async def test_run_json_summary_matches_the_cases(stack: ServiceStack, tmp_path: Path) -> None:
    suite = small_suite(tmp_path / "suite")
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    done = await evalbus(stack, "run", str(suite), "--json", cwd=elsewhere)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout
    doc = json.loads(lines[0])
    assert set(doc) == {"batch_id", "status", "summary"}
    assert doc["status"] == "succeeded"
    summary = doc["summary"]
    counts = summary["counts"]
    assert (counts["requested"], counts["executed"], counts["judged"], counts["exported"]) == (3, 3, 3, 3)
    verdicts = summary["verdicts"]
    assert (verdicts["passed"], verdicts["failed"]) == (1, 2)
    assert verdicts["passed"] + verdicts["failed"] + verdicts.get("no_verdict", 0) == len(CASES)
    metrics = {m["metric"]: m for m in summary["metrics"]}
    assert metrics["answer_match"]["count"] == 3
    assert metrics["answer_match"]["pass_rate"] == pytest.approx(1 / 3)
    assert metrics["judge:rubric"]["unmeasured"] == {"unsupported": 3}

    async with stack.client() as gw:
        view, runs = await gw.get(doc["batch_id"]), await gw.all_cases(doc["batch_id"])
    assert view.summary is not None
    assert summary == json.loads(encode(view.summary))
    assert sorted(r.case_id for r in runs) == sorted(CASES)
    assert all(r.executed_status == "succeeded" for r in runs)  # the agent path was resolved


async def test_init_writes_an_evaluation_that_runs_as_is(stack: ServiceStack, tmp_path: Path) -> None:
    folder = tmp_path / "first"
    made = await asyncio.to_thread(
        subprocess.run, [sys.executable, "-m", "evalbus.cli", "init", str(folder)], env=cli_env(),
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert made.returncode == 0, made.stderr
    done = await evalbus(stack, "run", "suite.yaml", "--json", "--fail-on-run-errors", cwd=folder)
    assert done.returncode == 0, done.stderr
    assert "warning" not in done.stderr
    doc = json.loads(done.stdout.splitlines()[-1])
    assert doc["status"] == "succeeded"
    verdicts = doc["summary"]["verdicts"]
    assert (verdicts["passed"], verdicts["failed"]) == (4, 1)  # the capital is not arithmetic
    assert doc["summary"]["counts"]["exported"] == 5


async def test_a_harness_that_cannot_start_is_warned_of_and_fails_the_batch_saying_why(
    stack: ServiceStack, tmp_path: Path
) -> None:
    suite = small_suite(tmp_path / "suite", command=["/no/such/agent"])
    done = await evalbus(stack, "run", str(suite), "--fail-on-run-errors", cwd=tmp_path)
    assert done.returncode == 1, done.stdout + done.stderr  # failed (which comes before a run error's 4)
    assert "warning: the harness program '/no/such/agent' does not exist" in done.stderr
    lines = done.stdout.splitlines()
    status = next(line for line in lines if line.startswith("status    "))
    assert status.startswith(
        "status    failed: no_run_executed: no run executed; 3 of 3 failed before their harness ran"
    )
    assert "spawn_failed: cannot start '/no/such/agent'" in status
    assert "failed cases (3 of 3)" in lines
    shown = [line for line in lines if "spawn_failed (config, run): cannot start '/no/such/agent'" in line]
    assert len(shown) == 3
    async with stack.client() as gw:
        batch_id = next(line.split()[1].rstrip(":") for line in lines if line.startswith("batch b"))
        runs = await gw.all_cases(batch_id)
    assert all(r.judged_status == "skipped" and r.scores == () and r.verdict is None for r in runs)  # not graded


async def test_run_draws_progress_then_the_scorecard(stack: ServiceStack, tmp_path: Path) -> None:
    suite = small_suite(tmp_path / "suite")
    done = await evalbus(stack, "run", str(suite), cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    lines = done.stdout.splitlines()
    batch_id = lines[0].split()[1].rstrip(":")
    assert lines[0].startswith(f"batch {batch_id}: cli-run, 3 runs")
    progress = [line for line in lines if line.startswith("[") and "s] " in line]
    assert progress, done.stdout
    assert progress[-1].endswith("requested 3/3  executed 3/3  judged 3/3  exported 3/3")
    assert "\x1b" not in done.stdout  # not a terminal: plain lines, no redrawing
    assert f"batch {batch_id}  suite cli-run  3 runs  status succeeded" in lines
    assert any(line.startswith("answer_match ") for line in lines)
    assert "verdicts  1 passed, 2 failed, 0 without a verdict (pass rate 33.3%, 95% CI 6.1–79.2%)" in lines
    assert any(line.startswith("export    succeeded: 3 exported, 0 failed  file://") for line in lines)
    assert "failed cases (2 of 3)" in lines
    capital = next(line for line in lines if line.strip().startswith("capital-03"))
    assert "'Canberra'" in capital
    assert "verdict fail (objective)" in capital

    # `tail` of the settled batch replays its events from the first one and ends at once.
    tail = await evalbus(stack, "tail", batch_id, cwd=tmp_path)
    assert tail.returncode == 0, tail.stderr
    rows = tail.stdout.splitlines()
    types = [row.split()[1] for row in rows[:-1]]
    assert types[0] == "batch.requested"
    assert types[-1] == "batch.finalized"
    assert sorted(types[1:-1]) == sorted(["case.requested", "case.executed", "case.judged", "case.exported"] * 3)
    assert rows[-1] == f"end: batch {batch_id} succeeded"
    as_json = await evalbus(stack, "tail", batch_id, "--json", cwd=tmp_path)
    events = [json.loads(row) for row in as_json.stdout.splitlines()]
    assert [e["type"] for e in events[:-1]] == types
    assert events[-1]["event"] == {"batch_id": batch_id, "status": "succeeded"}
    later = await evalbus(stack, "tail", batch_id, "--json", "--after", str(events[-3]["seq"]), cwd=tmp_path)
    assert [json.loads(row)["type"] for row in later.stdout.splitlines()] == [types[-1], "end"]


async def test_run_of_a_cancelled_batch_exits_1(stack: ServiceStack, tmp_path: Path) -> None:
    slow = tmp_path / "suite"
    suite = small_suite(slow, command=["python3", "slow_agent.py"], timeout_s=30)
    (slow / "slow_agent.py").write_text("import time\ntime.sleep(1.5)\nprint('done')\n")
    command = [sys.executable, "-m", "evalbus.cli", "run", str(suite)]
    command += ["--gateway", stack.gateway_url, "--token", stack.admin_token]
    proc = await asyncio.create_subprocess_exec(
        *command, env=cli_env(), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE
    )
    assert proc.stdout is not None
    first = (await asyncio.wait_for(proc.stdout.readline(), 60)).decode()
    batch_id = first.split()[1].rstrip(":")
    async with stack.client() as gw:
        await gw.cancel(batch_id)
    stdout, stderr = await asyncio.wait_for(proc.communicate(), 120)
    out, err = stdout.decode(), stderr.decode()
    assert proc.returncode == 1, err
    assert "status    cancelled (by admin)" in out.splitlines()


async def test_run_no_wait_only_submits(stack: ServiceStack, tmp_path: Path) -> None:
    """`--no-wait` returns once the batch is accepted: its one case is held until the command has
    returned, so a command that waited for the batch would never return."""
    folder = tmp_path / "suite"
    go = tmp_path / "go"
    suite = small_suite(folder, cases=("math-01",), command=["python3", "gated_agent.py"], timeout_s=90)
    (folder / "gated_agent.py").write_text(
        f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\nprint('done')\n"
    )
    done = await evalbus(stack, "run", str(suite), "--json", "--no-wait", cwd=tmp_path, timeout_s=60)
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert (doc["status"], doc["summary"]) == ("queued", None)
    go.touch()
    async with stack.client() as gw:

        async def end_status() -> str | None:
            async for event in gw.events(doc["batch_id"]):
                if event.event == "end":
                    return str(json.loads(event.data)["status"])
            return None

        assert await asyncio.wait_for(end_status(), 120) == "succeeded"


async def test_cancel_stops_a_batch_and_refuses_a_finished_or_unknown_one(stack: ServiceStack, tmp_path: Path) -> None:
    folder = tmp_path / "suite"
    go = tmp_path / "go"
    suite = small_suite(folder, cases=("math-01", "math-02"), command=["python3", "gated_agent.py"], timeout_s=90)
    (folder / "gated_agent.py").write_text(
        f"import os, time\nwhile not os.path.exists({str(go)!r}):\n    time.sleep(0.05)\nprint('done')\n"
    )
    submitted = await evalbus(stack, "run", str(suite), "--json", "--no-wait", cwd=tmp_path, timeout_s=60)
    assert submitted.returncode == 0, submitted.stderr
    batch_id = json.loads(submitted.stdout)["batch_id"]
    cancelled = await evalbus(stack, "cancel", batch_id, cwd=tmp_path)
    assert cancelled.returncode == 0, cancelled.stderr
    assert f"batch {batch_id} cancelling (cancelled)" in cancelled.stdout
    go.touch()  # what was in flight settles
    waited = await evalbus(stack, "cancel", batch_id, "--wait", "--json", cwd=tmp_path)  # may race the end
    if waited.returncode == 0:
        assert json.loads(waited.stdout.splitlines()[-1])["status"] == "cancelled"
    else:
        assert "409 conflict" in waited.stderr
    again = await evalbus(stack, "cancel", batch_id, cwd=tmp_path)
    assert again.returncode == 1
    assert "409 conflict at batch_id" in again.stderr
    unknown = await evalbus(stack, "cancel", "bnosuchbatch0", cwd=tmp_path)
    assert unknown.returncode == 1
    assert "404 not_found" in unknown.stderr


async def test_run_against_no_gateway_exits_1(tmp_path: Path) -> None:
    suite = small_suite(tmp_path / "suite", cases=("math-01",))
    command = [
        sys.executable,
        "-m",
        "evalbus.cli",
        "run",
        str(suite),
        "--gateway",
        "http://127.0.0.1:9",
        "--token",
        "t",
    ]
    done = await asyncio.to_thread(subprocess.run, command, env=cli_env(), capture_output=True, text=True, timeout=60)
    assert done.returncode == 1
    assert "unreachable" in done.stderr
    assert done.stdout == ""

    # no stack where it looks: it says how to point at one, not only to start another
    away = [sys.executable, "-m", "evalbus.cli", "run", str(suite)]
    env = {**cli_env(), "EVALBUS_DIR": str(tmp_path / "no-stack-here")}
    lost = await asyncio.to_thread(
        subprocess.run, away, env=env, capture_output=True, text=True, timeout=60, cwd=tmp_path
    )
    assert lost.returncode == 1
    assert f"evalbus is not up in {tmp_path / 'no-stack-here'}: point at the folder of a running stack" in lost.stderr
    assert "--dir DIR or $EVALBUS_DIR" in lost.stderr


async def test_the_model_judges_cost_is_accounted_beside_the_agents(stack: ServiceStack, tmp_path: Path) -> None:
    """The example's model judge pointed at the local chat server (10 + 5 tokens a call) with a
    price of $100 per million tokens: the batch summary's `judge_usage` (`GET /v1/batches/{id}`)
    holds 3 calls, 30 + 15 tokens and $0.0045, each judge score its own usage, and the scorecard
    prints it beside the agent's own cost."""
    provider = ChatCompletionsServer()
    await provider.start()
    try:
        suite = small_suite(tmp_path / "suite")
        doc = yaml.safe_load(suite.read_text())
        [rubric] = [j for j in doc["judges"] if j["kind"] == "model"]
        rubric.pop("api_key_secret")  # the local server takes no key (a key would go to an untrusted URL)
        rubric.update(base_url=f"{provider.root}/v1", price={"input_per_mtok": 100.0, "output_per_mtok": 100.0})
        suite.write_text(yaml.safe_dump(doc, sort_keys=False))
        done = await evalbus(stack, "run", str(suite), cwd=tmp_path)
        assert done.returncode == 0, done.stderr
        lines = done.stdout.splitlines()
        batch_id = lines[0].split()[1].rstrip(":")
        assert len(provider.requests) == 3, done.stdout
        async with stack.client() as gw:
            view, runs = await gw.get(batch_id), await gw.all_cases(batch_id)
        assert view.summary is not None
        usage = view.summary.judge_usage
        assert usage is not None
        assert (usage.calls, usage.input_tokens, usage.output_tokens, usage.unpriced_calls) == (3, 30, 15, 0)
        assert usage.cost_usd == pytest.approx(0.0045)
        for run in runs:
            [score] = [s for s in run.scores if s.metric == "judge:rubric"]
            assert score.usage is not None
            assert (score.usage.input_tokens, score.usage.output_tokens, score.usage.cost_source) == (10, 5, "price")
        agent_cost = next(m for m in view.summary.metrics if m.metric == "cost_usd")
        assert agent_cost.mean is not None
        [cost] = [line for line in lines if line.startswith("cost ")]
        assert cost.startswith("cost      agent $")
        assert cost.endswith("(cost_usd over 3 runs)  judges $0.0045 (3 model calls, 30 in / 15 out tokens)")
        shown = float(cost.removeprefix("cost      agent $").split()[0])
        assert shown == pytest.approx(agent_cost.mean * agent_cost.count, rel=0.01)  # the agent's total, 3 digits
    finally:
        await provider.stop()
