"""Placement while a harness runs, on the real local backend: a `placed` mark once its process group
exists, resource samples (pid, processes, resident memory, CPU, age) every interval while it runs,
an `exited` mark and exit sample saying how it ended; a long wait in the queue and a redelivery
marked `waiting`; failure evidence (marks, last sample, output tail) on the `CaseFailure`; and
the replica's presence in the `dispatchers` bucket of a real nats-server."""

from __future__ import annotations

import asyncio
import signal
import threading
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.testing.pipeline import eventually
from evalbus_contracts import CaseRequested, DispatcherStatus, Infra, PlacementSample, Snapshot
from evalbus_contracts.streams import DISPATCHERS
from evalbus_dispatcher import LiveSink, LocalBackend, OnOutput, execute_case
from evalbus_dispatcher.backends.base import Capacity, HarnessRun, OnSpawn, UnitUsage
from evalbus_dispatcher.execute import Queued
from evalbus_dispatcher.placement import FIRST_PUBLISH_S, Sampler
from evalbus_dispatcher.presence import Presence, status_key
from evalbus_grading import ExecResult
from evalbus_runtime import connect, ensure_topology

from .conftest import LiveRecord

Script = Callable[[str], tuple[str, ...]]
MakeRequest = Callable[..., CaseRequested]

pytestmark = pytest.mark.integration


def samples(records: list[LiveRecord]) -> list[PlacementSample]:
    return [rec[1] for rec in records if rec[0] == "placement"]


def marks(records: list[LiveRecord]) -> list[Infra]:
    return [rec[1] for rec in records if rec[0] == "infra"]


async def until(check: Callable[[], bool], what: str = "the condition", timeout_s: float = 15.0) -> None:
    await eventually(check, timeout_s=timeout_s, what=what)


async def test_a_running_harness_is_sampled_until_it_exits(
    backend: LocalBackend,
    script: Script,
    make_request: MakeRequest,
    live: LiveSink,
    live_records: list[LiveRecord],
    tmp_path: Path,
) -> None:
    go = tmp_path / "go"
    argv = script(
        f"""
        import os, time
        hold = b"m" * (32 * 2**20)
        print("holding", flush=True)
        while not os.path.exists({str(go)!r}):
            time.sleep(0.01)
        print("done")
        """
    )
    req = make_request(argv, timeout_s=60)
    task = asyncio.create_task(
        execute_case(req, backend, live=live, on_release=lambda: None, dispatcher="d-test", sample_interval_s=0.05)
    )
    # Samples arrive while it runs, growing older, the memory it holds in them.
    await until(
        lambda: len([s for s in samples(live_records) if (s.rss_bytes or 0) > 32 * 2**20]) >= 3,
        "three samples of the harness holding its memory",
    )
    running = samples(live_records)
    assert all(s.state == "running" for s in running)
    assert [m.event for m in marks(live_records)] == ["accepted", "started", "placed"]
    placed = marks(live_records)[-1]
    pid = running[0].pid
    assert pid is not None
    assert placed.unit == f"pgid:{pid}" == running[0].unit
    assert placed.node is not None
    assert placed.message == f"process group {pid} started on {placed.node}"
    assert {(s.dispatcher, s.node, s.timeout_s, s.slots) for s in running} == {("d-test", placed.node, 60.0, 1)}
    ages = [s.age_s for s in running]
    assert ages == sorted(ages)
    assert running[-1].processes >= 1
    assert running[-1].peak_rss_bytes is not None
    assert running[-1].peak_rss_bytes >= 32 * 2**20

    go.touch()
    executed = await task
    assert executed.status == "succeeded"
    final = samples(live_records)[-1]
    assert (final.state, final.exit_code, final.signal, final.oom, final.timed_out) == ("exited", 0, None, False, False)
    assert final.age_s == executed.result.timings.harness_seconds
    assert final.peak_rss_bytes is not None
    assert final.peak_rss_bytes >= 32 * 2**20
    exited = next(e for e in executed.result.trace if isinstance(e, Infra) and e.event == "exited")
    assert exited.message.startswith("exited with 0 after ")
    assert "MiB resident" in exited.message
    accepted = next(e for e in executed.result.trace if isinstance(e, Infra) and e.event == "accepted")
    assert accepted.message == "accepted by dispatcher d-test"


