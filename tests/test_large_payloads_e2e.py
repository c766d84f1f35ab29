"""Large outputs off the bus, end to end on a stock nats-server (1 MB `max_payload`, the embedded
default): a harness that prints 5 MB of trace events, writes a 20 MB artifact, 300 KB of stderr
and a 400 KB answer runs to `succeeded`; the events carry references instead (each far under the
message limit); the judge and the exporter read the offloaded answer and trace; the trajectory
reads back complete through the API, the artifact downloads byte for byte, `evalbus verify`
passes — and once the stored objects are replaced under the same names, the trajectory read
answers `409 tampered`, `evalbus verify` fails naming the object, a download is cut short, and a
re-judge of the batch fails visibly instead of judging other bytes.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from evalbus.infra.nats import STOCK_MAX_PAYLOAD
from evalbus.testing.pipeline import Pipeline, open_pipeline
from evalbus_contracts import (
    Artifact,
    BatchSpec,
    CaseExecuted,
    CaseJudged,
    CaseSpec,
    CommandHarness,
    ContainsJudge,
    Error,
    JsonlSink,
    StepsGrader,
    SuiteSpec,
    ToolCall,
    TraceEvent,
)
from evalbus_contracts.streams import ARTIFACTS
from evalbus_runtime.objects import put_object

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

AGENT = Path(__file__).parent / "harnesses" / "big_output_agent.py"
TRACE_BYTES = 5_000_000
ARTIFACT_BYTES = 20_000_000
STDERR_BYTES = 300_000
ANSWER_BYTES = 400_000
SEED = 11
_trace_decoder = msgspec.json.Decoder(tuple[TraceEvent, ...])


def artifact_digest() -> str:
    """The SHA-256 the agent's `out/big.bin` must have (its 1 MiB block repeated)."""
    sys.path.insert(0, str(AGENT.parent))
    try:
        from big_output_agent import BLOCK, block  # type: ignore[import-not-found]
    finally:
        sys.path.remove(str(AGENT.parent))
    digest = hashlib.sha256()
    data, left = block(SEED), ARTIFACT_BYTES
    while left > 0:
        digest.update(data[: min(left, BLOCK)])
        left -= BLOCK
    return digest.hexdigest()


@pytest.fixture
async def pipeline(pg_admin_url: str, tmp_path: Path) -> AsyncIterator[Pipeline]:
    async with open_pipeline(pg_admin_url, tmp_path / "pipeline") as p:
        yield p


def spec() -> BatchSpec:
    case_input = json.dumps(
        {
            "trace_bytes": TRACE_BYTES,
            "artifact_bytes": ARTIFACT_BYTES,
            "stderr_bytes": STDERR_BYTES,
            "answer_bytes": ANSWER_BYTES,
            "seed": SEED,
        }
    )
    return BatchSpec(
        suite=SuiteSpec(
            id="large-outputs",
            cases=(CaseSpec(id="big", input=case_input, expected="MARKER-END", graders=(StepsGrader(id="steps"),)),),
        ),
        harness=CommandHarness(id="big-output", command=(sys.executable, str(AGENT)), timeout_s=120),
        judges=(ContainsJudge(id="contains"),),
        sinks=(JsonlSink(path="big-{batch}.jsonl"),),
    )


async def evalbus_verify(pipeline: Pipeline, target: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("EVALBUS_")}
    env["EVALBUS_DIR"] = "/nonexistent-evalbus-dir"
    command = [sys.executable, "-m", "evalbus.cli", "verify", target, "--database", pipeline.database_url]
    command += ["--nats", pipeline.nats.url]
    return await asyncio.to_thread(subprocess.run, command, env=env, capture_output=True, text=True, timeout=120)


async def download(pipeline: Pipeline, run_id: str, name: str) -> tuple[int, bytes, dict[str, str]]:
    url = f"{pipeline.stack.gateway_url}/v1/runs/{run_id}/artifacts/{name}"
    headers = {"Authorization": f"Bearer {pipeline.stack.admin_token}"}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        try:
            body = await resp.read()
        except aiohttp.ClientPayloadError:
            body = b"<cut>"
        return resp.status, body, dict(resp.headers)


async def trajectory_json(pipeline: Pipeline, run_id: str) -> tuple[int, Any]:
    url = f"{pipeline.stack.gateway_url}/v1/runs/{run_id}/trajectory"
    headers = {"Authorization": f"Bearer {pipeline.stack.admin_token}"}
    async with aiohttp.ClientSession() as session, session.get(url, headers=headers) as resp:
        return resp.status, await resp.json()


