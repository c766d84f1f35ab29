"""The authorization matrix: every route of the gateway's table × {no token, bad token, a member
with nothing of its own, another member (with its own batch), the creator, an admin} gets the
answer docs/api.md gives, and nothing of another member's batch or run leaks through lists,
event streams, run reads, live reads, compare, exec / terminal / screen or the MCP tools.

The matrix is generated from the route table (`api.routes.ROUTES`): a route without an entry in
`EXPECTED` fails `test_every_route_has_an_expectation`, so a new route cannot be forgotten, and
an entry for a route that is gone fails too. One gateway (real nats-server, real PostgreSQL)
serves the module; the other services' events are published by `BatchScript`.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import msgspec
import pytest

from evalbus.infra.postgres import create_database, drop_database
from evalbus_api.models import ErrorBody
from evalbus_contracts import ExactJudge, OnlineSuiteSpec, OnlineTarget, to_builtins
from evalbus_gateway.api.routes import ROUTES
from evalbus_gateway.testing import BatchScript, RunningGateway, batch_spec, member, running_gateway

pytestmark = pytest.mark.integration

ALICE, BOB, CAROL = "tok-authz-alice", "tok-authz-bob", "tok-authz-carol"
PRINCIPALS = ("none", "bad", "carol", "bob", "alice", "admin")
"""Who asks: no token, an unknown token, a member with nothing of its own, another member (with a
batch of its own), the creator of what is asked about, an admin."""

_ANYONE = dict.fromkeys(PRINCIPALS, 200)
_MEMBERS = {"none": 401, "bad": 401, "carol": 200, "bob": 200, "alice": 200, "admin": 200}
_CREATOR = {"none": 401, "bad": 401, "carol": 404, "bob": 404, "alice": 200, "admin": 200}
"""A batch or run read: anyone else's is 404, exactly like a missing one."""
_ACTOR = {"none": 401, "bad": 401, "carol": 404, "bob": 404, "alice": 200, "admin": 200}
"""An action in a run's live sandbox: the creator or an admin; another member's run is 404, as for a
read (docs/api.md; an online suite's run, which every member sees, is 403)."""
_ADMIN = {"none": 401, "bad": 401, "carol": 403, "bob": 403, "alice": 403, "admin": 200}


def _with(base: dict[str, int], status: int) -> dict[str, int]:
    """`base` with its successes answered `status` instead of 200."""
    return {who: status if code == 200 else code for who, code in base.items()}


