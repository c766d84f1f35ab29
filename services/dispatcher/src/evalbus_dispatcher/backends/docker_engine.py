"""A small asynchronous client of the Docker Engine API: HTTP over the engine's unix socket (or a
`tcp://` address, with TLS as the docker CLI does it: `tls_context`), version-prefixed paths (`/v1.43/...`), the multiplexed stream framing, the
hijacked connection of an attached exec, and the tar stream of a container's archive (`GET
/containers/{id}/archive`, its path's stat in `X-Docker-Container-Path-Stat`).

Why not the official `docker` SDK: it is synchronous (every call, and every streamed log or exec
read, would hold a thread of a pool sized for the running cases, as the Kubernetes and Nomad
clients do), and what the backend needs is a dozen documented endpoints. aiohttp — already the
dispatcher's HTTP client — speaks to the socket through its `UnixConnector`. The one thing aiohttp's
client does not hand over is a hijacked connection (`POST /exec/{id}/start` answers
`101 UPGRADED` and the socket becomes the process's stdin/stdout), so that request is written on a
plain asyncio stream to the same address and the raw socket is the session.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import ssl
import struct
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal
from urllib.parse import urlsplit

import aiohttp

API_VERSION = "1.43"
"""Engine API version the paths are prefixed with (Docker Engine 24 and later serve it); an engine
that serves only an older one is spoken to in its own, down to `MIN_API_VERSION`."""
MIN_API_VERSION = "1.41"
"""The oldest Engine API the backend can use (one-shot stats; `DeviceRequests` since 1.40)."""
DEFAULT_HOST = "unix:///var/run/docker.sock"
"""Where the engine listens when `DOCKER_HOST` is unset."""
STDIN, STDOUT, STDERR = 0, 1, 2
"""Stream types in a multiplexed frame's header."""
_HEADER = struct.Struct(">BxxxL")
PATH_STAT_HEADER = "X-Docker-Container-Path-Stat"
"""Header of an archive answer: the path's stat, base64 of its JSON (`name`, `size`, `mode`, `mtime`,
`linkTarget`)."""
GO_MODE_TYPE = (1 << 31) | (1 << 27) | (1 << 26) | (1 << 25) | (1 << 24) | (1 << 21) | (1 << 19)
"""Go's `fs.ModeType` (dir, symlink, device, named pipe, socket, char device, irregular): a stat's
`mode` with none of these bits is a regular file."""
TAR_BLOCK = 512
"""A tar header's (and data padding's) size."""
_TAR_REGULAR = (b"0", b"\0", b"7")


class EngineError(Exception):
    """The engine answered with an error status (its `message`), or could not be reached (status 0)."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"{status} {message}" if status else message)
        self.status = status
        self.message = message


@dataclass(frozen=True, slots=True)
class EngineAddress:
    """Where the engine listens."""

    kind: Literal["unix", "tcp"]
    """A unix socket or a TCP address."""
    path: str = ""
    """The socket's path (unix)."""
    host: str = ""
    """Host name or address (tcp)."""
    port: int = 2375
    """Port (tcp)."""
    tls: bool = False
    """Whether the TCP connection is TLS (HTTPS), as with `DOCKER_TLS_VERIFY` or `DOCKER_TLS`."""

    @property
    def base_url(self) -> str:
        """The URL requests are made under (the socket's requests name a placeholder host)."""
        if self.kind == "unix":
            return "http://docker"
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}"

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix://{self.path}"
        return f"tcp://{self.host}:{self.port}" + (" (TLS)" if self.tls else "")


