"""The gateway's run and batch reads as MCP tools, over streamable HTTP at `/mcp` (the official
`mcp` SDK), so an agent can watch and steer evaluations the way a person does on the dashboard.

Tools: `list_batches`, `get_batch`, `get_batch_cases`, `cancel_batch`, `get_run`, `get_run_logs`,
`get_run_live_trace`, `get_run_trajectory`, and — when the gateway serves them — `get_run_placement`,
`exec_in_run`, `get_run_screen`. Every tool answers by calling this gateway's own `/v1` API on
loopback with the caller's bearer token, so a tool's answer IS the HTTP API's answer — the same
authorization (a member sees its own batches and runs), the same errors, the same JSON.

The SDK's side lives in `mcp_server`, imported on the first request (the SDK's imports take longer
than the rest of the gateway's start). The SDK's server is an ASGI (Starlette) application;
`mcp_server.AsgiBridge` hands it the aiohttp request
after the bearer token was checked like on every `/v1` route (401 otherwise). The server runs
stateless with JSON responses: any replica answers any request, nothing is held between calls.
DNS-rebinding protection (Host/Origin checks) is off because `/mcp` is never authenticated by a
cookie: a page on another origin cannot present the bearer token.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib
import json
import logging
from typing import TYPE_CHECKING, Any

from aiohttp import web

from evalbus_gateway.api.errors import ApiError
from evalbus_gateway.api.table import Body, Call, Route
from evalbus_gateway.api.validation import read_body

if TYPE_CHECKING:
    from evalbus_gateway.api.mcp_server import McpApp

log = logging.getLogger("evalbus.gateway.mcp")

MCP_PATH = "/mcp"

_SERVER_MODULE = "evalbus_gateway.api.mcp_server"


class McpEndpoint:
    """The `/mcp` endpoint. Its MCP server (`mcp_server.McpApp`, the SDK) is imported and started
    on the first request, in a thread so the event loop keeps serving meanwhile: most gateways
    never serve `/mcp`, and the SDK's imports would be most of a gateway's start. Concurrent first
    requests share one load; a load that failed is tried again by the next request."""

    def __init__(self) -> None:
        self._base_url: str | None = None
        self._app: McpApp | None = None
        self._loading: asyncio.Task[McpApp] | None = None
        self.loads = 0
        """How many times the MCP server was imported and started (one, once a request came)."""

    async def start(self, base_url: str) -> None:
        """Serve from now on; the tools call this gateway's API at `base_url`."""
        self._base_url = base_url

    async def _load(self, base_url: str) -> McpApp:
        self.loads += 1
        module = await asyncio.to_thread(importlib.import_module, _SERVER_MODULE)
        app: McpApp = module.McpApp()
        await app.start(base_url)
        return app

    async def app(self) -> McpApp:
        """The started MCP server (imported and started by the first call)."""
        if self._app is not None:
            return self._app
        if self._base_url is None:
            raise ApiError(503, "unavailable", "the MCP endpoint is not started", None)
        if self._loading is None:
            self._loading = asyncio.create_task(self._load(self._base_url), name="mcp-load")
        loading = self._loading
        try:
            app = await asyncio.shield(loading)
        except Exception as e:
            if self._loading is loading:
                self._loading = None
            log.exception("the MCP server did not start")
            raise ApiError(503, "unavailable", f"the MCP server did not start: {e}", None) from e
        self._app = app
        return app

    async def stop(self) -> None:
        """Stop the MCP server if it was started (a load under way is cancelled)."""
        self._base_url = None
        loading, self._loading = self._loading, None
        app, self._app = self._app, None
        if loading is not None and app is None:
            loading.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                app = await loading
        if app is not None:
            await app.stop()

    async def handle(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """One request to `/mcp` (its bearer token already checked, its body read)."""
        return await (await self.app()).handle(request, body)


def loopback_url(host: str, port: int) -> str:
    """This gateway's own base URL for its tools' calls (a wildcard bind is reached on loopback)."""
    if host in ("", "0.0.0.0", "::"):  # noqa: S104 - recognising the wildcard, not binding to it
        host = "127.0.0.1"
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


async def mcp_route(call: Call) -> web.StreamResponse:
    """POST/GET/DELETE /mcp (the route table checked the bearer token). The body is read under
    the API's limit (`GATEWAY_MAX_REQUEST_BYTES`, 413 beyond) like every other request body."""
    endpoint = call.state.mcp
    if endpoint is None:
        raise ApiError(503, "unavailable", "the MCP endpoint is not started", None)
    body = await read_body(call.request, call.state.settings.max_request_bytes)
    return await endpoint.handle(call.request, body)


def tool_result(result: Any) -> Any:
    """The JSON a tool returned, out of an MCP `CallToolResult` (for clients and tests)."""
    structured = getattr(result, "structured_content", None) or getattr(result, "structuredContent", None)
    if structured is not None:
        return structured.get("result", structured) if isinstance(structured, dict) else structured
    for item in getattr(result, "content", []) or []:
        text = getattr(item, "text", None)
        if text is not None:
            return json.loads(text)
    return None


_MCP_DESCRIPTION = (
    "Model Context Protocol over streamable HTTP (stateless, JSON responses), with the same bearer token as the "
    "API. Tools: list_batches, get_batch, get_batch_cases, cancel_batch, get_run, get_run_logs, get_run_live_trace, "
    "get_run_trajectory, get_run_placement, exec_in_run, get_run_screen; each answers exactly what the matching "
    "HTTP route answers for the same token."
)

_JSON_RPC = Body("A JSON-RPC message (or batch) of the Model Context Protocol", schema={"type": "object"})

ROUTES: tuple[Route, ...] = tuple(
    Route(
        (method,),
        MCP_PATH,
        f"mcp{method.title()}",
        summary,
        "member",
        mcp_route,
        description=_MCP_DESCRIPTION,
        tag="mcp",
        request=_JSON_RPC if method == "POST" else None,
    )
    for method, summary in (
        ("POST", "MCP messages (JSON-RPC): the run and batch reads as tools"),
        ("GET", "MCP server-to-client stream (stateless: an empty event stream that ends at once)"),
        ("DELETE", "MCP session end (stateless: nothing to end)"),
    )
)
"""The `/mcp` route (streamable HTTP: POST carries messages; GET and DELETE are answered by the SDK)."""
