"""What the gateway's handlers share: settings, tokens, and the resources opened at start (the
database pool, the bus connection and publisher of the chassis)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import asyncpg
from nats.js import JetStreamContext
from prometheus_client import Counter, Gauge

from evalbus_gateway.api.auth import TokenTable
from evalbus_gateway.api.limits import RunRate, StreamSlots
from evalbus_gateway.api.sse import EventStreams
from evalbus_gateway.errors import NotReadyError
from evalbus_gateway.live.fanout import Fanout
from evalbus_gateway.settings import GatewaySettings
from evalbus_runtime import Publisher, Service

if TYPE_CHECKING:
    from nats.aio.client import Client as NatsClient

    from evalbus_gateway.api.mcp import McpEndpoint


class GatewayState:
    """One per gateway process; handlers reach it through the route table."""

    def __init__(self, service: Service, settings: GatewaySettings, tokens: TokenTable) -> None:
        self.service = service
        self.settings = settings
        self.tokens = tokens
        self.streams = EventStreams()
        """Open SSE connections."""
        registry = service.metrics.registry
        lagging = Counter("evalbus_gateway_sse_lagging", "Event streams cut for falling behind", registry=registry)
        self.fanout = Fanout(on_lagged=lagging.inc)
        """The shared JetStream subscriptions the event streams follow."""
        Gauge(
            "evalbus_gateway_sse_subscriptions", "Shared subscriptions event streams follow", registry=registry
        ).set_function(lambda: self.fanout.subscriptions)
        Gauge(
            "evalbus_gateway_sse_watchers", "Event streams following a shared subscription", registry=registry
        ).set_function(lambda: self.fanout.watchers)
        self.stream_slots = StreamSlots()
        """Open event streams per principal (the `sse_max_per_principal` limit)."""
        self.exec_rate = RunRate()
        """Exec requests per run (the `exec_per_run_per_minute` limit)."""
        self.openapi = b"{}"
        """The OpenAPI document (generated when the routes are installed)."""
        self._pool: asyncpg.Pool[asyncpg.Record] | None = None
        self.mcp: McpEndpoint | None = None
        """The `/mcp` endpoint (set by `build_gateway`)."""

    @property
    def pool(self) -> asyncpg.Pool[asyncpg.Record]:
        """The database pool (after start)."""
        if self._pool is None:
            raise NotReadyError("the gateway is starting: the database is not open yet")
        return self._pool

    @property
    def pool_or_none(self) -> asyncpg.Pool[asyncpg.Record] | None:
        """The pool if it is open."""
        return self._pool

    def set_pool(self, pool: asyncpg.Pool[asyncpg.Record] | None) -> None:
        """Install (or forget) the pool."""
        self._pool = pool

    @property
    def publisher(self) -> Publisher:
        """The chassis' publisher."""
        try:
            return self.service.publisher
        except RuntimeError as e:
            raise NotReadyError("the gateway is starting: the bus is not connected yet") from e

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context."""
        try:
            return self.service.js
        except RuntimeError as e:
            raise NotReadyError("the gateway is starting: the bus is not connected yet") from e

    @property
    def nc(self) -> NatsClient:
        """The NATS connection."""
        try:
            return self.service.nc
        except RuntimeError as e:
            raise NotReadyError("the gateway is starting: the bus is not connected yet") from e
