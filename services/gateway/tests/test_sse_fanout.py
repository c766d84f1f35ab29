"""The batch event stream's fan-out against a real nats-server and PostgreSQL: every client of a
batch in a gateway process follows one shared JetStream subscription; many clients get every
frame once and in order; clients joining with `Last-Event-ID` while events are being published
get no gap and no duplicate across the replay → live handoff; a client that stops reading is cut
(`: lagging`, then it resumes with `Last-Event-ID`) while a fast one gets everything; the shared
subscription is gone once its last client left (`evalbus_gateway_sse_subscriptions`)."""

from __future__ import annotations

import asyncio
import contextlib
import re
import socket
import uuid
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.testing.pipeline import eventually
from evalbus_api.client import SseEvent, SseParser
from evalbus_contracts import EventBase
from evalbus_gateway.testing import BatchScript, RunningGateway, batch_events, batch_spec, member, running_gateway
from evalbus_runtime import Publisher

pytestmark = pytest.mark.integration

ALICE = "tok-alice"
HEARTBEAT_S = 0.2
BUFFER = 256
"""`sse_client_buffer`: frames a stream may fall behind before it is cut."""


@pytest.fixture
async def gateway(gw_nats: str, database_url: str) -> AsyncIterator[RunningGateway]:
    async with running_gateway(
        gw_nats,
        database_url,
        tokens={ALICE: member("alice")},
        sse_heartbeat_s=HEARTBEAT_S,
        sse_client_buffer=BUFFER,
    ) as gw:
        yield gw


def new_script(cases: int) -> BatchScript:
    return BatchScript("b" + uuid.uuid4().hex[:12], batch_spec(tuple(f"c{i}" for i in range(cases))))


def events_of(script: BatchScript, *, answer_chars: int = 0) -> list[EventBase]:
    """Requested, then each case requested and executed (never exported, so the gateway does not
    finalize the batch itself), then `batch.finalized`; an answer of `answer_chars` makes each
    `case.executed` that much larger."""
    out: list[EventBase] = [script.requested()]
    for case in script.case_ids:
        executed = script.executed(case)
        if answer_chars:
            executed = msgspec.structs.replace(
                executed, result=msgspec.structs.replace(executed.result, answer="x" * answer_chars)
            )
        out += [script.case_requested(case), executed]
    return [*out, script.finalized("cancelled")]


async def follow(
    http: aiohttp.ClientSession, gw: RunningGateway, batch_id: str, last_event_id: int | None = None
) -> list[SseEvent]:
    """Read the batch's stream to its `end` (which is left out)."""
    return (await batch_events(http, gw, batch_id, ALICE, last_event_id=last_event_id))[:-1]


async def metric(http: aiohttp.ClientSession, gw: RunningGateway, name: str) -> float:
    async with http.get(f"{gw.base_url}/metrics") as resp:
        text = await resp.text()
    found = re.search(rf"^{name} (\S+)$", text, re.MULTILINE)
    assert found, f"{name} not in /metrics"
    return float(found.group(1))


async def no_subscriptions(gw: RunningGateway) -> None:
    await eventually(
        lambda: gw.state.fanout.subscriptions == 0 and gw.state.fanout.watchers == 0,
        timeout_s=10,
        what="the shared subscriptions closed with their last client",
    )


