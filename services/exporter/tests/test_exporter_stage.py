"""The exporter on the bus: judged cases in, `case.exported` out, at most two exports at once
across replicas (the consumer's max_ack_pending)."""

from __future__ import annotations

import asyncio
import uuid
from dataclasses import dataclass, field

import pytest
from nats.aio.client import Client as NatsClient

from evalbus.infra.nats import STOCK_MAX_PAYLOAD, NatsServer
from evalbus.testing.pipeline import eventually
from evalbus_contracts import (
    CaseExported,
    CaseJudged,
    CasePlan,
    CaseResult,
    JsonlSink,
    ResultPayload,
    SinkOutcome,
    SinkSpec,
    decode_event,
    encode,
    encode_token,
)
from evalbus_contracts.streams import ARTIFACTS, EXPORTER_CASES
from evalbus_exporter.service import ExporterSettings, build_exporter
from evalbus_exporter.sinks.base import CaseSink
from evalbus_runtime import Publisher, Service, connect, ensure_topology
from evalbus_runtime.objects import put_object
from evalbus_runtime.payloads import offload_result

pytestmark = pytest.mark.integration


@dataclass
class Exports:
    """What the sinks of one test did: exports running now, the most at once, the runs exported."""

    running: int = 0
    peak: int = 0
    done: list[str] = field(default_factory=list)


class SlowSink:
    """Takes a while per export and counts them in `Exports`."""

    name = "slow"

    def __init__(self, exports: Exports) -> None:
        self.exports = exports

    async def export(self, judged: CaseJudged) -> SinkOutcome:
        exports = self.exports
        exports.running += 1
        exports.peak = max(exports.peak, exports.running)
        await asyncio.sleep(0.1)  # the export's own work, not a synchronisation
        exports.running -= 1
        exports.done.append(judged.run_id or "")
        return SinkOutcome(sink=self.name, status="ok", external_id=judged.run_id)

    async def close(self) -> None:
        return None


async def exporter_caught_up(nc: NatsClient, last_seq: int, deliveries: int) -> bool:
    """Whether the exporter's consumer delivered up to stream sequence `last_seq` in exactly
    `deliveries` deliveries and acked them all, with nothing left to deliver or redeliver."""
    info = await nc.jetstream().consumer_info("CASES", EXPORTER_CASES.durable)
    assert info.delivered is not None
    assert info.delivered.consumer_seq <= deliveries, f"redelivered: {info}"
    return bool(
        info.delivered.stream_seq >= last_seq
        and info.ack_floor is not None
        and info.ack_floor.consumer_seq == deliveries
        and info.num_pending == 0
        and info.num_ack_pending == 0
        and info.num_redelivered == 0
    )


async def exported_on_stream(nc: NatsClient, batch: str) -> list[CaseExported]:
    """Every `case.exported` of `batch` the stream holds."""
    js = nc.jetstream()
    subject = f"case.exported.{encode_token(batch)}.*"
    info = await js.stream_info("CASES", subjects_filter=subject)
    total = sum((info.state.subjects or {}).values())
    out: list[CaseExported] = []
    sub = await js.subscribe(subject, ordered_consumer=True)
    try:
        for _ in range(total):
            event = decode_event((await sub.next_msg(timeout=5)).data)
            assert isinstance(event, CaseExported)
            out.append(event)
    finally:
        await sub.unsubscribe()
    return out