@pytest.mark.timeout(600)
async def test_megabytes_of_output_run_on_a_stock_bus_read_back_and_verify(pipeline: Pipeline) -> None:
    assert pipeline.nc.max_payload == STOCK_MAX_PAYLOAD
    batch_id = await pipeline.submit(spec())
    view = await pipeline.finalized(batch_id, timeout_s=300)
    assert view.status == "succeeded", pipeline.diagnostics()
    [run] = (await pipeline.runs(batch_id)).values()
    assert run.verdict == "pass", run
    scores = {s.metric: s for s in run.scores}
    tool_calls = getattr(scores["tool_calls"], "value", None)
    assert tool_calls is not None
    assert getattr(scores["judge:contains"], "passed", None) is True  # the judge read the offloaded answer
    await pipeline.quiescent()

    # On the bus: references, each event far under the message limit.
    stream = await pipeline.stream(batch_id)
    assert max(len(m.data) for m in stream) < 300 * 1024
    [executed] = [m.event() for m in stream if m.event().type == "case.executed"]
    assert isinstance(executed, CaseExecuted)
    result = executed.result
    assert result.payload is not None
    assert result.payload.bucket == ARTIFACTS.bucket
    assert result.offloaded == ("answer", "trace", "snapshot")
    assert (result.answer, result.trace, result.snapshot) == (None, (), None)
    [judged] = [m.event() for m in stream if m.event().type == "case.judged"]
    assert isinstance(judged, CaseJudged)
    assert judged.result.payload == result.payload  # the judge did not carry the parts again

    # The trajectory reads back complete through the API.
    trajectory = await pipeline.gw.trajectory(run.run_id)
    [stored] = [e for e in trajectory.events if e.type == "case.executed"]
    assert stored.loaded == ("answer", "trace", "snapshot")
    body = msgspec.json.decode(stored.body)
    trace = _trace_decoder.decode(msgspec.json.encode(body["result"]["trace"]))
    calls = [e for e in trace if isinstance(e, ToolCall)]
    assert len(calls) == tool_calls
    assert [c.id for c in calls] == [f"call-{i}" for i in range(len(calls))]
    assert sum(len(c.args["note"]) + 200 for c in calls) >= TRACE_BYTES * 0.9
    assert body["result"]["answer"].endswith("MARKER-END")
    assert len(body["result"]["answer"]) >= ANSWER_BYTES - 200
    artifacts = {e.name: e for e in trace if isinstance(e, Artifact)}
    assert set(artifacts) == {"big", "stderr.log"}
    assert artifacts["big"].size == ARTIFACT_BYTES
    assert artifacts["big"].sha256 == artifact_digest()
    assert not [e for e in trace if isinstance(e, Error)], [e for e in trace if isinstance(e, Error)]

    # The exporter's sink got the offloaded answer.
    [export] = list(pipeline.workdir.rglob(f"big-{batch_id}.jsonl"))
    line = json.loads(export.read_text().splitlines()[0])
    assert line["answer"] == body["result"]["answer"]

    # The artifact and the full stderr download, byte for byte.
    status, data, headers = await download(pipeline, run.run_id, "files/out/big.bin")
    assert status == 200
    assert len(data) == ARTIFACT_BYTES
    assert hashlib.sha256(data).hexdigest() == artifact_digest() == headers["X-Evalbus-Sha256"]
    status, data, _ = await download(pipeline, run.run_id, "stderr.log")
    assert status == 200
    assert len(data) >= STDERR_BYTES - 100
    assert (await download(pipeline, run.run_id, "files/nope.bin"))[0] == 404

    verified = await evalbus_verify(pipeline, batch_id)
    assert verified.returncode == 0, verified.stdout + verified.stderr
    assert "3 objects" in verified.stdout  # the payload, the artifact and the stderr log

    # Tampering: other bytes under the same names.
    js = pipeline.nc.jetstream()
    artifact_name = artifacts["big"].ref.partition("/")[2]
    await put_object(js, ARTIFACTS, artifact_name, b"\0" * ARTIFACT_BYTES)  # same size, other bytes
    status, data, _ = await download(pipeline, run.run_id, "files/out/big.bin")
    assert status != 200 or len(data) < ARTIFACT_BYTES, "a tampered artifact was served whole"
    bad = await evalbus_verify(pipeline, run.run_id)
    assert bad.returncode == 1
    assert "MISMATCH" in bad.stdout
    assert artifact_name in bad.stdout

    await put_object(js, ARTIFACTS, result.payload.name, b'{"answer": "MARKER-END"}')
    status, doc = await trajectory_json(pipeline, run.run_id)
    assert status == 409
    assert doc["error"]["code"] == "tampered"
    assert "tampered with or replaced" in doc["error"]["message"]
    assert result.payload.name in doc["error"]["message"]
    bad = await evalbus_verify(pipeline, batch_id)
    assert bad.returncode == 1
    assert result.payload.name in bad.stdout

    # A re-judge reads the same reference: the judge refuses the replaced payload visibly.
    again = (await pipeline.gw.rejudge(batch_id)).batch_id
    rejudged = await pipeline.finalized(again, timeout_s=120)
    assert rejudged.judge_errors == 1
    [rerun] = (await pipeline.runs(again)).values()
    assert rerun.judge_error is not None
    assert "does not match its reference (tampered with or replaced)" in rerun.judge_error
    assert result.payload.name in rerun.judge_error
    contains = {s.metric: s for s in rerun.scores}["judge:contains"]
    assert getattr(contains, "reason", None) == "missing_evidence"


async def test_a_small_result_rides_inline(pipeline: Pipeline) -> None:
    small = msgspec.structs.replace(
        spec(),
        suite=SuiteSpec(id="small", cases=(CaseSpec(id="small", input="{}", expected="MARKER-END"),)),
        sinks=(),
    )
    batch_id = await pipeline.submit(small)
    view = await pipeline.finalized(batch_id)
    assert view.status == "succeeded", pipeline.diagnostics()

    [event] = [m.event() for m in await pipeline.stream(batch_id) if m.event().type == "case.executed"]
    assert isinstance(event, CaseExecuted)
    assert event.result.payload is None
    assert event.result.answer == "MARKER-END"
