"""Wiring of the collector: `case.executed` events whose trace is deferred (`control-plane` collect)
are completed by pulling the platform trace and published as `case.collected`, which the judge
consumes; complete cases are acknowledged and ignored. Online evaluation (the OTLP/HTTP receiver,
trace assembly and sampling) is wired by `evalbus_collector.online.stages`."""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp

from evalbus_collector.complete import complete
from evalbus_collector.online.stages import OnlineIngest, online_settings
from evalbus_contracts import CaseExecuted
from evalbus_contracts.events import EventBase
from evalbus_contracts.streams import COLLECTOR_CASES
from evalbus_runtime import Delivery, Retry, SecretStore, Service, ServiceSettings, Stage
from evalbus_traces import build_source, collect_trace


class CollectorSettings(ServiceSettings):
    """Settings of the collector (`COLLECTOR_<KEY>`, then `<KEY>`)."""

    concurrency: int = 32
    """Cases collected at once by one replica."""
    unavailable_retries: int = 2
    """Redeliveries (with backoff) before a dead endpoint soft-degrades."""
    retry_delay_s: float = 2.0
    """First delay before re-pulling from an unavailable endpoint."""
    empty_pull_delay_s: float = 2.0
    """Delay between empty pulls (3 pulls in all)."""
    otlp_host: str = "127.0.0.1"
    """Address of the OTLP/HTTP traces receiver (online evaluation)."""
    otlp_port: int = 4318
    """Port of the OTLP/HTTP receiver (the standard 4318; 0: any free port; -1: no receiver)."""
    otlp_max_body_bytes: int = 4 * 1024 * 1024
    """Largest export request body, after decompression (413 past it)."""
    otlp_max_in_flight: int = 64
    """Export requests being stored at once; more are answered 429 with Retry-After."""
    settle_s: float = 5.0
    """A trace is whole when its root span ended and no span came for this long."""
    max_wait_s: float = 60.0
    """...or this long after its first span, whatever else."""
    spans_concurrency: int = 20_000
    """Span batches held at once by one replica while their traces assemble."""
    observations_concurrency: int = 64
    """Observations sampled at once by one replica."""
    observation_max_bytes: int = 900_000
    """Largest assembled observation; a bigger one is dropped with fate `too_large`."""


def build_collector(service: Service, settings: CollectorSettings, secrets: SecretStore | None = None) -> OnlineIngest:
    """Add the collection stage and the online-evaluation stages to `service`."""
    store = secrets or SecretStore()
    session: aiohttp.ClientSession | None = None

    async def start(_: Service) -> None:
        nonlocal session
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))

    async def stop(_: Service) -> None:
        if session is not None:
            await session.close()

    async def handle(event: CaseExecuted, delivery: Delivery) -> Sequence[EventBase]:
        if event.trace_complete:
            return []
        ref = event.result.trace_ref
        if ref is None:
            return [complete(event, None, degraded="no trace reference to collect from")]
        assert session is not None
        outcome = await collect_trace(build_source(ref, store, session), ref, delay_s=settings.empty_pull_delay_s)
        if outcome.status == "unavailable":
            if delivery.num_delivered <= settings.unavailable_retries:
                raise Retry(
                    f"trace endpoint unavailable: {outcome.error}", settings.retry_delay_s * delivery.num_delivered
                )
            return [complete(event, outcome, degraded=f"trace unavailable at {ref.endpoint}: {outcome.error}")]
        return [complete(event, outcome)]

    service.on_start(start)
    service.on_stop(stop)
    service.add_stage(
        Stage(consumer=COLLECTOR_CASES, handler=handle, accepts=(CaseExecuted,), concurrency=settings.concurrency)
    )
    online = OnlineIngest(service, online_settings(settings))
    online.wire()
    return online
