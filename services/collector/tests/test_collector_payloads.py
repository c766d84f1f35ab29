"""A deferred (`control-plane`) case whose result was offloaded, through a real collector on a
nats-server with a stock 1 MB `max_payload`: the collector loads the parts, completes the trace
and offloads the completed result under its own name (the executed event's reference stays
true); a replaced payload is not completed on other bytes."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import pytest
from nats.aio.client import Client as NatsClient

from evalbus.infra.nats import STOCK_MAX_PAYLOAD, NatsServer
from evalbus.testing.pipeline import eventually
from evalbus_collector.service import build_collector
from evalbus_collector.settings import CollectorSettings
from evalbus_contracts import (
    CaseCollected,
    CaseExecuted,
    CasePlan,
    CaseResult,
    Error,
    ResultPayload,
    ToolCall,
    decode_event,
    encode,
    encode_token,
)
from evalbus_contracts.streams import ARTIFACTS
from evalbus_runtime import Publisher, Service, connect, ensure_topology
from evalbus_runtime.objects import ObjectDigestError, put_object
from evalbus_runtime.payloads import load_result, offload_result

pytestmark = pytest.mark.integration


@pytest.fixture
async def collector(fresh_nats: NatsServer) -> AsyncIterator[NatsClient]:
    svc = Service(CollectorSettings(service="collector", nats_url=fresh_nats.url, otlp_port=-1))
    build_collector(svc, CollectorSettings(service="collector", otlp_port=-1))
    await svc.start()
    nc = await connect(fresh_nats.url, "t")
    await ensure_topology(nc.jetstream())
    try:
        yield nc
    finally:
        await nc.close()
        await svc.stop()


async def collected(nc: NatsClient, batch: str) -> list[CaseCollected]:
    js = nc.jetstream()
    subject = f"case.collected.{encode_token(batch)}.*"
    info = await js.stream_info("CASES", subjects_filter=subject)
    total = sum((info.state.subjects or {}).values())
    out: list[CaseCollected] = []
    if not total:
        return out
    sub = await js.subscribe(subject, ordered_consumer=True)
    try:
        for _ in range(total):
            event = decode_event((await sub.next_msg(timeout=5)).data)
            assert isinstance(event, CaseCollected)
            out.append(event)
    finally:
        await sub.unsubscribe()
    return out


def deferred(batch: str, case: str, result: CaseResult) -> CaseExecuted:
    return CaseExecuted(
        batch_id=batch,
        case_id=case,
        run_id=result.run_id,
        status="succeeded",
        result=result,
        plan=CasePlan(),
        trace_complete=False,
    )


async def test_an_offloaded_deferred_result_is_completed_and_offloaded_again(collector: NatsClient) -> None:
    nc = collector
    assert nc.max_payload == STOCK_MAX_PAYLOAD
    js = nc.jetstream()
    pub = Publisher(nc)
    batch = f"b{uuid.uuid4().hex[:6]}"
    trace = tuple(ToolCall(id=f"c{i}", name="shell", args={"note": "x" * 1000}, t=float(i)) for i in range(1500))
    try:
        for case in ("ok", "bad"):
            run_id = f"evb-{batch}-{case}"
            slim = await offload_result(
                js, CaseResult(case_id=case, run_id=run_id, harness="h@1", trace=trace), attempt=1
            )
            assert slim.payload is not None
            if case == "bad":
                await put_object(js, ARTIFACTS, slim.payload.name, encode(ResultPayload()))
            await pub.publish_event(deferred(batch, case, slim))

        async def both() -> bool:
            return len(await collected(nc, batch)) == 2

        await eventually(both, timeout_s=30, what="both cases collected")
        by_case = {ev.case_id: ev for ev in await collected(nc, batch)}
        ok = by_case["ok"].result
        assert ok.payload is not None
        assert ok.payload.name == f"runs/evb-{batch}-ok/a1/collected.json"
        full = await load_result(js, ok)
        assert full.trace[: len(trace)] == trace
        assert any(isinstance(e, Error) and "no trace reference" in e.message for e in full.trace)
        # The executed event's own object is untouched, so its reference still verifies.
        executed = await offload_result(
            js, CaseResult(case_id="ok", run_id=f"evb-{batch}-ok", harness="h@1", trace=trace), attempt=1
        )
        assert (await load_result(js, executed)).trace == trace

        bad = by_case["bad"].result
        assert bad.payload is not None
        assert bad.payload.name.endswith("/result.json")  # still the replaced reference: the judge refuses it
        assert any(isinstance(e, Error) and "tampered with or replaced" in e.message for e in bad.trace)
        with pytest.raises(ObjectDigestError):
            await load_result(js, bad)
    finally:
        await pub.stop()
