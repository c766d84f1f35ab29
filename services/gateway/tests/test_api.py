"""The gateway's HTTP API against a real nats-server and PostgreSQL: submitting publishes
`batch.requested`, supersede and cancel publish `batch.cancelled`, reads come from the read
models, members see only their own batches, and the OpenAPI document matches the router."""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import aiohttp
import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from evalbus_api.client import ApiRequestError, GatewayClient
from evalbus_api.models import ErrorBody
from evalbus_contracts import (
    BatchCancelled,
    BatchRequested,
    CaseExecuted,
    EventBase,
    decode_event,
    encode_token,
    to_builtins,
)
from evalbus_gateway.store import get_batch, get_run
from evalbus_gateway.store.recorder import record
from evalbus_gateway.testing import BatchScript, RunningGateway, batch_spec, member, running_gateway
from evalbus_runtime import Publisher

pytestmark = pytest.mark.integration

ALICE, BOB = "tok-alice", "tok-bob"


# ---------------------------------------------------------------- fixtures and helpers


@pytest.fixture
async def gateway(gw_nats: str, database_url: str) -> AsyncIterator[RunningGateway]:
    async with running_gateway(
        gw_nats, database_url, tokens={ALICE: member("alice"), BOB: member("bob")}, page_size=50
    ) as gw:
        yield gw


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    async with aiohttp.ClientSession() as session:
        yield session


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


def spec_json(cases: tuple[str, ...] = ("c1", "c2"), **extra: Any) -> dict[str, Any]:
    doc: dict[str, Any] = to_builtins(batch_spec(cases))
    doc.update(extra)
    return doc


