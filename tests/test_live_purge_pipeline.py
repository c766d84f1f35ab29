"""A settled run's output leaves the LIVE stream, and its log is then answered from the event store:
the five services as real processes, the dispatcher purging at once (`DISPATCHER_LIVE_KEEP_SETTLED_S
=0`; the default keeps it two minutes), two compute slots.

Two runs of one batch: `quick` prints and settles, `slow` prints and waits for the test. Once
`quick` is executed, its subjects are gone from the stream (nats-server keeps memory for every
run's subjects it holds: the reason for the purge) while `slow`'s running output is untouched;
`GET /logs` of `quick` is the end of its output from the store (`source: store`), its log stream
one `recorded` chunk and `end` — for a client resuming after an id it had too (it may have missed
the rest). Each assertion fails without its part: no purge (the first wait times out, checked), no
store fallback (`found` false), a purge wider than the run's subjects (`slow`'s tail gone).
"""

from __future__ import annotations

import sys
from collections.abc import AsyncIterator
from pathlib import Path

import msgspec
import nats.js.errors
import pytest

from evalbus.testing.pipeline import REPO_ROOT, Pipeline, eventually, open_pipeline, wait_path
from evalbus_api.client import SseEvent
from evalbus_api.live import LogChunk, RunStreamEnd
from evalbus_contracts import BatchSpec, CaseSpec, CommandHarness, SuiteSpec, decode
from evalbus_contracts.streams import LIVE
from evalbus_contracts.subjects import live_subject

pytestmark = pytest.mark.e2e

AGENT = REPO_ROOT / "tests" / "harnesses" / "live_agent.py"


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    workdir = tmp_path_factory.mktemp("live-purge")
    env = {"dispatcher": {"DISPATCHER_SLOTS": "2", "DISPATCHER_LIVE_KEEP_SETTLED_S": "0"}}
    async with open_pipeline(pg_admin_url, workdir, service_env=env) as p:
        yield p


async def on_stream(p: Pipeline, run_id: str, channel: str) -> bool:
    """Whether the LIVE stream holds a message of the run's `channel`."""
    try:
        await p.nc.jetstream().get_last_msg(LIVE.name, live_subject(run_id, channel))
    except nats.js.errors.NotFoundError:
        return False
    return True


async def collect(events: AsyncIterator[SseEvent]) -> list[SseEvent]:
    return [e async for e in events]


async def test_a_settled_runs_output_leaves_the_stream_and_its_log_comes_from_the_store(
    pipeline: Pipeline, tmp_path: Path
) -> None:
    quick_out = [f"quick stdout {i}" for i in range(20)]
    quick_err = ["quick stderr line"]
    slow = {"stdout": ["slow is running"], "stderr": [], "events": 1}
    slow |= {"ready": str(tmp_path / "slow-ready"), "go": str(tmp_path / "slow-go")}
    cases = (
        CaseSpec(id="slow", input=msgspec.json.encode({"phases": [slow], "answer": "1"}).decode()),
        CaseSpec(
            id="quick",
            input=msgspec.json.encode(
                {"phases": [{"stdout": quick_out, "stderr": quick_err, "events": 2}], "answer": "2"}
            ).decode(),
        ),
    )
    spec = BatchSpec(
        suite=SuiteSpec(id="live-purge", cases=cases),
        harness=CommandHarness(id="live-agent", command=(sys.executable, str(AGENT)), timeout_s=300),
    )
    batch_id = await pipeline.submit(spec)
    quick, slow_run = f"evb-{batch_id}-quick", f"evb-{batch_id}-slow"
    await wait_path(tmp_path / "slow-ready")

    async def quick_recorded() -> bool:
        runs = await pipeline.runs(batch_id)
        return "quick" in runs and runs["quick"].executed_status == "succeeded"

    await eventually(quick_recorded, timeout_s=30, what="the quick run recorded as executed")

    async def slow_output_live() -> bool:  # its ready file comes before the dispatcher's next flush
        return await on_stream(pipeline, slow_run, "log") and await on_stream(pipeline, slow_run, "infra")

    await eventually(slow_output_live, timeout_s=30, what="the running slow run's log and marks on LIVE")

    async def quick_purged() -> bool:
        held = [await on_stream(pipeline, quick, channel) for channel in ("log", "trace", "infra", "placement")]
        return not any(held)

    await eventually(quick_purged, timeout_s=30, what="the quick run's output purged from LIVE")
    # the running run keeps its output, marks and all (they were there before the purge)
    assert await on_stream(pipeline, slow_run, "log")
    assert await on_stream(pipeline, slow_run, "infra")
    running = await pipeline.gw.logs(slow_run)
    assert (running.status, running.source, running.text) == ("running", "live", "slow is running\n")

    tail = await pipeline.gw.logs(quick)
    assert (tail.status, tail.found, tail.source, tail.last_event_id) == ("succeeded", True, "store", None)
    assert tail.text == "[stderr]\nquick stderr line\n[stdout]\n" + "\n".join(quick_out)

    frames = await collect(pipeline.gw.follow_run(quick, "logs", reconnects=0))
    assert [f.event for f in frames] == ["log", "end"]
    assert frames[0].id is None
    assert decode(frames[0].data, LogChunk) == LogChunk(stream="recorded", text=tail.text)
    assert decode(frames[1].data, RunStreamEnd) == RunStreamEnd(run_id=quick, status="succeeded")
    # a client that had read up to an id before the purge gets the recorded end of it too
    resumed = await collect(pipeline.gw.follow_run(quick, "logs", last_event_id=1, reconnects=0))
    assert [f.event for f in resumed] == ["log", "end"]
    assert resumed[0].data == frames[0].data
    live = await pipeline.gw.live_trace(quick)
    assert (live.status, live.found, live.events) == ("succeeded", False, ())

    (tmp_path / "slow-go").touch()
    await pipeline.finalized(batch_id)

    async def slow_purged() -> bool:
        return not await on_stream(pipeline, slow_run, "log")

    await eventually(slow_purged, timeout_s=30, what="the slow run's output purged once it settled")
    done = await pipeline.gw.logs(slow_run)
    assert (done.source, done.text) == ("store", "slow is running")
