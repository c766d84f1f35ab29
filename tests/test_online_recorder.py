"""The in-process recorder (`evalbus.online.Recorder`) against a real nats-server: what it accepts is
on the OBSERVATIONS stream exactly once after `close()`; its sampling decision is OpenTelemetry's
(and the collector's); every refusal and every loss is counted with its reason; `record()` never
raises; a NATS outage loses nothing accepted; `close()` with NATS down reports what it could not
send, within its timeout.

The stream is read message by message (`STREAM.MSG.GET`, next by subject) rather than consumed:
OBSERVATIONS is a work queue, and the collector's durable consumer owns `obs.received.>`.
"""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from nats.js.errors import NotFoundError

from evalbus.infra.nats import NatsServer, start_nats
from evalbus.infra.ports import free_port
from evalbus.online import Outcome, Recorder, RecorderStats
from evalbus.testing.pipeline import eventually
from evalbus_collector.online.decide import sampling_key
from evalbus_contracts import ObservationReceived, decode_event, encode_token, sampled_by_trace_id
from evalbus_contracts.sampling import TRACE_ID_LIMIT
from evalbus_contracts.trace import LlmCall, Message, ToolCall
from evalbus_runtime import connect, ensure_topology

pytestmark = pytest.mark.integration


# ---------------------------------------------------------------- the bus


@pytest.fixture(scope="module")
def own_nats(tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsServer]:
    """A nats-server of this module's (no collector anywhere consumes its observations)."""
    server = start_nats(tmp_path_factory.mktemp("recorder") / "nats")
    yield server
    server.stop()


async def define_topology(url: str) -> None:
    nc = await connect(url, "recorder-test")
    try:
        await ensure_topology(nc.jetstream())
    finally:
        await nc.close()


@pytest.fixture(scope="module")
async def bus_url(own_nats: NatsServer) -> str:
    await define_topology(own_nats.url)
    return own_nats.url


def target_name() -> str:
    """A target of the test's own (its subject holds only this test's observations)."""
    return f"app-{uuid.uuid4().hex[:8]}"


async def stored(url: str, target: str) -> list[tuple[ObservationReceived, dict[str, str]]]:
    """Every observation stored on `obs.received.<target>`, in stream order, with its headers."""
    nc = await connect(url, "recorder-test-reader")
    js = nc.jetstream()
    subject = f"obs.received.{encode_token(target)}"
    out: list[tuple[ObservationReceived, dict[str, str]]] = []
    try:
        seq = 1
        while True:
            try:
                msg = await js.get_msg("OBSERVATIONS", seq=seq, subject=subject, next=True)
            except NotFoundError:
                return out
            event = decode_event(msg.data or b"")
            assert isinstance(event, ObservationReceived)
            out.append((event, dict(msg.headers or {})))
            seq = (msg.seq or seq) + 1
    finally:
        await nc.close()


def trace_id() -> str:
    return os.urandom(16).hex()


def balanced(stats: RecorderStats) -> bool:
    """Every accepted observation is published, still pending, or lost with a reason."""
    return stats.accepted == stats.published + stats.pending + sum(stats.lost.values())


def unreachable_url() -> str:
    """A NATS URL nothing listens on."""
    return f"nats://127.0.0.1:{free_port()}"


NOWHERE = "nats://127.0.0.1:1"
"""For recorders that are never started."""


# ---------------------------------------------------------------- exactly once


