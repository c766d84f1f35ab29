"""The batch event stream (SSE) against a real nats-server and PostgreSQL: ids are CASES stream
sequences, `Last-Event-ID` resumes exactly after one, heartbeats keep a quiet stream open,
`event: end` follows `batch.finalized`, and shutdown closes open streams promptly."""

from __future__ import annotations

import asyncio
import contextlib
import time
import uuid
from collections.abc import AsyncIterator

import aiohttp
import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.testing.pipeline import eventually
from evalbus_api.client import SseEvent, SseParser
from evalbus_contracts import EventBase, decode_event
from evalbus_gateway.testing import BatchScript, RunningGateway, batch_spec, member, running_gateway
from evalbus_runtime import Publisher

pytestmark = pytest.mark.integration

ALICE = "tok-alice"
HEARTBEAT_S = 0.2
QUIET_HEARTBEAT_S = 30.0
"""A heartbeat interval far longer than a shutdown may take."""


@pytest.fixture
async def gateway(gw_nats: str, database_url: str) -> AsyncIterator[RunningGateway]:
    async with running_gateway(
        gw_nats, database_url, tokens={ALICE: member("alice")}, sse_heartbeat_s=HEARTBEAT_S
    ) as gw:
        yield gw


class Stream:
    """An open SSE response, read frame by frame with a deadline."""

    def __init__(self, resp: aiohttp.ClientResponse) -> None:
        self.resp = resp
        self.parser = SseParser()
        self.raw = b""
        self._ready: list[SseEvent] = []

    async def _more(self, timeout_s: float) -> bool:
        chunk = await asyncio.wait_for(self.resp.content.readany(), timeout_s)
        if not chunk:
            return False
        self.raw += chunk
        self._ready.extend(self.parser.feed(chunk))
        return True

    async def next(self, timeout_s: float = 10.0) -> SseEvent:
        deadline = time.monotonic() + timeout_s
        while not self._ready:
            if not await self._more(max(0.01, deadline - time.monotonic())):
                raise AssertionError("stream closed")
        return self._ready.pop(0)

    async def until_end(self, timeout_s: float = 20.0) -> list[SseEvent]:
        out: list[SseEvent] = []
        while True:
            event = await self.next(timeout_s)
            out.append(event)
            if event.event == "end":
                return out

    async def closed(self, timeout_s: float = 5.0) -> bool:
        """True when the server ended the response (after what was already read)."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if not await self._more(max(0.01, deadline - time.monotonic())):
                return True
        return False


async def open_stream(
    http: aiohttp.ClientSession, gw: RunningGateway, batch_id: str, last_event_id: int | None = None
) -> tuple[aiohttp.ClientResponse, Stream]:
    headers = {"Authorization": f"Bearer {ALICE}"}
    if last_event_id is not None:
        headers["Last-Event-ID"] = str(last_event_id)
    resp = await http.get(f"{gw.base_url}/v1/batches/{batch_id}/events", headers=headers)
    assert resp.status == 200, await resp.text()
    assert resp.headers["Content-Type"].startswith("text/event-stream")
    return resp, Stream(resp)


async def publish(pub: Publisher, events: list[EventBase]) -> list[int]:
    """Publish in order; return their stream sequences."""
    return [(await pub.publish_event(e)).seq for e in events]


def new_script(cases: tuple[str, ...] = ("c1", "c2")) -> BatchScript:
    return BatchScript("b" + uuid.uuid4().hex[:12], batch_spec(cases))


async def test_events_carry_stream_ids_and_end_after_finalized(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    _, pub = bus
    script = new_script(("c1",))
    other = new_script(("c1",))
    requested, finalized = script.requested(), script.finalized("succeeded")
    events: list[EventBase] = [*script.case_events("c1")]
    published = [requested, *events, finalized]
    seqs = await publish(pub, [requested])
    async with aiohttp.ClientSession() as http:
        resp, stream = await open_stream(http, gateway, script.batch_id)
        async with resp:
            for event in events:
                seqs += await publish(pub, [event])
                # Another batch's events interleave on the stream; they are not this stream's.
                await publish(pub, [other.requested() if event is events[0] else other.case_requested("c1")])
            seqs += await publish(pub, [finalized])
            received = await stream.until_end()
            assert await stream.closed()
    frames, end = received[:-1], received[-1]
    assert [f.id for f in frames] == seqs
    assert [f.event for f in frames] == [e.type for e in published]
    assert [decode_event(f.data.encode()).event_id for f in frames] == [e.event_id for e in published]
    assert end.event == "end"
    assert end.id is None or end.id == seqs[-1]
    assert msgspec.json.decode(end.data) == {"batch_id": script.batch_id, "status": "succeeded"}
    assert b"id: " in stream.raw


async def test_last_event_id_resumes_exactly_after_that_sequence(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    _, pub = bus
    script = new_script(("c1", "c2"))
    events: list[EventBase] = [script.requested(), *script.case_events("c1"), script.case_requested("c2")]
    seqs = await publish(pub, events)
    async with aiohttp.ClientSession() as http:
        # Read the first three, leave.
        resp, stream = await open_stream(http, gateway, script.batch_id)
        async with resp:
            seen = [await stream.next() for _ in range(3)]
        assert [e.id for e in seen] == seqs[:3]

        # More happens while nobody listens.
        rest: list[EventBase] = [
            script.executed("c2"),
            script.judged("c2"),
            script.exported("c2"),
            script.finalized("succeeded"),
        ]
        seqs += await publish(pub, rest)

        resp, stream = await open_stream(http, gateway, script.batch_id, last_event_id=seen[-1].id)
        async with resp:
            resumed = await stream.until_end()
    assert [e.id for e in resumed[:-1]] == seqs[3:]
    assert [e.event for e in resumed[:-1]] == [e.type for e in [*events, *rest][3:]]


async def test_resuming_after_the_finalized_event_ends_at_once(
    gateway: RunningGateway, bus: tuple[NatsClient, Publisher]
) -> None:
    _, pub = bus
    script = new_script(("c1",))
    seqs = await publish(pub, [script.requested(), *script.case_events("c1"), script.finalized("cancelled")])
    async with aiohttp.ClientSession() as http:
        resp, stream = await open_stream(http, gateway, script.batch_id, last_event_id=seqs[-1])
        async with resp:
            only = await stream.next(timeout_s=5)
            assert only.event == "end"
            assert msgspec.json.decode(only.data)["status"] == "cancelled"
            assert await stream.closed()
        # From the start, everything then `end`.
        resp, stream = await open_stream(http, gateway, script.batch_id, last_event_id=0)
        async with resp:
            everything = await stream.until_end()
    assert [e.id for e in everything[:-1]] == seqs


async def test_a_quiet_stream_gets_heartbeats(gateway: RunningGateway, bus: tuple[NatsClient, Publisher]) -> None:
    _, pub = bus
    script = new_script(("c1",))
    await publish(pub, [script.requested()])
    async with aiohttp.ClientSession() as http:
        resp, stream = await open_stream(http, gateway, script.batch_id)
        async with resp:
            first = await stream.next()
            assert first.event == "batch.requested"

            async def two_heartbeats() -> bool:
                if stream.raw.count(b": heartbeat\n\n") >= 2:
                    return True
                assert await stream._more(HEARTBEAT_S * 10), "stream closed"
                return False

            await eventually(two_heartbeats, timeout_s=10, what="two heartbeats")
            # Heartbeats are comments: no event came of them.
            assert stream._ready == []


async def test_shutdown_closes_open_streams(gw_nats: str, database_url: str, bus: tuple[NatsClient, Publisher]) -> None:
    """The shutdown ends an open stream itself instead of waiting on it: a stop with a stream open
    is as quick as one without (measured first, in this test), far from the stream's heartbeat."""
    _, pub = bus
    script = new_script(("c1",))
    await publish(pub, [script.requested()])

    def gateway() -> contextlib.AbstractAsyncContextManager[RunningGateway]:
        return running_gateway(
            gw_nats, database_url, tokens={ALICE: member("alice")}, sse_heartbeat_s=QUIET_HEARTBEAT_S
        )

    async with gateway():
        began = time.monotonic()
    baseline_s = time.monotonic() - began  # a stop with no stream open
    async with aiohttp.ClientSession() as http:
        gw_cm = gateway()
        gw = await gw_cm.__aenter__()
        resp, stream = await open_stream(http, gw, script.batch_id)
        async with resp:
            assert (await stream.next()).event == "batch.requested"
            assert len(gw.state.streams) == 1
            began = time.monotonic()
            await gw_cm.__aexit__(None, None, None)
            stop_s = time.monotonic() - began
            assert len(gw.state.streams) == 0
            assert await stream.closed(timeout_s=2.0)
    # A stream the stop did not close holds it until the stream's next wake-up (its heartbeat,
    # QUIET_HEARTBEAT_S away) or the NATS drain's timeout (30 s), whichever comes first.
    assert stop_s < baseline_s + QUIET_HEARTBEAT_S / 2, (stop_s, baseline_s)
    assert b": heartbeat" not in stream.raw