EXPECTED: dict[str, dict[str, int]] = {
    "POST /v1/batches": _with(_MEMBERS, 202),
    "POST /v1/datasets": _with(_MEMBERS, 201),
    "GET /v1/batches": _MEMBERS,
    "GET /v1/batches/{batch_id}": _CREATOR,
    "GET /v1/batches/{batch_id}/cases": _CREATOR,
    "GET /v1/batches/{batch_id}/events": _CREATOR,
    "POST /v1/batches/{batch_id}/cancel": _with(_CREATOR, 202),
    "POST /v1/batches/{batch_id}/rejudge": _with(_CREATOR, 202),
    "GET /v1/runs/{run_id}": _CREATOR,
    "GET /v1/runs/{run_id}/trajectory": _CREATOR,
    # The world's runs name no object: the creator's answer is the artifact's 404 (field `name`),
    # anyone else's the run's own 404 (field `run_id`), as for a missing run.
    "GET /v1/runs/{run_id}/artifacts/{name}": _with(_CREATOR, 404),
    "GET /v1/runs/{run_id}/logs": _CREATOR,
    "GET /v1/runs/{run_id}/logs/stream": _CREATOR,
    "GET /v1/runs/{run_id}/trajectory/live": _CREATOR,
    "GET /v1/runs/{run_id}/trajectory/live/stream": _CREATOR,
    "GET /v1/runs/{run_id}/placement": _CREATOR,
    "GET /v1/compare": _CREATOR,
    "GET /v1/suites/{suite_id}/baseline": _MEMBERS,  # suites are shared by the deployment
    "PUT /v1/suites/{suite_id}/baseline": _CREATOR,  # …but only a batch the caller sees can be set
    "POST /v1/runs/{run_id}/exec": _ACTOR,
    "POST /v1/runs/{run_id}/terminal-ticket": _with(_ACTOR, 201),
    "GET /v1/runs/{run_id}/terminal": dict.fromkeys(PRINCIPALS, 401),  # a ticket, never a bearer token
    "GET /v1/runs/{run_id}/screen": _ACTOR,
    "POST /v1/online/suites": _with(_ADMIN, 201),
    "GET /v1/online/suites": _MEMBERS,
    "GET /v1/online/suites/{suite_id}": _MEMBERS,
    "DELETE /v1/online/suites/{suite_id}": _ADMIN,
    "GET /v1/online/stats": _MEMBERS,
    "GET /v1/online/observations/{trace_id}": _MEMBERS,
    "GET /": _ANYONE,
    "GET /ui/assets/{name}": _ANYONE,
    "POST /ui/login": {"none": 401, "bad": 401, "carol": 200, "bob": 200, "alice": 200, "admin": 200},
    "POST /ui/logout": _ANYONE,
    "POST /mcp": _MEMBERS,
    "GET /mcp": _MEMBERS,  # stateless: an empty server-to-client stream that ends at once
    "DELETE /mcp": _with(_MEMBERS, 405),  # stateless: no session to end
    "GET /v1/me": _MEMBERS,
    "POST /v1/admin/read-models/rebuild": _ADMIN,
    "GET /openapi.json": _ANYONE,
    "GET /healthz": _ANYONE,
    "HEAD /healthz": _ANYONE,
    "GET /readyz": _ANYONE,
    "HEAD /readyz": _ANYONE,
    "GET /metrics": _ANYONE,
    "HEAD /metrics": _ANYONE,
}
"""Method and path → principal → the documented status."""

TABLE = [f"{method} {route.openapi_path}" for route in ROUTES for method in route.methods]


def test_every_route_has_an_expectation() -> None:
    assert sorted(set(TABLE) - set(EXPECTED)) == [], "routes without an expected answer per principal"
    assert sorted(set(EXPECTED) - set(TABLE)) == [], "expectations of routes that are gone"


# ---------------------------------------------------------------- the world


@dataclass(frozen=True)
class World:
    """The gateway and what is in it: alice's finalized batch `done` and open batch `open`, bob's
    batch `bobs`, an online suite, a baseline."""

    gateway: RunningGateway
    done: BatchScript
    open: BatchScript
    bobs: BatchScript
    online_suite: str

    @property
    def base_url(self) -> str:
        return self.gateway.base_url

    def token(self, who: str) -> str | None:
        return {
            "none": None,
            "bad": "tok-nobody",
            "carol": CAROL,
            "bob": BOB,
            "alice": ALICE,
            "admin": self.gateway.admin_token,
        }[who]


def headers(token: str | None) -> dict[str, str]:
    return {} if token is None else {"Authorization": f"Bearer {token}"}


async def _submit(http: aiohttp.ClientSession, gw: RunningGateway, token: str, cases: tuple[str, ...]) -> str:
    async with http.post(
        f"{gw.base_url}/v1/batches", json=to_builtins(batch_spec(cases)), headers=headers(token)
    ) as resp:
        assert resp.status == 202, await resp.text()
        return str((await resp.json())["batch_id"])


