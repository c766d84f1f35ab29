"""Live reads of a running run, end to end: the five services as real processes (one nats-server,
one database, one compute slot) plus a SECOND gateway replica on the same bus and database.

The harness (`tests/harnesses/live_agent.py`) writes its output in phases and waits between them,
so the run is still running while the test reads its log tail and its live trace, follows its log
and trace streams, drops the connection, and resumes with `Last-Event-ID` on the other replica —
and every chunk and event arrives exactly once, control lines stripped, the streams ending when
the run settles; the sealed result is what the harness printed, as before.
"""

from __future__ import annotations

import asyncio
import sys
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest

from evalbus.testing.pipeline import REPO_ROOT, Pipeline, eventually, open_pipeline, wait_path
from evalbus_api.client import GatewayClient, SseEvent
from evalbus_api.live import LogChunk, RunStreamEnd
from evalbus_contracts import BatchSpec, CaseSpec, CommandHarness, Infra, SuiteSpec, ToolCall, decode
from evalbus_gateway.testing import RunningGateway, running_gateway

pytestmark = pytest.mark.e2e

AGENT = REPO_ROOT / "tests" / "harnesses" / "live_agent.py"


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    workdir = tmp_path_factory.mktemp("live-reads")
    async with open_pipeline(pg_admin_url, workdir, service_env={"dispatcher": {"DISPATCHER_SLOTS": "1"}}) as p:
        yield p


@pytest.fixture
async def replica(pipeline: Pipeline) -> AsyncIterator[GatewayClient]:
    """A client of a second gateway replica, on the pipeline's bus and database."""
    gateway: RunningGateway
    async with (
        running_gateway(pipeline.nats.url, pipeline.database_url, admin_token=pipeline.stack.admin_token) as gateway,
        GatewayClient(gateway.base_url, gateway.admin_token) as client,
    ):
        yield client


def phase(tmp: Path, n: int, *, stdout: list[str], stderr: list[str], events: int) -> dict[str, object]:
    return {
        "stdout": stdout,
        "stderr": stderr,
        "events": events,
        "ready": str(tmp / f"ready-{n}"),
        "go": str(tmp / f"go-{n}"),
    }


def text_of(frames: list[SseEvent], stream: str) -> str:
    chunks = [decode(f.data, LogChunk) for f in frames if f.event == "log"]
    return "".join(c.text for c in chunks if c.stream == stream)


async def read_until(events: AsyncIterator[SseEvent], frames: list[SseEvent], done: Callable[[], bool]) -> None:
    """Append frames from `events` until `done()` holds for what was read (within 30 s)."""
    async with asyncio.timeout(30):
        async for event in events:
            frames.append(event)
            if done():
                return
    raise AssertionError("the stream ended early")


