"""Request limits: every route that reads a body refuses one over its limit (413, declared or
chunked); one member holds at most `GATEWAY_SSE_MAX_PER_PRINCIPAL` event streams open at once
(429 past it, naming `Authorization`; freed when the client leaves; admins are not capped); one run's sandbox is asked at
most `GATEWAY_EXEC_PER_RUN_PER_MINUTE` commands a minute (429 past it, naming `run_id`, with
`Retry-After`). One gateway (real nats-server, real PostgreSQL) serves the module.
"""

from __future__ import annotations

import asyncio
import io
import re
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import AsyncExitStack
from dataclasses import dataclass

import aiohttp
import msgspec
import pytest

from evalbus.infra.postgres import create_database, drop_database
from evalbus_api.client import GatewayClient, SseEvent
from evalbus_api.models import ErrorBody
from evalbus_contracts import to_builtins
from evalbus_gateway.api.limits import RunRate
from evalbus_gateway.api.routes import ROUTES
from evalbus_gateway.testing import BatchScript, RunningGateway, batch_spec, member, running_gateway

pytestmark = pytest.mark.integration

ALICE, BOB = "tok-limits-alice", "tok-limits-bob"
LIMIT = 64 * 1024
"""`GATEWAY_MAX_REQUEST_BYTES` here."""
OVER = 1024 * 1024 + 1
"""Over every route's limit (the largest is the online suites' fixed 1 MiB)."""
STREAMS = 2
"""`GATEWAY_SSE_MAX_PER_PRINCIPAL` here."""
EXECS = 3
"""`GATEWAY_EXEC_PER_RUN_PER_MINUTE` here."""


@dataclass(frozen=True)
class World:
    gateway: RunningGateway
    open_batch: BatchScript
    """Alice's batch, requested and never finished: its streams stay open."""

    def url(self, path: str) -> str:
        return self.gateway.base_url + path


