"""The live actions on the sandboxes this replica holds, answered over NATS request/reply: while a
run's sandbox lives the replica subscribes to `ctl.<run>.*`, so a gateway reaches it without knowing
which replica it is (nobody subscribed: no live sandbox holds the run).

- `exec`: one `sh -c` command in the sandbox's workdir and environment, its output's end (secrets
  masked) in the reply; one that is still running when the sandbox is released is killed with it
  and answered with `ended`;
- `terminal`: a persistent shell on a pseudo-terminal, its keystrokes and resizes on
  `term.<session>.in`, its output and its end on `term.<session>.out`, keep-alives both ways; the
  shell ends when the sandbox is released (`closed`, code 4410), when the client leaves or goes
  silent, or by itself;
- `screen`: a frame of the run's browser over CDP, or of its X display dumped by `xwd` through the
  exec path (see `screen`).

Every action is marked in the run's trace (`exec`, `terminal`), so the sealed trajectory says that
someone acted in the sandbox, who, and how it ended.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field

import msgspec
import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from evalbus_contracts import encode, subjects
from evalbus_contracts.control import (
    CLOSE_ERROR,
    CLOSE_RELEASED,
    EXEC_OUTPUT_MAX_BYTES,
    EXEC_TIMEOUT_MAX_S,
    TERMINAL_PING_S,
    ExecReply,
    ExecRequest,
    ScreenReply,
    ScreenRequest,
    TermClose,
    TermClosed,
    TerminalIn,
    TerminalOpen,
    TerminalOpened,
    TermInput,
    TermOutput,
    TermPing,
    TermResize,
)
from evalbus_dispatcher.backends.base import SandboxHandle, Shell, is_interactive
from evalbus_dispatcher.errors import BackendError

log = logging.getLogger(__name__)

Mark = Callable[[str, str], Awaitable[None]]
"""Adds an infra mark (event, message) to the run's trace."""
Detach = Callable[[], Awaitable[None]]
"""Ends the run's live actions, right before its sandbox is released."""
ScreenCapture = Callable[[], Awaitable[ScreenReply]]
"""Captures the run's screen."""

MAX_REPLY_BYTES = 900 * 1024
"""Replies stay below a stock server's 1 MB payload limit."""
RELEASED = "the run's sandbox was released"

_exec_decoder = msgspec.json.Decoder(ExecRequest)
_open_decoder = msgspec.json.Decoder(TerminalOpen)
_in_decoder: msgspec.json.Decoder[TerminalIn] = msgspec.json.Decoder(TerminalIn)
_screen_decoder = msgspec.json.Decoder(ScreenRequest)


def _who(principal: str | None) -> str:
    return principal or "someone"


def _quoted(command: str, limit: int = 200) -> str:
    one_line = " ".join(command.split())
    return one_line if len(one_line) <= limit else one_line[: limit - 1] + "…"