def parse_host(text: str) -> EngineAddress:
    """`unix:///path`, `tcp://host:port` (or `http://`) as `DOCKER_HOST` gives them; ValueError otherwise."""
    value = text.strip()
    if value.startswith("unix://"):
        path = value.removeprefix("unix://")
        if not path.startswith("/"):
            raise ValueError(
                f"DOCKER_HOST {text!r}: a unix socket needs an absolute path (unix:///var/run/docker.sock)"
            )
        return EngineAddress(kind="unix", path=path)
    if value.startswith(("tcp://", "http://")):
        parts = urlsplit(value)
        if not parts.hostname:
            raise ValueError(f"DOCKER_HOST {text!r}: no host")
        return EngineAddress(kind="tcp", host=parts.hostname, port=parts.port or 2375)
    raise ValueError(f"DOCKER_HOST {text!r} is neither unix:///path nor tcp://host:port")


TLS_FILES = ("ca.pem", "cert.pem", "key.pem")
"""What a `DOCKER_CERT_PATH` folder holds, as the docker CLI reads it: the engine's CA, the client's
certificate and its key."""


def tls_context(cert_path: Path, *, verify: bool) -> ssl.SSLContext:
    """The client side of the engine's TLS, as the docker CLI sets it up from `DOCKER_CERT_PATH`:
    the client certificate (`cert.pem`, `key.pem`) when the folder has one — an engine started with
    `--tlsverify` asks for it — and, with `verify` (`DOCKER_TLS_VERIFY`), the engine's certificate
    checked against `ca.pem` and the host name; without it (`DOCKER_TLS`) the connection is
    encrypted but the engine is not authenticated. `ValueError` naming the file that is missing or
    unreadable."""
    ca, cert, key = (cert_path / name for name in TLS_FILES)
    try:
        if verify:
            if not ca.is_file():
                raise ValueError(f"DOCKER_TLS_VERIFY needs the engine's CA in {ca}")
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH, cafile=str(ca))
        else:
            context = ssl.create_default_context(ssl.Purpose.SERVER_AUTH)
            context.check_hostname = False
            context.verify_mode = ssl.CERT_NONE
        if cert.is_file() or key.is_file():
            context.load_cert_chain(str(cert), str(key))
    except (OSError, ssl.SSLError) as e:
        raise ValueError(f"the Docker TLS files in {cert_path} cannot be used: {e}") from e
    return context


class FrameSplitter:
    """The multiplexed stream (`application/vnd.docker.multiplexed-stream`) → (stream type, payload):
    each frame is an 8-byte header — the stream type, three zero bytes, the payload's size as a
    big-endian uint32 — and the payload."""

    def __init__(self) -> None:
        self._buf = bytearray()

    def push(self, chunk: bytes) -> list[tuple[int, bytes]]:
        """The frames `chunk` completes (a partial frame waits for the rest)."""
        self._buf.extend(chunk)
        frames: list[tuple[int, bytes]] = []
        while len(self._buf) >= _HEADER.size:
            stream, size = _HEADER.unpack_from(self._buf)
            if len(self._buf) < _HEADER.size + size:
                break
            frames.append((stream, bytes(self._buf[_HEADER.size : _HEADER.size + size])))
            del self._buf[: _HEADER.size + size]
        return frames

    @property
    def pending(self) -> int:
        """Bytes of a frame not complete yet."""
        return len(self._buf)


def frame(stream: int, payload: bytes) -> bytes:
    """One multiplexed frame (what the engine writes)."""
    return _HEADER.pack(stream, len(payload)) + payload


@dataclass(eq=False)
class Hijacked:
    """An attached exec's connection after `101 UPGRADED`: read its output, write its stdin."""

    reader: asyncio.StreamReader
    writer: asyncio.StreamWriter
    multiplexed: bool
    """Output in multiplexed frames (no TTY), else the terminal's raw bytes."""

    def close(self) -> None:
        """Drop the connection (the engine closes the process's stdin)."""
        with contextlib.suppress(OSError, RuntimeError):
            self.writer.close()


