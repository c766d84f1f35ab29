"""A dataset far larger than a message, end to end on a stock nats-server (1 MB `max_payload`):
`evalbus run` of a suite reading a JSONL file of long inputs uploads the cases to the gateway
(`POST /v1/datasets`), the batch names the upload, the dispatcher fans it out from the object
store, and the batch runs to `succeeded` with every case exactly once per stage on the stream and
in the event store, every seal verifying.

The size is `EVALBUS_E2E_DATASET_CASES` cases (default 1,000 — 2.5 MB, two and a half times the
message limit, kept lean for CI; issue 9's full run is `EVALBUS_E2E_DATASET_CASES=20000`, 50 MB) of
`INPUT_BYTES`-long inputs, answered by `cut -c 1-8` (one small process per case) and graded by the
suite's `answer-match` against each case's id.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from evalbus.infra.nats import MAX_PAYLOAD_ENV, STOCK_MAX_PAYLOAD
from evalbus.testing.pipeline import Pipeline, open_pipeline
from evalbus_contracts import BatchRequested

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CASES = int(os.environ.get("EVALBUS_E2E_DATASET_CASES", "1000"))
INPUT_BYTES = 2_500
"""Bytes of each case's input: 20,000 cases make issue 9's 50 MB."""
STAGES = ("case.requested", "case.executed", "case.judged", "case.exported")

SUITE = """\
suite:
  id: large-dataset
  dataset: {path: cases.jsonl}
  graders:
  - {kind: answer-match, id: answer}
harness:
  id: cut
  command: [cut, -c, 1-8]
  timeout_s: 120
"""


@pytest.fixture
async def pipeline(pg_admin_url: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Pipeline]:
    monkeypatch.setenv(MAX_PAYLOAD_ENV, str(STOCK_MAX_PAYLOAD))  # the rig's nats-server, stock-sized
    async with open_pipeline(pg_admin_url, tmp_path / "pipeline") as p:
        yield p


def write_suite(folder: Path, cases: int) -> Path:
    folder.mkdir(parents=True)
    filler = ("All work and no play makes a long problem statement. " * 60)[: INPUT_BYTES - 9]
    with (folder / "cases.jsonl").open("w") as out:
        for i in range(cases):
            case_id = f"c{i:07d}"
            out.write(json.dumps({"id": case_id, "input": f"{case_id} {filler}", "expected": case_id}) + "\n")
    path = folder / "suite.yaml"
    path.write_text(SUITE)
    return path


@pytest.mark.timeout(180 + CASES / 10)
async def test_a_dataset_larger_than_the_bus_runs_through_evalbus_run(pipeline: Pipeline, tmp_path: Path) -> None:
    assert pipeline.nc.max_payload == STOCK_MAX_PAYLOAD
    suite = write_suite(tmp_path / "suite", CASES)
    assert (tmp_path / "suite" / "cases.jsonl").stat().st_size > 2 * STOCK_MAX_PAYLOAD
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVALBUS_")}
    env["EVALBUS_DIR"] = "/nonexistent-evalbus-dir"
    command = [sys.executable, "-m", "evalbus.cli", "run", str(suite), "--json"]
    command += ["--gateway", pipeline.stack.gateway_url, "--token", pipeline.stack.admin_token]
    done = await asyncio.to_thread(
        subprocess.run, command, env=env, capture_output=True, text=True, timeout=120 + CASES / 10
    )
    assert done.returncode == 0, done.stderr[-3000:] + pipeline.diagnostics()
    doc = json.loads(done.stdout)
    assert doc["status"] == "succeeded"
    counts = doc["summary"]["counts"]
    assert [counts[k] for k in ("requested", "executed", "judged", "exported")] == [CASES] * 4
    metrics = {m["metric"]: m for m in doc["summary"]["metrics"]}
    assert (metrics["answer_match"]["count"], metrics["answer_match"]["pass_rate"]) == (CASES, 1.0)

    batch_id = doc["batch_id"]
    await pipeline.quiescent()
    stream = await pipeline.stream_events(batch_id)
    [requested] = [ev for _, ev in stream if isinstance(ev, BatchRequested)]
    assert requested.spec.suite.cases == ()
    assert requested.spec.suite.dataset_ref is not None
    assert requested.spec.suite.dataset_ref.size > 2 * STOCK_MAX_PAYLOAD
    per_run = Counter((ev.run_id, ev.type) for _, ev in stream if ev.type in STAGES)
    runs = {run_id for run_id, _ in per_run}
    assert len(runs) == CASES
    assert set(per_run.values()) == {1}, "a case was published twice in a stage"
    assert len(per_run) == CASES * len(STAGES)
    stored = await pipeline.store_counts(batch_id)
    assert {k: v for k, v in stored.items() if k[1] in STAGES} == dict(per_run)
    verified = await pipeline.verify(batch_id)
    assert (verified.ok_count, verified.mismatched, verified.not_sealed) == (CASES, 0, 0)
