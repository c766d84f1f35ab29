"""The MCP SDK's side of the gateway's `/mcp` endpoint (`evalbus_gateway.api.mcp`): the tools, the
loopback calls they answer with, and the bridge from an aiohttp request to the SDK's ASGI app.

Importing this module imports the `mcp` SDK — about 1.5 s on two cores, more than the rest of the
gateway — so `McpEndpoint` imports it on the first request to `/mcp`, not at start.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any
from urllib.parse import quote

import aiohttp
from aiohttp import web
from mcp.server.mcpserver import Context, MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp.server.transport_security import TransportSecuritySettings

from evalbus_gateway.api.mcp import MCP_PATH

Scope = MutableMapping[str, Any]
Message = MutableMapping[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]
AsgiApp = Callable[[Scope, Receive, Send], Awaitable[None]]


class ApiToolError(ToolError):
    """The API answered a tool's call with an error: the tool's result is that error, as text
    (`404 not_found: no batch 'b1' (field batch_id)`), flagged `isError`."""


class LoopbackApi:
    """Calls of this gateway's own `/v1` API on behalf of the tool's caller."""

    def __init__(self) -> None:
        self.base_url = ""
        self._session: aiohttp.ClientSession | None = None

    async def start(self, base_url: str) -> None:
        self.base_url = base_url
        self._session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=120))

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def call(self, ctx: Context[Any, Any], method: str, path: str, body: Any = None) -> Any:
        """The JSON answer of `method path` with the caller's Authorization header."""
        request = ctx.request_context.request  # the SDK's Starlette request of this call
        headers = getattr(request, "headers", None)
        authorization = headers.get("authorization", "") if headers is not None else ""
        if self._session is None:
            raise ApiToolError("the gateway is not started")
        async with self._session.request(
            method, self.base_url + path, json=body, headers={"Authorization": authorization}
        ) as resp:
            data = await resp.json(content_type=None)
            if resp.status >= 400:
                error = (data or {}).get("error", {})
                field = f" (field {error.get('field')})" if error.get("field") else ""
                raise ApiToolError(f"{resp.status} {error.get('code')}: {error.get('message')}{field}")
            return data


def _q(value: str) -> str:
    return quote(value, safe="")


def build_server(api: LoopbackApi) -> MCPServer:
    """The MCP server with evalbus's tools."""
    server: MCPServer = MCPServer(
        "evalbus",
        instructions="Read evalbus batches and runs, watch running cases live, and cancel batches. "
        "Answers are the gateway's HTTP API answers, under your token's rights.",
    )

    @server.tool(description="Batches, newest first: id, suite, status, per-stage counts.")
    async def list_batches(ctx: Context[Any, Any], limit: int = 20, cursor: str | None = None) -> Any:
        query = f"?limit={int(limit)}" + (f"&cursor={_q(cursor)}" if cursor else "")
        return await api.call(ctx, "GET", f"/v1/batches{query}")

    @server.tool(description="One batch: status, counts, summary (per-metric means, pass rates, verdicts), export.")
    async def get_batch(ctx: Context[Any, Any], batch_id: str) -> Any:
        return await api.call(ctx, "GET", f"/v1/batches/{_q(batch_id)}")

    @server.tool(description="A batch's runs with their stage, verdict, scores and answer (paged by cursor).")
    async def get_batch_cases(
        ctx: Context[Any, Any], batch_id: str, limit: int = 100, cursor: str | None = None, stage: str | None = None
    ) -> Any:
        query = (
            f"?limit={int(limit)}"
            + (f"&cursor={_q(cursor)}" if cursor else "")
            + (f"&stage={_q(stage)}" if stage else "")
        )
        return await api.call(ctx, "GET", f"/v1/batches/{_q(batch_id)}/cases{query}")

    @server.tool(description="Cancel a batch: no new case starts; in-flight ones settle.")
    async def cancel_batch(ctx: Context[Any, Any], batch_id: str) -> Any:
        return await api.call(ctx, "POST", f"/v1/batches/{_q(batch_id)}/cancel", {})

    @server.tool(description="One run (a case × trial): stage, execution status, verdict, scores, answer, failure.")
    async def get_run(ctx: Context[Any, Any], run_id: str) -> Any:
        return await api.call(ctx, "GET", f"/v1/runs/{_q(run_id)}")

    @server.tool(description="The last 64 KiB of a running (or recent) run's output.")
    async def get_run_logs(ctx: Context[Any, Any], run_id: str) -> Any:
        return await api.call(ctx, "GET", f"/v1/runs/{_q(run_id)}/logs")

    @server.tool(description="A run's own trace before it seals: infra marks and the events its harness printed.")
    async def get_run_live_trace(ctx: Context[Any, Any], run_id: str) -> Any:
        return await api.call(ctx, "GET", f"/v1/runs/{_q(run_id)}/trajectory/live")

    @server.tool(description="A run's recorded events and its seal (the hash chain) once settled.")
    async def get_run_trajectory(ctx: Context[Any, Any], run_id: str) -> Any:
        return await api.call(ctx, "GET", f"/v1/runs/{_q(run_id)}/trajectory")

    @server.tool(description="Why is this case not running? Phase, reason, node, resources of a run.")
    async def get_run_placement(ctx: Context[Any, Any], run_id: str) -> Any:
        return await api.call(ctx, "GET", f"/v1/runs/{_q(run_id)}/placement")

    @server.tool(description="Run a shell command inside a live run's sandbox (its creator or an admin).")
    async def exec_in_run(ctx: Context[Any, Any], run_id: str, command: str, timeout_s: float = 30.0) -> Any:
        return await api.call(ctx, "POST", f"/v1/runs/{_q(run_id)}/exec", {"command": command, "timeout_s": timeout_s})

    @server.tool(description="A screenshot of a live run's screen (browser or desktop cases), as a data URL.")
    async def get_run_screen(ctx: Context[Any, Any], run_id: str) -> Any:
        return await api.call(ctx, "GET", f"/v1/runs/{_q(run_id)}/screen")

    return server


