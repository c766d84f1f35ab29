"""Wiring of the gateway on the chassis: the HTTP API on the chassis' app, the `gateway-recorder`
stage, and the database pool opened (and migrated) at start.

    service = Service(settings)
    build_gateway(service, settings)
    await service.run()
"""

from __future__ import annotations

import logging

from evalbus_gateway.api.auth import TokenTable
from evalbus_gateway.api.mcp import McpEndpoint, loopback_url
from evalbus_gateway.api.routes import install_api
from evalbus_gateway.compactor import Compactor
from evalbus_gateway.database import create_pool
from evalbus_gateway.errors import GatewayError
from evalbus_gateway.finalize import Finalizer, finalize_stragglers
from evalbus_gateway.recorder_stage import RecorderMetrics, RecorderStage, RecordWith
from evalbus_gateway.settings import GatewaySettings
from evalbus_gateway.state import GatewayState
from evalbus_gateway.store import migrate, record
from evalbus_runtime import Service

__all__ = ["GatewaySettings", "build_gateway"]

log = logging.getLogger("evalbus.gateway")


def build_gateway(
    service: Service,
    settings: GatewaySettings,
    *,
    tokens: TokenTable | None = None,
    record_with: RecordWith = record,
) -> GatewayState:
    """Add the gateway to `service` (before it starts); returns the shared state.

    `tokens` defaults to the admin token and the tokens file of `settings` (read now);
    `record_with` is how the recorder writes (`store.record`; tests wrap it to hold or fail a
    transaction). Raises `GatewayError` when there is no database URL, `TokensFileError` for a bad
    tokens file.
    """
    database_url = settings.database_url
    if not database_url:
        raise GatewayError("the gateway needs a database: set GATEWAY_DATABASE_URL or DATABASE_URL")
    tokens = tokens if tokens is not None else TokenTable.from_settings(settings.admin_token, settings.tokens_file)
    if not len(tokens):
        log.warning("no bearer tokens configured (GATEWAY_ADMIN_TOKEN, GATEWAY_TOKENS_FILE): every /v1 call is 401")
    state = GatewayState(service, settings, tokens)
    state.mcp = McpEndpoint()
    install_api(service.app, state)
    finalizer = Finalizer(state)
    recorder = RecorderStage(
        state,
        finalizer,
        max_batch=settings.recorder_batch_size,
        max_delay_s=settings.recorder_flush_ms / 1000.0,
        metrics=RecorderMetrics(service.metrics.registry),
        record_with=record_with,
    )

    compactor: Compactor | None = None

    async def start(_: Service) -> None:
        nonlocal compactor
        pool = await create_pool(database_url, min_size=settings.db_pool_min, max_size=settings.db_pool_max)
        try:
            applied = await migrate(pool)
        except BaseException:
            await pool.close()
            raise
        if applied:
            log.info("event store migrated", extra={"fields": {"applied": applied}})
        state.set_pool(pool)
        if state.mcp is not None and service.http_port is not None:
            await state.mcp.start(loopback_url(settings.http_host, service.http_port))
        recorder.batcher.start()
        try:
            await finalize_stragglers(pool, service.publisher)
        except Exception as e:  # the next message of the batch, or the next start, finalizes it
            log.warning("start-up finalisation sweep failed: %s: %s", type(e).__name__, e)
        if settings.stream_compaction:
            compactor = Compactor(
                service.js,
                pool,
                keep_s=settings.stream_keep_finalized_s,
                interval_s=settings.stream_compact_interval_s,
                registry=service.metrics.registry,
            )
            compactor.start()

    async def stop(_: Service) -> None:
        if compactor is not None:
            await compactor.stop()
        await state.streams.close_all()
        if state.mcp is not None:
            await state.mcp.stop()
        await recorder.batcher.stop()
        await finalizer.drain()
        pool = state.pool_or_none
        state.set_pool(None)
        if pool is not None:
            await pool.close()

    async def ready() -> bool:
        return state.pool_or_none is not None

    service.on_start(start)
    service.on_stop(stop)
    service.add_ready_check(ready)
    service.add_stage(recorder.stage(settings.recorder_concurrency))
    return state