async def test_a_killed_harness_says_which_signal_and_gives_an_oom_verdict(
    backend: LocalBackend, script: Script, make_request: MakeRequest, live: LiveSink, live_records: list[LiveRecord]
) -> None:
    argv = script(
        "import os, signal, sys; print('about to die', file=sys.stderr, flush=True); os.kill(os.getpid(), signal.SIGKILL)"
    )
    executed = await execute_case(make_request(argv), backend, live=live, on_release=lambda: None)
    failure = executed.result.failure
    assert failure is not None
    assert (failure.code, executed.result.exit_code) == ("exit_nonzero", 137)
    assert failure.placement is not None
    sample = failure.placement.resources
    assert sample is not None
    assert (sample.state, sample.signal, sample.exit_code) == ("exited", int(signal.SIGKILL), 137)
    assert sample.oom in (False, None)  # no OOM kill was counted (None where the cgroup does not count)
    exited = failure.placement.events[-1]
    assert exited.event == "exited"
    assert exited.message.startswith("killed by SIGKILL (exit 137) after ")
    assert failure.log_tail == "about to die"


@pytest.mark.unit
def test_queue_waits_and_redeliveries_are_worth_a_mark() -> None:
    assert Queued(waited_s=0.2).reason() is None
    assert Queued(waited_s=3.25).reason() == "waited 3.2s in the queue for a compute slot"
    redelivered = Queued(waited_s=40.0, delivery=2).reason()
    assert redelivered is not None
    assert redelivered.startswith("delivery 2: stored 40.0s ago; an earlier delivery was not acknowledged")
    backed_off = Queued(waited_s=2.5, delivery=2, attempt=3, backoff_s=2.0).reason()
    assert backed_off == (
        "attempt 3 waited 2s after a retryable failure (stored 2.5s ago; on the bus meanwhile, no compute slot held)"
    )
    crashed_after = Queued(waited_s=40.0, delivery=3, attempt=3, backoff_s=2.0).reason()
    assert crashed_after is not None
    assert crashed_after.startswith("delivery 3: stored 40.0s ago; an earlier delivery was not acknowledged")


async def test_a_long_queue_wait_is_a_sealed_waiting_mark(
    backend: LocalBackend, script: Script, make_request: MakeRequest, live: LiveSink, live_records: list[LiveRecord]
) -> None:
    req = make_request(script("print('hi')"))
    executed = await execute_case(
        req, backend, live=live, on_release=lambda: None, queued=Queued(waited_s=4.0, delivery=1)
    )
    sealed = [(e.event, e.message) for e in executed.result.trace if isinstance(e, Infra)][:2]
    assert sealed == [
        ("waiting", "waited 4.0s in the queue for a compute slot"),
        ("accepted", "accepted by a dispatcher"),
    ]
    assert [(m.event, m.message) for m in marks(live_records)][:2] == sealed


async def test_an_error_mid_run_keeps_the_output_seen_so_far_as_evidence(
    backend: LocalBackend, script: Script, make_request: MakeRequest, live: LiveSink
) -> None:
    """A dispatcher error after the harness printed (the backend's own capture lost with it): the
    failure still carries the end of the output the tee saw, and the marks so far."""

    argv = script(
        "import sys; print('step 1 ok', flush=True); print('warning: disk slow', file=sys.stderr, flush=True)"
    )
    req = make_request(argv)
    inner = await backend.provision(req)

    class LosingHandle:
        """The real sandbox, whose harness run ends in an error after the harness printed."""

        @property
        def unit(self) -> str | None:
            return inner.unit

        @property
        def node(self) -> str | None:
            return inner.node

        def usage(self) -> UnitUsage | None:
            return inner.usage()

        async def run_harness(self, on_output: OnOutput, on_spawn: OnSpawn | None = None) -> HarnessRun:
            await inner.run_harness(on_output, on_spawn)
            raise RuntimeError("the backend lost the process")

        async def exec(self, command: str, timeout_s: float) -> ExecResult:
            return await inner.exec(command, timeout_s)

        async def snapshot(self, answer: str) -> Snapshot:
            return await inner.snapshot(answer)

        async def release(self) -> None:
            await inner.release()

    class OneSandbox:
        async def provision(self, job: CaseRequested) -> LosingHandle:
            return LosingHandle()

        def capacity(self) -> Capacity:
            return backend.capacity()

    executed = await execute_case(req, OneSandbox(), live=live, on_release=lambda: None)
    failure = executed.result.failure
    assert failure is not None
    assert (failure.code, failure.failure_class) == ("dispatcher_error", "infra")
    assert failure.log_tail == "[stderr]\nwarning: disk slow\n[stdout]\nstep 1 ok"
    assert failure.placement is not None
    assert [m.event for m in failure.placement.events] == ["accepted", "started", "placed"]
    assert failure.placement.resources is not None  # the last sample before the error
    assert inner.released


