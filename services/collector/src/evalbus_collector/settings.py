"""Settings of the collector (`COLLECTOR_<KEY>`, then `<KEY>`): trace collection for
control-plane cases and online evaluation's OTLP ingest, assembly and sampling."""

from __future__ import annotations

from evalbus_runtime import ServiceSettings


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
