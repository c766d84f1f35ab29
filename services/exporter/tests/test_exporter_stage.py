"""The exporter on the bus: judged cases in, `case.exported` out, at most two exports at once
across replicas (the consumer's max_ack_pending)."""

from __future__ import annotations

import asyncio
import time
import uuid
from pathlib import Path

import pytest

from evalbus.infra.nats import NatsServer
from evalbus_contracts import (
    CaseExported,
    CaseJudged,
    CasePlan,
    CaseResult,
    JsonlSink,
    SinkOutcome,
    SinkSpec,
    decode_event,
    encode_token,
)
from evalbus_exporter.service import ExporterSettings, build_exporter
from evalbus_exporter.sinks.base import CaseSink
from evalbus_runtime import Publisher, Service, connect, ensure_topology

pytestmark = pytest.mark.integration


class SlowSink:
    """Records how many exports run at once."""

    name = "slow"
    running = 0
    peak = 0
    done = 0

    async def export(self, judged: CaseJudged) -> SinkOutcome:
        SlowSink.running += 1
        SlowSink.peak = max(SlowSink.peak, SlowSink.running)
        await asyncio.sleep(0.1)  # the export's own work, not a synchronisation
        SlowSink.running -= 1
        SlowSink.done += 1
        return SinkOutcome(sink=self.name, status="ok", external_id=judged.run_id)

    async def close(self) -> None:
        return None


async def test_two_replicas_export_every_case_once_and_never_more_than_two_at_once(
    fresh_nats: NatsServer, tmp_path: Path
) -> None:
    def factory(spec: SinkSpec, batch_id: str) -> CaseSink:
        return SlowSink()

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
        for i in range(n):
            result = CaseResult(case_id=f"c{i}", run_id=f"evb-{batch}-c{i}", harness="h@1")
            await pub.publish_event(
                CaseJudged(
                    batch_id=batch,
                    case_id=f"c{i}",
                    run_id=result.run_id,
                    status="judged",
                    result=result,
                    plan=CasePlan(sinks=(JsonlSink(path="unused.jsonl"),)),
                )
            )
        exported: dict[str, CaseExported] = {}
        sub = await nc.jetstream().subscribe(f"case.exported.{encode_token(batch)}.*", ordered_consumer=True)
        deadline = time.monotonic() + 30
        while len(exported) < n and time.monotonic() < deadline:
            msg = await sub.next_msg(timeout=10)
            ev = decode_event(msg.data)
            assert isinstance(ev, CaseExported)
            assert ev.run_id not in exported
            exported[ev.run_id or ""] = ev
        assert len(exported) == n
        assert all(ev.status == "exported" for ev in exported.values())
        assert SlowSink.peak <= 2
        assert SlowSink.peak == 2  # the limit was reached, so it is what held
    finally:
        for svc in services:
            await svc.stop()
        await pub.stop()
        await nc.close()