async def test_everything_recorded_is_on_the_stream_exactly_once(bus_url: str) -> None:
    target = target_name()
    recorder = Recorder(bus_url, target=target, metadata={"deployment.environment": "prod", "region": "eu"})
    recorder.start()
    trace = (Message(role="user", text="hi"), LlmCall(model="m-1", input_tokens=3), ToolCall(id="c1", name="search"))
    per_thread, threads = 400, 4
    outcomes: Counter[Outcome] = Counter()
    recorded: dict[str, str] = {}
    lock = threading.Lock()

    def application(worker: int) -> None:
        for i in range(per_thread):
            tid = trace_id()
            outcome = recorder.record(
                trace_id=tid,
                input=f"question {worker}-{i}",
                output="Thank you",
                trace=trace,
                metadata={"worker": str(worker), "region": "us"},
            )
            with lock:
                outcomes[outcome] += 1
                recorded[tid] = f"question {worker}-{i}"

    workers = [threading.Thread(target=application, args=(w,)) for w in range(threads)]
    for w in workers:
        w.start()
    # ...and from inside this event loop, with the SDK's integer trace ids and an explicit observation id
    from_loop = {}
    for i in range(100):
        tid = int(trace_id(), 16)
        assert recorder.record(trace_id=tid, observation_id=f"loop-{i}", input=f"loop {i}")
        from_loop[f"loop-{i}"] = f"{tid:032x}"
    for w in workers:
        w.join()

    stats = await recorder.aclose(30)
    n = threads * per_thread + 100
    assert outcomes == Counter({Outcome.ACCEPTED: threads * per_thread})
    assert (stats.accepted, stats.published, stats.pending, stats.duplicates) == (n, n, 0, 0)
    assert (stats.sampled_out, dict(stats.dropped), dict(stats.lost)) == (0, {}, {})

    found = await stored(bus_url, target)
    ids = Counter(event.observation_id for event, _ in found)
    assert ids == Counter(dict.fromkeys([*recorded, *from_loop], 1))
    for event, headers in found:
        assert headers["Nats-Msg-Id"] == event.msg_id()
        assert headers["Evalbus-Type"] == "obs.received"
        assert event.target == target
        if event.observation_id.startswith("loop-"):
            assert event.trace_id == from_loop[event.observation_id]
            assert event.metadata == {"deployment.environment": "prod", "region": "eu"}
            continue
        assert event.trace_id == event.observation_id
        assert event.input == recorded[event.observation_id]
        assert event.output == "Thank you"
        assert event.trace == trace
        assert event.metadata["deployment.environment"] == "prod"
        assert event.metadata["region"] == "us"  # the observation's own metadata over the recorder's


async def test_a_duplicate_observation_is_stored_once(bus_url: str) -> None:
    target = target_name()
    with Recorder(bus_url, target=target) as recorder:
        tid = trace_id()
        assert recorder.record(trace_id=tid, output="first")
        assert recorder.record(trace_id=tid, output="again")
    stats = recorder.stats()
    assert (stats.accepted, stats.published, stats.duplicates) == (2, 2, 1)
    assert [event.output for event, _ in await stored(bus_url, target)] == ["first"]


# ---------------------------------------------------------------- sampling


@settings(max_examples=400, deadline=None)
@given(
    st.integers(min_value=1, max_value=(1 << 128) - 1),
    st.floats(min_value=0.0, max_value=1.0),
    st.floats(min_value=0.0, max_value=1.0),
)
def test_sampling_is_the_trace_id_ratio_decision_and_nests(tid: int, a: float, b: float) -> None:
    low, high = sorted((a, b))
    recorder = Recorder(NOWHERE, target="t", sample_ratio=high, close_at_exit=False)
    hex_id = f"{tid:032x}"
    outcome = recorder.record(trace_id=hex_id)
    # not started: what is inside the ratio is a `not_started` drop, what is outside is sampled out
    assert (outcome is not Outcome.SAMPLED_OUT) == sampled_by_trace_id(hex_id, high)
    assert recorder.record(trace_id=tid) is outcome  # the SDK's int decides the same
    assert recorder.record(trace_id=hex_id.upper()) is outcome
    if sampled_by_trace_id(hex_id, low):  # a suite at a lower ratio samples only what the recorder forwards
        assert outcome is not Outcome.SAMPLED_OUT


def test_without_a_trace_id_it_samples_as_the_collector_does() -> None:
    recorder = Recorder(NOWHERE, target="t", sample_ratio=0.4, close_at_exit=False)
    forwarded = 0
    for i in range(2000):
        observation_id = f"obs-{i}"
        obs = ObservationReceived(target="t", observation_id=observation_id)
        key = sampling_key(obs)
        assert key is not None
        expected = sampled_by_trace_id(key, 0.4)
        assert (recorder.record(observation_id=observation_id) is not Outcome.SAMPLED_OUT) == expected
        forwarded += expected
    assert 600 < forwarded < 1000  # the ratio really splits the set
    assert recorder.stats().sampled_out == 2000 - forwarded


