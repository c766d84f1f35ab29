"""Test helpers for anything on the bus: wait on conditions, start chassis worker processes, read
what a stream holds (case events of a batch, dead letters of a service)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import time
import typing
import uuid
from collections.abc import AsyncIterator, Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from evalbus_contracts import (
    CaseExecuted,
    CasePlan,
    CaseRequested,
    CaseResult,
    CaseSpec,
    CommandHarness,
    DeadLetter,
    decode_event,
)
from evalbus_contracts.streams import ConsumerDef
from evalbus_runtime import ConsumerLoop, Publisher, ServiceMetrics, Stage, connect, ensure_topology

WORKER = Path(__file__).resolve().parents[3] / "libs" / "runtime" / "tests" / "worker.py"


def wait_until(predicate: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    """Poll a condition with a deadline (waiting on an observable fact, not sleeping for time)."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


async def await_until(predicate: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


class Marks:
    """Lines the workers write when they start and end a message."""

    def __init__(self, path: Path) -> None:
        self.path = path
        path.touch()

    def lines(self) -> list[list[str]]:
        return [line.split() for line in self.path.read_text().splitlines() if line.strip()]

    def count(self, kind: str) -> int:
        return sum(1 for parts in self.lines() if parts[0] == kind)


class Workers:
    """Worker processes of one test."""

    def __init__(self, nats_url: str, tmp: Path) -> None:
        self.nats_url = nats_url
        self.tmp = tmp
        self.procs: list[subprocess.Popen[bytes]] = []
        self._logs: list[typing.IO[bytes]] = []

    def start(self, consumer: ConsumerDef, marks: Marks, **env: str) -> subprocess.Popen[bytes]:
        log = open(self.tmp / f"worker-{len(self.procs)}.log", "wb")  # noqa: SIM115 - closed in stop_all
        self._logs.append(log)
        proc = subprocess.Popen(
            [sys.executable, str(WORKER)],
            env={
                **os.environ,
                "NATS_URL": self.nats_url,
                "WORKER_CONSUMER": msgspec.json.encode(consumer).decode(),
                "WORKER_MARKS": str(marks.path),
                "LOG_FORMAT": "text",
                **{k.upper(): v for k, v in env.items()},
            },
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        self.procs.append(proc)
        return proc

    def stop_all(self) -> None:
        for p in self.procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in self._logs:
            log.close()


@pytest.fixture
def workers(nats_url: str, tmp_path: Path) -> Iterator[Workers]:
    w = Workers(nats_url, tmp_path)
    yield w
    w.stop_all()


@pytest.fixture
async def bus(nats_url: str) -> AsyncIterator[tuple[NatsClient, Publisher]]:
    nc = await connect(nats_url, "test")
    await ensure_topology(nc.jetstream())
    pub = Publisher(nc)
    await pub.start()
    yield nc, pub
    await pub.stop()
    await nc.close()


def make_consumer(batch: str, **kw: object) -> ConsumerDef:
    from evalbus_contracts import encode_token

    defaults: dict[str, object] = {
        "durable": f"t-{uuid.uuid4().hex[:10]}",
        "stream": "CASES",
        "filter_subjects": (f"case.requested.{encode_token(batch)}.>",),
        "ack_wait_s": 5.0,
        "max_deliver": 5,
        "max_ack_pending": 100,
    }
    defaults.update(kw)
    return msgspec.convert(defaults, ConsumerDef)


def request(batch: str, case: str, text: str = "x") -> CaseRequested:
    return CaseRequested(
        batch_id=batch,
        case_id=case,
        run_id=f"evb-{batch}-{case}",
        case=CaseSpec(id=case, input=text),
        harness=CommandHarness(id="h", command=("true",)),
        plan=CasePlan(),
    )


def executed(event: CaseRequested) -> CaseExecuted:
    """The `case.executed` a test worker answers `event` with (answer "ok")."""
    result = CaseResult(case_id=event.case.id, run_id=event.run_id or "", harness="h@1", answer="ok")
    return CaseExecuted(
        batch_id=event.batch_id,
        case_id=event.case_id,
        run_id=event.run_id,
        status="succeeded",
        result=result,
        plan=event.plan,
    )


async def executed_count(nc: NatsClient, batch: str) -> dict[str, int]:
    """case_id → number of case.executed messages stored for the batch (read from the stream)."""
    from evalbus_contracts import encode_token

    js = nc.jetstream()
    counts: dict[str, int] = {}
    sub = await js.subscribe(f"case.executed.{encode_token(batch)}.>", ordered_consumer=True)
    try:
        info = await js.stream_info("CASES", subjects_filter=f"case.executed.{encode_token(batch)}.>")
        total = sum((info.state.subjects or {}).values())
        for _ in range(total):
            msg = await sub.next_msg(timeout=5)
            ev = decode_event(msg.data)
            counts[ev.case_id or ""] = counts.get(ev.case_id or "", 0) + 1
    finally:
        await sub.unsubscribe()
    return counts


async def dead_letters(nc: NatsClient, service: str, timeout_s: float = 0.5) -> list[DeadLetter]:
    """Every dead letter of `service` stored so far."""
    from evalbus_contracts import encode_token

    js = nc.jetstream()
    subject = f"dlq.{encode_token(service)}"
    info = await js.stream_info("DLQ", subjects_filter=subject)
    total = sum((info.state.subjects or {}).values())
    out: list[DeadLetter] = []
    if total == 0:
        return out
    sub = await js.subscribe(subject, ordered_consumer=True)
    try:
        for _ in range(total):
            msg = await sub.next_msg(timeout=5)
            ev = decode_event(msg.data)
            assert isinstance(ev, DeadLetter)
            out.append(ev)
    finally:
        await sub.unsubscribe()
    return out


async def window_passed(nc: NatsClient) -> None:
    """Wait until the CASES duplicate window has forgotten every `Nats-Msg-Id` published before this
    call: a probe id published now is, sent again, no longer a duplicate (a test shortens the window
    with `ensure_stream` first)."""
    from evalbus_contracts import BatchCancelled, encode

    js = nc.jetstream()
    probe = BatchCancelled(batch_id=f"bprobe{uuid.uuid4().hex[:8]}", reason="cancelled", by="test")
    msg_id = {"Nats-Msg-Id": f"probe:{probe.batch_id}"}
    assert not (await js.publish(probe.subject(), encode(probe), headers=msg_id)).duplicate

    deadline = time.monotonic() + 30.0
    while (await js.publish(probe.subject(), encode(probe), headers=msg_id)).duplicate:
        if time.monotonic() > deadline:
            raise AssertionError("timed out waiting for the duplicate window to forget the probe's id")
        await asyncio.sleep(0.1)


async def advisory_listener(nc: NatsClient, pub: Publisher, consumer: ConsumerDef, service: str) -> ConsumerLoop:
    """A started chassis loop with no handler slots on `consumer`: it pulls nothing and only
    dead-letters, from JetStream's advisory, what runs out of deliveries."""

    async def never(_event: object, _delivery: object) -> None:
        raise AssertionError("the advisory listener must not pull")

    loop = ConsumerLoop(
        nc,
        pub,
        Stage(consumer=consumer, handler=never, concurrency=0),
        service=service,
        metrics=ServiceMetrics(service),
    )
    await loop.start()
    return loop


async def exhaust(nc: NatsClient, consumer: ConsumerDef, deliveries: int) -> None:
    """Take `consumer`'s next message `deliveries` times and never answer (a worker that crashes
    every time), then keep a request waiting, as every live replica does: the server notices the
    exhaustion when it next tries to deliver, and the request comes back empty."""
    psub = await nc.jetstream().pull_subscribe_bind(durable=consumer.durable, stream=consumer.stream)
    for n in range(deliveries):
        taken = await psub.fetch(1, timeout=5)
        assert len(taken) == 1, f"delivery {n + 1} of {deliveries} did not come"
    with pytest.raises(TimeoutError):
        await psub.fetch(1, timeout=2)
