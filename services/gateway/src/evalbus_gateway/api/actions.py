"""Actions on a run's live sandbox: `POST /v1/runs/{run_id}/exec`, `POST …/terminal-ticket`,
`GET …/terminal?ticket=…` (a WebSocket) and `GET …/screen`.

Each travels as NATS request/reply to `ctl.<run>.<action>`, which only the dispatcher replica that
holds the run's sandbox subscribes to, so any gateway replica reaches it without knowing which one
it is; nobody answering means no live sandbox holds the run (`found: false`). Acting in a sandbox
runs commands in it, so it is allowed to the run's creator and to admins only (403 for anyone
else, 404 for an unknown run); the terminal's socket is authorized by a single-use ticket instead
of a bearer token, which a browser cannot send on a WebSocket.
"""

from __future__ import annotations

import msgspec
import nats.errors
from aiohttp import web

from evalbus_api.actions import ExecBody, ExecView, ScreenView, TicketView
from evalbus_api.models import ErrorBody
from evalbus_api.numbers import whole_number
from evalbus_contracts import decode, encode
from evalbus_contracts.control import (
    EXEC_TIMEOUT_MAX_S,
    ExecReply,
    ExecRequest,
    ScreenReply,
    ScreenRequest,
)
from evalbus_contracts.subjects import control_subject
from evalbus_gateway.api.access import actionable_run
from evalbus_gateway.api.errors import ApiError
from evalbus_gateway.api.table import Body, Call, Param, Route
from evalbus_gateway.api.validation import path_id, read_json
from evalbus_gateway.live.terminal import TerminalTickets, bridge

REPLY_MARGIN_S = 5.0
"""How much longer than a command's timeout the gateway waits for the dispatcher's answer."""
SCREEN_TIMEOUT_S = 20.0
"""Longest wait for a screen capture."""
MAX_COMMAND_BYTES = 64 * 1024


def _exec_body_problem(body: ExecBody) -> ApiError | None:
    if not body.command.strip():
        return ApiError(400, "invalid", "the command is empty", "$.command")
    if len(body.command.encode("utf-8")) > MAX_COMMAND_BYTES:
        return ApiError(400, "invalid", f"the command is longer than {MAX_COMMAND_BYTES} bytes", "$.command")
    if "\x00" in body.command:
        return ApiError(400, "invalid", "the command holds a NUL byte, which no command line can carry", "$.command")
    if not 0 < body.timeout_s <= EXEC_TIMEOUT_MAX_S:
        return ApiError(400, "invalid", f"must be more than 0 and at most {EXEC_TIMEOUT_MAX_S:g}", "$.timeout_s")
    return None


def _json(value: object) -> web.Response:
    return web.Response(body=encode(value), content_type="application/json")


async def run_exec(call: Call) -> web.StreamResponse:
    """POST /v1/runs/{run_id}/exec."""
    run_id = path_id(call.request, "run_id")
    body = await read_json(call.request, ExecBody, call.state.settings.max_request_bytes)
    problem = _exec_body_problem(body)
    if problem is not None:
        raise problem
    run = await actionable_run(call, run_id)
    call.state.exec_rate.take(run.run_id, call.state.settings.exec_per_run_per_minute)
    request = ExecRequest(command=body.command, timeout_s=body.timeout_s, principal=call.user.name)
    try:
        reply = await call.state.nc.request(
            control_subject(run.run_id, "exec"), encode(request), timeout=body.timeout_s + REPLY_MARGIN_S
        )
    except nats.errors.NoRespondersError:
        return _json(ExecView(run_id=run.run_id, found=False))
    except (nats.errors.TimeoutError, TimeoutError) as e:
        raise ApiError(503, "unavailable", "the dispatcher holding the run did not answer; retry", None) from e
    answer = decode(reply.data, ExecReply)
    return _json(ExecView(run_id=run.run_id, **msgspec.structs.asdict(answer)))


async def terminal_ticket(call: Call) -> web.StreamResponse:
    """POST /v1/runs/{run_id}/terminal-ticket."""
    run = await actionable_run(call, path_id(call.request, "run_id"))
    tickets = TerminalTickets(call.state.js, call.state.settings.terminal_ticket_s)
    ticket, expires = await tickets.mint(run.run_id, call.user.name)
    url = f"/v1/runs/{run.run_id}/terminal?ticket={ticket}"
    return web.Response(
        status=201, body=encode(TicketView(run_id=run.run_id, ticket=ticket, expires_at=expires, url=url)),
        content_type="application/json",
    )  # fmt: skip


def _size(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name)
    if raw is None:
        return default
    value = whole_number(raw, max_digits=4)
    if value is None or not 0 < value <= 1000:
        raise ApiError(400, "invalid", "must be an integer from 1 to 1000", name)
    return value


async def terminal(call: Call) -> web.StreamResponse:
    """GET /v1/runs/{run_id}/terminal?ticket=… (WebSocket)."""
    request = call.request
    run_id = path_id(request, "run_id")
    cols, rows = _size(request, "cols", 80), _size(request, "rows", 24)
    ticket = request.query.get("ticket", "")
    if not ticket:
        raise ApiError(401, "unauthorized", "a terminal ticket is needed (POST …/terminal-ticket)", "ticket")
    ws = web.WebSocketResponse(max_msg_size=64 * 1024)
    if not ws.can_prepare(request).ok:
        raise ApiError(400, "invalid", "expected a WebSocket upgrade", "Upgrade")
    state = call.state
    entry = await TerminalTickets(state.js, state.settings.terminal_ticket_s).spend(ticket, run_id)
    if entry is None:
        raise ApiError(401, "unauthorized", "unknown, used or expired ticket", "ticket")
    await ws.prepare(request)
    state.streams.enter()
    try:
        await bridge(ws, state.nc, run_id, entry.principal, cols=cols, rows=rows, ping_s=state.settings.terminal_ping_s)
    finally:
        state.streams.leave()
    return ws


