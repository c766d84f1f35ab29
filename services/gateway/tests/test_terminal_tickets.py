"""Terminal tickets in the `terminal-tickets` bucket of a real nats-server: a ticket is spent once
however many replicas race for it, only for its own run, never after it expired; the bucket holds
the ticket's digest, never the ticket; client frames are read as keystrokes and resizes."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import timedelta

import pytest
from aiohttp import WSMsgType
from nats.aio.client import Client as NatsClient

from evalbus.testing.pipeline import eventually
from evalbus_contracts import utcnow
from evalbus_contracts.control import TermInput, TermResize
from evalbus_contracts.streams import TERMINAL_TICKETS
from evalbus_gateway.live import terminal as terminal_module
from evalbus_gateway.live.terminal import TerminalTickets, client_frame, ticket_key
from evalbus_runtime import connect, ensure_topology

pytestmark = pytest.mark.integration


@pytest.fixture
async def nc(gw_nats: str) -> AsyncIterator[NatsClient]:
    client = await connect(gw_nats, "tickets-test")
    await ensure_topology(client.jetstream())
    yield client
    await client.close()


async def test_a_ticket_is_spent_once_among_racing_replicas(nc: NatsClient) -> None:
    js = nc.jetstream()
    ticket, expires = await TerminalTickets(js, 30.0).mint("evb-b1-c1", "alice")
    assert (expires - utcnow()).total_seconds() > 25
    kv = await js.key_value(TERMINAL_TICKETS.bucket)
    keys = await kv.keys()
    assert ticket_key(ticket) in keys
    assert ticket not in keys
    # Ten replicas (each its own store object) spend the same ticket at once: one wins.
    spent = await asyncio.gather(*(TerminalTickets(js, 30.0).spend(ticket, "evb-b1-c1") for _ in range(10)))
    winners = [e for e in spent if e is not None]
    assert len(winners) == 1
    assert (winners[0].run_id, winners[0].principal) == ("evb-b1-c1", "alice")
    assert await TerminalTickets(js, 30.0).spend(ticket, "evb-b1-c1") is None


async def test_a_ticket_opens_only_its_run_and_not_after_it_expired(nc: NatsClient) -> None:
    js = nc.jetstream()
    tickets = TerminalTickets(js, 30.0)
    other, _ = await tickets.mint("evb-b1-c1", "alice")
    assert await tickets.spend(other, "evb-b1-c2") is None
    assert await tickets.spend(other, "evb-b1-c1") is None  # a wrong try spends it too
    assert await tickets.spend("made-up", "evb-b1-c1") is None
    short = TerminalTickets(js, 0.2)
    ticket, expires = await short.mint("evb-b1-c1", "alice")
    await eventually(lambda: utcnow() > expires, timeout_s=5, what="the ticket to expire")
    assert await short.spend(ticket, "evb-b1-c1") is None


@pytest.mark.unit
def test_client_frames() -> None:
    assert client_frame(WSMsgType.BINARY, b"ls\n") == TermInput(data=b"ls\n")
    assert client_frame(WSMsgType.TEXT, '{"type": "input", "data": "pwd\\n"}') == TermInput(data=b"pwd\n")
    assert client_frame(WSMsgType.TEXT, '{"type": "resize", "cols": 120, "rows": 40}') == TermResize(cols=120, rows=40)
    assert client_frame(WSMsgType.TEXT, '{"type": "resize", "cols": 0, "rows": 40}') is None
    assert client_frame(WSMsgType.TEXT, "not json") is None
    assert client_frame(WSMsgType.BINARY, b"") is None


async def test_a_replica_whose_clock_is_off_neither_refuses_a_fresh_ticket_nor_takes_a_stale_one(
    nc: NatsClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The ticket's age is measured on the NATS server's clock, not the spending replica's."""
    js = nc.jetstream()
    fresh, _ = await TerminalTickets(js, 30.0).mint("evb-b1-c1", "alice")
    stale, _ = await TerminalTickets(js, 0.2).mint("evb-b1-c1", "alice")
    minted = utcnow()
    await eventually(lambda: (utcnow() - minted).total_seconds() > 0.5, timeout_s=5, what="the short ticket's age")
    ahead = minted + timedelta(minutes=10)
    behind = minted - timedelta(minutes=10)
    monkeypatch.setattr(terminal_module, "utcnow", lambda: ahead)
    assert await TerminalTickets(js, 30.0).spend(fresh, "evb-b1-c1") is not None
    monkeypatch.setattr(terminal_module, "utcnow", lambda: behind)
    assert await TerminalTickets(js, 0.2).spend(stale, "evb-b1-c1") is None
