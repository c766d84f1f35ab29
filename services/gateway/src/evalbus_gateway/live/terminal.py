"""The live terminal's gateway side: single-use tickets, and the bridge between a client's WebSocket
and the shell the dispatcher holding the run starts in its sandbox.

Tickets live on the bus, in the `terminal-tickets` key-value bucket, so one minted by any replica
works on any other: a browser cannot set an `Authorization` header on a WebSocket, so an
authorized `POST …/terminal-ticket` mints a random ticket and `GET …/terminal?ticket=…` spends it.
Single use needs one shared, atomic decision, which a signature shared by the replicas cannot give
(a signed ticket replayed at two replicas would be accepted by both): spending a ticket is a
delete at the revision it was read at, which JetStream applies to one caller only. The bucket holds
the ticket's SHA-256, never the ticket, and its age limit clears tickets nobody spent; the ticket's
own `expires_at` (30 s) is checked on top, since an age limit is enforced lazily.

The bridge: the client's keystrokes (binary frames, or `{"type": "input", "data": …}` text frames)
and resizes (`{"type": "resize", "cols": …, "rows": …}`) go to `term.<session>.in`, buffered in
order until the dispatcher has attached the shell, so none sent early is lost; the terminal's
output comes back on `term.<session>.out` as binary frames. The client gets `{"type": "attached",
"shell": …}` once the shell is there and `{"type": "closed", "reason": …, "exit_code": …}` before
the socket closes with the same reason: the shell exited (1000), the sandbox was released (4410), no
live sandbox holds the run (4404), the dispatcher stopped answering (1011), the gateway is stopping
(1001).
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import logging
import secrets
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

import msgspec
import nats.errors
import nats.js.errors
from aiohttp import WSMsgType, web
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.js import JetStreamContext

from evalbus_contracts import decode, encode, subjects, utcnow
from evalbus_contracts.control import (
    CLOSE_ERROR,
    CLOSE_NOT_FOUND,
    TermClose,
    TermClosed,
    TerminalIn,
    TerminalOpen,
    TerminalOpened,
    TerminalOut,
    TermInput,
    TermOutput,
    TermPing,
    TermResize,
)
from evalbus_contracts.streams import TERMINAL_TICKETS
from evalbus_gateway.live.reads import READ_TIMEOUT_S
from evalbus_gateway.live.server_clock import server_now

log = logging.getLogger("evalbus.gateway.terminal")

OPEN_TIMEOUT_S = 10.0
"""Longest wait for the dispatcher to attach a shell."""
CLOSE_GOING_AWAY = 1001
MAX_CLIENT_FRAME = 64 * 1024
"""Largest frame a client may send."""


class TicketEntry(msgspec.Struct, frozen=True, kw_only=True):
    """What the bucket keeps for a ticket (under the ticket's SHA-256)."""

    run_id: str
    """The run the ticket opens a terminal in."""
    principal: str
    """Who minted it."""
    created_at: datetime
    """When."""
    expires_at: datetime
    """Spent after this, it is refused."""


def ticket_key(ticket: str) -> str:
    """The bucket key of a ticket."""
    return hashlib.sha256(ticket.encode("utf-8")).hexdigest()


class TerminalTickets:
    """Minting and spending tickets in the `terminal-tickets` bucket."""

    def __init__(self, js: JetStreamContext, ttl_s: float) -> None:
        self._js = js
        self._ttl_s = ttl_s

    async def mint(self, run_id: str, principal: str) -> tuple[str, datetime]:
        """A new ticket for `run_id` and when it expires."""
        kv = await self._js.key_value(TERMINAL_TICKETS.bucket)
        ticket = secrets.token_urlsafe(32)
        now = utcnow()
        expires = now + timedelta(seconds=self._ttl_s)
        entry = TicketEntry(run_id=run_id, principal=principal, created_at=now, expires_at=expires)
        await kv.create(ticket_key(ticket), encode(entry))
        return ticket, expires

    async def spend(self, ticket: str, run_id: str) -> TicketEntry | None:
        """The ticket's entry if it is unspent, unexpired and for `run_id` — spent now, by this
        call alone; None otherwise (a second spend, on any replica, finds nothing). Its age is
        the server's to measure (the entry's stored time against the server's time now) against
        the lifetime it was minted with, so a gateway replica whose clock is off neither refuses a
        fresh ticket nor takes a stale one."""
        if not ticket or len(ticket) > 256:
            return None
        kv = await self._js.key_value(TERMINAL_TICKETS.bucket)
        key = ticket_key(ticket)
        stream = f"KV_{TERMINAL_TICKETS.bucket}"
        try:
            found = await self._js.get_last_msg(stream, f"$KV.{TERMINAL_TICKETS.bucket}.{key}")
        except nats.js.errors.NotFoundError:
            return None
        if (found.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not found.data:
            return None  # spent
        try:
            await kv.delete(key, last=found.seq)
        except nats.js.errors.APIError:
            return None  # spent meanwhile by another request
        try:
            entry = decode(found.data, TicketEntry)
        except msgspec.DecodeError:
            return None
        now = await server_now(self._js, stream, READ_TIMEOUT_S)
        if entry.run_id != run_id or now is None or found.time is None:
            return None
        lifetime = (entry.expires_at - entry.created_at).total_seconds()  # the minter's TTL, clock-free
        if (now - found.time).total_seconds() > lifetime:
            return None
        return entry


_out_decoder: msgspec.json.Decoder[TerminalOut] = msgspec.json.Decoder(TerminalOut)


class _ClientFrame(msgspec.Struct, frozen=True, kw_only=True):
    type: str
    data: str = ""
    cols: int = 80
    rows: int = 24


def client_frame(kind: WSMsgType, data: bytes | str) -> TerminalIn | None:
    """What a client's WebSocket frame asks for (None: nothing, or not understood)."""
    if kind == WSMsgType.BINARY and isinstance(data, bytes):
        return TermInput(data=data) if data else None
    if kind != WSMsgType.TEXT or not isinstance(data, str):
        return None
    try:
        frame = msgspec.json.decode(data, type=_ClientFrame)
    except msgspec.DecodeError:
        return None
    if frame.type == "input" and frame.data:
        return TermInput(data=frame.data.encode("utf-8"))
    if frame.type == "resize" and 0 < frame.cols <= 1000 and 0 < frame.rows <= 1000:
        return TermResize(cols=frame.cols, rows=frame.rows)
    return None


@dataclass
class _End:
    code: int
    reason: str
    exit_code: int | None = None


async def bridge(
    ws: web.WebSocketResponse,
    nc: NatsClient,
    run_id: str,
    principal: str,
    *,
    cols: int,
    rows: int,
    ping_s: float,
) -> None:
    """Connect `ws` (prepared) to a new shell in the run's sandbox until one side ends."""
    session = uuid.uuid4().hex
    out_subject = subjects.terminal_subject(session, "out")
    in_subject = subjects.terminal_subject(session, "in")
    outputs: asyncio.Queue[TerminalOut] = asyncio.Queue()
    early: list[TerminalIn] = []
    attached = False
    client_gone = asyncio.Event()

    async def on_out(msg: Msg) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            outputs.put_nowait(_out_decoder.decode(msg.data))

    async def send_in(frame: TerminalIn) -> None:
        with contextlib.suppress(nats.errors.Error):
            await nc.publish(in_subject, encode(frame))

    async def read_client() -> None:
        try:
            async for message in ws:
                frame = client_frame(message.type, message.data)
                if frame is None:
                    continue
                if attached:
                    await send_in(frame)
                else:
                    early.append(frame)  # typed before the shell is there: kept, in order
        finally:
            client_gone.set()

    out_sub = await nc.subscribe(out_subject, cb=on_out)  # before the shell exists: no output lost
    reader = asyncio.create_task(read_client())
    end: _End | None = None
    opened = False
    shell_ended = False
    try:
        try:
            reply = await nc.request(
                subjects.control_subject(run_id, "terminal"),
                encode(TerminalOpen(session=session, cols=cols, rows=rows, principal=principal)),
                timeout=OPEN_TIMEOUT_S,
            )
            answer = decode(reply.data, TerminalOpened)
        except nats.errors.NoRespondersError:
            answer = TerminalOpened(found=False, reason="no live sandbox holds the run")
        except (nats.errors.TimeoutError, TimeoutError):
            answer = TerminalOpened(found=False, reason="the dispatcher holding the run did not answer")
        except msgspec.DecodeError:
            answer = TerminalOpened(found=False, reason="the dispatcher's answer could not be read")
        if not answer.found:
            end = _End(CLOSE_NOT_FOUND, answer.reason or "no live sandbox holds the run")
            return
        opened = True
        while early:  # flush what was typed meanwhile, in order, before anything typed later
            await send_in(early.pop(0))
        attached = True
        await ws.send_json({"type": "attached", "shell": answer.shell})
        end = await _pump(ws, outputs, client_gone, send_in, ping_s)
        shell_ended = end is not None and end.code != CLOSE_ERROR
    except asyncio.CancelledError:
        end = _End(CLOSE_GOING_AWAY, "the gateway is stopping; open a new terminal")
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()
    finally:
        if opened and not shell_ended:  # the shell outlives no client
            reason = "the client closed the terminal" if end is None else end.reason
            await send_in(TermClose(reason=reason))
        with contextlib.suppress(Exception):
            await out_sub.unsubscribe()
        if end is not None and not ws.closed:
            with contextlib.suppress(Exception):
                await ws.send_json({"type": "closed", "reason": end.reason, "exit_code": end.exit_code})
            with contextlib.suppress(Exception):
                await ws.close(code=end.code, message=end.reason.encode("utf-8")[:120])
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError, Exception):
            await reader


async def _pump(
    ws: web.WebSocketResponse,
    outputs: asyncio.Queue[TerminalOut],
    client_gone: asyncio.Event,
    send_in: Callable[[TerminalIn], Awaitable[None]],
    ping_s: float,
) -> _End | None:
    """Output to the client until the shell ends, the client leaves (None) or the dispatcher goes
    silent; a keep-alive to the dispatcher every `ping_s`, whatever flows."""
    heard = time.monotonic()
    next_ping = heard + ping_s
    gone = asyncio.create_task(client_gone.wait())
    try:
        while True:
            getter = asyncio.create_task(outputs.get())
            wait_s = max(0.0, next_ping - time.monotonic())
            done, _ = await asyncio.wait({getter, gone}, timeout=wait_s, return_when=asyncio.FIRST_COMPLETED)
            if getter not in done:
                getter.cancel()
            elif isinstance(frame := getter.result(), TermOutput | TermPing | TermClosed):
                heard = time.monotonic()
                if isinstance(frame, TermOutput):
                    await ws.send_bytes(frame.data)
                elif isinstance(frame, TermClosed):
                    return _End(frame.code, frame.reason, frame.exit_code)
            if gone in done:
                return None
            now = time.monotonic()
            if now - heard > 3 * ping_s:
                return _End(CLOSE_ERROR, "the dispatcher holding the sandbox stopped answering")
            if now >= next_ping:
                next_ping = now + ping_s
                await send_in(TermPing())
    finally:
        gone.cancel()
