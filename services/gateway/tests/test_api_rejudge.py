"""`POST /v1/batches/{batch_id}/rejudge` against a real nats-server and PostgreSQL: a finalized
batch's executed runs are republished as `case.executed` of a new batch (new run ids, new judges,
results unchanged), with `batch.requested` carrying `rejudge_of` and no `case.requested`; control-
plane runs are replayed from their collected result; access, 404, 409 and bad bodies are answered
with the offending field. `rejudge_events` (the pure part) is tested on its own first."""

from __future__ import annotations

import asyncio
import io
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from evalbus_api.models import ErrorBody
from evalbus_contracts import (
    BatchRequested,
    CaseCollected,
    CaseExecuted,
    ContainsJudge,
    EventBase,
    ExactJudge,
    Measured,
    batch_run_id,
    decode_event,
    encode_token,
    to_builtins,
)
from evalbus_gateway.api.rejudge import RejudgeError, rejudge_events
from evalbus_gateway.store import get_batch
from evalbus_gateway.testing import BatchScript, RunningGateway, batch_spec, member, running_gateway
from evalbus_runtime import Publisher

ALICE, BOB = "tok-alice", "tok-bob"


# ---------------------------------------------------------------- pure


@pytest.mark.unit
def test_rejudge_events_replaces_ids_and_judges_and_keeps_results() -> None:
    script = BatchScript("bold", batch_spec(("c1", "c2")))
    stored = [script.executed("c1", passed=True), script.executed("c2", passed=False)]
    stored[0] = msgspec.structs.replace(stored[0], output_tail="what c1 printed")
    new_judges = (ContainsJudge(id="contains"),)
    requested, cases = rejudge_events(
        old_batch_id="bold", new_batch_id="bnew", spec=script.spec, judges=new_judges, submitted_by="bob", stored=stored
    )
    assert (requested.batch_id, requested.rejudge_of, requested.submitted_by) == ("bnew", "bold", "bob")
    assert requested.spec.judges == new_judges
    assert requested.spec.suite == script.spec.suite
    assert [c.run_id for c in cases] == [batch_run_id("bnew", "c1"), batch_run_id("bnew", "c2")]
    for old, new in zip(stored, cases, strict=True):
        assert (new.batch_id, new.case_id, new.rejudge_of) == ("bnew", old.case_id, "bold")
        assert new.plan.judges == new_judges
        assert new.plan.submitted_by == "bob"
        assert new.result == msgspec.structs.replace(old.result, run_id=new.run_id)
        assert new.case == old.case
        assert new.trace_complete
        assert new.output_tail == old.output_tail  # the re-judged run's log is its original's


@pytest.mark.unit
def test_rejudge_events_defaults_to_old_judges_and_keeps_trials() -> None:
    spec = msgspec.structs.replace(
        batch_spec(("c1",)),
        judges=(ExactJudge(id="exact"),),
        policy=msgspec.structs.replace(batch_spec().policy, trials=2),
    )
    script = BatchScript("bold", spec)
    stored = []
    for trial in (1, 2):
        executed = script.executed("c1")
        run_id = batch_run_id("bold", "c1", trial)
        result = msgspec.structs.replace(executed.result, run_id=run_id, trial=trial)
        stored.append(msgspec.structs.replace(executed, run_id=run_id, result=result))
    requested, cases = rejudge_events(
        old_batch_id="bold", new_batch_id="bnew", spec=spec, judges=None, submitted_by="alice", stored=stored
    )
    assert requested.spec.judges == (ExactJudge(id="exact"),)
    assert [c.run_id for c in cases] == ["evb-bnew-c1-t1", "evb-bnew-c1-t2"]
    assert [c.result.trial for c in cases] == [1, 2]
    assert all(c.plan.judges == (ExactJudge(id="exact"),) for c in cases)