async def test_a_running_run_is_watched_live_across_replicas_without_loss_or_repeat(
    pipeline: Pipeline, replica: GatewayClient, tmp_path: Path
) -> None:
    out = [[f"phase {p} stdout line {i} " + "ü" * 40 for i in range(30)] for p in range(3)]
    err = [[f"phase {p} stderr line {i}" for i in range(5)] for p in range(3)]
    phases = [phase(tmp_path, p, stdout=out[p], stderr=err[p], events=2) for p in range(2)]
    phases.append({"stdout": out[2], "stderr": err[2], "events": 2})
    spec = BatchSpec(
        suite=SuiteSpec(
            id="live-reads",
            cases=(CaseSpec(id="c1", input=msgspec.json.encode({"phases": phases, "answer": "42"}).decode()),),
        ),
        harness=CommandHarness(id="live-agent", command=(sys.executable, str(AGENT)), timeout_s=300),
    )
    batch_id = await pipeline.submit(spec)
    run_id = f"evb-{batch_id}-c1"
    gateways = {"stack": pipeline.gw, "replica": replica}

    def expected(stream: str, upto: int) -> str:
        lines = (out if stream == "stdout" else err)[: upto + 1]
        return "".join(line + "\n" for group in lines for line in group)

    # Phase 0 written, the harness waits: both replicas show the same running tail.
    await wait_path(tmp_path / "ready-0")

    async def tail_complete() -> bool:
        tail = await pipeline.gw.logs(run_id)
        return all(line in tail.text for line in out[0] + err[0])

    await eventually(tail_complete, timeout_s=15, what="phase 0 in the log tail")
    tails = [await gw.logs(run_id) for gw in gateways.values()]
    assert tails[0] == tails[1]
    assert tails[0].status == "running"
    assert tails[0].found
    assert "EVALBUS_" not in tails[0].text

    def through(upto: int) -> bool:
        so, se = text_of(frames, "stdout"), text_of(frames, "stderr")
        assert expected("stdout", 2).startswith(so), "a stdout chunk was lost or repeated"
        assert expected("stderr", 2).startswith(se), "a stderr chunk was lost or repeated"
        return so == expected("stdout", upto) and se == expected("stderr", upto)

    # Follow the log on the stack's gateway until phase 0 is in; drop the connection.
    frames: list[SseEvent] = []
    first = pipeline.gw.follow_run(run_id, "logs", reconnects=0)
    await read_until(first, frames, lambda: through(0))
    await first.aclose()

    # Phase 1 is written while nobody watches; resume on the OTHER replica from the last id seen.
    (tmp_path / "go-0").touch()
    await wait_path(tmp_path / "ready-1")
    second = replica.follow_run(run_id, "logs", last_event_id=frames[-1].id, reconnects=0)
    await read_until(second, frames, lambda: through(1))
    await second.aclose()

    # The live trace, mid-run, is the same on both replicas: marks, then the printed events.
    traces = [await gw.live_trace(run_id) for gw in gateways.values()]
    assert traces[0] == traces[1]
    assert [e.event for e in traces[0].events if isinstance(e, Infra)] == ["accepted", "started", "placed"]
    assert [e.id for e in traces[0].events if isinstance(e, ToolCall)] == [f"call-{i}" for i in range(4)]
    trace_frames: list[SseEvent] = []
    trace_stream = replica.follow_run(run_id, "trajectory/live", reconnects=0)
    await read_until(trace_stream, trace_frames, lambda: len(trace_frames) == len(traces[0].events))
    await trace_stream.aclose()

    # The last phase and the result; back on the first replica, resumed, to the end.
    (tmp_path / "go-1").touch()
    third = pipeline.gw.follow_run(run_id, "logs", last_event_id=frames[-1].id, reconnects=0)
    await read_until(third, frames, lambda: frames[-1].event == "end")
    await third.aclose()
    assert text_of(frames, "stdout") == expected("stdout", 2)
    assert text_of(frames, "stderr") == expected("stderr", 2)
    ids = [f.id for f in frames if f.event == "log" and f.id is not None]
    assert ids == sorted(set(ids)), "a chunk arrived twice or out of order"
    assert decode(frames[-1].data, RunStreamEnd) == RunStreamEnd(run_id=run_id, status="succeeded")

    # The trace stream, resumed on the stack's gateway, brings the rest and ends too.
    rest = pipeline.gw.follow_run(run_id, "trajectory/live", last_event_id=trace_frames[-1].id, reconnects=0)
    await read_until(rest, trace_frames, lambda: trace_frames[-1].event == "end")
    await rest.aclose()
    kinds = [msgspec.json.decode(f.data) for f in trace_frames if f.event == "trace"]
    assert [k.get("event") for k in kinds if k["kind"] == "infra"] == [
        "accepted",
        "started",
        "placed",
        "exited",
        "released",
    ]
    assert [k["id"] for k in kinds if k["kind"] == "tool_call"] == [f"call-{i}" for i in range(6)]

    # The buffered result contract is unchanged: the sealed run has the answer and every event.
    await pipeline.finalized(batch_id)
    run = await pipeline.gw.run(run_id)
    assert run.answer == "42"
    assert run.live_trace is None
    settled = await replica.logs(run_id)
    assert settled.status == "succeeded"
    assert not settled.truncated  # all of it fits in the 64 KiB tail
    assert sorted(settled.text.splitlines()) == sorted(line for group in out + err for line in group)
