"""Server-sent events for the live benchmark: the bare relay, a swarm of clients, stamped events.

- `stamp(k)` / `STAMP`: an event id that carries the publish moment, `"event_id":"lv-<k>-<ns>"`
  (the index `k` and `time.monotonic_ns()` when it was published), so a client computes
  publish → arrival from the bytes alone; every server forwards the event JSON unchanged.
- `relay` (`python bench/_sse.py relay <nats_url> <port> <subject>...`): the baseline, a minimal
  aiohttp SSE server with one core NATS subscription for all its clients that writes each message
  to every open response as it comes, in the gateway's own frame format (`frame`, `event_type`).
  The bus notes measured this as the fastest simple way (coalescing writes only helps past
  1,000 events/s).
- `swarm` (`python bench/_sse.py swarm <url> <n> <events> <warmup>`, the bearer token in
  `BENCH_SSE_TOKEN` when the server wants one): `n` connections on
  one event stream, raw asyncio protocols (no client-side SSE parser, so the clients cost as
  little as they can), each recording when each stamped event arrived. It prints `ready` once
  every connection has its response headers, then one JSON line (`SwarmResult`) when every client
  has every event or `stop` arrives on its stdin.

`open_stream` and `read_frames` are the ordinary client side for the run streams (aiohttp and the
gateway client's `SseParser`).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import sys
import time
from collections.abc import AsyncIterator, Sequence
from pathlib import Path
from urllib.parse import urlsplit

if __package__ in (None, ""):  # run as `python bench/_sse.py`: make `bench.*` importable
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import msgspec
from aiohttp import web
from bench._stats import mean, percentile
from nats.aio.msg import Msg

from evalbus_api.client import SseEvent, SseParser
from evalbus_gateway.api.sse import event_type, frame
from evalbus_runtime import connect

TOKEN_ENV = "BENCH_SSE_TOKEN"
"""Where the swarm finds the bearer token (not on its command line, where `ps` shows it)."""
STAMP = b'"event_id":"lv-'
"""What precedes a stamped event's index and publish time in its JSON."""


def stamp(k: int) -> str:
    """The event id of stamped event `k`, published now."""
    return f"lv-{k}-{time.monotonic_ns()}"


# ---------------------------------------------------------------- the bare relay


