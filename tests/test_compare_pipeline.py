"""Deciding with the results, end to end: the five services as real processes, the `evalbus`
command as a real subprocess. One deterministic suite runs twice — the adder agent as it is, then
with a bug that answers 8 of its 12 cases wrong — and:

- `evalbus baseline set` makes the first batch the suite's baseline (a superseded batch is refused);
- `evalbus compare` finds the regression significant (exact McNemar on the 8 discordant pairs,
  q < 0.05), lists the 8 regressed cases with both answers, and cost unchanged;
- `evalbus run --gate …` exits 3 when a gate fails (regression against the baseline, a pass rate
  threshold), prints each gate with what it measured, and exits 0 when every gate passes;
- a gate on a metric the suite does not measure fails with the reason instead of passing;
- a gate that does not parse exits 2 before anything is submitted;
- `--junit` and `--summary-md` write a test case per run and per gate, and a Markdown summary.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import uuid
import xml.etree.ElementTree as ET
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from evalbus.testing.pipeline import Pipeline, open_pipeline

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ADDER = """\
import json, os, sys
task = json.loads(sys.stdin.read())
a, b = task["a"], task["b"]
answer = a + b
if os.environ.get("ADDER_BUG") == "1" and a >= 4:
    answer += 1  # the regression: off by one from 4 on
print("EVALBUS_EVENT " + json.dumps({"kind": "llm_call", "t": 0.0, "model": "adder", "input_tokens": 10,
      "output_tokens": 2, "cost_usd": 0.001}), flush=True)
print("EVALBUS_RESULT " + json.dumps({"answer": str(answer)}), flush=True)
"""
CASES = [f"add-{a:02d}" for a in range(12)]
REGRESSED = CASES[4:]


def write_suite(folder: Path, suite_id: str, *, bug: bool, gates: list[Any] | None = None) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "adder.py").write_text(ADDER)
    doc: dict[str, Any] = {
        "suite": {
            "id": suite_id,
            "cases": [
                {
                    "id": case,
                    "input": json.dumps({"a": a, "b": 1}),
                    "expected": str(a + 1),
                    "graders": [{"kind": "answer-match", "id": "answer"}, {"kind": "cost", "id": "cost"}],
                }
                for a, case in enumerate(CASES)
            ],
        },
        "harness": {
            "id": "adder",
            "command": [sys.executable, "adder.py"],
            "env": {"ADDER_BUG": "1" if bug else "0"},
            "timeout_s": 60,
        },
    }
    if gates:
        doc["gates"] = gates
    path = folder / ("buggy.yaml" if bug else "suite.yaml")
    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return path


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    async with open_pipeline(pg_admin_url, tmp_path_factory.mktemp("compare-pipeline")) as p:
        yield p


async def evalbus(p: Pipeline, *args: str, cwd: Path) -> subprocess.CompletedProcess[str]:
    """The command as a subprocess against the pipeline's gateway (in a thread: the loop stays free)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVALBUS_")}
    env["EVALBUS_DIR"] = "/nonexistent-evalbus-dir"
    command = [
        sys.executable,
        "-m",
        "evalbus.cli",
        *args,
        "--gateway",
        p.stack.gateway_url,
        "--token",
        p.stack.admin_token,
    ]
    return await asyncio.to_thread(
        subprocess.run, command, cwd=cwd, env=env, capture_output=True, text=True, timeout=180
    )


def one_json(done: subprocess.CompletedProcess[str]) -> dict[str, Any]:
    lines = done.stdout.splitlines()
    assert len(lines) == 1, done.stdout + done.stderr
    doc: dict[str, Any] = json.loads(lines[0])
    return doc