def auth(token: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {token}"}


async def until(check: Callable[[], bool | Awaitable[bool]], what: str, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.02)  # polling an observable condition with a deadline


@pytest.fixture(scope="module")
async def world(gw_nats: str, pg_admin_url: str) -> AsyncIterator[World]:
    url = await create_database(pg_admin_url, "evalbus_limits")
    try:
        async with (
            running_gateway(
                gw_nats,
                url,
                tokens={ALICE: member("alice"), BOB: member("bob")},
                max_request_bytes=LIMIT,
                max_dataset_bytes=LIMIT,
                sse_max_per_principal=STREAMS,
                exec_per_run_per_minute=EXECS,
                sse_heartbeat_s=0.2,
            ) as gw,
            aiohttp.ClientSession() as http,
        ):
            async with http.post(
                gw.base_url + "/v1/batches", json=to_builtins(batch_spec(("c1", "c2", "c3"))), headers=auth(ALICE)
            ) as resp:
                assert resp.status == 202
                script = BatchScript((await resp.json())["batch_id"], batch_spec(("c1", "c2", "c3")))
            for case in script.case_ids:
                await gw.state.publisher.publish_event(script.case_requested(case))

            async def recorded() -> bool:
                async with http.get(f"{gw.base_url}/v1/batches/{script.batch_id}/cases", headers=auth(ALICE)) as resp:
                    return resp.status == 200 and len((await resp.json())["cases"]) == 3

            await until(recorded, "the runs recorded")
            yield World(gateway=gw, open_batch=script)
    finally:
        await drop_database(pg_admin_url, url)


# ---------------------------------------------------------------- body size

BODY_ROUTES = [(m, r.path) for r in ROUTES if r.request is not None for m in r.methods]


def _target(template: str) -> str:
    return re.sub(r"\{[a-z_]+\}", "x1", template)


@pytest.mark.parametrize(("method", "template"), BODY_ROUTES, ids=[f"{m} {p}" for m, p in BODY_ROUTES])
@pytest.mark.parametrize("chunked", [False, True], ids=["declared", "chunked"])
async def test_every_body_route_refuses_a_body_over_its_limit(
    world: World, method: str, template: str, chunked: bool
) -> None:
    async def chunks() -> AsyncIterator[bytes]:
        for _ in range(OVER // 65536 + 1):
            yield b" " * 65536

    data: object = chunks() if chunked else io.BytesIO(b" " * OVER)
    headers = {**auth(world.gateway.admin_token), "Content-Type": "application/json"}
    async with (
        aiohttp.ClientSession() as http,
        http.request(method, world.url(_target(template)), data=data, headers=headers) as resp,
    ):
        assert resp.status == 413, await resp.text()
        error = msgspec.json.decode(await resp.read(), type=ErrorBody).error
    assert (error.code, error.field) == ("payload_too_large", "$")


def test_every_body_route_is_covered() -> None:
    """The MCP endpoint reads a body too (it was read up to the chassis' 16 MiB, not the API's limit)."""
    assert ("POST", "/mcp") in BODY_ROUTES
    assert len(BODY_ROUTES) >= 8


# ---------------------------------------------------------------- event streams per principal


async def _open(stack: AsyncExitStack, http: aiohttp.ClientSession, url: str, token: str) -> aiohttp.ClientResponse:
    resp = await stack.enter_async_context(http.get(url, headers=auth(token)))
    assert resp.status == 200, await resp.text()
    assert (await resp.content.readline()).startswith(b": evalbus")  # the stream is open: its slot is held
    return resp


async def test_event_streams_per_principal_are_capped(world: World) -> None:
    batch = world.open_batch
    events = world.url(f"/v1/batches/{batch.batch_id}/events")
    logs = world.url(f"/v1/runs/{batch.run_id('c1')}/logs/stream")
    trace = world.url(f"/v1/runs/{batch.run_id('c2')}/trajectory/live/stream")
    slots = world.gateway.state.stream_slots
    async with aiohttp.ClientSession() as http, AsyncExitStack() as held:
        first = await _open(held, http, events, ALICE)
        await _open(held, http, logs, ALICE)
        assert slots.open_for("alice") == STREAMS
        for url in (events, logs, trace):  # every kind of stream counts
            async with http.get(url, headers=auth(ALICE)) as resp:
                assert resp.status == 429, await resp.text()
                assert resp.headers["Retry-After"] == "1"
                error = msgspec.json.decode(await resp.read(), type=ErrorBody).error
                assert (error.code, error.field) == ("too_many_requests", "Authorization")
        # Another principal is not held back by alice's streams.
        async with http.get(world.url("/v1/batches/b000000000000/events"), headers=auth(BOB)) as resp:
            assert resp.status == 404
        for _ in range(STREAMS + 1):  # an admin is not capped
            await _open(held, http, events, world.gateway.admin_token)
        assert slots.open_for("admin") == 0
        # Alice leaves one stream: the gateway notices at its next heartbeat and frees the slot.
        first.close()
        await until(lambda: slots.open_for("alice") == STREAMS - 1, "alice's slot freed")
        await _open(held, http, trace, ALICE)
        assert slots.open_for("alice") == STREAMS
    await until(lambda: slots.open_for("alice") == 0, "every slot freed once the clients left")


async def test_the_client_waits_for_a_stream_slot_instead_of_failing(world: World) -> None:
    """A follow refused 429 (every slot of the principal taken) waits out `Retry-After` and
    connects once a slot frees, as `Client.wait` and `follow` in a notebook need."""
    batch = world.open_batch
    events = world.url(f"/v1/batches/{batch.batch_id}/events")
    statuses: list[int] = []

    async def on_end(_: aiohttp.ClientSession, __: object, params: aiohttp.TraceRequestEndParams) -> None:
        statuses.append(params.response.status)

    trace = aiohttp.TraceConfig()
    trace.on_request_end.append(on_end)
    async with (
        aiohttp.ClientSession() as http,
        aiohttp.ClientSession(trace_configs=[trace]) as traced,
        AsyncExitStack() as held,
    ):
        opened = [await _open(held, http, events, ALICE) for _ in range(STREAMS)]
        client = GatewayClient(world.url(""), ALICE, session=traced)

        async def first_event() -> SseEvent:
            async for event in client.events(batch.batch_id):
                return event
            raise AssertionError("the stream ended without an event")

        first = asyncio.create_task(first_event())
        await until(lambda: 429 in statuses or first.done(), "the client was refused a slot")
        assert not first.done(), first.result()  # it waits; it has not failed
        opened[0].close()  # a slot frees at the gateway's next heartbeat
        event = await asyncio.wait_for(first, 60)
        assert event.event == "batch.requested"
        assert statuses.count(200) == 1


# ---------------------------------------------------------------- exec rate per run


async def test_exec_per_run_is_rate_limited(world: World) -> None:
    """Authorized requests count (another member's 404 does not); the limit is per run, whoever asks."""
    batch = world.open_batch
    body = {"command": "true"}
    async with aiohttp.ClientSession() as http:

        async def execute(run: str, token: str) -> tuple[int, aiohttp.ClientResponse, bytes]:
            async with http.post(world.url(f"/v1/runs/{run}/exec"), json=body, headers=auth(token)) as resp:
                return resp.status, resp, await resp.read()

        run = batch.run_id("c3")
        for _ in range(EXECS + 2):
            assert (await execute(run, BOB))[0] == 404
        for _ in range(EXECS - 1):
            assert (await execute(run, ALICE))[0] == 200  # found false: no dispatcher holds the run here
        assert (await execute(run, world.gateway.admin_token))[0] == 200
        status, resp, raw = await execute(run, ALICE)
        assert status == 429, raw
        assert 1 <= int(resp.headers["Retry-After"]) <= 60
        error = msgspec.json.decode(raw, type=ErrorBody).error
        assert (error.code, error.field) == ("too_many_requests", "run_id")
        assert (await execute(run, world.gateway.admin_token))[0] == 429
        assert (await execute(batch.run_id("c2"), ALICE))[0] == 200  # another run has its own budget


async def test_exec_bodies_no_command_line_can_carry_are_refused(world: World) -> None:
    run = world.open_batch.run_id("c4")
    cases = [
        ({"command": "   "}, "$.command"),
        ({"command": "echo a\u0000b"}, "$.command"),  # exec(2) cannot take it: 400, not a dispatcher timeout
        ({"command": "true", "timeout_s": 0}, "$.timeout_s"),
    ]
    async with aiohttp.ClientSession() as http:
        for body, where in cases:
            async with http.post(world.url(f"/v1/runs/{run}/exec"), json=body, headers=auth(ALICE)) as resp:
                raw = await resp.read()
                assert resp.status == 400, raw
                error = msgspec.json.decode(raw, type=ErrorBody).error
                assert (error.code, error.field) == ("invalid", where), error


@pytest.mark.unit
def test_the_exec_window_slides() -> None:
    now = [1000.0]
    rate = RunRate(window_s=60.0, clock=lambda: now[0])
    for _ in range(3):
        rate.take("r", 3)
    with pytest.raises(Exception, match="retry in 60 s") as refused:
        rate.take("r", 3)
    assert getattr(refused.value, "headers", {}).get("Retry-After") == "60"
    now[0] += 59.5
    with pytest.raises(Exception, match="retry in 1 s"):
        rate.take("r", 3)
    now[0] += 0.5
    rate.take("r", 3)  # the oldest left the window
    rate.take("other", 1)
    rate.take("r", 0)  # 0: no limit
