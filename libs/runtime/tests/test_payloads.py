"""Large results off the bus: the threshold decision (pure), the split and join of a result, and the
round trip through a real nats-server with a stock 1 MB `max_payload` — including an object
replaced under the same name, which every reader refuses."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.cli.dlq import read_letters, redrive_letter
from evalbus.infra.nats import STOCK_MAX_PAYLOAD, NatsServer
from evalbus.testing.bus import advisory_listener, dead_letters, exhaust, make_consumer, request
from evalbus.testing.pipeline import eventually
from evalbus_contracts import (
    Artifact,
    CaseExecuted,
    CasePlan,
    CaseRequested,
    CaseResult,
    Log,
    Message,
    ObjectRef,
    PromptSnapshot,
    ToolCall,
    decode,
    decode_token,
    encode,
)
from evalbus_contracts.streams import ARTIFACTS
from evalbus_runtime import ConsumerLoop, Delivery, Publisher, ServiceMetrics, Stage, connect, ensure_topology
from evalbus_runtime.bus import ensure_consumer
from evalbus_runtime.objects import ObjectDigestError, put_object
from evalbus_runtime.payloads import (
    DEFAULT_INLINE_MAX_BYTES,
    field_sizes,
    first_bad_object,
    join_result,
    keep_offloaded,
    load_result,
    object_refs,
    offload_result,
    plan_offload,
    run_prefix,
    split_result,
)


def big_result(run_id: str = "evb-b1-c1", *, lines: int = 2000, width: int = 1000) -> CaseResult:
    answer = "A" * (lines * width // 4)
    trace = tuple(
        ToolCall(id=f"call-{i}", name="shell", args={"line": str(i) + "x" * width}, t=float(i)) for i in range(lines)
    )
    return CaseResult(
        case_id="c1",
        run_id=run_id,
        harness="h@1",
        answer=answer,
        trace=(*trace, Message(role="assistant", text="done", t=float(lines))),
        snapshot=PromptSnapshot(output=answer),
    )


# ---------------------------------------------------------------- the decision (pure)


def test_nothing_moves_while_the_parts_fit() -> None:
    assert plan_offload({"answer": 10, "trace": 100, "snapshot": 10}, 256) == ()
    assert plan_offload({"answer": 0, "trace": 256, "snapshot": 0}, 256) == ()


def test_the_largest_part_moves_first_until_the_rest_fits() -> None:
    assert plan_offload({"answer": 100, "trace": 1000, "snapshot": 100}, 256) == ("trace",)
    assert plan_offload({"answer": 300, "trace": 1000, "snapshot": 300}, 256) == ("answer", "trace", "snapshot")
    assert plan_offload({"answer": 300, "trace": 1000, "snapshot": 10}, 256) == ("answer", "trace")


def test_an_empty_part_never_moves() -> None:
    assert plan_offload({"answer": 0, "trace": 5000, "snapshot": 0}, 1) == ("trace",)


def test_ties_move_in_field_order() -> None:
    assert plan_offload({"answer": 200, "trace": 200, "snapshot": 0}, 256) == ("answer",)


def test_field_sizes_are_the_encoded_bytes() -> None:
    result = big_result(lines=10, width=10)
    sizes = field_sizes(result)
    assert sizes["trace"] == len(encode(result.trace))
    assert sizes["answer"] == len(encode(result.answer))
    assert field_sizes(CaseResult(case_id="c", run_id="r", harness="h")) == {"answer": 0, "trace": 0, "snapshot": 0}


def test_split_then_join_is_the_result_again() -> None:
    result = big_result(lines=50, width=10)
    for fields in (("trace",), ("answer", "snapshot"), ("answer", "trace", "snapshot")):
        slim, payload = split_result(result, fields)
        assert slim.offloaded == fields
        assert ("trace" in fields) == (slim.trace == ())
        assert join_result(slim, payload) == result


def test_a_stage_s_update_keeps_the_offloaded_form() -> None:
    result = big_result(lines=20, width=10)
    slim, payload = split_result(result, ("trace",))
    ref = ObjectRef(bucket="artifacts", name="runs/x/a1/result.json", size=1, sha256="0" * 64)
    stored = msgspec.structs.replace(slim, payload=ref)
    loaded = join_result(stored, payload)
    judged = msgspec.structs.replace(loaded, scores=())
    kept = keep_offloaded(judged, stored)
    assert kept.trace == ()
    assert kept.payload == ref
    assert kept.offloaded == ("trace",)
    assert keep_offloaded(judged, loaded) is judged  # nothing was offloaded: unchanged


def test_run_prefix_is_deterministic_readable_and_reversible() -> None:
    assert run_prefix("evb-b1-c1", 2) == "runs/evb-b1-c1/a2"
    odd = run_prefix("evb-b1-case.one/two", 1)
    token = odd.split("/")[1]
    assert decode_token(token.replace("=", "~")) == "evb-b1-case.one/two"
    long = run_prefix("r" * 400, 1)
    assert long.startswith("runs/sha256-")
    assert len(long) < 100
    ObjectRef(bucket="artifacts", name=odd + "/result.json", size=0, sha256="0" * 64)
    assert decode(encode(ObjectRef(bucket="artifacts", name=odd + "/x", size=0, sha256="0" * 64)), ObjectRef)


def test_object_refs_finds_payloads_and_stored_artifacts_only() -> None:
    ref = ObjectRef(bucket="artifacts", name="runs/r/a1/result.json", size=5, sha256="a" * 64)
    stored = Artifact(name="big", ref="artifacts/runs/r/a1/files/big.bin", size=7, sha256="b" * 64)
    declared = Artifact(name="small", ref="out/small.txt")
    result = CaseResult(case_id="c", run_id="r", harness="h", trace=(stored, declared, Log(stream="stdout", text="x")))
    doc = msgspec.json.decode(encode(msgspec.structs.replace(result, payload=ref)))
    found = list(object_refs(doc))
    assert ref in found
    assert ObjectRef(bucket="artifacts", name="runs/r/a1/files/big.bin", size=7, sha256="b" * 64) in found
    assert len(found) == 2


# ---------------------------------------------------------------- on a real nats-server (1 MB)

integration = pytest.mark.integration


@pytest.fixture
async def stock_bus(stock_nats: NatsServer) -> AsyncIterator[NatsClient]:
    nc = await connect(stock_nats.url, "payloads-test")
    await ensure_topology(nc.jetstream())
    yield nc
    await nc.close()


@integration
async def test_a_result_bigger_than_a_message_rides_as_a_reference_and_loads_back(stock_bus: NatsClient) -> None:
    js = stock_bus.jetstream()
    run_id = f"evb-{uuid.uuid4().hex[:8]}-c1"
    result = big_result(run_id)
    assert len(encode(result)) > 2 * STOCK_MAX_PAYLOAD
    slim = await offload_result(js, result, attempt=1)
    assert slim.payload is not None
    assert slim.payload.name == f"runs/{run_id}/a1/result.json"
    assert len(encode(slim)) <= DEFAULT_INLINE_MAX_BYTES
    assert await load_result(js, slim) == result
    again = await offload_result(js, result, attempt=1)  # a redelivery writes the same bytes, same name
    assert again == slim
    assert await offload_result(js, slim, attempt=1) is slim


@integration
async def test_a_small_result_is_untouched(stock_bus: NatsClient) -> None:
    result = big_result(lines=3, width=10)
    assert await offload_result(stock_bus.jetstream(), result, attempt=1) is result


@integration
async def test_an_object_replaced_under_its_name_is_refused_by_readers_and_the_check(stock_bus: NatsClient) -> None:
    js = stock_bus.jetstream()
    run_id = f"evb-{uuid.uuid4().hex[:8]}-c1"
    slim = await offload_result(js, big_result(run_id), attempt=1)
    assert slim.payload is not None
    body = encode(msgspec.structs.replace(slim, trace_ref=None))
    assert await first_bad_object(js, [(7, body.decode())]) == (None, None, 1)
    other = encode(split_result(big_result(run_id, lines=10, width=5), ("trace",))[1])
    await put_object(js, ARTIFACTS, slim.payload.name, other)
    with pytest.raises(ObjectDigestError):
        await load_result(js, slim)
    seq, detail, _ = await first_bad_object(js, [(7, body.decode())])
    assert seq == 7
    assert detail is not None
    assert slim.payload.name in detail


@integration
async def test_an_output_over_max_payload_is_dead_lettered_at_once_not_retried(stock_nats: NatsServer) -> None:
    nc = await connect(stock_nats.url, "too-large-test")
    try:
        await ensure_topology(nc.jetstream())
        pub = Publisher(nc)
        await pub.start()
        batch = f"b{uuid.uuid4().hex[:8]}"
        service = f"w{batch}"
        calls: list[int] = []

        async def handle(event: CaseRequested, delivery: Delivery) -> list[CaseExecuted]:
            calls.append(delivery.num_delivered)
            result = CaseResult(case_id="c1", run_id=event.run_id or "", harness="h@1", answer="z" * STOCK_MAX_PAYLOAD)
            return [
                CaseExecuted(
                    batch_id=batch,
                    case_id="c1",
                    run_id=event.run_id,
                    status="succeeded",
                    result=result,
                    plan=CasePlan(),
                )
            ]

        stage = Stage(consumer=make_consumer(batch), handler=handle, accepts=(CaseRequested,))
        await ensure_consumer(nc.jetstream(), stage.consumer)
        loop = ConsumerLoop(nc, pub, stage, service=service, metrics=ServiceMetrics(service))
        await loop.start()
        try:
            await pub.publish_event(request(batch, "c1"))

            async def lettered() -> bool:
                return bool(await dead_letters(nc, service))

            await eventually(lettered, timeout_s=20, what=f"the dead letter (handled: {calls})")
            [letter] = await dead_letters(nc, service)
            assert letter.reason.startswith("too_large: ")
            assert "max_payload" in letter.reason
            assert calls == [1]  # never redelivered
        finally:
            await loop.stop(5.0)
            await pub.stop()
    finally:
        await nc.close()


@integration
async def test_an_exhausted_message_too_big_to_copy_whole_is_dead_lettered_with_its_head(stock_bus: NatsClient) -> None:
    """A message near `max_payload` that runs out of deliveries: its letter (the message escaped
    once more, plus a reason, headers and an envelope) would not fit, so it carries the message's
    head and says where the original is, as a poison letter does; a redrive publishes the original
    from the stream. (Before, the copy was whole: the letter's publish was refused as too large and
    the message was never dead-lettered — tried.)"""
    nc = stock_bus
    pub = Publisher(nc)
    await pub.start()
    batch = f"b{uuid.uuid4().hex[:8]}"
    service = f"w{batch}"
    consumer = make_consumer(batch, ack_wait_s=0.5, max_deliver=2)
    await ensure_consumer(nc.jetstream(), consumer)
    listener = await advisory_listener(nc, pub, consumer, service)
    try:
        # Quotes: two bytes each in the message, four in a letter that escapes the message again.
        envelope = len(encode(request(batch, "c1", text="")))
        big = request(batch, "c1", text='"' * ((STOCK_MAX_PAYLOAD - envelope - 1024) // 2))
        await pub.publish_event(big)
        await exhaust(nc, consumer, 2)

        async def lettered() -> bool:
            return bool(await dead_letters(nc, service))

        await eventually(lettered, timeout_s=20, what="the exhausted message's dead letter")
        [letter] = await dead_letters(nc, service)
        assert letter.reason.startswith("max_deliver exhausted")
        assert letter.payload.startswith('{"')
        assert letter.payload.endswith("more bytes: read the original at its stream sequence]")
        assert letter.stream_seq is not None
        original = await nc.jetstream().get_msg("CASES", letter.stream_seq)
        assert decode(original.data or b"", CaseRequested).case.input == big.case.input
        assert letter.payload_cut()

        # `evalbus dlq redrive` publishes the original whole, read from the stream; once the stream
        # has lost it, a letter holding only the head is refused rather than redriven cut.
        [stored] = await read_letters(nc, service)
        redriven = await nc.jetstream().get_msg("CASES", await redrive_letter(nc, stored))
        assert redriven.data == original.data
        assert redriven.subject == original.subject
        await nc.jetstream().delete_msg("CASES", letter.stream_seq)
        with pytest.raises(ValueError, match="holds only the head of its message"):
            await redrive_letter(nc, stored)
    finally:
        await listener.stop(1)
        await pub.stop()