async def test_only_what_is_inside_the_ratio_is_forwarded(bus_url: str) -> None:
    target = target_name()
    ratio = 0.25
    ids = [trace_id() for _ in range(400)]
    with Recorder(bus_url, target=target, sample_ratio=ratio) as recorder:
        outcomes = {tid: recorder.record(trace_id=tid) for tid in ids}
    inside = {tid for tid in ids if sampled_by_trace_id(tid, ratio)}
    assert 40 < len(inside) < 160
    assert {tid for tid, o in outcomes.items() if o is Outcome.ACCEPTED} == inside
    assert {tid for tid, o in outcomes.items() if o is Outcome.SAMPLED_OUT} == set(ids) - inside
    stats = recorder.stats()
    assert (stats.accepted, stats.published, stats.sampled_out) == (len(inside), len(inside), len(ids) - len(inside))
    assert {event.observation_id for event, _ in await stored(bus_url, target)} == inside


def test_sample_ratio_zero_forwards_nothing_and_one_everything() -> None:
    zero = Recorder(NOWHERE, target="t", sample_ratio=0.0, close_at_exit=False)
    assert all(zero.record(trace_id=f"{TRACE_ID_LIMIT:032x}") is Outcome.SAMPLED_OUT for _ in range(3))
    assert zero.record(trace_id="0" * 31 + "1") is Outcome.SAMPLED_OUT
    one = Recorder(NOWHERE, target="t", close_at_exit=False)
    assert one.record(trace_id=f"{TRACE_ID_LIMIT:032x}") is Outcome.NOT_STARTED
    with pytest.raises(ValueError, match="sample_ratio"):
        Recorder(NOWHERE, sample_ratio=1.5)


# ---------------------------------------------------------------- drops with reasons


async def test_drops_are_counted_with_their_reasons() -> None:
    recorder = Recorder(unreachable_url(), target="t", max_queue=3, max_bytes=1000)
    assert recorder.record(trace_id=trace_id()) is Outcome.NOT_STARTED
    recorder.start()
    outcomes = [recorder.record(trace_id=trace_id(), output="ok") for _ in range(5)]
    assert outcomes == [Outcome.ACCEPTED] * 3 + [Outcome.QUEUE_FULL] * 2
    assert not outcomes[3]
    assert bool(outcomes[0])
    for bad in ("xyz", "0" * 32, "g" * 32, "a" * 31, "a" * 33, 0, -5, 1 << 128, 1.5, b"a" * 32, True):
        assert recorder.record(trace_id=bad) is Outcome.INVALID_TRACE_ID, bad  # type: ignore[arg-type]
    assert recorder.record(trace_id=trace_id(), input="x" * 1001) is Outcome.TOO_LARGE
    assert recorder.record(trace_id=trace_id(), target="") is Outcome.INVALID
    assert recorder.record(trace_id=trace_id(), output=42) is Outcome.INVALID  # type: ignore[arg-type]
    assert recorder.record(trace_id=trace_id(), observation_id=7) is Outcome.INVALID  # type: ignore[arg-type]
    assert recorder.record(trace_id=trace_id(), trace=5) is Outcome.INVALID  # type: ignore[arg-type]
    assert recorder.record(trace_id=trace_id(), trace="events") is Outcome.INVALID  # type: ignore[arg-type]
    assert recorder.record(trace_id=trace_id(), metadata=[1, 2]) is Outcome.INVALID  # type: ignore[arg-type]
    untargeted = Recorder(unreachable_url(), close_at_exit=False).start()
    assert untargeted.record(trace_id=trace_id()) is Outcome.INVALID
    await untargeted.aclose(0)

    started = time.monotonic()
    stats = await recorder.aclose(0.5)
    closing_s = time.monotonic() - started
    assert recorder.record(trace_id=trace_id()) is Outcome.CLOSED
    assert closing_s < 0.5 + 2.0  # within the timeout (the thread's exit is the margin)
    assert (stats.accepted, stats.published, stats.pending) == (3, 0, 0)
    assert dict(stats.dropped) == {
        "not_started": 1,
        "queue_full": 2,
        "invalid_trace_id": 11,
        "too_large": 1,
        "invalid": 6,
    }
    assert dict(stats.lost) == {"unsent": 3}
    assert balanced(stats)
    assert stats.offered == 3 + 1 + 2 + 11 + 1 + 6
    assert recorder.stats().dropped["closed"] == 1