async def run_screen(call: Call) -> web.StreamResponse:
    """GET /v1/runs/{run_id}/screen."""
    run = await actionable_run(call, path_id(call.request, "run_id"))
    try:
        reply = await call.state.nc.request(
            control_subject(run.run_id, "screen"),
            encode(ScreenRequest(principal=call.user.name)),
            timeout=SCREEN_TIMEOUT_S,
        )
    except nats.errors.NoRespondersError:
        return _json(
            ScreenView(run_id=run.run_id, supported=False, found=False, reason="no live sandbox holds the run")
        )
    except (nats.errors.TimeoutError, TimeoutError) as e:
        raise ApiError(503, "unavailable", "the dispatcher holding the run did not answer; retry", None) from e
    answer = decode(reply.data, ScreenReply)
    return _json(ScreenView(run_id=run.run_id, **msgspec.structs.asdict(answer)))


# ---------------------------------------------------------------- the table

_RUN_ID = Param(
    "run_id", "path", "Run id (`evb-<batch>-<case>[-t<trial>]`)", {"type": "string", "minLength": 1, "maxLength": 256}
)
_WHO = "The run's creator or an admin (403 for another member). "

ROUTES: tuple[Route, ...] = (
    Route(
        ("POST",),
        "/v1/runs/{run_id}/exec",
        "execInRun",
        "Run one command in a run's live sandbox",
        "member",
        run_exec,
        tag="runs",
        description=_WHO + "`sh -c` in the sandbox's workdir and environment (its secrets masked in the output), "
        "through the dispatcher holding the run. `found` is false when no live sandbox holds it (not started yet, "
        "released, settled). A command still running when the sandbox is released is killed with it (`ended`).",
        params=(_RUN_ID,),
        request=Body("The command", ExecBody),
        responses={
            200: Body("The outcome", ExecView),
            429: Body("The run was asked too often this minute (`error.field` = `run_id`; `Retry-After`)", ErrorBody),
        },
    ),
    Route(
        ("POST",),
        "/v1/runs/{run_id}/terminal-ticket",
        "createTerminalTicket",
        "A single-use ticket for a terminal in a run's live sandbox",
        "member",
        terminal_ticket,
        tag="runs",
        description=_WHO + "Open `url` as a WebSocket within 30 s: the ticket works once, on any gateway replica.",
        params=(_RUN_ID,),
        responses={201: Body("The ticket", TicketView)},
    ),
    Route(
        ("GET",),
        "/v1/runs/{run_id}/terminal",
        "openTerminal",
        "An interactive terminal in a run's live sandbox (WebSocket)",
        "public",
        terminal,
        tag="runs",
        description="Authorized by a ticket from `POST …/terminal-ticket` instead of a bearer token (401 for a "
        "missing, used or expired one). A persistent shell on a pseudo-terminal: send keystrokes as binary frames (or "
        '`{"type": "input", "data": …}`) and `{"type": "resize", "cols": …, "rows": …}`; receive its output as binary '
        'frames, `{"type": "attached", "shell": …}` once it is there (what was typed before is kept) and '
        '`{"type": "closed", "reason": …, "exit_code": …}` before the socket closes: 1000 the shell exited, 4410 the '
        "sandbox was released, 4404 no live sandbox holds the run, 1011 the dispatcher stopped answering, 1001 the "
        "gateway is stopping.",
        params=(
            _RUN_ID,
            Param("ticket", "query", "The single-use ticket", {"type": "string"}, required=True),
            Param("cols", "query", "Terminal width (default 80)", {"type": "integer", "minimum": 1, "maximum": 1000}),
            Param("rows", "query", "Terminal height (default 24)", {"type": "integer", "minimum": 1, "maximum": 1000}),
        ),
        responses={
            101: Body("Switching to the WebSocket protocol", schema={"type": "string"}, content_type="text/plain"),
            401: Body("Missing, unknown, used or expired ticket (`error.field` = `ticket`)", ErrorBody),
        },
    ),
    Route(
        ("GET",),
        "/v1/runs/{run_id}/screen",
        "getRunScreen",
        "A frame of what a run's live browser or desktop shows",
        "member",
        run_screen,
        tag="runs",
        description=_WHO + "Captured over CDP (`Page.captureScreenshot`) from the browser the harness declared "
        "(`EVALBUS_CDP <url>` on its stdout, or `EVALBUS_CDP_URL` in its environment), on the page most recently "
        "active; else from the X display it declared (`EVALBUS_DISPLAY :<n>` on its stdout, or `EVALBUS_DISPLAY` / "
        "`DISPLAY` in its environment), dumped by `xwd` inside the sandbox. `supported` is the capture attempt "
        "itself: false when no screen could be reached.",
        params=(_RUN_ID,),
        responses={200: Body("The frame", ScreenView)},
    ),
)
"""The live action routes, added to the gateway's table in `api.routes`."""
