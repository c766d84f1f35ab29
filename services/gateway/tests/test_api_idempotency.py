"""`Idempotency-Key` against a real nats-server and PostgreSQL: a retry (byte-identical or
re-serialised) gets the same batch and publishes no second `batch.requested`; the key with another
body is a 409 `idempotency_key_reused` naming the header, and the first batch is unchanged; another
principal's key is another batch; of concurrent requests with one key and different bodies one wins.
All of it also after JetStream's duplicate window has forgotten the batch's `Nats-Msg-Id`, with the
batch still on the stream or only in the event store. The digest rule is tested on its own first."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from typing import Any

import aiohttp
import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.testing.bus import window_passed
from evalbus.testing.pipeline import eventually
from evalbus_api.models import ErrorBody
from evalbus_contracts import (
    BatchRequested,
    BatchSpec,
    ContainsJudge,
    ExactJudge,
    decode_event,
    to_builtins,
)
from evalbus_contracts.objects import DatasetIndex, ObjectRef
from evalbus_contracts.streams import CASES
from evalbus_gateway.api.idempotency import spec_digest
from evalbus_gateway.api.routes import idempotent_batch_id
from evalbus_gateway.store import get_batch, get_batch_request
from evalbus_gateway.testing import BatchScript, RunningGateway, batch_spec, member, running_gateway
from evalbus_runtime import Publisher
from evalbus_runtime.bus import ensure_stream

ALICE, BOB = "tok-alice", "tok-bob"


# ---------------------------------------------------------------- pure


@pytest.mark.unit
def test_the_digest_is_of_the_decoded_spec_not_of_its_bytes() -> None:
    spec = batch_spec(("c1", "c2"))
    doc = to_builtins(spec)
    reordered = json.loads(json.dumps(doc), object_pairs_hook=lambda pairs: dict(reversed(pairs)))
    again = msgspec.json.decode(json.dumps(reordered, indent=3).encode(), type=type(spec))
    assert spec_digest(again) == spec_digest(spec)
    assert spec_digest(msgspec.structs.replace(spec, labels={"b": "2", "a": "1"})) == spec_digest(
        msgspec.structs.replace(spec, labels={"a": "1", "b": "2"})
    )
    assert spec_digest(batch_spec(("c1", "c3"))) != spec_digest(spec)
    assert spec_digest(msgspec.structs.replace(spec, labels={"a": "1"})) != spec_digest(spec)


@pytest.mark.unit
def test_the_digest_knows_a_dataset_by_its_content_and_leaves_out_the_index_the_gateway_fills_in() -> None:
    spec = batch_spec(())
    ref = ObjectRef(bucket="datasets", name="ds-1", size=10, sha256="a" * 64)

    def naming(ref: ObjectRef, index: DatasetIndex | None = None) -> BatchSpec:
        return msgspec.structs.replace(
            spec, suite=msgspec.structs.replace(spec.suite, dataset_ref=ref, dataset_index=index)
        )

    uploaded_again = msgspec.structs.replace(ref, name="ds-2")
    assert spec_digest(naming(uploaded_again, DatasetIndex(cases=1))) == spec_digest(naming(ref))
    assert spec_digest(naming(msgspec.structs.replace(ref, sha256="b" * 64))) != spec_digest(naming(ref))
    assert spec_digest(naming(msgspec.structs.replace(ref, size=11))) != spec_digest(naming(ref))


# ---------------------------------------------------------------- against the gateway


@pytest.fixture
async def gateway(gw_nats: str, database_url: str) -> AsyncIterator[RunningGateway]:
    async with running_gateway(gw_nats, database_url, tokens={ALICE: member("alice"), BOB: member("bob")}) as gw:
        yield gw


def headers(token: str, key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Idempotency-Key": key, "Content-Type": "application/json"}


async def post(gw: RunningGateway, token: str, key: str, body: Any, path: str = "/v1/batches") -> tuple[int, Any]:
    """POST `body` (a document, or its bytes exactly) with the key; status and JSON answer."""
    data = body if isinstance(body, bytes) else msgspec.json.encode(body)
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{gw.base_url}{path}", data=data, headers=headers(token, key)) as resp,
    ):
        return resp.status, await resp.json()


def spec_doc(cases: tuple[str, ...] = ("c1", "c2"), **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = to_builtins(batch_spec(cases))
    doc.update(extra)
    return doc


async def requests_on_stream(nc: NatsClient, batch_id: str) -> list[BatchRequested]:
    """Every `batch.requested` of the batch the CASES stream holds."""
    js = nc.jetstream()
    info = await js.stream_info("CASES", subjects_filter=f"batch.requested.{batch_id}")
    count = sum((info.state.subjects or {}).values())
    found: list[BatchRequested] = []
    seq = 0
    for _ in range(count):
        raw = await js.get_msg("CASES", seq + 1, subject=f"batch.requested.{batch_id}", next=True)
        seq = int(raw.seq or 0)
        event = decode_event(raw.data or b"")
        assert isinstance(event, BatchRequested)
        found.append(event)
    return found


def reused(status: int, body: Any, batch_id: str) -> bool:
    if status != 409:
        return False
    error = msgspec.convert(body, ErrorBody).error
    assert (error.code, error.field) == ("idempotency_key_reused", "Idempotency-Key")
    assert batch_id in error.message
    return True


async def recorded(gw: RunningGateway, batch_id: str) -> None:
    async def check() -> bool:
        return await get_batch_request(gw.state.pool, batch_id) is not None

    await eventually(check, timeout_s=20, what=f"the batch.requested of {batch_id} recorded")


async def test_a_retry_is_the_same_batch_and_publishes_nothing(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    nc, _ = bus
    key = uuid.uuid4().hex
    raw = json.dumps(spec_doc()).encode()
    reserialised = json.dumps(dict(reversed(spec_doc().items())), indent=2).encode()
    answers = [await post(gateway, ALICE, key, body) for body in (raw, raw, reserialised)]
    assert [status for status, _ in answers] == [202, 202, 202], answers
    ids = {body["batch_id"] for _, body in answers}
    assert ids == {idempotent_batch_id("alice", key)}
    [requested] = await requests_on_stream(nc, ids.pop())
    assert requested.request_digest == spec_digest(batch_spec(("c1", "c2")))


async def test_the_key_with_another_body_is_a_409_and_the_batch_is_unchanged(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    nc, _ = bus
    key = uuid.uuid4().hex
    status, body = await post(gateway, ALICE, key, spec_doc(("c1", "c2")))
    assert status == 202, body
    batch_id = body["batch_id"]
    for other in (spec_doc(("c1", "c2", "c3")), spec_doc(("c1", "c2"), labels={"run": "2"})):
        status, answer = await post(gateway, ALICE, key, other)
        assert reused(status, answer, batch_id), (status, answer)
    [requested] = await requests_on_stream(nc, batch_id)
    assert [c.id for c in requested.spec.suite.cases] == ["c1", "c2"]
    assert requested.spec.labels == {}
    await recorded(gateway, batch_id)
    view = await get_batch(gateway.state.pool, batch_id)
    assert view is not None
    assert view.total_runs == 2


async def test_another_principal_with_the_same_key_gets_another_batch(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    nc, _ = bus
    key = uuid.uuid4().hex
    alice = await post(gateway, ALICE, key, spec_doc(("c1",)))
    bob = await post(gateway, BOB, key, spec_doc(("c1", "c2")))
    assert alice[0] == bob[0] == 202, (alice, bob)
    assert alice[1]["batch_id"] != bob[1]["batch_id"]
    [of_alice] = await requests_on_stream(nc, alice[1]["batch_id"])
    [of_bob] = await requests_on_stream(nc, bob[1]["batch_id"])
    assert (of_alice.submitted_by, len(of_alice.spec.suite.cases)) == ("alice", 1)
    assert (of_bob.submitted_by, len(of_bob.spec.suite.cases)) == ("bob", 2)


async def test_of_concurrent_requests_with_one_key_one_body_wins(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    nc, _ = bus
    key = uuid.uuid4().hex
    bodies = [spec_doc(("c1",)), spec_doc(("c1", "c2"))] * 4
    answers = await asyncio.gather(*(post(gateway, ALICE, key, body) for body in bodies))
    batch_id = idempotent_batch_id("alice", key)
    [requested] = await requests_on_stream(nc, batch_id)
    winner = len(requested.spec.suite.cases)
    for body, (status, answer) in zip(bodies, answers, strict=True):
        if len(body["suite"]["cases"]) == winner:
            assert (status, answer["batch_id"]) == (202, batch_id), answer
        else:
            assert reused(status, answer, batch_id), (status, answer)


# ---------------------------------------------------------------- after the duplicate window


@pytest.fixture
async def short_window(gateway: RunningGateway, bus: tuple[NatsClient, Publisher]) -> AsyncIterator[None]:
    """The CASES stream with a 1 s duplicate window (this module's own nats-server), so a test can
    get past it; the contract's window again afterwards."""
    js = bus[0].jetstream()
    await ensure_stream(js, msgspec.structs.replace(CASES, duplicate_window_s=1.0))
    try:
        yield
    finally:
        await ensure_stream(js, CASES)


@pytest.mark.usefixtures("short_window")
async def test_after_the_window_a_retry_still_publishes_nothing_and_another_body_is_a_409(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    nc, _ = bus
    key = uuid.uuid4().hex
    first, other = spec_doc(("c1", "c2")), spec_doc(("c9",))
    status, body = await post(gateway, ALICE, key, first)
    assert status == 202, body
    batch_id = body["batch_id"]
    await recorded(gateway, batch_id)
    await window_passed(nc)

    # The stream holds the batch: it answers.
    assert await post(gateway, ALICE, key, first) == (status, body)
    assert len(await requests_on_stream(nc, batch_id)) == 1
    assert reused(*await post(gateway, ALICE, key, other), batch_id)
    assert len(await requests_on_stream(nc, batch_id)) == 1

    # Only the event store still has it.
    await nc.jetstream().purge_stream("CASES", subject=f"batch.requested.{batch_id}")
    assert await requests_on_stream(nc, batch_id) == []
    assert await post(gateway, ALICE, key, first) == (status, body)
    assert await requests_on_stream(nc, batch_id) == []
    assert reused(*await post(gateway, ALICE, key, other), batch_id)
    assert await requests_on_stream(nc, batch_id) == []


@pytest.mark.usefixtures("short_window")
async def test_after_the_window_a_rejudge_retry_publishes_only_missing_runs_and_other_judges_are_a_409(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    nc, pub = bus
    spec = msgspec.structs.replace(batch_spec(("c1", "c2")), judges=(ExactJudge(id="exact"),))
    script = BatchScript("b" + uuid.uuid4().hex[:12], spec)
    await pub.publish_events([script.requested(), *script.case_events("c1"), *script.case_events("c2")])

    async def finalized() -> bool:
        view = await get_batch(gateway.state.pool, script.batch_id)
        return view is not None and view.finalized_at is not None

    await eventually(finalized, timeout_s=30, what=f"{script.batch_id} finalized")
    key, path = uuid.uuid4().hex, f"/v1/batches/{script.batch_id}/rejudge"
    status, body = await post(gateway, ALICE, key, {}, path)
    assert status == 202, body
    new = body["batch_id"]

    async def executed_on_stream() -> int:
        info = await nc.jetstream().stream_info("CASES", subjects_filter=f"case.executed.{new}.>")
        return sum((info.state.subjects or {}).values())

    async def both_published() -> bool:
        return await executed_on_stream() == 2

    await eventually(both_published, timeout_s=20, what="the replayed runs published")
    await window_passed(nc)

    same_judges = {"judges": to_builtins(script.spec.judges)}  # the old judges, named: the same new batch
    assert await post(gateway, ALICE, key, same_judges, path) == (status, body)
    assert (len(await requests_on_stream(nc, new)), await executed_on_stream()) == (1, 2)

    # A first attempt that stopped after one run: the retry publishes the other, and only it.
    await nc.jetstream().purge_stream("CASES", subject=f"case.executed.{new}.c2")
    assert await executed_on_stream() == 1
    assert await post(gateway, ALICE, key, {}, path) == (status, body)
    assert (len(await requests_on_stream(nc, new)), await executed_on_stream()) == (1, 2)
    other = {"judges": [to_builtins(ContainsJudge(id="contains"))]}
    assert reused(*await post(gateway, ALICE, key, other, path), new)
    [requested] = await requests_on_stream(nc, new)
    assert (requested.rejudge_of, requested.spec.judges) == (script.batch_id, script.spec.judges)
    assert await executed_on_stream() == 2