async def test_the_forwarder_drops_what_does_not_encode_or_is_too_large(bus_url: str) -> None:
    target = target_name()
    recorder = Recorder(bus_url, target=target, max_bytes=2000)
    with recorder:
        good = trace_id()
        assert recorder.record(trace_id=good, output="fine", metadata={"n": 3, "ok": True, "x": 1.5})  # type: ignore[dict-item]
        # the text is small, the trace is not: only encoding tells
        big = tuple(Message(role="user", text="y" * 100) for _ in range(40))
        assert recorder.record(trace_id=trace_id(), trace=big)
        # wrong types the request path does not look into: the collector could not decode them
        assert recorder.record(trace_id=trace_id(), trace=(Message(role="robot", text="hi"),))  # type: ignore[arg-type]
        assert recorder.record(trace_id=trace_id(), trace=("not an event",))  # type: ignore[arg-type]
        assert recorder.record(trace_id=trace_id(), metadata={"k": object()})  # type: ignore[dict-item]
        assert recorder.record(trace_id=trace_id(), metadata={1: "v"})  # type: ignore[dict-item]
    stats = recorder.stats()
    assert (stats.accepted, stats.published, stats.pending, dict(stats.dropped)) == (6, 1, 0, {})
    assert dict(stats.lost) == {"too_large": 1, "invalid": 4}
    assert balanced(stats)
    [(event, _)] = await stored(bus_url, target)
    assert event.observation_id == good
    assert event.metadata == {"n": "3", "ok": "true", "x": "1.5"}


_garbage = st.one_of(
    st.none(),
    st.text(max_size=40),
    st.integers(),
    st.floats(allow_nan=True),
    st.binary(max_size=40),
    st.booleans(),
    st.lists(st.one_of(st.integers(), st.text(max_size=5), st.none()), max_size=4),
    st.dictionaries(st.one_of(st.text(max_size=5), st.integers()), st.one_of(st.text(max_size=5), st.integers())),
    st.builds(object),
    st.sampled_from([Message(role="user", text="hi"), "0" * 32, "f" * 32, (Message(role="user", text="x"),)]),
)


async def test_record_never_raises_whatever_it_is_given(bus_url: str) -> None:
    target = target_name()
    recorder = Recorder(bus_url, target=target, max_queue=50, max_bytes=500)
    recorder.start()
    calls = 0
    targets = {target}

    @settings(max_examples=500, deadline=None, suppress_health_check=list(HealthCheck))
    @given(
        st.fixed_dictionaries(
            {},
            optional=dict.fromkeys(
                ("trace_id", "observation_id", "input", "output", "expected", "trace", "metadata", "target"), _garbage
            ),
        )
    )
    def offer(kwargs: dict[str, object]) -> None:
        nonlocal calls
        calls += 1
        outcome = recorder.record(**kwargs)  # type: ignore[arg-type]
        assert isinstance(outcome, Outcome)
        if outcome and kwargs.get("target") is not None:
            targets.add(str(kwargs["target"]))

    await asyncio.to_thread(offer)
    stats = await recorder.aclose(30)
    assert stats.offered == calls
    assert stats.pending == 0
    assert balanced(stats)
    assert set(stats.lost) <= {"too_large", "invalid"}  # nothing unsent or rejected with NATS up
    # what was published is well formed (it decoded as an observation to be listed here), once each
    published = [event for name in sorted(targets) for event, _ in await stored(bus_url, name)]
    assert len({(e.target, e.observation_id) for e in published}) == len(published)
    assert len(published) == stats.published - stats.duplicates