# ---------------------------------------------------------------- presence (real nats-server)


@pytest.fixture
async def nc(nats_url: str) -> AsyncIterator[NatsClient]:
    client = await connect(nats_url, "dispatcher-presence-test")
    await ensure_topology(client.jetstream())
    yield client
    await client.close()


async def test_a_replica_keeps_its_slots_and_runs_in_the_bucket_and_leaves_it_on_stop(nc: NatsClient) -> None:
    replica = f"d-{uuid.uuid4().hex[:8]}"
    kv = await nc.jetstream().key_value(DISPATCHERS.bucket)
    presence = Presence(replica, slots=3, node="node-a", interval_s=0.1)
    await presence.start(nc.jetstream())

    async def status() -> DispatcherStatus | None:
        try:
            entry = await kv.get(status_key(replica))
        except Exception:
            return None
        return msgspec.json.decode(entry.value or b"", type=DispatcherStatus)

    first = await status()
    assert first is not None
    assert (first.dispatcher, first.node, first.slots, first.used, first.runs) == (replica, "node-a", 3, 0, ())

    presence.hold("evb-b1-c1")
    presence.hold("evb-b1-c2")

    async def holds(expected: tuple[str, ...]) -> bool:
        found = await status()
        return found is not None and found.runs == expected and found.used == len(expected)

    await eventually(lambda: holds(("evb-b1-c1", "evb-b1-c2")), timeout_s=10, what="both runs in the status")
    presence.free("evb-b1-c1")
    presence.free("evb-b1-c1")  # a second free of one hold changes nothing
    await eventually(lambda: holds(("evb-b1-c2",)), timeout_s=10, what="one run left in the status")
    # Kept fresh while nothing changes.
    before = await status()
    assert before is not None

    async def rewritten() -> bool:
        now = await status()
        return now is not None and now.updated_at > before.updated_at

    await eventually(rewritten, timeout_s=10, what="the status written again")

    await presence.stop()
    assert await status() is None


async def test_a_burst_of_slot_changes_is_a_few_writes_not_one_per_change(nc: NatsClient) -> None:
    """At hundreds of cases a second every hold and free used to be a bucket write; changes that
    come within `min_gap_s` of a write now go out together in the next one."""
    replica = f"d-{uuid.uuid4().hex[:8]}"
    js = nc.jetstream()
    kv = await js.key_value(DISPATCHERS.bucket)
    gap_s = 0.05
    presence = Presence(replica, slots=64, interval_s=3600, min_gap_s=gap_s)
    await presence.start(js)
    watcher = await kv.watch(status_key(replica))
    writes: list[DispatcherStatus] = []

    async def count() -> None:
        async for entry in watcher:
            if entry is not None and entry.value:
                writes.append(msgspec.json.decode(entry.value, type=DispatcherStatus))

    counting = asyncio.create_task(count())
    try:
        await eventually(lambda: bool(writes), timeout_s=10, what="the first status")
        first = len(writes)
        loop = asyncio.get_running_loop()
        began = loop.time()
        runs = [f"evb-burst-r{i}" for i in range(200)]
        for run in runs:
            presence.hold(run)
            await asyncio.sleep(0)  # let the writer run between changes, as a busy loop would
        for run in runs[:100]:
            presence.free(run)
            await asyncio.sleep(0)
        await eventually(
            lambda: bool(writes) and writes[-1].runs == tuple(sorted(runs[100:])),
            timeout_s=10,
            what="the last change written",
        )
        elapsed = loop.time() - began
        burst = len(writes) - first
        # One write per change would be 300; the gap allows one per `gap_s` plus the last.
        assert burst <= elapsed / gap_s + 2, f"{burst} writes for 300 changes in {elapsed:.3f} s"
    finally:
        counting.cancel()
        await watcher.stop()  # type: ignore[no-untyped-call]
        await presence.stop()