@pytest.fixture(scope="module")
async def world(gw_nats: str, pg_admin_url: str) -> AsyncIterator[World]:
    url = await create_database(pg_admin_url, "evalbus_authz")
    try:
        tokens = {ALICE: member("alice"), BOB: member("bob"), CAROL: member("carol")}
        async with running_gateway(gw_nats, url, tokens=tokens) as gw, aiohttp.ClientSession() as http:
            pub = gw.state.publisher
            done = BatchScript(await _submit(http, gw, ALICE, ("c1", "c2")), batch_spec(("c1", "c2")))
            opened = BatchScript(await _submit(http, gw, ALICE, ("c1",)), batch_spec(("c1",)))
            bobs = BatchScript(await _submit(http, gw, BOB, ("c1",)), batch_spec(("c1",)), submitted_by="bob")
            for script in (done, bobs):
                for case in script.case_ids:
                    await pub.publish_events(script.case_events(case))
                await pub.publish_event(script.finalized())
            await pub.publish_event(opened.case_requested("c1"))
            suite = OnlineSuiteSpec(id="authz-online", target=OnlineTarget(service="svc"), judges=(ExactJudge(id="e"),))
            async with http.post(
                f"{gw.base_url}/v1/online/suites", json=to_builtins(suite), headers=headers(gw.admin_token)
            ) as resp:
                assert resp.status == 201, await resp.text()
            world = World(gateway=gw, done=done, open=opened, bobs=bobs, online_suite=suite.id)
            await _recorded(http, world)
            async with http.put(
                f"{gw.base_url}/v1/suites/suite/baseline", json={"batch_id": done.batch_id}, headers=headers(ALICE)
            ) as resp:
                assert resp.status == 200, await resp.text()
            yield world
    finally:
        await drop_database(pg_admin_url, url)


async def _recorded(http: aiohttp.ClientSession, world: World) -> None:
    """Wait until the recorder wrote every batch as finalized (or running) and every run."""
    deadline = time.monotonic() + 30
    admin = headers(world.gateway.admin_token)
    while True:
        ready = True
        for script, final in ((world.done, True), (world.bobs, True), (world.open, False)):
            async with http.get(f"{world.base_url}/v1/batches/{script.batch_id}/cases", headers=admin) as resp:
                cases = (await resp.json())["cases"] if resp.status == 200 else []
            async with http.get(f"{world.base_url}/v1/batches/{script.batch_id}", headers=admin) as resp:
                view = await resp.json()
            ready &= len(cases) == len(script.case_ids) and (view.get("finalized_at") is not None) == final
            ready &= (
                await world.gateway.state.pool.fetchval(
                    "SELECT finalized_at IS NOT NULL FROM batches WHERE batch_id = $1", script.batch_id
                )
            ) is final
        if ready:
            return
        assert time.monotonic() < deadline, "the world recorded"
        await asyncio.sleep(0.05)  # polling an observable condition with a deadline


# ---------------------------------------------------------------- the requests


@dataclass(frozen=True)
class Ask:
    """One request of the matrix."""

    path: str
    params: dict[str, str] | None = None
    body: Any = None
    headers: dict[str, str] | None = None


_MCP_HEADERS = {"Accept": "application/json, text/event-stream"}


def ask(key: str, world: World, who: str) -> Ask:
    """The request of route `key` about alice's things (the creator's)."""
    done, run = world.done.batch_id, world.done.run_id("c1")
    method, template = key.split(" ", 1)
    fill = {"batch_id": done, "run_id": run, "suite_id": "suite", "trace_id": "0" * 32, "name": "app.js"}
    path = template.format(**fill)
    match key:
        case "POST /v1/batches":
            return Ask(path, body=to_builtins(batch_spec(("c1",))))
        case "POST /v1/datasets":
            return Ask(path, body={"id": "c1", "input": "one JSONL line"})
        case "POST /v1/batches/{batch_id}/cancel":
            return Ask(f"/v1/batches/{world.open.batch_id}/cancel", body={})
        case "POST /v1/batches/{batch_id}/rejudge":
            return Ask(path, body={})
        case "GET /v1/compare":
            return Ask(path, params={"candidate": done, "base": done})
        case "PUT /v1/suites/{suite_id}/baseline":
            return Ask(path, body={"batch_id": done})
        case "POST /v1/runs/{run_id}/exec":
            return Ask(path, body={"command": "id"})
        case "GET /v1/online/suites/{suite_id}" | "DELETE /v1/online/suites/{suite_id}":
            return Ask(f"/v1/online/suites/{world.online_suite}")
        case "POST /v1/online/suites":
            suite = OnlineSuiteSpec(id=f"authz-{who}", target=OnlineTarget(service="svc"), judges=(ExactJudge(id="e"),))
            return Ask(path, body=to_builtins(suite))
        case "POST /ui/login":
            return Ask(path, body={"token": world.token(who) or ""})
        case "POST /mcp":
            return Ask(path, body={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}, headers=_MCP_HEADERS)
        case "GET /mcp" | "DELETE /mcp":
            return Ask(path, headers=_MCP_HEADERS)
    assert method in ("GET", "HEAD", "POST", "DELETE", "PUT"), key
    return Ask(path)