# ---------------------------------------------------------------- outages


async def test_a_nats_outage_then_recovery_loses_nothing(tmp_path: Path) -> None:
    """An application records steadily while nats-server is SIGKILLed and started again: publish
    windows are cut mid-flight, the backlog waits in the queue, nothing accepted is lost or doubled."""
    port, monitor = free_port(), free_port()
    server = start_nats(tmp_path / "nats", port, monitor_port=monitor)
    try:
        await define_topology(server.url)
        target = target_name()
        recorder = Recorder(server.url, target=target, max_queue=1_000_000, max_queue_bytes=1 << 30)
        recorder.start()
        recorded: list[str] = []
        outcomes: Counter[Outcome] = Counter()
        stop = threading.Event()

        def application() -> None:
            while not stop.is_set():
                for _ in range(20):  # a burst of requests, then a millisecond's pause: ~15,000/s
                    tid = trace_id()
                    outcomes[recorder.record(trace_id=tid, output="answer")] += 1
                    recorded.append(tid)
                stop.wait(0.001)

        producer = threading.Thread(target=application)
        producer.start()
        try:
            await eventually(lambda: recorder.stats().published > 2000, timeout_s=20, what="publishing under way")
            server.kill()
            await eventually(lambda: not recorder.stats().connected, timeout_s=20, what="the recorder to see NATS down")
            backlog = recorder.stats().pending
            await eventually(
                lambda: recorder.stats().pending > backlog + 2000, timeout_s=20, what="records accepted while down"
            )
            assert not recorder.stats().connected
            server = start_nats(tmp_path / "nats", port, monitor_port=monitor)
            await eventually(lambda: recorder.stats().connected, timeout_s=20, what="the recorder to reconnect")
            resumed = recorder.stats().published
            await eventually(
                lambda: recorder.stats().published > resumed + 5000, timeout_s=30, what="publishing after recovery"
            )
        finally:
            stop.set()
            producer.join()
        stats = await recorder.aclose(30)
        assert outcomes == Counter({Outcome.ACCEPTED: len(recorded)})  # accepted, never blocked, never dropped
        assert (stats.accepted, stats.published, stats.pending) == (len(recorded), len(recorded), 0)
        assert (dict(stats.dropped), dict(stats.lost)) == ({}, {})
        ids = Counter(event.observation_id for event, _ in await stored(server.url, target))
        assert ids == Counter(dict.fromkeys(recorded, 1))
    finally:
        server.stop()


def _state(pid: int) -> str:
    """The process state letter of /proc/<pid>/stat (`T`: stopped by a signal)."""
    with open(f"/proc/{pid}/stat") as f:
        return f.read().rsplit(")", 1)[1].split()[0]


async def test_a_stalled_nats_times_windows_out_and_each_observation_is_stored_once(fresh_nats: NatsServer) -> None:
    """nats-server stopped (SIGSTOP) with the connection open: a window's PubAcks do not come, it is
    published again after its timeout (the stopped server queues every copy), and when the server
    resumes it stores the first copy and answers the others `duplicate` — one message each."""
    await define_topology(fresh_nats.url)
    target = target_name()
    recorder = Recorder(fresh_nats.url, target=target, ack_timeout_s=0.3)
    recorder.start()
    first = [trace_id() for _ in range(100)]
    for tid in first:
        assert recorder.record(trace_id=tid)
    await eventually(lambda: recorder.stats().published == len(first), timeout_s=20, what="the first batch published")
    fresh_nats.process.send_signal(signal.SIGSTOP)
    try:
        # stopped for sure before anything more is recorded (a loaded CI run acked one after the signal)
        await eventually(lambda: _state(fresh_nats.process.pid) == "T", timeout_s=10, what="nats-server stopped")
        stalled = [trace_id() for _ in range(300)]
        for tid in stalled:
            assert recorder.record(trace_id=tid)
        await eventually(
            lambda: "PubAcks not received" in (recorder.stats().last_error or ""),
            timeout_s=20,
            what="a publish window to time out",
        )
        assert recorder.stats().pending == len(stalled)
    finally:
        fresh_nats.process.send_signal(signal.SIGCONT)
    await eventually(lambda: recorder.stats().pending == 0, timeout_s=30, what="the stalled observations published")
    stats = await recorder.aclose(10)
    assert (stats.accepted, stats.published, dict(stats.lost)) == (400, 400, {})
    assert stats.duplicates > 0  # the retry happened, and JetStream deduplicated it
    ids = Counter(event.observation_id for event, _ in await stored(fresh_nats.url, target))
    assert ids == Counter(dict.fromkeys([*first, *stalled], 1))