@pytest.mark.unit
def test_rejudge_events_replays_a_collected_run_as_complete() -> None:
    script = BatchScript("bold", batch_spec(("c1",)))
    executed = msgspec.structs.replace(script.executed("c1"), trace_complete=False, deferred_graders=("steps",))
    extra = Measured(grader_id="steps", metric="tool_calls", value=2.0)
    collected = CaseCollected(
        batch_id="bold",
        case_id="c1",
        run_id=executed.run_id,
        result=msgspec.structs.replace(executed.result, scores=(*executed.result.scores, extra)),
        plan=executed.plan,
        case=executed.case,
    )
    _, [case] = rejudge_events(
        old_batch_id="bold",
        new_batch_id="bnew",
        spec=script.spec,
        judges=None,
        submitted_by="alice",
        stored=[executed, collected],
    )
    assert case.trace_complete
    assert case.deferred_graders == ()
    assert case.result.scores == collected.result.scores
    assert case.result.run_id == "evb-bnew-c1"


@pytest.mark.unit
def test_rejudge_events_refuses_missing_runs() -> None:
    script = BatchScript("bold", batch_spec(("c1", "c2")))
    with pytest.raises(RejudgeError, match="1 executed runs of the 2"):
        rejudge_events(
            old_batch_id="bold",
            new_batch_id="bnew",
            spec=script.spec,
            judges=None,
            submitted_by="alice",
            stored=[script.executed("c1")],
        )


# ---------------------------------------------------------------- against the gateway


@pytest.fixture
async def gateway(gw_nats: str, database_url: str) -> AsyncIterator[RunningGateway]:
    async with running_gateway(gw_nats, database_url, tokens={ALICE: member("alice"), BOB: member("bob")}) as gw:
        yield gw


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


def new_id() -> str:
    return "b" + uuid.uuid4().hex[:12]


async def finalized_batch(
    gw: RunningGateway, pub: Publisher, script: BatchScript, events: list[EventBase] | None = None
) -> None:
    """Publish a whole batch (every case through every stage) and wait until it is finalized."""
    if events is None:
        events = [script.requested()]
        for case_id in script.case_ids:
            events += script.case_events(case_id, passed=case_id != script.case_ids[-1])
    await pub.publish_events(events)

    async def done() -> bool:
        view = await get_batch(gw.state.pool, script.batch_id)
        return view is not None and view.finalized_at is not None

    await eventually(done, f"{script.batch_id} finalized")


async def post(
    gw: RunningGateway, batch_id: str, token: str, body: Any = None, headers: dict[str, str] | None = None
) -> tuple[int, Any]:
    raw = None if body is None else (body if isinstance(body, bytes) else msgspec.json.encode(body))
    data = None if raw is None else io.BytesIO(raw)
    all_headers = {"Authorization": f"Bearer {token}", **(headers or {})}
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{gw.base_url}/v1/batches/{batch_id}/rejudge", data=data, headers=all_headers) as resp,
    ):
        return resp.status, await resp.json()


async def recorded_events(gw: RunningGateway, batch_id: str, count: int) -> list[EventBase]:
    """The batch's events once `count` of them are recorded, in stream order."""
    rows: list[Any] = []

    async def enough() -> bool:
        nonlocal rows
        async with gw.state.pool.acquire() as conn:
            rows = await conn.fetch(
                "SELECT body::text AS body FROM events WHERE batch_id = $1 ORDER BY stream_seq", batch_id
            )
        return len(rows) >= count

    await eventually(enough, f"{count} events of {batch_id} recorded")
    return [decode_event(str(r["body"]).encode()) for r in rows]


async def requested_on_stream(nc: NatsClient, batch_id: str) -> int:
    info = await nc.jetstream().stream_info("CASES", subjects_filter=f"case.requested.{encode_token(batch_id)}.>")
    return sum((info.state.subjects or {}).values())