async def test_many_clients_share_one_subscription_and_get_every_frame_once_in_order(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    _, pub = bus
    script = new_script(40)
    events = events_of(script)
    seqs = [(await pub.publish_event(events[0])).seq]
    async with aiohttp.ClientSession() as http:
        clients = [asyncio.ensure_future(follow(http, gateway, script.batch_id)) for _ in range(12)]
        await eventually(lambda: gateway.state.fanout.watchers == 12, timeout_s=20, what="12 clients joined")
        assert gateway.state.fanout.subscriptions == 1
        assert await metric(http, gateway, "evalbus_gateway_sse_subscriptions") == 1.0
        assert await metric(http, gateway, "evalbus_gateway_sse_watchers") == 12.0
        seqs += [(await pub.publish_event(e)).seq for e in events[1:]]
        received = await asyncio.wait_for(asyncio.gather(*clients), 30)
        for frames in received:
            assert [f.id for f in frames] == seqs
            assert [f.event for f in frames] == [e.type for e in events]
        await no_subscriptions(gateway)
        assert await metric(http, gateway, "evalbus_gateway_sse_subscriptions") == 0.0


@pytest.mark.parametrize("ring_items", [2048, 16], ids=["kept", "replayed"])
async def test_clients_joining_mid_stream_get_no_gap_and_no_duplicate(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher], ring_items: int
) -> None:
    """Publishes race the joins: each joiner resumes from the latest id published, an older one,
    or nothing, and must see exactly the batch's events after its resume point, in order — from
    what the shared feed kept, or (a feed keeping 16 items, opened after the batch's first event)
    a replay of the stream handed over to what the feed kept and offers."""
    gateway.state.fanout.ring_items = ring_items
    _, pub = bus
    script = new_script(150)
    events = events_of(script)
    seqs: list[int] = []
    async with aiohttp.ClientSession() as http:
        seqs.append((await pub.publish_event(events[0])).seq)
        # The first client opens the feed from its resume point: from the start, or (replayed) after
        # the batch's request, so a joiner from the start must read the request from the stream.
        first = None if ring_items > 16 else seqs[0]
        anchor = asyncio.ensure_future(follow(http, gateway, script.batch_id, first))
        await eventually(lambda: gateway.state.fanout.watchers == 1, timeout_s=10, what="the first client")
        joiners: list[tuple[int | None, asyncio.Future[list[SseEvent]]]] = []

        async def publish_all() -> None:
            for event in events[1:]:
                seqs.append((await pub.publish_event(event)).seq)

        publishing = asyncio.ensure_future(publish_all())
        step = len(events) // 10
        while len(joiners) < 8:
            at = len(seqs)
            await eventually(lambda at=at: len(seqs) >= at + step or publishing.done(), timeout_s=20, what="more")
            resume = (seqs[-1], seqs[len(seqs) // 2], None)[len(joiners) % 3]
            joiners.append((resume, asyncio.ensure_future(follow(http, gateway, script.batch_id, resume))))
        await publishing
        everything = await asyncio.wait_for(anchor, 30)
        assert [f.id for f in everything] == (seqs if first is None else seqs[1:])
        for resume, joiner in joiners:
            frames = await asyncio.wait_for(joiner, 30)
            expected = seqs if resume is None else seqs[seqs.index(resume) + 1 :]
            assert [f.id for f in frames] == expected, resume
        await no_subscriptions(gateway)


class StalledClient:
    """An SSE connection that reads its response headers, then nothing (a tiny receive buffer, so
    the server's writes back up at once)."""

    def __init__(self, gw: RunningGateway, batch_id: str) -> None:
        self.gw = gw
        self.batch_id = batch_id
        self.reader: asyncio.StreamReader | None = None
        self.writer: asyncio.StreamWriter | None = None

    async def open(self) -> None:
        host, port = self.gw.base_url.removeprefix("http://").split(":")
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        sock.setblocking(False)
        await asyncio.get_running_loop().sock_connect(sock, (host, int(port)))
        self.reader, self.writer = await asyncio.open_connection(sock=sock, limit=4096)
        self.writer.write(
            f"GET /v1/batches/{self.batch_id}/events HTTP/1.1\r\nHost: {host}:{port}\r\n"
            f"Authorization: Bearer {ALICE}\r\nAccept: text/event-stream\r\n\r\n".encode()
        )
        head = await asyncio.wait_for(self.reader.readuntil(b"\r\n\r\n"), 10)
        assert head.startswith(b"HTTP/1.1 200"), head

    async def rest(self) -> bytes:
        """Everything the server sent after the headers, until it closed the connection."""
        assert self.reader is not None
        out = b""
        with contextlib.suppress(ConnectionResetError):
            while chunk := await asyncio.wait_for(self.reader.read(65536), 10):
                out += chunk
        return out

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


async def test_a_client_that_stops_reading_is_cut_without_stalling_a_fast_one(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    _, pub = bus
    script = new_script(400)
    events = events_of(script, answer_chars=32 * 1024)  # 13 MB of frames: far more than the sockets hold
    seqs = [(await pub.publish_event(events[0])).seq]
    stalled = StalledClient(gateway, script.batch_id)
    try:
        await stalled.open()
        async with aiohttp.ClientSession() as http:
            fast = asyncio.ensure_future(follow(http, gateway, script.batch_id))
            await eventually(lambda: gateway.state.fanout.watchers == 2, timeout_s=10, what="both clients")
            seqs += [(await pub.publish_event(e)).seq for e in events[1:]]
            # The fast client gets everything while the stalled one has not read a byte.
            frames = await asyncio.wait_for(fast, 30)
            assert [f.id for f in frames] == seqs
            await eventually(lambda: gateway.state.fanout.lagged == 1, timeout_s=10, what="the stalled client cut")
            assert await metric(http, gateway, "evalbus_gateway_sse_lagging_total") == 1.0
            # What it got ends without `end` (a lagging comment, or an aborted connection): it
            # resumes from the last id it parsed and misses nothing.
            parsed = SseParser().feed(await stalled.rest())
            assert all(e.event != "end" for e in parsed)
            got = [e for e in parsed if e.id is not None]
            assert len(got) < len(seqs)
            assert [e.id for e in got] == seqs[: len(got)]
            resumed = await follow(http, gateway, script.batch_id, got[-1].id if got else None)
            assert [e.id for e in got] + [f.id for f in resumed] == seqs
            await no_subscriptions(gateway)
    finally:
        stalled.close()
