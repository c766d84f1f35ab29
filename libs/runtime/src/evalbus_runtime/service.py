"""The service runner: settings, logging, tracing, the NATS connection, the streams and consumers,
the consumer loops, and an HTTP server with `/healthz`, `/readyz` and `/metrics`.

A service is its stage logic plus a few lines of wiring:

    service = Service(settings)
    service.add_stage(Stage(consumer=JUDGE_CASES, handler=judge.handle, accepts=(CaseExecuted,)))
    await service.run()          # until SIGTERM / SIGINT, then a graceful shutdown
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import logging
import signal
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
from aiohttp import web
from nats.aio.client import Client as NatsClient
from nats.js import JetStreamContext
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from evalbus_contracts.streams import STREAMS
from evalbus_runtime.bus import connect, ensure_consumer, ensure_topology
from evalbus_runtime.consumer import ConsumerLoop, Stage
from evalbus_runtime.faults import Faults
from evalbus_runtime.logs import configure_logging
from evalbus_runtime.metrics import ServiceMetrics
from evalbus_runtime.publisher import Publisher
from evalbus_runtime.settings import ServiceSettings
from evalbus_runtime.tracing import configure_tracing

log = logging.getLogger("evalbus.service")

Hook = Callable[["Service"], Awaitable[None]]
ReadyCheck = Callable[[], Awaitable[bool]]


class Service:
    """One service process (or one service inside a test process)."""

    def __init__(self, settings: ServiceSettings) -> None:
        self.settings = settings
        self.name = settings.service
        self.metrics = ServiceMetrics(settings.service)
        self.app = web.Application(client_max_size=16 * 1024 * 1024)
        self.app.router.add_get("/healthz", self._healthz)
        self.app.router.add_get("/readyz", self._readyz)
        self.app.router.add_get("/metrics", self._metrics)
        self._stages: list[Stage] = []
        self._loops: list[ConsumerLoop] = []
        self._on_start: list[Hook] = []
        self._on_stop: list[Hook] = []
        self._ready_checks: list[ReadyCheck] = []
        self._nc: NatsClient | None = None
        self._js: JetStreamContext | None = None
        self._publisher: Publisher | None = None
        self._runner: web.AppRunner | None = None
        self._stop = asyncio.Event()
        self._started = asyncio.Event()
        self._hooks_started = False
        self.http_port: int | None = None
        self._faults = Faults.from_setting(settings.fault_kill)

    # ------------------------------------------------------------ wiring

    def add_stage(self, stage: Stage) -> None:
        """Run `stage` once the service starts (with the service's `ack_wait_s`, when set)."""
        if self.settings.ack_wait_s is not None:
            consumer = msgspec.structs.replace(stage.consumer, ack_wait_s=self.settings.ack_wait_s)
            stage = dataclasses.replace(stage, consumer=consumer)
        self._stages.append(stage)

    def on_start(self, hook: Hook) -> None:
        """Run `hook` after the bus is up and before the stages start."""
        self._on_start.append(hook)

    def on_stop(self, hook: Hook) -> None:
        """Run `hook` after the stages stopped, before the connection drains."""
        self._on_stop.append(hook)

    def add_ready_check(self, check: ReadyCheck) -> None:
        """`/readyz` also requires `check()` to be true."""
        self._ready_checks.append(check)

    @property
    def nc(self) -> NatsClient:
        """The NATS connection (after start)."""
        if self._nc is None:
            raise RuntimeError("service not started")
        return self._nc

    @property
    def js(self) -> JetStreamContext:
        """The JetStream context (after start)."""
        if self._js is None:
            raise RuntimeError("service not started")
        return self._js

    @property
    def publisher(self) -> Publisher:
        """The shared publisher (after start)."""
        if self._publisher is None:
            raise RuntimeError("service not started")
        return self._publisher

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Connect, create streams and consumers, start HTTP and the consumer loops. When any step
        fails (or start is cancelled), what was started is stopped again before the error is
        raised: no connection, port, consumer loop or hook's resources left behind."""
        try:
            await self._start()
        except BaseException:
            log.warning("start failed; stopping what was started", exc_info=True)
            with contextlib.suppress(Exception):
                await asyncio.shield(self.stop())
            raise

    async def _start(self) -> None:
        self._nc = await connect(
            self.settings.nats_url,
            f"evalbus-{self.name}",
            on_reconnect=self._reconnected,
            inbox_prefix=self.settings.inbox_prefix,
        )
        self._js = self._nc.jetstream()
        # Streams are shared; consumers belong to the service that reads them, which applies its
        # own settings (a global limit raised for one deployment is not reset by another service).
        if self.settings.create_topology:
            await ensure_topology(self._js, STREAMS, (), replicas=self.settings.stream_replicas)
        for stage in self._stages:
            await ensure_consumer(self._js, stage.consumer)
        self._publisher = Publisher(self._nc)
        await self._publisher.start()
        self._runner = web.AppRunner(self.app, access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self.settings.http_host, self.settings.http_port)
        await site.start()
        sockets = getattr(site._server, "sockets", None)  # aiohttp exposes the bound port only here
        if sockets:
            self.http_port = int(sockets[0].getsockname()[1])
        for hook in self._on_start:
            self._hooks_started = True  # from now on the stop hooks have something to stop
            await hook(self)
        for stage in self._stages:
            loop = ConsumerLoop(
                self._nc, self._publisher, stage, service=self.name, metrics=self.metrics, faults=self._faults
            )
            await loop.start()
            self._loops.append(loop)
        self._started.set()
        if self._faults.armed:
            log.warning("fault points armed (test only): %s", self.settings.fault_kill)
        log.info("started", extra={"fields": {"http_port": self.http_port, "settings": self.settings.redacted()}})

    async def stop(self) -> None:
        """Graceful shutdown: stop pulling, finish in-flight work within the timeout, drain."""
        timeout = self.settings.shutdown_timeout_s
        results = await asyncio.gather(*(loop.stop(timeout) for loop in self._loops), return_exceptions=True)
        if not all(r is True for r in results):
            log.warning("shutdown timeout: unfinished messages will be redelivered")
        self._loops.clear()
        if self._hooks_started:
            self._hooks_started = False
            for hook in reversed(self._on_stop):
                try:
                    await hook(self)
                except Exception:
                    log.exception("stop hook failed")
        if self._publisher is not None:
            await self._publisher.stop()
        if self._nc is not None and not self._nc.is_closed:
            with contextlib.suppress(Exception):
                await self._nc.drain()
        if self._runner is not None:
            runner, self._runner = self._runner, None
            await runner.cleanup()
        log.info("stopped")

    def request_stop(self) -> None:
        """Ask `run()` to shut down."""
        self._stop.set()

    async def run(self) -> None:
        """Start, serve until SIGTERM/SIGINT (or `request_stop`), then stop gracefully."""
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.add_signal_handler(sig, self._stop.set)
        await self.start()
        try:
            await self._stop.wait()
        finally:
            await self.stop()

    async def _reconnected(self) -> None:
        for consumer_loop in self._loops:
            consumer_loop.reset_requests()

    # ------------------------------------------------------------ HTTP

    async def _healthz(self, _: web.Request) -> web.Response:
        return web.json_response({"status": "ok", "service": self.name})

    async def _readyz(self, _: web.Request) -> web.Response:
        checks: dict[str, Any] = {
            "nats": self._nc is not None and self._nc.is_connected,
            "started": self._started.is_set(),
        }
        for i, check in enumerate(self._ready_checks):
            try:
                checks[f"check_{i}"] = bool(await check())
            except Exception as e:
                checks[f"check_{i}"] = f"{type(e).__name__}: {e}"
        ok = all(v is True for v in checks.values())
        return web.json_response({"status": "ok" if ok else "unavailable", "checks": checks}, status=200 if ok else 503)

    async def _metrics(self, _: web.Request) -> web.Response:
        body = generate_latest(self.metrics.registry)
        return web.Response(body=body, headers={"Content-Type": CONTENT_TYPE_LATEST})


def run_service(
    settings: ServiceSettings,
    build: Callable[[Service], Awaitable[None] | None],
) -> None:
    """Entry point helper: configure logging and tracing, build the service, run it."""
    configure_logging(settings.service, settings.log_level, settings.log_format)
    configure_tracing(settings.service, settings.otel_exporter_otlp_endpoint)

    async def main() -> None:
        service = Service(settings)
        built = build(service)
        if built is not None:
            await built
        service.on_start(_freeze_heap)  # last: after every hook the service registered
        await service.run()

    asyncio.run(main())


async def _freeze_heap(_: Service) -> None:
    """Move what the process built on its way up (modules, settings, clients) out of the garbage
    collector's sight: a full collection then scans only what serving allocates. Without it, each
    full collection of a gateway walked the whole import graph and stalled its event loop for
    50–90 ms, the tail of every live stream it served."""
    gc.collect()
    gc.freeze()