@pytest.mark.parametrize("key", TABLE)
async def test_every_route_answers_each_principal_as_documented(world: World, key: str) -> None:
    method = key.split(" ", 1)[0]
    answers: dict[str, int] = {}
    bodies: dict[str, bytes] = {}
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as http:
        for who in PRINCIPALS:
            request = ask(key, world, who)
            kwargs: dict[str, Any] = {
                "headers": {**headers(world.token(who)), **(request.headers or {})},
                "params": request.params,
            }
            if request.body is not None:
                kwargs["json"] = request.body
            async with http.request(method, world.base_url + request.path, **kwargs) as resp:
                answers[who] = resp.status
                bodies[who] = await resp.read()  # an event stream of a settled batch or run ends by itself
    assert answers == EXPECTED[key], {who: bodies[who][:200] for who in PRINCIPALS if answers[who] >= 400}
    for who in PRINCIPALS:
        if answers[who] >= 400 and key not in ("GET /mcp", "DELETE /mcp"):  # the SDK answers its own errors
            error = msgspec.json.decode(bodies[who], type=ErrorBody).error
            assert error.field, (who, error)
            if answers[who] == 404:
                assert "no " in error.message, error  # exactly the answer a missing id gets


# ---------------------------------------------------------------- nothing leaks


async def _get(world: World, who: str, path: str, **params: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(world.base_url + path, headers=headers(world.token(who)), params=params) as resp,
    ):
        return resp.status, await resp.json(content_type=None)


async def test_lists_show_only_what_is_yours(world: World) -> None:
    done, opened, bobs = world.done.batch_id, world.open.batch_id, world.bobs.batch_id

    async def listed(who: str) -> set[str]:
        status, page = await _get(world, who, "/v1/batches", limit="1000")
        assert status == 200
        return {b["batch_id"] for b in page["batches"]}

    assert {done, opened} <= await listed("alice")
    assert bobs not in await listed("alice")
    assert await listed("bob") & {done, opened} == set()
    assert bobs in await listed("bob")
    assert await listed("carol") & {done, opened, bobs} == set()
    assert {done, opened, bobs} <= await listed("admin")
    everyone = await listed("admin")
    for who in ("alice", "bob", "carol"):
        _status, page = await _get(world, who, "/v1/batches", limit="1000")
        assert all(b["submitted_by"] == who for b in page["batches"]), (who, page)
        assert await listed(who) <= everyone


async def test_another_members_ids_look_exactly_like_missing_ones(world: World) -> None:
    """Bob asking about alice's batch and run gets, byte for byte apart from the id, what he gets
    for ids that do not exist: nothing tells him they exist."""
    done = world.done.batch_id
    for real, missing in (
        (f"/v1/batches/{done}", "/v1/batches/b000000000000"),
        (f"/v1/batches/{done}/cases", "/v1/batches/b000000000000/cases"),
        (f"/v1/batches/{done}/events", "/v1/batches/b000000000000/events"),
        (f"/v1/runs/{world.done.run_id('c1')}", "/v1/runs/evb-b000000000000-c1"),
        (f"/v1/runs/{world.done.run_id('c1')}/logs", "/v1/runs/evb-b000000000000-c1/logs"),
        (f"/v1/runs/{world.done.run_id('c1')}/placement", "/v1/runs/evb-b000000000000-c1/placement"),
    ):
        status, body = await _get(world, "bob", real)
        missing_status, missing_body = await _get(world, "bob", missing)
        assert (status, missing_status) == (404, 404)
        assert body["error"]["field"] == missing_body["error"]["field"]
        real_id, missing_id = real.split("/")[3], missing.split("/")[3]
        assert body["error"]["message"].replace(real_id, "ID") == missing_body["error"]["message"].replace(
            missing_id, "ID"
        )