async def test_stop_ends_the_writer_even_when_a_slot_changes_just_before(nc: NatsClient) -> None:
    """A free right before `stop()` (a case released as the service stops) sets the writer's event
    in the same turn as the cancel: with `asyncio.wait_for` on Python 3.11 the cancel could be
    swallowed and `stop()` waited for ever (seen as a 300 s hang of tests/test_lanes_upgrade.py).
    Later the writer's own `kv.put` (nats-py's `wait_for`) lost the cancel the same way, and the
    `stop()` of that day swallowed this test's timeout too, so the test passed after 10 s: 120
    rounds of it failed every time before `cancel_and_wait`, 12 only now and then."""
    js = nc.jetstream()
    for i in range(60):
        presence = Presence(f"d-stop-{uuid.uuid4().hex[:6]}", slots=1, interval_s=3600, min_gap_s=0)
        await presence.start(js)
        presence.hold("evb-b-c1")
        for _ in range(i % 6):  # the cancel lands at a different step of the writer each time
            await asyncio.sleep(0)
        presence.free("evb-b-c1")
        async with asyncio.timeout(10):
            await presence.stop()


async def test_the_sampler_reads_a_quick_usage_on_the_loop_and_the_blocking_one_only_when_it_cannot() -> None:
    loop_thread: list[bool] = []
    published: list[PlacementSample] = []
    quick_answers: list[UnitUsage | None] = [UnitUsage(pid=7, processes=1, rss_bytes=4096, cpu_seconds=0.5), None]
    main = threading.get_ident()

    def usage() -> UnitUsage | None:
        loop_thread.append(threading.get_ident() == main)
        return UnitUsage(pid=7, processes=2, rss_bytes=8192, cpu_seconds=1.0)

    def quick() -> UnitUsage | None:
        return quick_answers.pop(0)

    async def publish(sample: PlacementSample) -> None:
        published.append(sample)

    sampler = Sampler(usage, publish, dispatcher="d-1", node=None, timeout_s=None, interval_s=3600, quick=quick)
    await sampler.start(7)  # the quick read answers: no thread, no blocking read
    assert loop_thread == []
    assert sampler.last is not None
    assert (sampler.last.processes, sampler.last.rss_bytes) == (1, 4096)
    await sampler.finish(None)

    again = Sampler(usage, publish, dispatcher="d-1", node=None, timeout_s=None, interval_s=3600, quick=quick)
    await again.start(7)  # the quick read cannot tell: the blocking one, in a thread
    assert loop_thread == [False]
    assert again.last is not None
    assert (again.last.processes, again.last.rss_bytes) == (2, 8192)
    await again.finish(None)
    assert published == []  # both over before their first sample was due


async def test_a_short_run_publishes_its_exit_sample_only_and_a_longer_one_its_first_soon_after() -> None:
    published: list[PlacementSample] = []

    async def publish(sample: PlacementSample) -> None:
        published.append(sample)

    def usage() -> UnitUsage | None:
        return UnitUsage(pid=7, processes=1, rss_bytes=64 * 2**20, cpu_seconds=0.1)

    run = HarnessRun(exit_code=0, stdout="", stderr="", duration_s=0.01)
    short = Sampler(usage, publish, dispatcher="d-1", node=None, timeout_s=None, interval_s=3600)
    await short.start(7)
    exited = await short.finish(run)
    assert published == [exited]
    assert exited is not None
    assert exited.state == "exited"
    assert exited.peak_rss_bytes == 64 * 2**20  # the spawn's reading counts, unpublished

    published.clear()
    longer = Sampler(usage, publish, dispatcher="d-1", node=None, timeout_s=None, interval_s=3600)
    await longer.start(7)
    await until(lambda: len(published) == 1, "the first sample of a run still going")
    assert published[0].state == "running"
    assert published[0].age_s >= FIRST_PUBLISH_S
    await longer.finish(run)
    assert [p.state for p in published] == ["running", "exited"]
