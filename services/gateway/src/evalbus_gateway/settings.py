"""Settings of the gateway (`GATEWAY_<KEY>` first, then the shared `<KEY>`), read once at start."""

from __future__ import annotations

from typing import ClassVar

from evalbus_contracts.control import TERMINAL_PING_S
from evalbus_runtime import ServiceSettings


class GatewaySettings(ServiceSettings):
    """The gateway's settings: database, auth, HTTP limits, recorder batching, SSE."""

    SECRET_FIELDS: ClassVar[frozenset[str]] = ServiceSettings.SECRET_FIELDS | {"admin_token"}

    service: str = "gateway"
    """Service name."""
    admin_token: str | None = None
    """Bearer token of the `admin` principal (`GATEWAY_ADMIN_TOKEN`); unset: no admin token."""
    tokens_file: str | None = None
    """JSON file mapping token → `{"principal": ..., "role": "admin" | "member"}`."""
    max_request_bytes: int = 1024 * 1024
    """Largest request body accepted (413 above)."""
    max_dataset_bytes: int = 1024 * 1024 * 1024
    """Largest dataset `POST /v1/datasets` accepts (413 above); it streams into the object store,
    never held whole in memory."""
    page_size: int = 100
    """Default page size of list endpoints."""
    max_page_size: int = 1000
    """Largest page size a client may ask for."""
    db_pool_min: int = 2
    """Connections the pool keeps open."""
    db_pool_max: int = 16
    """Most connections the pool opens."""
    recorder_concurrency: int = 2048
    """Messages the recorder holds at once (they wait in the write batcher for their commit)."""
    recorder_batch_size: int = 1000
    """Most messages written in one transaction."""
    recorder_flush_ms: float = 25.0
    """Longest time a message waits for its batch to be written (was 10: at 200 cases/s the
    pipeline's gateway and PostgreSQL spent 10-25 % less CPU a case at 30, bench/README.md)."""
    sse_heartbeat_s: float = 15.0
    """Seconds between SSE heartbeat comments on a quiet stream."""
    sse_max_per_principal: int = 16
    """Event streams (server-sent events) one member may hold open on this replica at once; 429
    beyond (0: no limit). Admins (the CLI, operators, benchmarks) are not capped."""
    sse_client_buffer: int = 1024
    """Events (frames) an event stream may fall behind the shared feed it follows before it is cut
    with a `: lagging` comment (the client resumes with `Last-Event-ID`); bounds its memory."""
    exec_per_run_per_minute: int = 30
    """Commands (`POST /v1/runs/{run_id}/exec`) one run may be asked to run per minute on this
    replica; 429 beyond (0: no limit)."""
    terminal_ticket_s: float = 30.0
    """How long a terminal ticket is valid (it works once, on any replica)."""
    terminal_ping_s: float = TERMINAL_PING_S
    """Seconds between a live terminal's keep-alives to the dispatcher (one silent for three is gone)."""
    stream_keep_finalized_s: float = 60.0
    """How long a finalized batch's events stay on the CASES stream once the event store holds every
    one of them (`compactor`); then they leave the stream and are read from the store. Bounds
    nats-server's memory, which holds an entry for every distinct subject (per case)."""
    stream_compaction: bool = True
    """Whether this replica compacts the stream (`false`: every event stays on it for ever)."""
    stream_compact_interval_s: float = 30.0
    """Seconds between two compaction rounds."""