async def relay(nats_url: str, port: int, subject_list: Sequence[str]) -> None:
    """Serve `GET /events`: every message on `subject_list`, to every client, as it comes."""
    clients: dict[web.StreamResponse, asyncio.Future[None]] = {}

    async def on_msg(msg: Msg) -> None:
        data = frame(msg.data, event=event_type(msg.headers, msg.data))
        for response, gone in list(clients.items()):
            try:
                await response.write(data)
            except (ConnectionResetError, RuntimeError):
                clients.pop(response, None)
                if not gone.done():
                    gone.set_result(None)

    async def events(request: web.Request) -> web.StreamResponse:
        response = web.StreamResponse(
            headers={"Content-Type": "text/event-stream; charset=utf-8", "Cache-Control": "no-cache"}
        )
        await response.prepare(request)
        await response.write(b": relay\n\n")
        gone: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        clients[response] = gone
        try:
            await gone
        finally:
            clients.pop(response, None)
        return response

    nc = await connect(nats_url, "bench-sse-relay")
    for subject in subject_list:
        await nc.subscribe(subject, cb=on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
    await nc.flush()
    app = web.Application()
    app.router.add_get("/events", events)
    runner = web.AppRunner(app)
    await runner.setup()
    await web.TCPSite(runner, "127.0.0.1", port).start()
    print("ready", flush=True)
    await asyncio.Event().wait()  # serves until the benchmark terminates the process


# ---------------------------------------------------------------- the client swarm


class SwarmResult(msgspec.Struct, frozen=True, kw_only=True):
    """What a swarm of SSE clients saw."""

    clients: int
    """Connections asked for."""
    connected: int
    """Connections answered 200."""
    complete: int
    """Clients that received every stamped event."""
    delivered: int
    """Stamped events received, over all clients (each counted once per client)."""
    expected: int
    """Stamped events × clients."""
    duplicates: int
    """Stamped events a client received more than once."""
    samples: int
    """Latencies measured (events after the warm-up, over all clients)."""
    p50_ms: float
    p90_ms: float
    p99_ms: float
    p999_ms: float
    max_ms: float
    mean_ms: float
    frames_per_s: float
    """Stamped events delivered per second, over all clients, from the first arrival to the last."""
    cpu_s: float
    """CPU seconds of the swarm process."""


class _Client(asyncio.Protocol):
    """One SSE connection: finds the stamps in what arrives and records their latency."""

    def __init__(self, request: bytes, events: int, warmup: int, latencies: list[int], on_event: asyncio.Event) -> None:
        self._request = request
        self._warmup = warmup
        self._latencies = latencies
        self._on_event = on_event
        self._buffer = b""
        self._head = True
        self.seen = bytearray(events)
        self.received = 0
        self.first = 0
        self.last = 0
        self.duplicates = 0
        self.status = 0
        self.headers = asyncio.get_running_loop().create_future()

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        assert isinstance(transport, asyncio.Transport)
        transport.write(self._request)

    def connection_lost(self, exc: Exception | None) -> None:
        if not self.headers.done():
            self.headers.set_result(None)

    def data_received(self, data: bytes) -> None:
        now = time.monotonic_ns()
        buffer = self._buffer + data if self._buffer else data
        if self._head:
            end = buffer.find(b"\r\n\r\n")
            if end < 0:
                self._buffer = buffer
                return
            self.status = int(buffer[9:12]) if buffer.startswith(b"HTTP/1.") else 0
            self._head = False
            self.headers.set_result(None)
            buffer = buffer[end + 4 :]
        pos = 0
        found = False
        while True:
            start = buffer.find(STAMP, pos)
            if start < 0:
                self._buffer = buffer[-(len(STAMP) - 1) :]  # may hold the start of the next stamp
                break
            end = buffer.find(b'"', start + len(STAMP))
            if end < 0:
                self._buffer = buffer[start:]
                break
            index, _, sent = buffer[start + len(STAMP) : end].partition(b"-")
            k = int(index)
            if self.seen[k]:
                self.duplicates += 1
            else:
                self.seen[k] = 1
                self.received += 1
                found = True
                if k >= self._warmup:
                    self._latencies.append(now - int(sent))
            pos = end + 1
        if found:
            self.first = self.first or now
            self.last = now
            self._on_event.set()


async def swarm(url: str, n: int, events: int, warmup: int, token: str | None) -> SwarmResult:
    """`n` clients on the stream at `url` until each has `events` stamped events or `stop` comes."""
    loop = asyncio.get_running_loop()
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    auth = f"Authorization: Bearer {token}\r\n" if token else ""
    request = (f"GET {parts.path} HTTP/1.1\r\nHost: {host}:{port}\r\nAccept: text/event-stream\r\n{auth}\r\n").encode()
    latencies: list[int] = []
    progress = asyncio.Event()
    clients: list[_Client] = []
    transports: list[asyncio.BaseTransport] = []
    for _ in range(n):
        transport, client = await loop.create_connection(
            lambda: _Client(request, events, warmup, latencies, progress), host, port
        )
        clients.append(client)
        transports.append(transport)
    await asyncio.gather(*(c.headers for c in clients))
    print("ready", flush=True)

    reader = asyncio.StreamReader()
    await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
    stop = asyncio.ensure_future(reader.readline())
    while not stop.done() and any(c.received < events for c in clients):
        progress.clear()
        waiter = asyncio.ensure_future(progress.wait())
        await asyncio.wait({stop, waiter}, return_when=asyncio.FIRST_COMPLETED)
        waiter.cancel()
    stop.cancel()
    for connection in transports:
        connection.close()
    ms = [x / 1e6 for x in latencies]
    delivered = sum(c.received for c in clients)
    firsts, lasts = [c.first for c in clients if c.first], [c.last for c in clients if c.last]
    span_s = (max(lasts) - min(firsts)) / 1e9 if firsts else 0.0
    times = os.times()
    return SwarmResult(
        clients=n,
        connected=sum(1 for c in clients if c.status == 200),
        complete=sum(1 for c in clients if c.received == events),
        delivered=delivered,
        expected=n * events,
        duplicates=sum(c.duplicates for c in clients),
        samples=len(ms),
        p50_ms=percentile(ms, 0.5),
        p90_ms=percentile(ms, 0.9),
        p99_ms=percentile(ms, 0.99),
        p999_ms=percentile(ms, 0.999),
        max_ms=max(ms, default=float("nan")),
        mean_ms=mean(ms),
        frames_per_s=delivered / span_s if span_s > 0 else float("nan"),
        cpu_s=times.user + times.system,
    )


# ---------------------------------------------------------------- run streams (the ordinary client)


@contextlib.asynccontextmanager
async def open_stream(
    http: aiohttp.ClientSession, url: str, token: str, *, timeout_s: float, retry_s: float = 0.1
) -> AsyncIterator[aiohttp.ClientResponse]:
    """The event stream at `url`, retried while it answers 404 (a run not known yet), for at most
    `timeout_s`; any other failure raises."""
    deadline = time.monotonic() + timeout_s
    headers = {"Authorization": f"Bearer {token}", "Accept": "text/event-stream"}
    while True:
        response = await http.get(url, headers=headers, timeout=aiohttp.ClientTimeout(total=None, sock_connect=10))
        if response.status == 404 and time.monotonic() < deadline:
            response.release()
            await asyncio.sleep(retry_s)
            continue
        try:
            response.raise_for_status()
            yield response
        finally:
            response.release()
        return


async def read_frames(response: aiohttp.ClientResponse) -> AsyncIterator[tuple[int, SseEvent]]:
    """Each frame of an event stream with its arrival (`time.monotonic_ns()`), until it closes."""
    parser = SseParser()
    async for chunk in response.content.iter_any():
        now = time.monotonic_ns()
        for event in parser.feed(chunk):
            yield now, event


# ---------------------------------------------------------------- entry points


def main(argv: Sequence[str]) -> None:
    """`relay <nats_url> <port> <subject>...` or `swarm <url> <n> <events> <warmup>`."""
    if argv[0] == "relay":
        asyncio.run(relay(argv[1], int(argv[2]), argv[3:]))
    elif argv[0] == "swarm":
        token = os.environ.get(TOKEN_ENV) or None
        result = asyncio.run(swarm(argv[1], int(argv[2]), int(argv[3]), int(argv[4]), token))
        print(msgspec.json.encode(result).decode(), flush=True)
    else:
        raise SystemExit(f"unknown command {argv[0]!r}")


if __name__ == "__main__":
    main(sys.argv[1:])
