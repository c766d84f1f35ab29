"""Chassis benchmark: a 3-stage relay through the chassis' consumer loop versus a bare nats-py relay.

Both relays run the same pipeline on the same nats-server, each stage in its own process:
case.requested → case.executed → case.judged → case.exported (real contract events, ~1 KB).
The bare relay is the usual nats-py idiom — `pull_subscribe` + `fetch(batch)` + `js.publish_async`
with `Nats-Msg-Id` + `ack` after the PubAcks — without decoding the payload; the chassis decodes
each event, runs the handler, publishes the output with dedup headers, acks after the PubAck.

Prints a short table, or one JSON line with --json: end-to-end events/s for both and their ratio
(goal ≥ 0.7), and the chassis' p50/p99 publish-to-last-stage latency at a paced rate (goal p99 ≤ 30 ms
at 500/s).

    uv run python bench/chassis.py [--events 20000] [--rate 500] [--paced-seconds 10] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

from evalbus.infra.nats import start_nats
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

STAGES = ("case.requested", "case.executed", "case.judged")


def consumer_for(mode: str, stage: int, batch: str) -> ConsumerDef:
    subject = f"{STAGES[stage]}.{encode_token(batch)}.>"
    return ConsumerDef(
        durable=f"bench-{mode}-{stage}-{batch}", stream="CASES", filter_subjects=(subject,), max_ack_pending=2000
    )


def request(batch: str, i: int, prefix: str = "c") -> CaseRequested:
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
    return CaseResult(
        case_id=ev.case_id or "",
        run_id=ev.run_id or "",
        harness="bench@1",
        answer="4",
        trace=(Message(role="assistant", text="4"), ToolCall(id="t1", name="calc", args={"expr": "2+2"})),
        scores=(Measured(grader_id="am", metric="answer_match", value=1.0, passed=True),),
    )


async def chassis_stage(url: str, stage: int, batch: str) -> None:
    service = Service(ServiceSettings(service=f"bench{stage}", nats_url=url, http_port=0))

    async def handle(ev: EventBase, _: Delivery) -> Sequence[EventBase]:
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

    service.add_stage(Stage(consumer=consumer_for("chassis", stage, batch), handler=handle, concurrency=256))
    await service.run()


async def bare_stage(url: str, stage: int, batch: str) -> None:
    nc = await connect(url, f"bare{stage}")
    js = nc.jetstream()
    consumer = consumer_for("bare", stage, batch)
    await ensure_consumer(js, consumer)
    psub = await js.pull_subscribe_bind(durable=consumer.durable, stream="CASES")
    nxt = STAGES[stage + 1] if stage + 1 < len(STAGES) else "case.exported"
    while True:
        try:
            msgs = await psub.fetch(256, timeout=1)
        except Exception:  # noqa: BLE001 - nothing to do yet
            continue
        futures = []
        for m in msgs:
            rest = m.subject.split(".", 2)[2]
            futures.append(await js.publish_async(f"{nxt}.{rest}", m.data, headers={"Nats-Msg-Id": f"{nxt}:{rest}"}))
        await asyncio.gather(*futures)
        for m in msgs:
            await m.ack()


def spawn(mode: str, url: str, stage: int, batch: str, logdir: Path) -> subprocess.Popen[bytes]:
    log = open(logdir / f"{mode}-{stage}.log", "wb")  # noqa: SIM115 - the child owns it
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
    first_out = last_out = 0.0

    async def on_out(msg: object) -> None:
        nonlocal first_out, last_out
        now = time.perf_counter()
        run = msg.subject.rsplit(".", 1)[-1]  # type: ignore[attr-defined]
        t0 = sent.pop(run, None)
        if t0 is not None:
            latencies.append(now - t0)
            first_out = first_out or now
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
            target = t_start + i * interval
            delay = target - time.perf_counter()
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
    batch = f"{mode}{time.time_ns() % 10**9}"
    nc = await connect(url, "bench-setup")
    await ensure_topology(nc.jetstream(), [CASES], [])
    for stage in range(3):
        await ensure_consumer(nc.jetstream(), consumer_for(mode, stage, batch))
    await nc.close()
    procs = [spawn(mode, url, stage, batch, logdir) for stage in range(3)]
    try:
        await drive(url, batch, 200, None, prefix="w")  # warm-up: every stage process is ready
        return await drive(url, batch, n, rate)
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()


async def main(args: argparse.Namespace) -> dict[str, object]:
    with tempfile.TemporaryDirectory(prefix="evalbus-bench-") as tmp:
        server = start_nats(Path(tmp) / "nats")
        try:
            logdir = Path(tmp)
            bare = await run_mode(server.url, "bare", args.events, None, logdir)
            chassis = await run_mode(server.url, "chassis", args.events, None, logdir)
            paced = await run_mode(server.url, "chassis", int(args.rate * args.paced_seconds), args.rate, logdir)
        finally:
            server.stop()
    ratio = chassis["events_per_s"] / bare["events_per_s"]
    return {
        "benchmark": "chassis",
        "events": args.events,
        "bare_events_per_s": round(bare["events_per_s"], 1),
        "chassis_events_per_s": round(chassis["events_per_s"], 1),
        "ratio": round(ratio, 3),
        "ratio_goal": 0.7,
        "paced_rate": args.rate,
        "paced_p50_ms": round(paced["p50_ms"], 2),
        "paced_p99_ms": round(paced["p99_ms"], 2),
        "p99_goal_ms": 30.0,
        "ok": ratio >= 0.7 and paced["p99_ms"] <= 30.0,
    }


def cli() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "stage":
        _, _, mode, url, stage, batch = sys.argv
        runner = chassis_stage if mode == "chassis" else bare_stage
        asyncio.run(runner(url, int(stage), batch))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--events", type=int, default=20_000)
    parser.add_argument("--rate", type=float, default=500.0)
    parser.add_argument("--paced-seconds", type=float, default=10.0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args()
    out = asyncio.run(main(args))
    if args.json:
        print(json.dumps(out))
        return
    print(f"{'relay':<10}{'events/s':>12}")
    print(f"{'bare':<10}{out['bare_events_per_s']:>12}")
    print(f"{'chassis':<10}{out['chassis_events_per_s']:>12}")
    print(f"ratio chassis/bare: {out['ratio']} (goal ≥ {out['ratio_goal']})")
    print(f"paced {out['paced_rate']}/s: p50 {out['paced_p50_ms']} ms, p99 {out['paced_p99_ms']} ms (goal ≤ 30 ms)")
    print(json.dumps(out))


if __name__ == "__main__":
    cli()
