"""Datasets off the bus, through the gateway on a nats-server with a stock 1 MB `max_payload`: an
upload several times the message limit is checked line by line as it streams in and stored; a batch
naming it is accepted and its `batch.requested` carries the reference, never the cases; a bad
dataset is refused by line and field and nothing of it is kept; a dataset is only the uploader's."""

from __future__ import annotations

import io
import shutil
import tempfile
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from evalbus.infra.nats import STOCK_MAX_PAYLOAD, start_nats
from evalbus.testing.pipeline import read_stream
from evalbus_api.models import DatasetUploaded, ErrorBody
from evalbus_contracts import (
    BatchRequested,
    CaseSpec,
    CommandGrader,
    DatasetIndex,
    ObjectRef,
    SuiteSpec,
    decode_event,
    encode,
)
from evalbus_gateway.testing import RunningGateway, batch_spec, member, running_gateway
from evalbus_runtime.objects import get_object

pytestmark = pytest.mark.integration

ALICE, BOB = "tok-ds-alice", "tok-ds-bob"


@pytest.fixture(scope="module")
def stock_gw_nats() -> Iterator[str]:
    folder = Path(tempfile.mkdtemp(prefix="evalbus-gw-ds-"))
    server = start_nats(folder / "nats", max_payload=STOCK_MAX_PAYLOAD)
    yield server.url
    server.stop()
    shutil.rmtree(folder, ignore_errors=True)


@pytest.fixture
async def gateway(stock_gw_nats: str, database_url: str) -> AsyncIterator[RunningGateway]:
    tokens = {ALICE: member("alice"), BOB: member("bob")}
    async with running_gateway(
        stock_gw_nats, database_url, tokens=tokens, max_dataset_bytes=8 << 20, max_request_bytes=4 << 20
    ) as gw:
        yield gw


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def long_cases(n: int, size: int) -> list[CaseSpec]:
    """Cases with long inputs; every tenth has an objective `command` grader."""
    pad = "x" * size
    return [
        CaseSpec(
            id=f"case-{i}",
            input=f"problem {i}: {pad}",
            expected=str(i),
            graders=(CommandGrader(id="tests", command="true", metric="tests_ok"),) if i % 10 == 0 else (),
        )
        for i in range(n)
    ]


def jsonl(cases: list[CaseSpec]) -> bytes:
    return b"".join(encode(c) + b"\n" for c in cases)


async def chunked(data: bytes, size: int = 100_000) -> AsyncIterator[bytes]:
    for at in range(0, len(data), size):
        yield data[at : at + size]


async def upload(gw: RunningGateway, token: str, body: bytes) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            gw.base_url + "/v1/datasets",
            data=chunked(body),
            headers={**auth(token), "Content-Type": "application/x-ndjson"},
        ) as resp,
    ):
        raw = await resp.read()
        if resp.status == 201:
            return resp.status, msgspec.json.decode(raw, type=DatasetUploaded)
        return resp.status, msgspec.json.decode(raw, type=ErrorBody).error


async def submit(gw: RunningGateway, token: str, suite: SuiteSpec) -> tuple[int, Any]:
    spec = msgspec.structs.replace(batch_spec(), suite=suite)
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            gw.base_url + "/v1/batches",
            data=io.BytesIO(encode(spec)),
            headers={**auth(token), "Content-Type": "application/json"},
        ) as resp,
    ):
        body = await resp.json()
        return resp.status, body if resp.status == 202 else msgspec.convert(body, ErrorBody).error