def fit_reply(reply: ExecReply) -> bytes:
    """The reply's JSON, its outputs cut from the front until it fits one message."""
    data = encode(reply)
    while len(data) > MAX_REPLY_BYTES and (reply.stdout or reply.stderr):
        reply = msgspec.structs.replace(
            reply,
            stdout=reply.stdout[len(reply.stdout) // 2 :],
            stderr=reply.stderr[len(reply.stderr) // 2 :],
            truncated=True,
        )
        data = encode(reply)
    return data


@dataclass
class _Terminal:
    """One open terminal session."""

    session: str
    shell: Shell
    principal: str | None
    sub: Subscription | None = None
    heard: float = field(default_factory=time.monotonic)
    closed: bool = False
    task: asyncio.Task[None] | None = None


class _RunControls:
    """The live actions of one run's sandbox."""

    def __init__(
        self,
        nc: NatsClient,
        run_id: str,
        handle: SandboxHandle,
        mark: Mark,
        *,
        ping_s: float,
        screen: ScreenCapture | None,
    ) -> None:
        self._nc = nc
        self._run_id = run_id
        self._handle = handle
        self._mark = mark
        self._ping_s = ping_s
        self._screen = screen
        self._sub: Subscription | None = None
        self._execs: dict[asyncio.Task[None], list[int]] = {}
        self._terminals: dict[str, _Terminal] = {}
        self._closing = False
        self._tasks: set[asyncio.Task[None]] = set()
        self._watchers: set[asyncio.Task[None]] = set()

    async def start(self) -> None:
        self._sub = await self._nc.subscribe(subjects.control_filter(self._run_id), cb=self._on_request)

    async def _on_request(self, msg: Msg) -> None:
        action = msg.subject.rsplit(".", 1)[-1]
        handler = {"exec": self._exec, "terminal": self._terminal, "screen": self._screen_capture}.get(action)
        if handler is None or not msg.reply:
            return
        task = asyncio.create_task(handler(msg))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _respond(self, msg: Msg, data: bytes) -> None:
        with contextlib.suppress(nats.errors.Error):
            await msg.respond(data)

    # ------------------------------------------------------------ exec

    async def _exec(self, msg: Msg) -> None:
        try:
            req = _exec_decoder.decode(msg.data)
        except msgspec.DecodeError as e:
            await self._respond(msg, encode(ExecReply(found=True, stderr=f"unreadable exec request: {e}", exit_code=2)))
            return
        if self._closing or not is_interactive(self._handle):
            await self._respond(msg, encode(ExecReply(found=False)))
            return
        current = asyncio.current_task()
        assert current is not None
        groups: list[int] = []
        self._execs[current] = groups

        async def spawned(pgid: int) -> None:
            groups.append(pgid)

        timeout_s = min(max(req.timeout_s, 0.001), EXEC_TIMEOUT_MAX_S)
        try:
            done = await self._handle.exec_live(
                req.command, timeout_s, cap_bytes=EXEC_OUTPUT_MAX_BYTES, on_spawn=spawned
            )
        except BackendError:
            reply = ExecReply(found=False)
        except (OSError, ValueError) as e:  # ValueError: what exec(2) cannot carry (a NUL byte)
            reply = ExecReply(found=True, stderr=f"cannot run the command: {e}", exit_code=127)
        else:
            reply = ExecReply(
                found=True,
                stdout=done.stdout,
                stderr=done.stderr,
                exit_code=done.exit_code,
                timed_out=done.timed_out,
                truncated=done.truncated,
                ended=f"{RELEASED} while the command ran" if self._closing else None,
            )
        finally:
            self._execs.pop(current, None)
        if reply.found:
            how = reply.ended or ("timed out" if reply.timed_out else f"exit {reply.exit_code}")
            await self._mark("exec", f"{_who(req.principal)} ran `{_quoted(req.command)}` in the sandbox ({how})")
        await self._respond(msg, fit_reply(reply))

    # ------------------------------------------------------------ terminal

    async def _terminal(self, msg: Msg) -> None:
        try:
            req = _open_decoder.decode(msg.data)
        except msgspec.DecodeError as e:
            await self._respond(msg, encode(TerminalOpened(found=False, reason=f"unreadable request: {e}")))
            return
        if self._closing or not is_interactive(self._handle):
            await self._respond(msg, encode(TerminalOpened(found=False, reason=RELEASED)))
            return
        out_subject = subjects.terminal_subject(req.session, "out")

        async def forward(data: bytes) -> None:
            await self._nc.publish(out_subject, encode(TermOutput(data=data)))

        try:
            shell = await self._handle.open_shell(req.cols, req.rows, forward)
        except BackendError:
            await self._respond(msg, encode(TerminalOpened(found=False, reason=RELEASED)))
            return
        except OSError as e:
            await self._respond(msg, encode(TerminalOpened(found=False, reason=f"the shell could not start: {e}")))
            return
        term = _Terminal(session=req.session, shell=shell, principal=req.principal)
        self._terminals[req.session] = term

        async def on_input(in_msg: Msg) -> None:
            term.heard = time.monotonic()
            try:
                frame = _in_decoder.decode(in_msg.data)
            except msgspec.DecodeError:
                return
            if isinstance(frame, TermInput):
                shell.write(frame.data)
            elif isinstance(frame, TermResize):
                shell.resize(frame.cols, frame.rows)
            elif isinstance(frame, TermClose):
                await self._end(term, TermClosed(reason=frame.reason or "the client closed the terminal"))

        # Subscribed before the reply goes out (same connection, so in this order at the server):
        # keystrokes the gateway sends once it has the reply are never lost.
        term.sub = await self._nc.subscribe(subjects.terminal_subject(req.session, "in"), cb=on_input)
        await self._respond(msg, encode(TerminalOpened(found=True, shell=shell.shell)))
        await self._mark("terminal", f"{_who(req.principal)} opened a terminal in the sandbox ({shell.shell})")
        term.task = asyncio.create_task(self._watch(term))
        self._watchers.add(term.task)
        term.task.add_done_callback(self._watchers.discard)

    async def _watch(self, term: _Terminal) -> None:
        """Keep-alives while it lives; its end when the shell exits or the client goes silent."""
        waiter = asyncio.create_task(term.shell.wait())
        try:
            while True:
                done, _ = await asyncio.wait({waiter}, timeout=self._ping_s)
                if done:
                    code = waiter.result()
                    await self._end(term, TermClosed(reason=f"the shell exited with {code}", exit_code=code))
                    return
                if time.monotonic() - term.heard > 3 * self._ping_s:
                    await self._end(term, TermClosed(reason="the client went silent", code=CLOSE_ERROR))
                    return
                await self._send(term, TermPing())
        finally:
            if not waiter.done():
                term.shell.kill()
                with contextlib.suppress(Exception):
                    await asyncio.wait_for(waiter, 5.0)

    async def _send(self, term: _Terminal, frame: TermPing | TermClosed) -> None:
        with contextlib.suppress(nats.errors.Error):
            await self._nc.publish(subjects.terminal_subject(term.session, "out"), encode(frame))

    async def _end(self, term: _Terminal, closed: TermClosed) -> None:
        if term.closed:
            return
        term.closed = True
        term.shell.kill()
        self._terminals.pop(term.session, None)
        if term.sub is not None:
            with contextlib.suppress(Exception):
                await term.sub.unsubscribe()
        await self._send(term, closed)
        await self._mark("terminal", f"{_who(term.principal)}'s terminal closed: {closed.reason}")

    # ------------------------------------------------------------ screen

    async def _screen_capture(self, msg: Msg) -> None:
        with contextlib.suppress(msgspec.DecodeError):
            _screen_decoder.decode(msg.data)
        if self._closing:
            return  # no answer: no live sandbox
        if self._screen is None:
            await self._respond(msg, encode(ScreenReply(supported=False, found=False, reason="no screen is declared")))
            return
        await self._respond(msg, encode(await self._screen()))

    # ------------------------------------------------------------ the end

    async def detach(self) -> None:
        """The sandbox is about to be released: stop answering, end every terminal, kill and answer
        every command still running."""
        self._closing = True
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        for term in list(self._terminals.values()):
            await self._end(term, TermClosed(reason=RELEASED, code=CLOSE_RELEASED))
        if self._watchers:  # each sees its killed shell exit and ends; one that does not is cancelled
            _, stuck = await asyncio.wait(set(self._watchers), timeout=5.0)
            for task in stuck:
                task.cancel()
        if is_interactive(self._handle):
            for groups in self._execs.values():
                for pgid in groups:
                    self._handle.kill_group(pgid)
        pending = [t for t in self._tasks if not t.done()]
        if pending:
            await asyncio.wait(pending, timeout=10.0)


class LiveControls:
    """This replica's live actions: `attach(run_id, handle, mark)` when a run's sandbox exists, and
    the detach it returns right before the sandbox is released."""

    def __init__(self, nc: NatsClient | None = None, *, ping_s: float = TERMINAL_PING_S) -> None:
        self._nc = nc
        self._ping_s = ping_s
        self._runs: dict[str, _RunControls] = {}

    def bind(self, nc: NatsClient) -> None:
        """Use `nc` (the service's connection, once it is up)."""
        self._nc = nc

    async def attach(
        self, run_id: str, handle: SandboxHandle, mark: Mark, screen: ScreenCapture | None = None
    ) -> Detach:
        """Answer the run's actions until the returned detach is awaited."""
        if self._nc is None:
            raise RuntimeError("live controls are not bound to a connection")
        controls = _RunControls(self._nc, run_id, handle, mark, ping_s=self._ping_s, screen=screen)
        await controls.start()
        self._runs[run_id] = controls

        async def detach() -> None:
            if self._runs.get(run_id) is controls:
                del self._runs[run_id]
            await controls.detach()

        return detach

    async def close(self) -> None:
        """Detach every run (the replica stops)."""
        for controls in list(self._runs.values()):
            await controls.detach()
        self._runs.clear()
