"""`evalbus run` of a suite whose cases come from a dataset file, end to end: the five services as
real processes, the command as a real subprocess. `examples/dataset.yaml` (the demo agent on
`examples/cases.jsonl`, mapped by column, the suite's graders given to every case) is sampled down
and runs to `succeeded`; every sampled row is one run through every stage, with the ids, expected
answers and graders the mapping made."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from evalbus.cli.suite_file import load_suite
from evalbus.testing.stack import ServiceStack

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

EXAMPLES = Path(__file__).resolve().parents[1] / "examples"
SAMPLE = 6


def dataset_suite(folder: Path) -> Path:
    """The example dataset suite in `folder` (with its agent and data file), sampled to `SAMPLE`
    rows of the file's ten."""
    folder.mkdir(parents=True)
    for name in ("agent.py", "cases.jsonl"):
        shutil.copy(EXAMPLES / name, folder / name)
    text = (EXAMPLES / "dataset.yaml").read_text()
    text = text.replace("    path: cases.jsonl\n", f"    path: cases.jsonl\n    sample: {SAMPLE}\n    seed: 3\n")
    path = folder / "dataset.yaml"
    path.write_text(text)
    return path


@pytest.fixture
def stack(service_stack: ServiceStack) -> ServiceStack:
    service_stack.start_all()
    return service_stack


async def test_a_sampled_dataset_suite_runs_every_row_through_every_stage(stack: ServiceStack, tmp_path: Path) -> None:
    suite = dataset_suite(tmp_path / "suite")
    expected = {c.id: c.expected for c in load_suite(suite).suite.cases}
    assert len(expected) == SAMPLE
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVALBUS_")}
    env["EVALBUS_DIR"] = "/nonexistent-evalbus-dir"
    command = [sys.executable, "-m", "evalbus.cli", "run", str(suite), "--json"]
    command += ["--gateway", stack.gateway_url, "--token", stack.admin_token]
    done = await asyncio.to_thread(
        subprocess.run, command, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180
    )
    assert done.returncode == 0, done.stderr
    doc = json.loads(done.stdout)
    assert doc["status"] == "succeeded"
    counts = doc["summary"]["counts"]
    assert (counts["requested"], counts["executed"], counts["judged"], counts["exported"]) == (SAMPLE,) * 4
    metrics = {m["metric"]: m for m in doc["summary"]["metrics"]}
    assert metrics["answer_match"]["count"] == SAMPLE  # the suite's grader reached every case
    assert metrics["tool_calls"]["count"] == SAMPLE

    async with stack.client() as gw:
        runs = await gw.all_cases(doc["batch_id"])
    assert sorted(r.case_id for r in runs) == sorted(expected)
    assert all(r.executed_status == "succeeded" for r in runs)