async def test_a_dataset_larger_than_the_bus_is_uploaded_and_named_by_a_batch(gateway: RunningGateway) -> None:
    cases = long_cases(1200, 2500)
    body = jsonl(cases)
    assert len(body) > 2 * STOCK_MAX_PAYLOAD
    status, uploaded = await upload(gateway, ALICE, body)
    assert status == 201, uploaded
    ref = uploaded.dataset_ref
    assert (ref.bucket, ref.size) == ("datasets", len(body))
    assert uploaded.index == DatasetIndex(cases=1200, objective_metrics=("tests_ok",))
    js = gateway.state.js
    assert await get_object(js, ref) == body

    # Inline, the same suite is more than the bus takes: 413 naming the cases, pointing at uploads.
    status, error = await submit(gateway, ALICE, SuiteSpec(id="big", cases=tuple(cases)))
    assert (status, error.code, error.field) == (413, "payload_too_large", "$.suite.cases")
    assert "POST /v1/datasets" in error.message

    # By reference it is accepted; a client's own index is replaced by the gateway's.
    forged = DatasetIndex(cases=1, objective_metrics=())
    status, accepted = await submit(gateway, ALICE, SuiteSpec(id="big", dataset_ref=ref, dataset_index=forged))
    assert status == 202, accepted
    batch_id = accepted["batch_id"]
    stored = await read_stream(gateway.state.nc, "CASES", (f"batch.requested.{batch_id}",))
    assert len(stored) == 1
    assert len(stored[0].data) < 8 * 1024
    event = decode_event(stored[0].data)
    assert isinstance(event, BatchRequested)
    assert event.spec.suite.cases == ()
    assert event.spec.suite.dataset_ref == ref
    assert event.spec.suite.dataset_index == uploaded.index


async def test_a_bad_dataset_is_refused_by_line_and_field_and_nothing_is_kept(gateway: RunningGateway) -> None:
    js = gateway.state.js
    before = (await js.stream_info("OBJ_datasets")).state.messages
    good = jsonl(long_cases(600, 2500))  # > 1 MB before the first bad line: chunks were written
    bad = (
        b'{"id": "ok-1", "input": "fine"}\n'
        b"\n"
        b'{"id": "t-1", "input": "x", "timout_s": 3}\n'
        b'{"id": "case-3", "input": "a duplicate of an earlier id"}\n'
        b'{"id": "n-1", "input": 7}\n'
        b"not json\n"
    )
    status, error = await upload(gateway, ALICE, good + bad)
    assert status == 400
    assert error.field == "line 603, $.timout_s"
    assert "did you mean `timeout_s`?" in error.message
    assert error.message.endswith("(and 3 more)")
    assert (await js.stream_info("OBJ_datasets")).state.messages == before

    status, error = await upload(gateway, ALICE, b"\n\n")
    assert (status, error.field) == (400, "$")
    assert "at least one case" in error.message


async def test_a_dataset_is_only_its_uploaders_and_must_be_the_bytes_named(gateway: RunningGateway) -> None:
    status, uploaded = await upload(gateway, ALICE, jsonl(long_cases(3, 10)))
    assert status == 201
    ref = uploaded.dataset_ref
    missing = msgspec.structs.replace(ref, name="ds-" + "0" * 24)
    answers = []
    for token, named in ((BOB, ref), (ALICE, missing)):
        status, error = await submit(gateway, token, SuiteSpec(id="s", dataset_ref=named))
        answers.append((status, error.code, error.field, error.message.replace(named.name, "<name>")))
    # Another member's dataset answers exactly like one that does not exist.
    assert answers[0] == answers[1] == (400, "invalid", "$.suite.dataset_ref.name", answers[0][3])
    for changed, field in (
        (msgspec.structs.replace(ref, size=ref.size + 1), "$.suite.dataset_ref.size"),
        (msgspec.structs.replace(ref, sha256="0" * 64), "$.suite.dataset_ref.sha256"),
        (ObjectRef(bucket="artifacts", name=ref.name, size=ref.size, sha256=ref.sha256), "$.suite.dataset_ref.bucket"),
    ):
        status, error = await submit(gateway, ALICE, SuiteSpec(id="s", dataset_ref=changed))
        assert (status, error.field) == (400, field), error
    both = SuiteSpec(id="s", dataset_ref=ref, cases=(CaseSpec(id="a", input="b"),))
    status, error = await submit(gateway, ALICE, both)
    assert (status, error.field) == (400, "$.suite.cases")
    # An admin may name anyone's dataset.
    status, _ = await submit(gateway, gateway.admin_token, SuiteSpec(id="s", dataset_ref=ref))
    assert status == 202