class DockerEngine:
    """The Engine API at one address, through one aiohttp session (made on first use)."""

    def __init__(
        self,
        address: EngineAddress,
        *,
        api_version: str = API_VERSION,
        timeout_s: float = 30.0,
        tls: ssl.SSLContext | None = None,
    ) -> None:
        if address.tls and tls is None:
            raise ValueError(f"the Docker engine at {address} is spoken to over TLS: pass its context (tls_context)")
        self.address = address
        self._tls = tls if address.tls else None
        self.api_version = api_version
        """The version requests are prefixed with: the one asked for, or the engine's own when older."""
        self._negotiated = False
        self._timeout_s = timeout_s
        self._session: aiohttp.ClientSession | None = None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            connector: aiohttp.BaseConnector = (
                aiohttp.UnixConnector(path=self.address.path)
                if self.address.kind == "unix"
                else aiohttp.TCPConnector(ssl=self._tls if self._tls is not None else False)
            )
            self._session = aiohttp.ClientSession(
                base_url=self.address.base_url,
                connector=connector,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._timeout_s),
            )
        return self._session

    async def negotiate(self) -> str:
        """The API version to speak: the one asked for, lowered to the engine's (`GET /_ping`'s
        `API-Version`) when that is older; `EngineError` (status 400) when even that is older than
        `MIN_API_VERSION`. Asked once, on the first request."""
        if self._negotiated:
            return self.api_version
        try:
            async with self._client().get("/_ping", timeout=aiohttp.ClientTimeout(total=self._timeout_s)) as ping:
                served = ping.headers.get("API-Version", "")
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise EngineError(
                0, f"the Docker engine at {self.address} cannot be reached: {type(e).__name__}: {e}"
            ) from e
        if served and _version(served) < _version(self.api_version):
            if _version(served) < _version(MIN_API_VERSION):
                raise EngineError(
                    400, f"the Docker engine at {self.address} serves API {served}; evalbus needs {MIN_API_VERSION}+"
                )
            self.api_version = served
        self._negotiated = True
        return self.api_version

    def path(self, endpoint: str) -> str:
        """`endpoint` under the version prefix."""
        return f"/v{self.api_version}{endpoint}"

    async def close(self) -> None:
        """Close the session."""
        if self._session is not None:
            await self._session.close()

    async def call(
        self,
        method: str,
        endpoint: str,
        *,
        params: dict[str, str] | None = None,
        body: Any = None,
        timeout_s: float | None = None,
    ) -> Any:
        """One request answered with JSON (or nothing); `EngineError` on an error status."""
        await self.negotiate()
        try:
            async with self._client().request(
                method,
                self.path(endpoint),
                params=params,
                json=body,
                timeout=aiohttp.ClientTimeout(total=timeout_s or self._timeout_s),
            ) as response:
                data = await response.read()
                if response.status >= 400:
                    raise EngineError(response.status, _message(data))
                if not data or response.status == 204:
                    return None
                if response.content_type == "application/json":
                    return json.loads(data)
                return data.decode("utf-8", errors="replace")
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise EngineError(
                0, f"the Docker engine at {self.address} cannot be reached: {type(e).__name__}: {e}"
            ) from e

    @contextlib.asynccontextmanager
    async def stream(
        self, method: str, endpoint: str, *, params: dict[str, str] | None = None, body: Any = None
    ) -> AsyncIterator[aiohttp.ClientResponse]:
        """A streamed answer (logs, events, a pull's progress), no total timeout; `EngineError` on an error status."""
        await self.negotiate()
        try:
            async with self._client().request(
                method, self.path(endpoint), params=params, json=body, timeout=aiohttp.ClientTimeout(total=None)
            ) as response:
                if response.status >= 400:
                    raise EngineError(response.status, _message(await response.read()))
                yield response
        except (aiohttp.ClientConnectionError, aiohttp.ClientPayloadError, OSError) as e:
            raise EngineError(
                0, f"the Docker engine at {self.address} cannot be reached: {type(e).__name__}: {e}"
            ) from e

    async def open_stream(
        self, method: str, endpoint: str, *, params: dict[str, str] | None = None
    ) -> aiohttp.ClientResponse:
        """A streamed answer (an archive) the caller reads and then closes (`close()`), a read idle
        past the client's timeout failing; `EngineError` on an error status."""
        await self.negotiate()
        try:
            response = await self._client().request(
                method, self.path(endpoint), params=params,
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self._timeout_s, sock_read=self._timeout_s),
            )  # fmt: skip
        except (aiohttp.ClientError, OSError, TimeoutError) as e:
            raise EngineError(
                0, f"the Docker engine at {self.address} cannot be reached: {type(e).__name__}: {e}"
            ) from e
        if response.status >= 400:
            try:
                data = await response.read()
            finally:
                response.close()
            raise EngineError(response.status, _message(data))
        return response

    async def hijack(
        self, endpoint: str, body: dict[str, Any], *, multiplexed: bool, timeout_s: float | None = None
    ) -> Hijacked:
        """`POST endpoint` with `body`, asking to upgrade the connection (`Upgrade: tcp`); the raw
        connection once the engine answered `101` (or, as older engines do, `200` with the stream).
        `multiplexed`: the output comes in frames (an exec without a TTY — engines before API 1.42
        label that stream `raw-stream` too, so the caller says, not the content type)."""
        address = self.address
        await self.negotiate()
        try:
            async with asyncio.timeout(timeout_s or self._timeout_s):
                if address.kind == "unix":
                    reader, writer = await asyncio.open_unix_connection(address.path)
                elif self._tls is not None:
                    reader, writer = await asyncio.open_connection(
                        address.host, address.port, ssl=self._tls, server_hostname=address.host
                    )
                else:
                    reader, writer = await asyncio.open_connection(address.host, address.port)
                data = json.dumps(body).encode("utf-8")
                head = (
                    f"POST {self.path(endpoint)} HTTP/1.1\r\nHost: docker\r\nContent-Type: application/json\r\n"
                    f"Content-Length: {len(data)}\r\nConnection: Upgrade\r\nUpgrade: tcp\r\n\r\n"
                )
                writer.write(head.encode("ascii") + data)
                await writer.drain()
                status_line = (await reader.readuntil(b"\r\n")).decode("latin-1")
                headers: dict[str, str] = {}
                while (line := (await reader.readuntil(b"\r\n")).decode("latin-1")) != "\r\n":
                    name, _, value = line.partition(":")
                    headers[name.strip().lower()] = value.strip()
        except (OSError, TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError) as e:  # ssl.SSLError too
            raise EngineError(0, f"the Docker engine at {address} cannot be reached: {type(e).__name__}: {e}") from e
        parts = status_line.split(" ", 2)
        status = int(parts[1]) if len(parts) > 1 and parts[1].isdigit() else 0
        if status not in (101, 200):
            length = int(headers.get("content-length", "0") or 0)
            raw = b""
            with contextlib.suppress(OSError, asyncio.IncompleteReadError, TimeoutError):
                raw = await asyncio.wait_for(reader.readexactly(length), 5.0) if length else b""
            writer.close()
            raise EngineError(status, _message(raw) or status_line.strip())
        return Hijacked(reader=reader, writer=writer, multiplexed=multiplexed)