async def eventually(check: Callable[[], Awaitable[bool]], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not await check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        await asyncio.sleep(0.02)


async def last_on_stream(nc: NatsClient, subject: str) -> EventBase | None:
    try:
        raw = await nc.jetstream().get_last_msg("CASES", subject)
    except Exception:
        return None
    return decode_event(raw.data or b"")


async def submit(http: aiohttp.ClientSession, gw: RunningGateway, token: str, body: dict[str, Any]) -> str:
    async with http.post(f"{gw.base_url}/v1/batches", json=body, headers=auth(token)) as resp:
        assert resp.status == 202, await resp.text()
        return str((await resp.json())["batch_id"])


async def recorded(gw: RunningGateway, batch_id: str) -> None:
    async def check() -> bool:
        view = await get_batch(gw.state.pool, batch_id)
        return view is not None and view.submitted_by is not None

    await eventually(check, f"{batch_id} recorded")


def error_of(body: bytes) -> ErrorBody:
    return msgspec.json.decode(body, type=ErrorBody)


# ---------------------------------------------------------------- submit, read back


async def test_submit_publishes_batch_requested(
    gateway: RunningGateway, http: aiohttp.ClientSession, bus: tuple[NatsClient, Publisher]
) -> None:
    nc, _ = bus
    async with http.post(
        f"{gateway.base_url}/v1/batches", json=spec_json(labels={"team": "x"}), headers=auth(ALICE)
    ) as resp:
        assert resp.status == 202
        body = await resp.json()
        assert resp.headers["Location"] == f"/v1/batches/{body['batch_id']}"
    batch_id = body["batch_id"]
    assert body["status"] == "queued"
    assert len(batch_id) == 13
    assert batch_id.startswith("b")
    assert encode_token(batch_id) == batch_id
    assert body["links"]["events"] == f"/v1/batches/{batch_id}/events"
    event = await last_on_stream(nc, f"batch.requested.{batch_id}")
    assert isinstance(event, BatchRequested)
    assert event.batch_id == batch_id
    assert event.submitted_by == "alice"
    assert [c.id for c in event.spec.suite.cases] == ["c1", "c2"]
    assert event.spec.labels == {"team": "x"}

    # Readable at once (from the stream until recorded), then from the read model.
    async with http.get(f"{gateway.base_url}/v1/batches/{batch_id}", headers=auth(ALICE)) as resp:
        assert resp.status == 200
        view = await resp.json()
    assert view["status"] == "queued"
    assert view["total_runs"] == 2
    await recorded(gateway, batch_id)
    async with http.get(f"{gateway.base_url}/v1/batches", headers=auth(ALICE)) as resp:
        listed = await resp.json()
    assert [b["batch_id"] for b in listed["batches"]] == [batch_id]


async def test_idempotency_key_returns_the_same_batch(
    gateway: RunningGateway, http: aiohttp.ClientSession, bus: tuple[NatsClient, Publisher]
) -> None:
    nc, _ = bus
    key = uuid.uuid4().hex
    ids = []
    for _ in range(2):
        async with http.post(
            f"{gateway.base_url}/v1/batches", json=spec_json(), headers={**auth(ALICE), "Idempotency-Key": key}
        ) as resp:
            assert resp.status == 202
            ids.append((await resp.json())["batch_id"])
    assert ids[0] == ids[1]
    info = await nc.jetstream().stream_info("CASES", subjects_filter=f"batch.requested.{ids[0]}")
    assert sum((info.state.subjects or {}).values()) == 1


async def test_supersede_cancels_open_batches_with_the_same_key(
    gateway: RunningGateway, http: aiohttp.ClientSession, bus: tuple[NatsClient, Publisher]
) -> None:
    nc, _ = bus
    key = f"pr-{uuid.uuid4().hex[:6]}"
    first = await submit(http, gateway, ALICE, spec_json(supersede_key=key))
    await recorded(gateway, first)
    async with http.post(
        f"{gateway.base_url}/v1/batches", json=spec_json(supersede_key=key), headers=auth(ALICE)
    ) as resp:
        assert resp.status == 202
        second_body = await resp.json()
    second = second_body["batch_id"]
    assert second_body["superseded"] == [first]
    cancelled = await last_on_stream(nc, f"batch.cancelled.{first}")
    assert isinstance(cancelled, BatchCancelled)
    assert cancelled.reason == "superseded"
    assert cancelled.superseded_by == second
    assert await last_on_stream(nc, f"batch.cancelled.{second}") is None

    # Another member's batch with the same key is not theirs to supersede.
    await recorded(gateway, second)
    third = await submit(http, gateway, BOB, spec_json(supersede_key=key))
    assert await last_on_stream(nc, f"batch.cancelled.{second}") is None
    # An admin supersedes every open batch with the key.
    await recorded(gateway, third)

    async def first_cancel_recorded() -> bool:
        view = await get_batch(gateway.state.pool, first)
        return view is not None and view.cancel_reason == "superseded"

    await eventually(first_cancel_recorded, "the first supersede recorded")
    async with http.post(
        f"{gateway.base_url}/v1/batches", json=spec_json(supersede_key=key), headers=auth(gateway.admin_token)
    ) as resp:
        fourth_body = await resp.json()
    assert sorted(fourth_body["superseded"]) == sorted([second, third])


async def test_an_older_request_never_supersedes_a_newer_batch(
    gateway: RunningGateway, http: aiohttp.ClientSession, bus: tuple[NatsClient, Publisher]
) -> None:
    """A keyed retry of X after Y superseded it (both recorded, Y open) must not cancel Y: requests
    are ordered by their place on the stream, not by when their HTTP call arrived."""
    nc, _ = bus
    key, idem = f"pr-{uuid.uuid4().hex[:6]}", uuid.uuid4().hex
    headers = {**auth(ALICE), "Idempotency-Key": idem}
    async with http.post(f"{gateway.base_url}/v1/batches", json=spec_json(supersede_key=key), headers=headers) as r:
        x = (await r.json())["batch_id"]
    await recorded(gateway, x)
    y = await submit(http, gateway, ALICE, spec_json(supersede_key=key))
    await recorded(gateway, y)
    assert (await last_on_stream(nc, f"batch.cancelled.{x}")) is not None  # Y superseded X
    async with http.post(f"{gateway.base_url}/v1/batches", json=spec_json(supersede_key=key), headers=headers) as r:
        retried = await r.json()
    assert (r.status, retried["batch_id"], retried["superseded"]) == (202, x, [])
    assert await last_on_stream(nc, f"batch.cancelled.{y}") is None  # the newer batch stands

    # An admin's older batch, retried after a member's newer one with the key (which the member
    # could not cancel): the admin may cancel anyone's, but not a batch requested after its own.
    admin = {**auth(gateway.admin_token), "Idempotency-Key": uuid.uuid4().hex}
    async with http.post(f"{gateway.base_url}/v1/batches", json=spec_json(supersede_key=key), headers=admin) as r:
        older = (await r.json())["batch_id"]
    await recorded(gateway, older)
    newer = await submit(http, gateway, ALICE, spec_json(supersede_key=key))
    await recorded(gateway, newer)
    assert await last_on_stream(nc, f"batch.cancelled.{older}") is None  # not alice's to cancel
    async with http.post(f"{gateway.base_url}/v1/batches", json=spec_json(supersede_key=key), headers=admin) as r:
        assert (await r.json())["superseded"] == []
    assert await last_on_stream(nc, f"batch.cancelled.{newer}") is None


async def test_supersede_sees_a_batch_submitted_a_moment_before_its_recording(
    gw_nats: str, database_url: str, http: aiohttp.ClientSession, bus: tuple[NatsClient, Publisher]
) -> None:
    """A CI job pushing twice: the first batch is not in the read model yet (here the recorder is
    held, so it never is) and still the second supersedes it; two submissions racing end with the
    later one on the stream alive and every earlier one cancelled once."""
    nc, _ = bus
    js = nc.jetstream()
    hold = asyncio.Event()

    async def held(db: Any, messages: Any) -> Any:
        await hold.wait()  # nothing is recorded until the test is done with this gateway
        return await record(db, messages)

    async def seq_of(batch_id: str) -> int:
        seq = (await js.get_last_msg("CASES", f"batch.requested.{batch_id}")).seq
        assert seq is not None
        return seq

    async def cancelled_by(batch_id: str) -> str | None:
        event = await last_on_stream(nc, f"batch.cancelled.{batch_id}")
        assert event is None or isinstance(event, BatchCancelled)
        return None if event is None else event.superseded_by

    async with running_gateway(gw_nats, database_url, tokens={ALICE: member("alice")}, record_with=held) as gw:
        try:
            key = f"ci-{uuid.uuid4().hex[:6]}"
            first = await submit(http, gw, ALICE, spec_json(supersede_key=key))
            async with http.post(
                f"{gw.base_url}/v1/batches", json=spec_json(supersede_key=key), headers=auth(ALICE)
            ) as r:
                body = await r.json()
            second = body["batch_id"]
            assert body["superseded"] == [first]
            assert await cancelled_by(first) == second
            assert await get_batch(gw.state.pool, first) is None  # it was never in the read model

            racing = await asyncio.gather(*(submit(http, gw, ALICE, spec_json(supersede_key=key)) for _ in range(4)))
            batches = [second, *racing]
            seqs = {b: await seq_of(b) for b in batches}
            latest = max(batches, key=seqs.__getitem__)
            verdicts = {b: await cancelled_by(b) for b in batches}
            assert verdicts[latest] is None, verdicts  # the last on the stream runs
            assert all(verdicts[b] is not None for b in batches if b != latest), verdicts  # every other is cancelled
            for b in batches:
                cancels = await js.stream_info("CASES", subjects_filter=f"batch.cancelled.{b}")
                assert sum((cancels.state.subjects or {}).values()) == (0 if b == latest else 1), b
        finally:
            hold.set()  # the gateway stops once its held write is let go


# ---------------------------------------------------------------- cancel


async def test_cancel_publishes_batch_cancelled_and_409_once_finalized(
    gateway: RunningGateway, http: aiohttp.ClientSession, bus: tuple[NatsClient, Publisher]
) -> None:
    nc, pub = bus
    batch_id = await submit(http, gateway, ALICE, spec_json())
    async with http.post(f"{gateway.base_url}/v1/batches/{batch_id}/cancel", headers=auth(BOB)) as resp:
        assert resp.status == 404
        assert error_of(await resp.read()).error.field == "batch_id"
    async with http.post(f"{gateway.base_url}/v1/batches/{batch_id}/cancel", headers=auth(ALICE)) as resp:
        assert resp.status == 202
        assert await resp.json() == {"batch_id": batch_id, "status": "cancelling", "reason": "cancelled"}
    event = await last_on_stream(nc, f"batch.cancelled.{batch_id}")
    assert isinstance(event, BatchCancelled)
    assert event.reason == "cancelled"
    assert event.by == "alice"

    other = await submit(http, gateway, ALICE, spec_json())
    await pub.publish_event(BatchScript(other).finalized("succeeded"))
    async with http.post(f"{gateway.base_url}/v1/batches/{other}/cancel", headers=auth(ALICE)) as resp:
        assert resp.status == 409
        err = error_of(await resp.read()).error
    assert err.code == "conflict"
    assert err.field == "batch_id"
    assert await last_on_stream(nc, f"batch.cancelled.{other}") is None


# ---------------------------------------------------------------- reads


async def test_cases_are_paginated_and_filtered_by_stage(
    gateway: RunningGateway, http: aiohttp.ClientSession, bus: tuple[NatsClient, Publisher]
) -> None:
    _, pub = bus
    cases = ("c1", "c2", "c3", "c4", "c5")
    batch_id = await submit(http, gateway, ALICE, spec_json(cases))
    script = BatchScript(batch_id, batch_spec(cases))
    for case in cases:
        await pub.publish_event(script.case_requested(case))
    await pub.publish_event(script.executed("c2"))
    await pub.publish_event(script.executed("c4", passed=False))

    async def all_recorded() -> bool:
        run = await get_run(gateway.state.pool, script.run_id("c4"))
        count = await gateway.state.pool.fetchval("SELECT count(*) FROM runs WHERE batch_id = $1", batch_id)
        return run is not None and run.executed_status == "succeeded" and count == 5

    await eventually(all_recorded, "runs recorded")
    seen: list[str] = []
    cursor: str | None = None
    pages = 0
    while True:
        params = {"limit": "2", **({"cursor": cursor} if cursor else {})}
        async with http.get(
            f"{gateway.base_url}/v1/batches/{batch_id}/cases", params=params, headers=auth(ALICE)
        ) as resp:
            assert resp.status == 200
            page = await resp.json()
        pages += 1
        assert len(page["cases"]) <= 2
        seen.extend(r["run_id"] for r in page["cases"])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert pages == 3
    assert seen == sorted(script.run_id(c) for c in cases)

    async with http.get(
        f"{gateway.base_url}/v1/batches/{batch_id}/cases", params={"stage": "executed"}, headers=auth(ALICE)
    ) as resp:
        executed = (await resp.json())["cases"]
    assert {r["case_id"] for r in executed} == {"c2", "c4"}
    by_case = {r["case_id"]: r for r in executed}
    assert by_case["c2"]["verdict"] == "pass"
    assert by_case["c4"]["verdict"] == "fail"
    assert by_case["c2"]["executed_status"] == "succeeded"
    assert by_case["c2"]["scores"][0]["metric"] == "tests_pass"

    # A batch's counts per stage.
    async with http.get(f"{gateway.base_url}/v1/batches/{batch_id}", headers=auth(ALICE)) as resp:
        view = await resp.json()
    assert view["status"] == "running"
    assert view["counts"]["requested"] == 5
    assert view["counts"]["executed"] == 2


async def test_runs_and_trajectories(
    gateway: RunningGateway, http: aiohttp.ClientSession, bus: tuple[NatsClient, Publisher]
) -> None:
    _, pub = bus
    batch_id = await submit(http, gateway, ALICE, spec_json(("c1",)))
    script = BatchScript(batch_id, batch_spec(("c1",)))
    for event in script.case_events("c1"):
        await pub.publish_event(event)
    run_id = script.run_id("c1")

    async def sealed() -> bool:
        run = await get_run(gateway.state.pool, run_id)
        return run is not None and run.sealed

    await eventually(sealed, "run sealed")
    async with http.get(f"{gateway.base_url}/v1/runs/{run_id}", headers=auth(ALICE)) as resp:
        assert resp.status == 200
        run = await resp.json()
    assert run["stage"] == "exported"
    assert run["verdict"] == "pass"
    async with http.get(f"{gateway.base_url}/v1/runs/{run_id}/trajectory", headers=auth(ALICE)) as resp:
        assert resp.status == 200
        trajectory = await resp.json()
    types = [e["type"] for e in trajectory["events"]]
    assert types == ["case.requested", "case.executed", "case.judged", "case.exported"]
    seqs = [e["stream_seq"] for e in trajectory["events"]]
    assert seqs == sorted(seqs)
    assert trajectory["events"][1]["body"]["run_id"] == run_id
    assert trajectory["seal"]["event_count"] == 4
    assert trajectory["seal"]["last_seq"] == seqs[-1]

    for path in (f"/v1/runs/{run_id}", f"/v1/runs/{run_id}/trajectory"):
        async with http.get(gateway.base_url + path, headers=auth(BOB)) as resp:
            assert resp.status == 404
            assert error_of(await resp.read()).error.field == "run_id"
        async with http.get(gateway.base_url + path, headers=auth(gateway.admin_token)) as resp:
            assert resp.status == 200


# ---------------------------------------------------------------- auth


async def test_auth_roles_and_member_isolation(
    gateway: RunningGateway, http: aiohttp.ClientSession, bus: tuple[NatsClient, Publisher]
) -> None:
    alice_batch = await submit(http, gateway, ALICE, spec_json())
    bob_batch = await submit(http, gateway, BOB, spec_json())
    await recorded(gateway, alice_batch)
    await recorded(gateway, bob_batch)
    base = gateway.base_url

    # No token, a malformed header, an unknown token: 401 naming the header.
    for headers in ({}, {"Authorization": "Basic YWxpY2U6eA=="}, {"Authorization": "Bearer nope"}):
        async with http.get(f"{base}/v1/batches/{alice_batch}", headers=headers) as resp:
            assert resp.status == 401
            assert resp.headers["WWW-Authenticate"].startswith("Bearer")
            err = error_of(await resp.read()).error
            assert err.code == "unauthorized"
            assert err.field == "Authorization"

    # Wrong role: a member on an admin route.
    async with http.post(f"{base}/v1/admin/read-models/rebuild", headers=auth(ALICE)) as resp:
        assert resp.status == 403
        err = error_of(await resp.read()).error
        assert (err.code, err.field) == ("forbidden", "Authorization")
    async with http.post(f"{base}/v1/admin/read-models/rebuild", headers=auth(gateway.admin_token)) as resp:
        assert resp.status == 200
        assert (await resp.json())["events"] >= 2

    # Members see only their own batches; the admin sees all.
    async with http.get(f"{base}/v1/batches/{bob_batch}", headers=auth(ALICE)) as resp:
        assert resp.status == 404
        assert error_of(await resp.read()).error.field == "batch_id"
    async with http.get(f"{base}/v1/batches/{bob_batch}/cases", headers=auth(ALICE)) as resp:
        assert resp.status == 404
    async with http.get(f"{base}/v1/batches/{bob_batch}/events", headers=auth(ALICE)) as resp:
        assert resp.status == 404
    async with http.get(f"{base}/v1/batches", headers=auth(ALICE)) as resp:
        assert [b["batch_id"] for b in (await resp.json())["batches"]] == [alice_batch]
    async with http.get(f"{base}/v1/batches", headers=auth(gateway.admin_token)) as resp:
        assert {b["batch_id"] for b in (await resp.json())["batches"]} == {alice_batch, bob_batch}
    async with http.get(f"{base}/v1/batches/{bob_batch}", headers=auth(gateway.admin_token)) as resp:
        assert resp.status == 200
    async with http.get(f"{base}/v1/me", headers=auth(BOB)) as resp:
        assert await resp.json() == {"principal": "bob", "role": "member"}

    # Public routes need no token.
    for path in ("/openapi.json", "/healthz", "/readyz", "/metrics"):
        async with http.get(base + path) as resp:
            assert resp.status == 200, path


async def test_list_pages_newest_first(gateway: RunningGateway, http: aiohttp.ClientSession) -> None:
    ids = [await submit(http, gateway, ALICE, spec_json(("c1",))) for _ in range(3)]
    for batch_id in ids:
        await recorded(gateway, batch_id)
    seen: list[str] = []
    cursor: str | None = None
    while True:
        params = {"limit": "2", **({"cursor": cursor} if cursor else {})}
        async with http.get(f"{gateway.base_url}/v1/batches", params=params, headers=auth(ALICE)) as resp:
            page = await resp.json()
        seen.extend(b["batch_id"] for b in page["batches"])
        cursor = page["next_cursor"]
        if cursor is None:
            break
    assert seen == list(reversed(ids))
    # A member's cursor is not valid for another principal's list.
    async with http.get(f"{gateway.base_url}/v1/batches", params={"limit": "1"}, headers=auth(ALICE)) as resp:
        alice_cursor = (await resp.json())["next_cursor"]
    async with http.get(f"{gateway.base_url}/v1/batches", params={"cursor": alice_cursor}, headers=auth(BOB)) as resp:
        assert resp.status == 400
        assert error_of(await resp.read()).error.field == "cursor"


# ---------------------------------------------------------------- client


async def test_python_client(gateway: RunningGateway, bus: tuple[NatsClient, Publisher]) -> None:
    _, pub = bus
    async with GatewayClient(gateway.base_url, ALICE) as client:
        assert (await client.me()).principal == "alice"
        accepted = await client.submit(batch_spec(("c1",)))
        script = BatchScript(accepted.batch_id, batch_spec(("c1",)))
        for event in script.case_events("c1"):
            await pub.publish_event(event)
        seen = [ev async for ev in client.events(accepted.batch_id)]
        assert seen[-1].event == "end"
        assert [e.event for e in seen[:-1]] == [
            "batch.requested",
            "case.requested",
            "case.executed",
            "case.judged",
            "case.exported",
            "batch.finalized",
        ]
        executed = seen[2].decoded()
        assert isinstance(executed, CaseExecuted)
        assert executed.run_id == script.run_id("c1")
        batch = await client.get(accepted.batch_id)
        assert batch.batch_id == accepted.batch_id
        runs = await client.all_cases(accepted.batch_id)
        assert [r.case_id for r in runs] == ["c1"]
        with pytest.raises(ApiRequestError) as info:
            await client.cancel(accepted.batch_id)
        assert info.value.status == 409
        assert info.value.field == "batch_id"
        with pytest.raises(ApiRequestError) as missing:
            await client.get("bnope")
        assert (missing.value.status, missing.value.field) == (404, "batch_id")


# ---------------------------------------------------------------- OpenAPI


async def test_openapi_document_matches_the_router(gateway: RunningGateway, http: aiohttp.ClientSession) -> None:
    async with http.get(f"{gateway.base_url}/openapi.json") as resp:
        assert resp.status == 200
        doc = await resp.json()
    assert doc["openapi"].startswith("3.1")
    documented = {
        (method.upper(), path)
        for path, item in doc["paths"].items()
        for method in item
        if method in {"get", "put", "post", "delete", "patch", "head", "options"}
    }
    routed = {
        (route.method, route.resource.canonical) for route in gateway.service.app.router.routes() if route.resource
    }
    heads = {(m, path) for m, path in routed if m == "HEAD"}
    assert all(("GET", path) in routed for _, path in heads)  # HEAD only as a GET route's
    assert {(m, path) for m, path in documented if m == "HEAD"} <= heads
    assert routed - heads == {(m, path) for m, path in documented if m != "HEAD"}

    # Every reference resolves, and the request/response bodies carry schemas.
    schemas = doc["components"]["schemas"]
    text = msgspec.json.encode(doc).decode()
    for ref in set(__import__("re").findall(r'"\$ref":"#/components/schemas/([^"]+)"', text)):
        assert ref in schemas, ref
    submit_op = doc["paths"]["/v1/batches"]["post"]
    assert submit_op["requestBody"]["content"]["application/json"]["schema"] == {
        "$ref": "#/components/schemas/BatchSpec"
    }
    assert "202" in submit_op["responses"]
    assert "401" in submit_op["responses"]
    assert "413" in submit_op["responses"]
    assert "403" in doc["paths"]["/v1/admin/read-models/rebuild"]["post"]["responses"]
    assert doc["paths"]["/openapi.json"]["get"]["security"] == []


async def test_unexpected_errors_are_a_json_500_without_traceback(
    gw_nats: str, database_url: str, http: aiohttp.ClientSession, caplog: pytest.LogCaptureFixture
) -> None:
    async with running_gateway(gw_nats, database_url) as gw:
        # A broken database: the handler's query fails in a way nobody planned for.
        await gw.state.pool.execute("ALTER TABLE batches RENAME COLUMN created_at TO created_at_renamed")
        with caplog.at_level("ERROR", logger="evalbus.gateway.api"):
            async with http.get(f"{gw.base_url}/v1/batches", headers=auth(gw.admin_token)) as resp:
                assert resp.status == 500
                text = await resp.text()
        assert msgspec.json.decode(text, type=ErrorBody).error.code == "internal"
        assert "Traceback" not in text
        assert "created_at" not in text
        assert any("unexpected error" in r.getMessage() and r.exc_info for r in caplog.records)