async def test_close_with_nats_down_reports_what_was_not_sent_within_the_timeout(fresh_nats: NatsServer) -> None:
    await define_topology(fresh_nats.url)
    target = target_name()
    recorder = Recorder(fresh_nats.url, target=target)
    recorder.start()
    sent = [trace_id() for _ in range(50)]
    for tid in sent:
        assert recorder.record(trace_id=tid)
    await eventually(lambda: recorder.stats().published == len(sent), timeout_s=20, what="the first batch published")
    fresh_nats.kill()
    for _ in range(700):
        assert recorder.record(trace_id=trace_id())
    timeout_s = 1.0
    started = time.monotonic()
    stats = await recorder.aclose(timeout_s)
    elapsed = time.monotonic() - started
    assert elapsed < timeout_s + 2.0, elapsed
    assert (stats.accepted, stats.published, stats.pending) == (750, 50, 0)
    assert (dict(stats.dropped), dict(stats.lost)) == ({}, {"unsent": 700})


async def test_observations_wait_for_the_stream_to_be_defined(fresh_nats: NatsServer) -> None:
    """Started before evalbus defined its streams: JetStream answers 503, the forwarder retries."""
    target = target_name()
    recorder = Recorder(fresh_nats.url, target=target)
    recorder.start()
    ids = [trace_id() for _ in range(20)]
    for tid in ids:
        assert recorder.record(trace_id=tid)
    await eventually(
        lambda: "no stream answered" in (recorder.stats().last_error or ""),
        timeout_s=20,
        what="the forwarder to meet the missing stream",
    )
    assert recorder.stats().pending == len(ids)
    await define_topology(fresh_nats.url)
    await eventually(lambda: recorder.stats().pending == 0, timeout_s=20, what="the observations published")
    stats = await recorder.aclose(10)
    assert (stats.published, dict(stats.dropped), dict(stats.lost)) == (len(ids), {}, {})
    assert {e.observation_id for e, _ in await stored(fresh_nats.url, target)} == set(ids)


async def test_started_before_nats_is_up_it_connects_and_publishes(tmp_path: Path) -> None:
    port = free_port()
    target = target_name()
    recorder = Recorder(f"nats://127.0.0.1:{port}", target=target)
    recorder.start()
    ids = [trace_id() for _ in range(30)]
    for tid in ids:
        assert recorder.record(trace_id=tid)
    assert not recorder.stats().connected
    server = start_nats(tmp_path / "nats", port)
    try:
        await define_topology(server.url)
        await eventually(lambda: recorder.stats().pending == 0, timeout_s=30, what="the observations published")
        stats = await recorder.aclose(10)
        assert (stats.accepted, stats.published, dict(stats.lost)) == (30, 30, {})
        assert {e.observation_id for e, _ in await stored(server.url, target)} == set(ids)
    finally:
        server.stop()


def test_the_recorder_imports_no_service_package() -> None:
    """It runs inside the application: importing it must not pull in a service (or the gateway's
    database driver)."""
    code = (
        "import sys, evalbus.online; "
        "print(sorted({m.split('.')[0] for m in sys.modules if m.split('.')[0] in ("
        "'evalbus_collector', 'evalbus_gateway', 'evalbus_judge', 'evalbus_dispatcher', 'evalbus_exporter', "
        "'asyncpg', 'evalbus_grading')}))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]", done.stdout