@dataclass(frozen=True, slots=True)
class PathStat:
    """A container path's stat, as an archive answer's header gives it."""

    name: str
    """Its last element."""
    size: int
    """Bytes."""
    mode: int
    """Go `fs.FileMode` bits."""
    link_target: str = ""
    """Where a symbolic link points (empty otherwise)."""

    @property
    def regular(self) -> bool:
        """A regular file (not a folder, link, device, pipe or socket)."""
        return self.mode & GO_MODE_TYPE == 0


def path_stat(header: str | None) -> PathStat | None:
    """The `X-Docker-Container-Path-Stat` header read (None: absent or unreadable)."""
    if not header:
        return None
    try:
        body = json.loads(base64.b64decode(header))
        return PathStat(
            name=str(body.get("name", "")), size=int(body.get("size") or 0), mode=int(body.get("mode") or 0),
            link_target=str(body.get("linkTarget") or ""),
        )  # fmt: skip
    except (ValueError, TypeError, binascii.Error, AttributeError):
        return None


@dataclass(frozen=True, slots=True)
class TarEntry:
    """One member's header in a tar stream."""

    name: str
    """Its path in the archive (a PAX `path` or GNU long name when there is one)."""
    size: int
    """Bytes of data that follow (padded to `TAR_BLOCK`)."""
    regular: bool
    """A regular file."""