async def test_two_replicas_export_every_case_once_and_never_more_than_two_at_once(fresh_nats: NatsServer) -> None:
    exports = Exports()

    def factory(spec: SinkSpec, batch_id: str) -> CaseSink:
        return SlowSink(exports)

    services = []
    for _ in range(2):
        svc = Service(ExporterSettings(service="exporter", nats_url=fresh_nats.url, concurrency=4))
        build_exporter(svc, ExporterSettings(service="exporter", concurrency=4), factory)
        await svc.start()
        services.append(svc)
    nc = await connect(fresh_nats.url, "t")
    await ensure_topology(nc.jetstream())
    pub = Publisher(nc)
    batch = f"b{uuid.uuid4().hex[:6]}"
    n = 12
    try:
        seqs: list[int] = []
        for i in range(n):
            result = CaseResult(case_id=f"c{i}", run_id=f"evb-{batch}-c{i}", harness="h@1")
            ack = await pub.publish_event(
                CaseJudged(
                    batch_id=batch,
                    case_id=f"c{i}",
                    run_id=result.run_id,
                    status="judged",
                    result=result,
                    plan=CasePlan(sinks=(JsonlSink(path="unused.jsonl"),)),
                )
            )
            seqs.append(ack.seq)
        # Every case stored, delivered once and acked (the chassis acks after its output is
        # stored): nothing is left that could be exported or published again.
        await eventually(
            lambda: exporter_caught_up(nc, max(seqs), n),
            timeout_s=30,
            what=f"the exporter to ack all {n} cases",
        )
        exported = await exported_on_stream(nc, batch)
        run_ids = [f"evb-{batch}-c{i}" for i in range(n)]
        assert sorted(ev.run_id or "" for ev in exported) == sorted(run_ids)
        assert all(ev.status == "exported" for ev in exported)
        assert sorted(exports.done) == sorted(run_ids)  # each case through a sink exactly once
        assert exports.peak <= 2
        assert exports.peak == 2  # the limit was reached, so it is what held
    finally:
        for svc in services:
            await svc.stop()
        await pub.stop()
        await nc.close()


class AnswerSink:
    """Records the answer each exported case carried."""

    name = "answers"

    def __init__(self) -> None:
        self.answers: dict[str, str | None] = {}

    async def export(self, judged: CaseJudged) -> SinkOutcome:
        self.answers[judged.run_id or ""] = judged.result.answer
        return SinkOutcome(sink=self.name, status="ok")

    async def close(self) -> None:
        return None


async def test_an_offloaded_answer_reaches_the_sink_and_a_replaced_one_never_does(fresh_nats: NatsServer) -> None:
    sink = AnswerSink()
    svc = Service(ExporterSettings(service="exporter", nats_url=fresh_nats.url))
    build_exporter(svc, ExporterSettings(service="exporter"), lambda spec, batch_id: sink)
    await svc.start()
    nc = await connect(fresh_nats.url, "t")
    assert nc.max_payload == STOCK_MAX_PAYLOAD  # the rig's default: a stock server's
    await ensure_topology(nc.jetstream())
    pub = Publisher(nc)
    js = nc.jetstream()
    batch = f"b{uuid.uuid4().hex[:6]}"
    answer = "long answer " * 100_000  # 1.2 MB: more than the stock bus takes in one message
    try:
        seqs = []
        for case in ("ok", "bad"):
            run_id = f"evb-{batch}-{case}"
            full = CaseResult(case_id=case, run_id=run_id, harness="h@1", answer=answer)
            slim = await offload_result(js, full, attempt=1)
            assert slim.payload is not None
            if case == "bad":
                await put_object(js, ARTIFACTS, slim.payload.name, encode(ResultPayload(answer="other")))
            event = CaseJudged(
                batch_id=batch,
                case_id=case,
                run_id=run_id,
                status="judged",
                result=slim,
                plan=CasePlan(sinks=(JsonlSink(path="unused.jsonl"),)),
            )
            seqs.append((await pub.publish_event(event)).seq)
        await eventually(lambda: exporter_caught_up(nc, max(seqs), 2), timeout_s=30, what="both cases exported")
        by_case = {ev.case_id: ev for ev in await exported_on_stream(nc, batch)}
        assert by_case["ok"].status == "exported"
        assert sink.answers == {f"evb-{batch}-ok": answer}  # loaded back; the replaced one never sent
        assert by_case["bad"].status == "failed"
        [outcome] = by_case["bad"].outcomes
        assert outcome.error is not None
        assert "tampered with or replaced" in outcome.error
    finally:
        await svc.stop()
        await pub.stop()
        await nc.close()