class AsgiBridge:
    """Serves an ASGI application from an aiohttp handler (one request, one response)."""

    def __init__(self, app: AsgiApp) -> None:
        self._app = app

    async def __call__(self, request: web.Request, body: bytes) -> web.StreamResponse:
        host, port = (
            (request.transport.get_extra_info("sockname") or ("127.0.0.1", 0))[:2] if request.transport else ("", 0)
        )
        scope: Scope = {
            "type": "http",
            "asgi": {"version": "3.0", "spec_version": "2.3"},
            "http_version": f"{request.version.major}.{request.version.minor}",
            "method": request.method,
            "scheme": request.scheme,
            "path": request.path,
            "raw_path": request.raw_path.split("?", 1)[0].encode("latin-1"),
            "query_string": request.query_string.encode("latin-1"),
            "root_path": "",
            "headers": [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in request.headers.items()],
            "client": (request.remote or "", 0),
            "server": (host, port),
        }
        delivered = False
        response: web.StreamResponse | None = None

        async def receive() -> Message:
            nonlocal delivered
            if not delivered:
                delivered = True
                return {"type": "http.request", "body": body, "more_body": False}
            return {"type": "http.disconnect"}

        async def send(message: Message) -> None:
            nonlocal response
            if message["type"] == "http.response.start":
                response = web.StreamResponse(status=int(message["status"]))
                for name, value in message.get("headers", []):
                    key = name.decode("latin-1")
                    if key.lower() not in ("content-length", "transfer-encoding"):
                        response.headers.add(key, value.decode("latin-1"))
                await response.prepare(request)
            elif message["type"] == "http.response.body" and response is not None:
                chunk = message.get("body", b"")
                if chunk:
                    await response.write(chunk)

        await self._app(scope, receive, send)
        if response is None:
            return web.Response(status=500, text="the MCP server sent no response")
        await response.write_eof()
        return response


class McpApp:
    """The MCP server of the `/mcp` endpoint: the SDK's app, its lifecycle, its request handler."""

    def __init__(self) -> None:
        self.api = LoopbackApi()
        self.server = build_server(self.api)
        asgi = self.server.streamable_http_app(
            streamable_http_path=MCP_PATH,
            stateless_http=True,
            json_response=True,
            transport_security=TransportSecuritySettings(enable_dns_rebinding_protection=False),
        )
        self._bridge = AsgiBridge(asgi)
        self._runner: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    async def start(self, base_url: str) -> None:
        """Start the loopback client and the SDK's session manager (in a task of its own: its
        task group must be left by the task that entered it)."""
        await self.api.start(base_url)
        started = asyncio.Event()
        self._stopping.clear()

        async def run() -> None:
            async with self.server.session_manager.run():
                started.set()
                await self._stopping.wait()

        self._runner = asyncio.create_task(run(), name="mcp-session-manager")
        started_wait = asyncio.create_task(started.wait())
        done, _ = await asyncio.wait({started_wait, self._runner}, return_when=asyncio.FIRST_COMPLETED)
        if self._runner in done:
            started_wait.cancel()
            self._runner.result()  # it ended at once: raise why

    async def stop(self) -> None:
        """Stop them."""
        if self._runner is not None:
            self._stopping.set()
            with contextlib.suppress(Exception):
                await self._runner
            self._runner = None
        await self.api.close()

    async def handle(self, request: web.Request, body: bytes) -> web.StreamResponse:
        """One request to `/mcp` (its bearer token already checked, its body read)."""
        return await self._bridge(request, body)