async def test_compare_never_reads_another_members_batch(world: World) -> None:
    done, bobs = world.done.batch_id, world.bobs.batch_id
    status, body = await _get(world, "bob", "/v1/compare", candidate=bobs, base=done)
    assert (status, body["error"]["field"]) == (404, "base"), body
    status, body = await _get(world, "bob", "/v1/compare", candidate=done, base=bobs)
    assert (status, body["error"]["field"]) == (404, "candidate"), body
    # The default base is the suite's baseline, alice's batch: bob's comparison may not read it.
    status, body = await _get(world, "bob", "/v1/compare", candidate=bobs)
    assert (status, body["error"]["field"]) == (404, "base"), body
    status, body = await _get(world, "alice", "/v1/compare", candidate=done)
    assert status == 200, body


async def test_another_member_cannot_cancel_or_rejudge(world: World) -> None:
    async with aiohttp.ClientSession() as http:
        fresh = BatchScript(await _submit(http, world.gateway, ALICE, ("c1",)), batch_spec(("c1",)))
        for action in ("cancel", "rejudge"):
            async with http.post(
                f"{world.base_url}/v1/batches/{fresh.batch_id}/{action}", json={}, headers=headers(BOB)
            ) as resp:
                assert resp.status == 404
    status, view = await _get(world, "alice", f"/v1/batches/{fresh.batch_id}")
    assert status == 200
    assert view.get("cancel_reason") is None, view


async def _mcp_tool(world: World, who: str, name: str, arguments: dict[str, Any]) -> tuple[bool, str]:
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/call", "params": {"name": name, "arguments": arguments}}
    async with (
        aiohttp.ClientSession() as http,
        http.post(world.base_url + "/mcp", json=message, headers={**headers(world.token(who)), **_MCP_HEADERS}) as resp,
    ):
        assert resp.status == 200, await resp.text()
        result = (await resp.json())["result"]
    return bool(result.get("isError")), json.dumps(result)


@pytest.mark.parametrize(
    ("tool", "arguments", "refusal"),
    [
        ("get_batch", lambda w: {"batch_id": w.done.batch_id}, "404 not_found"),
        ("get_batch_cases", lambda w: {"batch_id": w.done.batch_id}, "404 not_found"),
        ("cancel_batch", lambda w: {"batch_id": w.open.batch_id}, "404 not_found"),
        ("get_run", lambda w: {"run_id": w.done.run_id("c1")}, "404 not_found"),
        ("get_run_logs", lambda w: {"run_id": w.done.run_id("c1")}, "404 not_found"),
        ("get_run_live_trace", lambda w: {"run_id": w.done.run_id("c1")}, "404 not_found"),
        ("get_run_trajectory", lambda w: {"run_id": w.done.run_id("c1")}, "404 not_found"),
        ("get_run_placement", lambda w: {"run_id": w.done.run_id("c1")}, "404 not_found"),
        ("exec_in_run", lambda w: {"run_id": w.done.run_id("c1"), "command": "id"}, "404 not_found"),
        ("get_run_screen", lambda w: {"run_id": w.done.run_id("c1")}, "404 not_found"),
    ],
)
async def test_mcp_tools_hold_the_same_line(
    world: World, tool: str, arguments: Callable[[World], dict[str, Any]], refusal: str
) -> None:
    """Every MCP tool about alice's things: refused to bob as the HTTP route refuses him, answered
    to alice and the admin."""
    refused, text = await _mcp_tool(world, "bob", tool, arguments(world))
    assert refused, text
    assert refusal in text, text
    if tool != "cancel_batch":
        for who in ("alice", "admin"):
            refused, text = await _mcp_tool(world, who, tool, arguments(world))
            assert not refused, (who, text)


async def test_mcp_lists_only_what_is_yours(world: World) -> None:
    refused, text = await _mcp_tool(world, "bob", "list_batches", {"limit": 1000})
    assert not refused, text
    assert world.bobs.batch_id in text
    assert world.done.batch_id not in text
    assert world.open.batch_id not in text