def _tar_number(field: bytes) -> int:
    if field[:1] and field[0] & 0x80:  # base-256, for sizes past 8 GiB
        return int.from_bytes(field[1:], "big")
    text = field.strip(b" \0")
    return int(text, 8) if text else 0


def _pax(data: bytes) -> dict[str, str]:
    """PAX extended header records (`<len> <key>=<value>\\n`)."""
    out: dict[str, str] = {}
    at = 0
    while at < len(data):
        space = data.index(b" ", at)
        length = int(data[at:space])
        key, _, value = data[space + 1 : at + length - 1].partition(b"=")
        out[key.decode("utf-8", "replace")] = value.decode("utf-8", "replace")
        at += length
    return out


async def read_tar_entry(reader: asyncio.StreamReader | aiohttp.StreamReader) -> TarEntry | None:
    """The next member's header of a tar stream (PAX and GNU long-name headers folded in), its data
    left to read; None at the archive's end. `ValueError` for a header that is no tar header;
    `asyncio.IncompleteReadError` when the stream ends inside one."""
    pax: dict[str, str] = {}
    long_name: str | None = None
    while True:
        header = await reader.readexactly(TAR_BLOCK)
        if header == bytes(TAR_BLOCK):
            return None
        stored = sum(header[:148]) + 8 * 32 + sum(header[156:])
        try:
            checksum, size = _tar_number(header[148:156]), _tar_number(header[124:136])
        except ValueError:
            checksum = size = -1
        if checksum != stored or size < 0:
            raise ValueError("not a tar header (its checksum does not match)")
        flag = header[156:157]
        if flag in (b"x", b"g", b"L"):
            data = (await reader.readexactly(-(-size // TAR_BLOCK) * TAR_BLOCK))[:size]
            if flag == b"x":
                pax.update(_pax(data))
            elif flag == b"L":
                long_name = data.rstrip(b"\0").decode("utf-8", "replace")
            continue
        name = header[:100].rstrip(b"\0").decode("utf-8", "replace")
        prefix = header[345:500].rstrip(b"\0").decode("utf-8", "replace") if header[257:262] == b"ustar" else ""
        name = pax.get("path") or long_name or (f"{prefix}/{name}" if prefix else name)
        return TarEntry(name=name, size=int(pax.get("size", size)), regular=flag in _TAR_REGULAR)


def _version(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.strip().split("."))
    except ValueError:
        return (0,)


def _message(data: bytes) -> str:
    """The engine's `{"message": …}` error body, else the text."""
    text = data.decode("utf-8", errors="replace").strip()
    try:
        body = json.loads(text)
    except ValueError:
        return text
    return str(body.get("message", text)) if isinstance(body, dict) else text


def query(**values: object) -> dict[str, str]:
    """Query parameters as the engine reads them (booleans `1`/`0`, dicts as JSON filters)."""
    out: dict[str, str] = {}
    for key, value in values.items():
        if value is None:
            continue
        if isinstance(value, bool):
            out[key] = "1" if value else "0"
        elif isinstance(value, dict | list):
            out[key] = json.dumps(value)
        else:
            out[key] = str(value)
    return out
