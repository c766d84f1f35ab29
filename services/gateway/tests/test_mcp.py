"""The MCP endpoint (`/mcp`, streamable HTTP) with the official `mcp` SDK's client, against a real
gateway (nats-server, PostgreSQL): every tool answers exactly what the matching HTTP route answers
for the same token — batches, cases, runs, trajectories, live reads, cancel — and a member sees
only its own batches there too."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import aiohttp
import pytest
from mcp import Client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared._httpx_utils import create_mcp_http_client

from evalbus.infra.postgres import create_database, drop_database
from evalbus_contracts import to_builtins
from evalbus_gateway.api.mcp import tool_result
from evalbus_gateway.testing import BatchScript, RunningGateway, batch_spec, member, running_gateway

pytestmark = pytest.mark.integration

ALICE, BOB = "tok-alice-mcp", "tok-bob-mcp"


@pytest.fixture(scope="module")
async def gateway(gw_nats: str, pg_admin_url: str) -> AsyncIterator[RunningGateway]:
    url = await create_database(pg_admin_url, "evalbus_test")
    try:
        async with running_gateway(gw_nats, url, tokens={ALICE: member("alice"), BOB: member("bob")}) as gw:
            yield gw
    finally:
        await drop_database(pg_admin_url, url)


async def http_get(gw: RunningGateway, path: str, token: str) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(gw.base_url + path, headers={"Authorization": f"Bearer {token}"}) as resp,
    ):
        return resp.status, await resp.json()


@pytest.fixture(scope="module")
async def alices_batch(gateway: RunningGateway) -> dict[str, str]:
    async with (
        aiohttp.ClientSession() as http,
        http.post(
            f"{gateway.base_url}/v1/batches",
            json=to_builtins(batch_spec(("c1", "c2"))),
            headers={"Authorization": f"Bearer {ALICE}"},
        ) as resp,
    ):
        assert resp.status == 202
        batch_id = str((await resp.json())["batch_id"])
    script = BatchScript(batch_id, batch_spec(("c1", "c2")))
    for case in script.case_ids:
        await gateway.state.publisher.publish_event(script.case_requested(case))
    deadline = time.monotonic() + 20
    while True:
        status, page = await http_get(gateway, f"/v1/batches/{batch_id}/cases", ALICE)
        if status == 200 and len(page["cases"]) == 2:
            return {"batch_id": batch_id, "run_id": page["cases"][0]["run_id"]}
        assert time.monotonic() < deadline, "runs recorded"
        await asyncio.sleep(0.02)


@asynccontextmanager
async def mcp_client(gw: RunningGateway, token: str | None) -> AsyncIterator[Client]:
    """The SDK's client over streamable HTTP with the token (its HTTP client closed after)."""
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with (
        create_mcp_http_client(headers=headers) as http,
        Client(streamable_http_client(f"{gw.base_url}/mcp", http_client=http)) as client,
    ):
        yield client


async def test_the_first_requests_load_the_mcp_server_once(gateway: RunningGateway) -> None:
    """The SDK is imported on the first request to `/mcp`, not at the gateway's start, and requests
    that come together while it loads share that one load."""
    endpoint = gateway.state.mcp
    assert endpoint is not None
    assert endpoint.loads == 0  # the gateway is up and serving, and nothing loaded the SDK yet
    message = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    headers = {"Authorization": f"Bearer {ALICE}", "Accept": "application/json, text/event-stream"}

    async def tools(http: aiohttp.ClientSession) -> set[str]:
        async with http.post(f"{gateway.base_url}/mcp", json=message, headers=headers) as resp:
            assert resp.status == 200, await resp.text()
            return {tool["name"] for tool in (await resp.json())["result"]["tools"]}

    async with aiohttp.ClientSession() as http:
        answers = await asyncio.gather(*(tools(http) for _ in range(4)))
    assert all("get_run" in names for names in answers), answers
    assert endpoint.loads == 1


async def test_the_tools_are_listed(gateway: RunningGateway) -> None:
    async with mcp_client(gateway, ALICE) as client:
        tools = {tool.name for tool in (await client.list_tools()).tools}
    assert tools >= {
        "list_batches",
        "get_batch",
        "get_batch_cases",
        "cancel_batch",
        "get_run",
        "get_run_logs",
        "get_run_live_trace",
        "get_run_trajectory",
        "get_run_placement",
        "exec_in_run",
        "get_run_screen",
    }


async def test_every_read_answers_as_the_http_api(gateway: RunningGateway, alices_batch: dict[str, str]) -> None:
    batch_id, run_id = alices_batch["batch_id"], alices_batch["run_id"]
    pairs = [
        ("get_batch", {"batch_id": batch_id}, f"/v1/batches/{batch_id}"),
        ("get_batch_cases", {"batch_id": batch_id}, f"/v1/batches/{batch_id}/cases?limit=100"),
        ("get_run", {"run_id": run_id}, f"/v1/runs/{run_id}"),
        ("get_run_trajectory", {"run_id": run_id}, f"/v1/runs/{run_id}/trajectory"),
        ("get_run_logs", {"run_id": run_id}, f"/v1/runs/{run_id}/logs"),
        ("get_run_live_trace", {"run_id": run_id}, f"/v1/runs/{run_id}/trajectory/live"),
    ]
    async with mcp_client(gateway, ALICE) as client:
        for tool, args, path in pairs:
            result = await client.call_tool(tool, args)
            assert not result.is_error, (tool, result)
            status, expected = await http_get(gateway, path, ALICE)
            assert status == 200
            assert tool_result(result) == expected, tool
        listed = tool_result(await client.call_tool("list_batches", {"limit": 5}))
        assert batch_id in [b["batch_id"] for b in listed["batches"]]


async def test_a_member_sees_only_its_own_batches_through_mcp_too(
    gateway: RunningGateway, alices_batch: dict[str, str]
) -> None:
    async with mcp_client(gateway, BOB) as client:
        result = await client.call_tool("get_batch", {"batch_id": alices_batch["batch_id"]})
        assert result.is_error
        text = " ".join(getattr(c, "text", "") for c in result.content)
        assert "404 not_found" in text
        cancel = await client.call_tool("cancel_batch", {"batch_id": alices_batch["batch_id"]})
        assert cancel.is_error
    async with mcp_client(gateway, ALICE) as client:
        cancelled = await client.call_tool("cancel_batch", {"batch_id": alices_batch["batch_id"]})
        assert not cancelled.is_error, cancelled
        assert tool_result(cancelled)["batch_id"] == alices_batch["batch_id"]


async def test_mcp_needs_a_token(gateway: RunningGateway) -> None:
    async with (
        aiohttp.ClientSession() as http,
        http.post(f"{gateway.base_url}/mcp", json={"jsonrpc": "2.0", "id": 1, "method": "tools/list"}) as resp,
    ):
        assert resp.status == 401
        assert (await resp.json())["error"]["field"] == "Authorization"
