"""Fan-out of a batch whose cases are in an uploaded dataset, on a nats-server with a stock 1 MB
`max_payload`: the same runs as the same cases inline, and poison — never a partial fan-out — for a
dataset that is gone or not the bytes its reference pins."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator

import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.infra.nats import NatsServer
from evalbus_contracts import (
    BatchPolicy,
    BatchRequested,
    BatchSpec,
    CaseRequested,
    CaseSpec,
    CommandHarness,
    DatasetIndex,
    ObjectRef,
    SuiteSpec,
    encode,
)
from evalbus_contracts.streams import DATASETS
from evalbus_dispatcher.fanout import fan_out, fan_out_batch
from evalbus_runtime import Poison, connect, ensure_topology
from evalbus_runtime.objects import put_object

pytestmark = pytest.mark.integration

HARNESS = CommandHarness(id="agent", command=("agent",))


@pytest.fixture
async def nc(stock_nats: NatsServer) -> AsyncIterator[NatsClient]:
    client = await connect(stock_nats.url, "fanout-test")
    await ensure_topology(client.jetstream())
    yield client
    await client.close()


def cases(n: int) -> list[CaseSpec]:
    return [CaseSpec(id=f"c{i}", input=f"task {i} " + "y" * 3000, expected=str(i), tags=("t",)) for i in range(n)]


def requested(suite: SuiteSpec, trials: int = 1) -> BatchRequested:
    spec = BatchSpec(suite=suite, harness=HARNESS, policy=BatchPolicy(trials=trials))
    return BatchRequested(batch_id=f"b{uuid.uuid4().hex[:10]}", spec=spec, submitted_by="alice")


def content(req: CaseRequested) -> tuple[object, ...]:
    """A request without its own event id and time."""
    return (req.batch_id, req.run_id, req.trial, req.case, req.harness, req.plan)


async def upload(nc: NatsClient, rows: list[CaseSpec]) -> ObjectRef:
    body = b"".join(encode(c) + b"\n" for c in rows) + b"\n"  # a trailing blank line is skipped
    return await put_object(nc.jetstream(), DATASETS, f"ds-{uuid.uuid4().hex}", body)


async def test_a_dataset_batch_fans_out_exactly_like_the_same_cases_inline(nc: NatsClient) -> None:
    rows = [*cases(600), CaseSpec(id="c7", input="a repeated id: the first wins")]
    ref = await upload(nc, rows)
    assert ref.size > 1024 * 1024
    by_ref = requested(
        SuiteSpec(id="s", dataset_ref=ref, dataset_index=DatasetIndex(cases=600)),
        trials=2,
    )
    inline = msgspec.structs.replace(
        by_ref, spec=msgspec.structs.replace(by_ref.spec, suite=SuiteSpec(id="s", cases=tuple(rows)))
    )
    runs = await fan_out_batch(nc.jetstream(), by_ref)
    assert len(runs) == 1200
    assert [content(r) for r in runs] == [content(r) for r in fan_out(inline)]
    assert runs[14].case.input.startswith("task 7 ")


async def test_a_tampered_or_missing_dataset_is_poison(nc: NatsClient) -> None:
    rows = cases(400)
    ref = await upload(nc, rows)
    changed = [*rows[:-1], msgspec.structs.replace(rows[-1], expected="999")]  # as long as "399"
    await put_object(nc.jetstream(), DATASETS, ref.name, b"".join(encode(c) + b"\n" for c in changed) + b"\n")
    req = requested(SuiteSpec(id="s", dataset_ref=ref, dataset_index=DatasetIndex(cases=400)))
    with pytest.raises(Poison, match=r"cannot be used: object .* does not match its reference"):
        await fan_out_batch(nc.jetstream(), req)
    gone = requested(SuiteSpec(id="s", dataset_ref=msgspec.structs.replace(ref, name="ds-gone")))
    with pytest.raises(Poison, match="is not in bucket 'datasets'"):
        await fan_out_batch(nc.jetstream(), gone)
