"""Exec into a pod over the Kubernetes WebSocket channel protocol (`v5.channel.k8s.io`, falling back
to `v4.channel.k8s.io`), with aiohttp — no kubectl.

Every binary message starts with its channel byte: 0 stdin, 1 stdout, 2 stderr, 3 error (a `Status`
object once the command ended: `Success`, or `Failure` with the exit code in
`details.causes[reason=ExitCode]`), 4 resize (`{"Width": cols, "Height": rows}`); v5 adds 255
close (`[255, channel]`: that stream is done, used to close stdin).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import ssl
from collections.abc import AsyncGenerator, Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlencode

import aiohttp

PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
"""Subprotocols offered, preferred first."""
STDIN, STDOUT, STDERR, ERROR, RESIZE, CLOSE = 0, 1, 2, 3, 4, 255


@dataclass(frozen=True, slots=True)
class ApiAccess:
    """How to reach the API server for a WebSocket: base URL, headers, TLS."""

    host: str
    """`https://…` (or `http://…` for a local test server)."""
    headers: dict[str, str]
    """Authorization and the like."""
    ssl: ssl.SSLContext | bool
    """TLS context (False: plain HTTP)."""

    @classmethod
    def from_configuration(cls, cfg: Any) -> ApiAccess:
        """From a `kubernetes.client.Configuration` (kubeconfig or in-cluster)."""
        if getattr(cfg, "refresh_api_key_hook", None) is not None:
            cfg.refresh_api_key_hook(cfg)
        headers: dict[str, str] = {}
        for auth in cfg.auth_settings().values():  # what the client itself sends (a bearer token)
            if auth.get("in") == "header" and auth.get("value"):
                headers[str(auth["key"]).title()] = str(auth["value"])
        host = str(cfg.host).rstrip("/")
        context: ssl.SSLContext | bool = False
        if host.startswith("https://"):
            ctx = (
                ssl.create_default_context(cafile=cfg.ssl_ca_cert) if cfg.ssl_ca_cert else ssl.create_default_context()
            )
            if cfg.cert_file:
                ctx.load_cert_chain(cfg.cert_file, cfg.key_file)
            if not cfg.verify_ssl:
                ctx.check_hostname = False
                ctx.verify_mode = ssl.CERT_NONE
            context = ctx
        return cls(host=host, headers=headers, ssl=context)


def exec_url(access: ApiAccess, namespace: str, pod: str, container: str, command: Sequence[str], *, stdin: bool,
             tty: bool) -> str:  # fmt: skip
    """The exec endpoint with its query (one `command` parameter per argv element)."""
    query = [("command", part) for part in command]
    query += [("container", container), ("stdin", _flag(stdin)), ("stdout", "true"), ("tty", _flag(tty))]
    query += [("stderr", _flag(not tty))]  # with a terminal stderr is merged into stdout
    base = access.host.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
    return f"{base}/api/v1/namespaces/{namespace}/pods/{pod}/exec?{urlencode(query)}"


def _flag(value: bool) -> str:
    return "true" if value else "false"


def exit_code(status: bytes) -> int:
    """The exit code an error-channel `Status` says (0 on `Success`; 1 for a failure without one)."""
    try:
        body = json.loads(status)
    except ValueError:
        return 1
    if body.get("status") == "Success":
        return 0
    for cause in (body.get("details") or {}).get("causes") or ():
        if cause.get("reason") == "ExitCode":
            with contextlib.suppress(TypeError, ValueError):
                return int(cause.get("message"))
    return 1


def frame(channel: int, data: bytes) -> bytes:
    """A message for `channel`."""
    return bytes([channel]) + data


class ExecError(Exception):
    """The exec connection could not be opened (the pod is gone or not running, the API refused)."""


async def connect(session: aiohttp.ClientSession, access: ApiAccess, url: str) -> aiohttp.ClientWebSocketResponse:
    """Open the exec WebSocket; `ExecError` with the API's message when it is refused."""
    try:
        return await session.ws_connect(url, protocols=PROTOCOLS, headers=access.headers, ssl=access.ssl,
                                        heartbeat=30.0, max_msg_size=0)  # fmt: skip
    except aiohttp.WSServerHandshakeError as e:
        raise ExecError(f"exec refused ({e.status}): {e.message}") from e
    except aiohttp.ClientError as e:
        raise ExecError(f"exec connection failed: {e}") from e