@pytest.mark.integration
async def test_rejudge_republishes_executed_runs_with_new_judges(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    nc, pub = bus
    script = BatchScript(new_id(), batch_spec(("c1", "c2", "c3")), submitted_by="alice")
    await finalized_batch(gateway, pub, script)
    judges = [to_builtins(ContainsJudge(id="contains"))]

    status, body = await post(gateway, script.batch_id, ALICE, {"judges": judges})
    assert status == 202, body
    new = body["batch_id"]
    assert new != script.batch_id
    assert body["links"]["events"] == f"/v1/batches/{new}/events"

    events = await recorded_events(gateway, new, 4)
    requested = [e for e in events if isinstance(e, BatchRequested)]
    executed = [e for e in events if isinstance(e, CaseExecuted)]
    assert len(requested) == 1
    assert (requested[0].rejudge_of, requested[0].submitted_by) == (script.batch_id, "alice")
    assert requested[0].spec.judges == (ContainsJudge(id="contains"),)
    assert sorted(e.run_id or "" for e in executed) == [batch_run_id(new, c) for c in ("c1", "c2", "c3")]
    for event in executed:
        old = script.executed(event.case_id or "", passed=event.case_id != "c3")
        assert event.rejudge_of == script.batch_id
        assert event.plan.judges == (ContainsJudge(id="contains"),)
        assert event.result.scores == old.result.scores
        assert event.result.answer == old.result.answer
        assert event.result.run_id == event.run_id
    assert await requested_on_stream(nc, new) == 0
    assert await requested_on_stream(nc, script.batch_id) == 3

    view = await get_batch(gateway.state.pool, new)
    assert view is not None
    assert (view.total_runs, view.submitted_by, view.counts.requested, view.counts.executed) == (3, "alice", 0, 3)


@pytest.mark.integration
async def test_rejudge_replays_control_plane_runs_from_their_collected_result(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    _, pub = bus
    script = BatchScript(new_id(), batch_spec(("c1",)))
    executed = msgspec.structs.replace(script.executed("c1"), trace_complete=False)
    extra = Measured(grader_id="steps", metric="tool_calls", value=3.0)
    collected = CaseCollected(
        batch_id=script.batch_id,
        case_id="c1",
        run_id=executed.run_id,
        result=msgspec.structs.replace(executed.result, scores=(*executed.result.scores, extra)),
        plan=executed.plan,
        case=executed.case,
    )
    events: list[EventBase] = [
        script.requested(),
        script.case_requested("c1"),
        executed,
        collected,
        script.judged("c1"),
        script.exported("c1"),
    ]
    await finalized_batch(gateway, pub, script, events)

    status, body = await post(gateway, script.batch_id, gateway.admin_token)
    assert status == 202, body
    replayed = [e for e in await recorded_events(gateway, body["batch_id"], 2) if isinstance(e, CaseExecuted)]
    assert len(replayed) == 1
    assert replayed[0].trace_complete
    assert replayed[0].result.scores == collected.result.scores
    assert replayed[0].plan.judges == script.spec.judges


@pytest.mark.integration
async def test_rejudge_with_the_same_idempotency_key_is_the_same_batch(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    _, pub = bus
    script = BatchScript(new_id(), batch_spec(("c1",)))
    await finalized_batch(gateway, pub, script)
    key = {"Idempotency-Key": "again"}
    first = await post(gateway, script.batch_id, ALICE, headers=key)
    second = await post(gateway, script.batch_id, ALICE, headers=key)
    other = await post(gateway, script.batch_id, ALICE, headers={"Idempotency-Key": "other"})
    assert first[0] == second[0] == other[0] == 202
    assert first[1]["batch_id"] == second[1]["batch_id"] != other[1]["batch_id"]
    events = await recorded_events(gateway, first[1]["batch_id"], 2)
    assert len(events) == 2  # the retry's events were dropped as duplicates

    judges = {"judges": [to_builtins(ContainsJudge(id="contains"))]}
    status, body = await post(gateway, script.batch_id, ALICE, judges, headers=key)
    assert (status, error_of(body)) == (409, ("idempotency_key_reused", "Idempotency-Key"))
    assert first[1]["batch_id"] in body["error"]["message"]
    info = await gateway.state.js.stream_info("CASES", subjects_filter=f"case.*.{first[1]['batch_id']}.>")
    assert sum((info.state.subjects or {}).values()) == 1  # its one run; nothing of the refused request
    requested = [e for e in await recorded_events(gateway, first[1]["batch_id"], 2) if isinstance(e, BatchRequested)]
    assert [r.spec.judges for r in requested] == [script.spec.judges]


def error_of(body: Any) -> tuple[str, str | None]:
    error = msgspec.convert(body, ErrorBody).error
    assert error.message
    return error.code, error.field


@pytest.mark.integration
async def test_rejudge_access_unknown_and_unfinished(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    _, pub = bus
    script = BatchScript(new_id(), batch_spec(("c1", "c2")), submitted_by="alice")
    await finalized_batch(gateway, pub, script)

    status, body = await post(gateway, script.batch_id, BOB)  # another member: like a missing batch
    assert (status, error_of(body)) == (404, ("not_found", "batch_id"))
    status, body = await post(gateway, "b-no-such-batch", gateway.admin_token)
    assert (status, error_of(body)) == (404, ("not_found", "batch_id"))
    status, body = await post(gateway, script.batch_id, "tok-nobody")
    assert (status, error_of(body)) == (401, ("unauthorized", "Authorization"))

    open_batch = BatchScript(new_id(), batch_spec(("c1", "c2")), submitted_by="alice")
    await pub.publish_events([open_batch.requested(), *open_batch.case_events("c1")])

    async def recorded() -> bool:
        view = await get_batch(gateway.state.pool, open_batch.batch_id)
        return view is not None and view.counts.exported == 1

    await eventually(recorded, "the open batch recorded")
    status, body = await post(gateway, open_batch.batch_id, ALICE)
    assert (status, error_of(body)) == (409, ("conflict", "batch_id"))


@pytest.mark.integration
@pytest.mark.parametrize(
    ("body", "status", "code", "field"),
    [
        (b"{", 400, "invalid_json", "$"),
        (b"[]", 400, "invalid", "$"),
        ({"judges": "exact"}, 400, "invalid", "$.judges"),
        ({"judges": [{"kind": "nope", "id": "x"}]}, 400, "invalid", "$.judges[0].kind"),
        ({"judges": [{"kind": "exact"}]}, 400, "invalid", "$.judges[0].id"),
        ({"judges": [{"kind": "exact", "id": "a:b"}]}, 400, "invalid", "$.judges[0].id"),
        ({"judges": [{"kind": "regex", "id": "r", "pattern": "("}]}, 400, "invalid", "$.judges[0].pattern"),
        ({"judges": [], "extra": 1}, 400, "invalid", "$.extra"),
        ({"judges": []}, 400, "invalid", "$.judges"),
        (b"x" * (1024 * 1024 + 1), 413, "payload_too_large", "$"),
    ],
    ids=[
        "not-json",
        "not-object",
        "judges-not-list",
        "unknown-kind",
        "no-id",
        "colon-id",
        "bad-regex",
        "unknown-field",
        "no-judges",
        "too-big",
    ],
)
async def test_rejudge_bad_bodies_name_the_field(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher], body: Any, status: int, code: str, field: str
) -> None:
    _, pub = bus
    script = BatchScript(new_id(), batch_spec(("c1",)))
    await finalized_batch(gateway, pub, script)
    got_status, got = await post(gateway, script.batch_id, gateway.admin_token, body)
    assert (got_status, error_of(got)) == (status, (code, field))


@pytest.mark.integration
async def test_rejudge_is_in_the_openapi_document(gateway: RunningGateway) -> None:
    async with aiohttp.ClientSession() as http, http.get(f"{gateway.base_url}/openapi.json") as resp:
        doc = await resp.json()
    operation = doc["paths"]["/v1/batches/{batch_id}/rejudge"]["post"]
    assert operation["operationId"] == "rejudgeBatch"
    assert {"202", "400", "401", "404", "409", "413"} <= set(operation["responses"])
    assert not operation["requestBody"].get("required", False)
