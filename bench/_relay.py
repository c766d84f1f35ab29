"""A 3-stage relay on JetStream, run two ways: through the chassis' consumer loop, and bare.

case.requested → case.executed → case.judged → case.exported (real contract events, ~1 KB), each
stage a process of its own on a durable pull consumer (`max_ack_pending` 2,000), at most
`IN_FLIGHT` messages held at once per stage in both modes.

- `chassis`: an `evalbus_runtime.Service` with one `Stage` — the consumer loop pulls with a credit
  of free slots, decodes each event, runs a handler that builds the next event, publishes it with
  its dedup headers, acks after the PubAck (plus metrics, log context and tracing).
- `bare`: the strongest simple relay in plain nats-py, the baseline the chassis is compared with.
  It pulls the way the chassis does (its own pull requests to
  `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>` for as many messages as it has free slots, the
  messages arriving on an inbox subscription: 3–4× faster than `fetch()`, see the bus notes),
  forwards each payload undecoded to the next subject with a core publish whose reply inbox
  collects the PubAck (`Nats-Msg-Id` set, as the chassis does), and acks the input when the PubAck
  arrives — all in subscription callbacks, no task per message, so many messages are in flight.
  Like the chassis it pulls afresh after a reconnect, and a forward left without a PubAck gives
  its slot back (its input is nak'ed, redelivered, and deduplicated on the next publish).

`run_mode` starts the three stage processes, warms them up and drives `n` requests through them
(`drive`): end-to-end events/s and publish-to-`case.exported` latency. A stage process that exits,
or a relay that stalls, fails the run with each stage's consumer state and log tail.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import statistics
import subprocess
import sys
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from evalbus_contracts import (
    CaseExecuted,
    CaseExported,
    CaseJudged,
    CasePlan,
    CaseRequested,
    CaseResult,
    CaseSpec,
    CommandHarness,
    Measured,
    Message,
    ToolCall,
    encode_token,
)
from evalbus_contracts.events import EventBase
from evalbus_contracts.streams import CASES, ConsumerDef
from evalbus_runtime import Delivery, Publisher, Service, ServiceSettings, Stage, connect, ensure_topology
from evalbus_runtime.bus import ensure_consumer

T = TypeVar("T")

STAGES = ("case.requested", "case.executed", "case.judged")
"""The subjects the three stages consume (each publishes the next one, the last `case.exported`)."""
MODES = ("bare", "chassis")
IN_FLIGHT = 256
"""Messages a stage holds at once, in both modes (the chassis stage's `concurrency`)."""
PULL_EXPIRES_S = 10.0
"""Lifetime of one pull request (the chassis' default)."""
PUBACK_TIMEOUT_S = 10.0
"""A forward without a PubAck by then gives its slot back and naks its input (redelivered)."""


def consumer_for(mode: str, stage: int, batch: str) -> ConsumerDef:
    """The durable consumer of one stage of one run."""
    subject = f"{STAGES[stage]}.{encode_token(batch)}.>"
    return ConsumerDef(
        durable=f"bench-{mode}-{stage}-{batch}", stream="CASES", filter_subjects=(subject,), max_ack_pending=2000
    )


def request(batch: str, i: int, prefix: str = "c") -> CaseRequested:
    """The `i`-th `case.requested` of a run."""
    case = f"{prefix}{i}"
    return CaseRequested(
        batch_id=batch,
        case_id=case,
        run_id=f"evb-{batch}-{case}",
        case=CaseSpec(id=case, input="What is 2 + 2? Answer with a number only." * 4, expected="4"),
        harness=CommandHarness(id="bench", command=("python", "agent.py")),
        plan=CasePlan(suite_id="bench"),
    )


def result_for(ev: CaseRequested | CaseExecuted) -> CaseResult:
    """A short result (a trace and a score) for the chassis' executed events."""
    return CaseResult(
        case_id=ev.case_id or "",
        run_id=ev.run_id or "",
        harness="bench@1",
        answer="4",
        trace=(Message(role="assistant", text="4"), ToolCall(id="t1", name="calc", args={"expr": "2+2"})),
        scores=(Measured(grader_id="am", metric="answer_match", value=1.0, passed=True),),
    )


# ---------------------------------------------------------------- the chassis relay


async def relay_handler(ev: EventBase, _: Delivery) -> Sequence[EventBase]:
    """The chassis stage: the next event of the case."""
    if isinstance(ev, CaseRequested):
        return [
            CaseExecuted(
                batch_id=ev.batch_id,
                case_id=ev.case_id,
                run_id=ev.run_id,
                status="succeeded",
                result=result_for(ev),
                plan=ev.plan,
                case=ev.case,
            )
        ]
    if isinstance(ev, CaseExecuted):
        return [
            CaseJudged(
                batch_id=ev.batch_id,
                case_id=ev.case_id,
                run_id=ev.run_id,
                status="judged",
                result=ev.result,
                plan=ev.plan,
                case=ev.case,
            )
        ]
    assert isinstance(ev, CaseJudged)
    return [CaseExported(batch_id=ev.batch_id, case_id=ev.case_id, run_id=ev.run_id, status="skipped")]


async def chassis_stage(url: str, stage: int, batch: str) -> None:
    """One stage as a chassis service, until terminated."""
    service = Service(ServiceSettings(service=f"bench{stage}", nats_url=url, http_port=0))
    service.add_stage(
        Stage(consumer=consumer_for("chassis", stage, batch), handler=relay_handler, concurrency=IN_FLIGHT)
    )
    await service.run()


# ---------------------------------------------------------------- the bare relay


@dataclass
class _Pull:
    remaining: int
    deadline: float


class BareStage:
    """One bare relay stage: credit-based pulls, forward, ack on the PubAck (see the module doc)."""

    def __init__(self, nc: NatsClient, consumer: ConsumerDef, next_subject: str, in_flight: int) -> None:
        self._nc = nc
        self._next = next_subject
        self._free = in_flight
        self._pull_subject = f"$JS.API.CONSUMER.MSG.NEXT.{consumer.stream}.{consumer.durable}"
        self._inbox = nc.new_inbox()
        self._ack_inbox = nc.new_inbox()
        self._pulls: dict[str, _Pull] = {}
        self._forwarded: dict[str, tuple[Msg, float]] = {}
        self._ids = itertools.count(1)
        self._refill_scheduled = False

    async def run(self) -> None:
        """Subscribe, pull, and keep pulling until cancelled."""
        await self._nc.subscribe(f"{self._inbox}.*", cb=self._on_message, pending_msgs_limit=-1, pending_bytes_limit=-1)
        await self._nc.subscribe(
            f"{self._ack_inbox}.*", cb=self._on_puback, pending_msgs_limit=-1, pending_bytes_limit=-1
        )
        await self._refill()
        while True:  # forget pulls and forwards whose answer was lost, so their credit comes back
            await asyncio.sleep(1.0)
            now = time.monotonic()
            for rid, pull in list(self._pulls.items()):
                if now > pull.deadline + 2.0:
                    del self._pulls[rid]
            for reply, (msg, sent) in list(self._forwarded.items()):
                if now - sent > PUBACK_TIMEOUT_S:
                    del self._forwarded[reply]
                    with contextlib.suppress(Exception):
                        await msg.nak()
                    self._free += 1
            self._schedule_refill()

    def reset_pulls(self) -> None:
        """After a reconnect the server has forgotten the pull requests: pull afresh."""
        self._pulls.clear()
        self._schedule_refill()

    def _schedule_refill(self) -> None:
        # One pull request for all the slots freed in one read of the socket.
        if not self._refill_scheduled:
            self._refill_scheduled = True
            asyncio.get_running_loop().call_soon(lambda: asyncio.ensure_future(self._refill()))

    async def _refill(self) -> None:
        self._refill_scheduled = False
        credit = self._free - sum(p.remaining for p in self._pulls.values())
        if credit <= 0:
            return
        rid = str(next(self._ids))
        self._pulls[rid] = _Pull(remaining=credit, deadline=time.monotonic() + PULL_EXPIRES_S)
        body = b'{"batch":%d,"expires":%d}' % (credit, int(PULL_EXPIRES_S * 1e9))
        await self._nc.publish(self._pull_subject, body, reply=f"{self._inbox}.{rid}")

    async def _on_message(self, msg: Msg) -> None:
        if msg.headers and not msg.data:  # a status: 404/408/409 end the pull, 100 is a heartbeat
            if msg.headers.get("Status") != "100":
                self._pulls.pop(msg.subject.rsplit(".", 1)[-1], None)
                self._schedule_refill()
            return
        for rid, pull in self._pulls.items():  # the server serves pulls in order: count the oldest
            pull.remaining -= 1
            if pull.remaining <= 0:
                del self._pulls[rid]
            break
        self._free -= 1
        rest = msg.subject.split(".", 2)[2]
        reply = f"{self._ack_inbox}.{next(self._ids)}"
        self._forwarded[reply] = (msg, time.monotonic())
        await self._nc.publish(
            f"{self._next}.{rest}", msg.data, reply=reply, headers={"Nats-Msg-Id": f"{self._next}:{rest}"}
        )

    async def _on_puback(self, ack: Msg) -> None:
        forwarded = self._forwarded.pop(ack.subject, None)
        if forwarded is None:
            return
        msg = forwarded[0]
        if not ack.data or b'"error"' in ack.data:
            await msg.nak()  # not stored: let JetStream redeliver the input
        else:
            await msg.ack()
        self._free += 1
        self._schedule_refill()


async def bare_stage(url: str, stage: int, batch: str) -> None:
    """One stage as a bare nats-py relay, until terminated."""
    relay: BareStage | None = None

    async def reconnected() -> None:
        if relay is not None:
            relay.reset_pulls()

    nc = await connect(url, f"bare{stage}", on_reconnect=reconnected)
    consumer = consumer_for("bare", stage, batch)
    await ensure_consumer(nc.jetstream(), consumer)
    nxt = STAGES[stage + 1] if stage + 1 < len(STAGES) else "case.exported"
    relay = BareStage(nc, consumer, nxt, IN_FLIGHT)
    await relay.run()


# ---------------------------------------------------------------- running a relay


def spawn(mode: str, url: str, stage: int, batch: str, logdir: Path) -> subprocess.Popen[bytes]:
    """One stage process (this file run as `stage <mode> <url> <stage> <batch>`)."""
    log = open(logdir / f"{mode}-{stage}-{batch}.log", "wb")  # noqa: SIM115 - the child owns it
    return subprocess.Popen(
        [sys.executable, __file__, "stage", mode, url, str(stage), batch],
        stdout=log,
        stderr=subprocess.STDOUT,
        env={**os.environ, "LOG_LEVEL": "WARNING", "LOG_FORMAT": "text"},
    )


async def drive(url: str, batch: str, n: int, rate: float | None, prefix: str = "c") -> dict[str, float]:
    """Publish n requests (at `rate`/s, or as fast as possible) and time each to case.exported."""
    nc = await connect(url, "bench-driver")
    sent: dict[str, float] = {}
    latencies: list[float] = []
    done = asyncio.Event()
    last_out = 0.0

    async def on_out(msg: Msg) -> None:
        nonlocal last_out
        now = time.perf_counter()
        t0 = sent.pop(msg.subject.rsplit(".", 1)[-1], None)
        if t0 is not None:
            latencies.append(now - t0)
            last_out = now
            if len(latencies) == n:
                done.set()

    await nc.subscribe(
        f"case.exported.{encode_token(batch)}.>", cb=on_out, pending_msgs_limit=-1, pending_bytes_limit=-1
    )
    pub = Publisher(nc)
    await pub.start()
    payloads = [(request(batch, i, prefix), f"{prefix}{i}") for i in range(n)]
    pending: set[asyncio.Future[object]] = set()
    t_start = time.perf_counter()
    if rate is None:
        window = 512
        for k in range(0, n, window):
            chunk = payloads[k : k + window]
            now = time.perf_counter()
            for _, case in chunk:
                sent[case] = now
            await pub.publish_events(ev for ev, _ in chunk)
    else:
        interval = 1.0 / rate
        for i, (ev, case) in enumerate(payloads):
            delay = t_start + i * interval - time.perf_counter()
            if delay > 0:
                await asyncio.sleep(delay)
            sent[case] = time.perf_counter()
            pending.add(asyncio.ensure_future(pub.publish_event(ev)))
    await asyncio.wait_for(done.wait(), timeout=max(120.0, n / 200))
    await asyncio.gather(*pending)
    elapsed = last_out - t_start
    await pub.stop()
    await nc.close()
    lat = sorted(latencies)
    return {
        "events": n,
        "seconds": elapsed,
        "events_per_s": n / elapsed,
        "p50_ms": 1000 * statistics.median(lat),
        "p99_ms": 1000 * lat[min(len(lat) - 1, int(0.99 * len(lat)))],
    }


async def run_mode(url: str, mode: str, n: int, rate: float | None, logdir: Path) -> dict[str, float]:
    """Start the three stages of `mode` on the nats-server at `url`, warm them up with 200
    requests, then drive `n` (at `rate`/s, or as fast as possible)."""
    batch = f"{mode}{time.time_ns() % 10**9}"
    nc = await connect(url, "bench-setup")
    await ensure_topology(nc.jetstream(), [CASES], [])
    for stage in range(3):
        await ensure_consumer(nc.jetstream(), consumer_for(mode, stage, batch))
    await nc.close()
    procs = [spawn(mode, url, stage, batch, logdir) for stage in range(3)]
    try:
        # warm-up: every stage process is ready
        await while_alive(procs, drive(url, batch, 200, None, prefix="w"))
        return await while_alive(procs, drive(url, batch, n, rate))
    except (TimeoutError, ChildProcessError) as e:
        raise RuntimeError(
            f"the {mode} relay failed ({e!r}): {await stall_report(url, mode, batch, procs, logdir)}"
        ) from e
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


async def while_alive(procs: Sequence[subprocess.Popen[bytes]], work: Awaitable[T]) -> T:
    """`work`, cancelled with `ChildProcessError` as soon as one of `procs` exits."""
    task = asyncio.ensure_future(work)
    while not task.done():
        dead = [p.pid for p in procs if p.poll() is not None]
        if dead:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
            raise ChildProcessError(f"stage process {dead} exited")
        await asyncio.wait({task}, timeout=0.5)
    return task.result()


async def stall_report(url: str, mode: str, batch: str, procs: Sequence[subprocess.Popen[bytes]], logdir: Path) -> str:
    """What each stage's consumer holds, whether its process lives, and its log's tail."""
    nc = await connect(url, "bench-stall")
    lines = []
    try:
        for stage, proc in enumerate(procs):
            consumer = consumer_for(mode, stage, batch)
            info = await nc.jetstream().consumer_info(consumer.stream, consumer.durable)
            log = (logdir / f"{mode}-{stage}-{batch}.log").read_text(errors="replace")[-600:]
            lines.append(
                f"stage {stage}: exit {proc.poll()}, pending {info.num_pending}, ack pending "
                f"{info.num_ack_pending}, redelivered {info.num_redelivered}, waiting pulls {info.num_waiting}; "
                f"log: {log!r}"
            )
    finally:
        await nc.close()
    return "; ".join(lines)


def stage_main(argv: Sequence[str]) -> None:
    """`stage <mode> <url> <stage> <batch>`: run one stage process."""
    mode, url, stage, batch = argv
    runner = chassis_stage if mode == "chassis" else bare_stage
    asyncio.run(runner(url, int(stage), batch))


if __name__ == "__main__" and sys.argv[1:2] == ["stage"]:
    stage_main(sys.argv[2:])