@dataclass
class Collected:
    """What a one-shot exec gave."""

    exit_code: int
    stdout: bytes
    stderr: bytes
    timed_out: bool


async def run_once(ws: aiohttp.ClientWebSocketResponse, timeout_s: float, cap_bytes: int) -> Collected:
    """Read a command's output to its end (or its timeout, which closes the stream), keeping the
    last `cap_bytes` of each stream."""
    out, err = bytearray(), bytearray()
    code: int | None = None
    timed_out = False
    try:
        async with asyncio.timeout(timeout_s):
            async for msg in ws:
                if msg.type != aiohttp.WSMsgType.BINARY or not msg.data:
                    continue
                channel, data = msg.data[0], msg.data[1:]
                if channel in (STDOUT, STDERR):
                    buf = out if channel == STDOUT else err
                    buf.extend(data)
                    del buf[: -cap_bytes or None]
                elif channel == ERROR:
                    code = exit_code(data)
    except TimeoutError:
        timed_out = True
    finally:
        await ws.close()
    if timed_out:
        return Collected(exit_code=124, stdout=bytes(out), stderr=bytes(err), timed_out=True)
    return Collected(exit_code=1 if code is None else code, stdout=bytes(out), stderr=bytes(err), timed_out=False)


async def exec_frames(
    ws: aiohttp.ClientWebSocketResponse, idle_timeout_s: float
) -> AsyncGenerator[tuple[int, bytes], None]:
    """Every (channel, data) of a command's binary messages, as they come, up to and including its
    status (the error channel) or the connection's end; the connection is closed once done (or
    when the reader stops). `TimeoutError` when nothing came for `idle_timeout_s`."""
    try:
        while True:
            async with asyncio.timeout(idle_timeout_s):
                msg = await ws.receive()
            if msg.type in (aiohttp.WSMsgType.CLOSE, aiohttp.WSMsgType.CLOSING, aiohttp.WSMsgType.CLOSED,
                            aiohttp.WSMsgType.ERROR):  # fmt: skip
                return
            if msg.type != aiohttp.WSMsgType.BINARY or not msg.data:
                continue
            channel, data = msg.data[0], bytes(msg.data[1:])
            yield channel, data
            if channel == ERROR:
                return
    finally:
        await ws.close()


class ExecShell:
    """An interactive shell in a pod over one exec connection (a terminal: stderr comes as stdout)."""

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, on_output: Callable[[bytes], Awaitable[None]],
                 shell: str) -> None:  # fmt: skip
        self.shell = shell
        """The program."""
        self._ws = ws
        self._on_output = on_output
        self._code: int | None = None
        self._sends: set[asyncio.Task[Any]] = set()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.BINARY or not msg.data:
                continue
            channel, data = msg.data[0], msg.data[1:]
            if channel in (STDOUT, STDERR):
                await self._on_output(data)
            elif channel == ERROR:
                self._code = exit_code(data)

    def _send(self, data: bytes) -> None:
        if self._ws.closed:
            return
        task = asyncio.create_task(self._ws.send_bytes(data))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    def write(self, data: bytes) -> None:
        """Type into it."""
        self._send(frame(STDIN, data))

    def resize(self, cols: int, rows: int) -> None:
        """Tell the terminal its size."""
        self._send(frame(RESIZE, json.dumps({"Width": cols, "Height": rows}).encode()))

    def kill(self) -> None:
        """Close the connection (the API server ends the shell)."""
        task = asyncio.create_task(self._ws.close())
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def wait(self) -> int | None:
        """Until the shell ended; its exit code (None when the connection dropped without one)."""
        with contextlib.suppress(aiohttp.ClientError):
            await self._reader
        return self._code