async def test_a_regression_is_found_compared_and_gated(pipeline: Pipeline, tmp_path: Path) -> None:
    suite_id = f"adder-{uuid.uuid4().hex[:6]}"
    good = write_suite(tmp_path, suite_id, bug=False)
    buggy = write_suite(tmp_path, suite_id, bug=True)

    # The baseline run: every case right.
    done = await evalbus(pipeline, "run", str(good), "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    base = one_json(done)
    assert base["summary"]["verdicts"]["passed"] == 12
    base_id = base["batch_id"]

    # Without a baseline, a regression gate fails (it never passes vacuously).
    done = await evalbus(
        pipeline, "run", str(good), "--gate", "no_significant_regression: answer_match", "--json", cwd=tmp_path
    )
    assert done.returncode == 3, done.stdout + done.stderr
    [gate] = one_json(done)["gates"]
    assert gate["passed"] is False
    assert f"suite {suite_id} has no baseline" in gate["detail"]
    done = await evalbus(pipeline, "compare", base_id, cwd=tmp_path)  # nothing to compare with: says what to run
    assert done.returncode == 1
    assert "evalbus compare BASE CANDIDATE" in done.stderr
    assert "evalbus baseline set SUITE BATCH" in done.stderr

    done = await evalbus(pipeline, "baseline", "set", suite_id, base_id, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert done.stdout.startswith(f"baseline of {suite_id}: {base_id} (set by admin at ")
    done = await evalbus(pipeline, "baseline", "show", suite_id, "--json", cwd=tmp_path)
    assert (done.returncode, one_json(done)["batch_id"]) == (0, base_id)

    # The buggy agent, gated against the baseline: exit 3, each gate printed with what it measured.
    done = await evalbus(
        pipeline,
        "run",
        str(buggy),
        "--gate",
        "no_significant_regression: answer_match, verdicts",
        "--gate",
        "verdicts.pass_rate >= 0.9",
        "--gate",
        "metric.cost_usd.mean <= 0.05",
        "--gate",
        "metric.latency_s.mean <= 10",
        "--junit",
        str(tmp_path / "junit.xml"),
        "--summary-md",
        str(tmp_path / "summary.md"),
        cwd=tmp_path,
    )
    assert done.returncode == 3, done.stdout + done.stderr
    lines = done.stdout.splitlines()
    candidate_id = lines[0].split()[1].rstrip(":")
    assert "gates     1 of 4 passed" in lines
    gate_lines = {line.split()[1]: line for line in lines if line.startswith(("  PASS", "  FAIL"))}
    assert gate_lines["no_significant_regression:"].startswith("  FAIL")
    assert f"against {base_id}: answer_match regressed: Δ -0.667" in gate_lines["no_significant_regression:"]
    assert gate_lines["verdicts.pass_rate"].startswith("  FAIL")
    assert "measured 0.3333 (needs >= 0.9)" in gate_lines["verdicts.pass_rate"]
    assert gate_lines["metric.cost_usd.mean"].startswith("  PASS")
    assert "measured 0.001 (needs <= 0.05)" in gate_lines["metric.cost_usd.mean"]
    assert gate_lines["metric.latency_s.mean"].startswith("  FAIL")  # no latency grader: not measured
    assert "metric latency_s was not measured" in gate_lines["metric.latency_s.mean"]

    # The CI reports: a test case per run (8 failures) and per gate (3 failures).
    junit = ET.fromstring((tmp_path / "junit.xml").read_text())
    cases_suite, gates_suite = list(junit)
    assert (cases_suite.get("tests"), cases_suite.get("failures"), cases_suite.get("errors")) == ("12", "8", "0")
    assert (gates_suite.get("tests"), gates_suite.get("failures")) == ("4", "3")
    failed = sorted(c.get("name") or "" for c in cases_suite if c.find("failure") is not None)
    assert failed == REGRESSED
    summary_md = (tmp_path / "summary.md").read_text()
    assert f"## evalbus: {suite_id} — batch `{candidate_id}` succeeded" in summary_md
    assert "**Gates: 1 of 4 passed**" in summary_md

    # compare, against the baseline by default.
    done = await evalbus(pipeline, "compare", candidate_id, "--json", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    comparison = one_json(done)
    assert (comparison["base"], comparison["candidate"], comparison["baseline"]) == (base_id, candidate_id, True)
    rows = {m["metric"]: m for m in comparison["metrics"]}
    for metric in ("verdicts", "answer_match"):
        row = rows[metric]
        assert (row["n"], row["test"], row["base_only"], row["candidate_only"]) == (12, "mcnemar", 8, 0)
        assert row["p_value"] == pytest.approx(2 / 2**8)
        assert row["q_value"] < 0.05
        assert (row["significant"], row["change"]) == (True, "regressed")
    assert (rows["cost_usd"]["delta"], rows["cost_usd"]["significant"]) == (0.0, False)
    assert [c["case_id"] for c in comparison["cases"]["regressed"]] == REGRESSED
    assert [c["case_id"] for c in comparison["cases"]["unchanged"]] == CASES[:4]
    first = comparison["cases"]["regressed"][0]
    assert (first["base"]["runs"][0]["answer"], first["candidate"]["runs"][0]["answer"]) == ("5", "6")

    # The same as text, naming both batches explicitly.
    done = await evalbus(pipeline, "compare", base_id, candidate_id, cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    text = done.stdout.splitlines()
    assert text[0] == f"candidate {candidate_id}  suite {suite_id}  against base {base_id}"
    assert "significant (q < 0.05): verdicts regressed, answer_match regressed" in text
    assert "regressed cases (8)" in text
    row = next(line for line in text if line.strip().startswith("add-04"))
    assert "pass '5'" in row
    assert "fail '6'" in row
    assert "answer_match" in row  # what it no longer passes

    # Gates that hold exit 0; the gates the suite file declares count too.
    gated = write_suite(
        tmp_path / "gated",
        suite_id,
        bug=False,
        gates=["verdicts.pass_rate >= 0.9", {"no_significant_regression": ["verdicts"]}],
    )
    done = await evalbus(
        pipeline, "run", str(gated), "--gate", "metric.answer_match.pass_rate.ci_low > 0.7", cwd=tmp_path
    )
    assert done.returncode == 0, done.stdout + done.stderr
    assert "gates     3 of 3 passed" in done.stdout.splitlines()

    # An unknown batch is refused (a superseded or failed one too: services/gateway/tests/test_api_compare.py).
    done = await evalbus(pipeline, "baseline", "set", suite_id, "bdoesnotexist", cwd=tmp_path)
    assert done.returncode == 1
    assert "404 not_found" in done.stderr


async def test_a_bad_gate_exits_2_before_anything_is_submitted(pipeline: Pipeline, tmp_path: Path) -> None:
    suite_id = f"adder-{uuid.uuid4().hex[:6]}"
    good = write_suite(tmp_path, suite_id, bug=False)
    done = await evalbus(pipeline, "run", str(good), "--gate", "coverage >= 0.9", cwd=tmp_path)
    assert done.returncode == 2
    assert "evalbus run: --gate 'coverage >= 0.9' is not a valid gate: 'coverage >= 0.9': unknown path" in done.stderr
    in_file = write_suite(tmp_path / "bad", suite_id, bug=False, gates=["verdicts.pass_rate >= lots"])
    done = await evalbus(pipeline, "run", str(in_file), cwd=tmp_path)
    assert done.returncode == 2
    assert "$.gates[0]: 'verdicts.pass_rate >= lots': 'lots' is not a number" in done.stderr
    batches = await pipeline.gw.list_batches()
    assert not [b for b in batches.batches if b.suite_id == suite_id]
