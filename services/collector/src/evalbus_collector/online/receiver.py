"""The OTLP/HTTP traces receiver: `POST /v1/traces` on the collector's OTLP port (4318 by default).

A request is answered 200 only once every span batch it holds is stored in JetStream
(`obs.spans.<service>.<trace>`), so an export that got 200 survives any collector crash; assembly, sampling
and judging happen after, from the bus. Answers follow the OTLP/HTTP specification:

- 200 with an `ExportTraceServiceResponse` in the request's encoding, carrying `partial_success`
  (rejected span count and why) when some spans had no valid ids;
- 400 for a body that cannot be read, 413 over the size limit (after decompression), 415 for an
  unsupported content type or encoding;
- 429 with `Retry-After` when more requests are being stored than `max_in_flight` (shed load,
  never hang), 503 with `Retry-After` when JetStream does not acknowledge.

Error bodies are a `google.rpc.Status`-shaped `{"code", "message"}` as JSON.
"""

from __future__ import annotations

import asyncio
import logging
import time

import msgspec
from aiohttp import web
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceResponse
from prometheus_client import CollectorRegistry, Counter

from evalbus_collector.online.otlp_ingest import PROTOBUF, IngestedRequest, OtlpRequestError, ingest_request, read_body
from evalbus_contracts import ObservationSpans, encode, new_event_id
from evalbus_runtime import Publisher, PublishFailedError

log = logging.getLogger("evalbus.collector.otlp")

SPAN_BATCH_BYTES = 256 * 1024
"""Largest span batch message (encoded): a trace's spans are split into batches below it."""


class ReceiverMetrics:
    """What the receiver took in, in the service's registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.requests = Counter(
            "evalbus_otlp_requests_total", "OTLP export requests, by HTTP status", ["status"], registry=registry
        )
        self.spans = Counter(
            "evalbus_otlp_spans_total", "Spans received, by result (accepted, rejected)", ["result"], registry=registry
        )
        self.fates = Counter(
            "evalbus_online_fates_total",
            "Observation fates decided by this replica, by suite, fate and reason (a redelivered observation may "
            "count again; GET /v1/online/stats has the exact counts)",
            ["suite", "fate", "reason"],
            registry=registry,
        )


def split_batch(batch: ObservationSpans, limit: int = SPAN_BATCH_BYTES) -> list[ObservationSpans]:
    """`batch` as batches whose encoded size stays under `limit` (a single span over it goes alone)."""
    if len(encode(batch)) <= limit or len(batch.spans) == 1:
        return [batch]
    half = len(batch.spans) // 2
    first = msgspec.structs.replace(batch, spans=batch.spans[:half], event_id=new_event_id())
    second = msgspec.structs.replace(batch, spans=batch.spans[half:], event_id=new_event_id())
    return split_batch(first, limit) + split_batch(second, limit)


def _status_body(code: int, message: str) -> dict[str, object]:
    return {"code": code, "message": message}


class OtlpReceiver:
    """The receiver's HTTP server."""

    def __init__(
        self,
        publisher: Publisher,
        *,
        host: str,
        port: int,
        max_body_bytes: int,
        max_in_flight: int,
        metrics: ReceiverMetrics,
    ) -> None:
        self._publisher = publisher
        self._host = host
        self._port = port
        self._max_body = max_body_bytes
        self._max_in_flight = max_in_flight
        self._metrics = metrics
        self._in_flight = 0
        self._runner: web.AppRunner | None = None
        self.port: int | None = None

    def app(self) -> web.Application:
        """The aiohttp application (one route)."""
        # aiohttp refuses bodies over client_max_size with 413 before we read them. It would also
        # inflate gzip bodies itself: turned off, so `read_body` inflates with the exact limit.
        app = web.Application(client_max_size=self._max_body + 1, handler_args={"auto_decompress": False})
        app.router.add_post("/v1/traces", self.traces)
        return app

    async def start(self) -> None:
        """Listen on the configured address."""
        self._runner = web.AppRunner(self.app(), access_log=None)
        await self._runner.setup()
        site = web.TCPSite(self._runner, self._host, self._port)
        await site.start()
        sockets = getattr(site._server, "sockets", None)  # aiohttp exposes the bound port only here
        if sockets:
            self.port = int(sockets[0].getsockname()[1])
        log.info("OTLP/HTTP receiver on %s:%s", self._host, self.port)

    async def stop(self) -> None:
        """Stop listening."""
        if self._runner is not None:
            await self._runner.cleanup()
            self._runner = None

    def _answer(self, status: int, body: dict[str, object], headers: dict[str, str] | None = None) -> web.Response:
        self._metrics.requests.labels(str(status)).inc()
        return web.json_response(body, status=status, headers=headers)

    async def traces(self, request: web.Request) -> web.Response:
        """`POST /v1/traces`."""
        if self._in_flight >= self._max_in_flight:
            return self._answer(429, _status_body(8, "too many exports in flight"), {"Retry-After": "1"})
        self._in_flight += 1
        try:
            try:
                raw = await request.read()
            except web.HTTPRequestEntityTooLarge:
                return self._answer(413, _status_body(11, f"body over the limit of {self._max_body} bytes"))
            try:
                body = read_body(raw, request.headers.get("Content-Encoding"), self._max_body)
                ingested = ingest_request(body, request.content_type, received_ns=time.time_ns())
            except OtlpRequestError as e:
                return self._answer(e.status, _status_body(3, e.message))
            try:
                await self._store(ingested)
            except PublishFailedError as e:
                log.warning("span batches not stored: %s", e)
                return self._answer(503, _status_body(14, "spans could not be stored; retry"), {"Retry-After": "2"})
            self._metrics.spans.labels("accepted").inc(ingested.spans)
            if ingested.rejected:
                self._metrics.spans.labels("rejected").inc(ingested.rejected)
            return self._success(request.content_type, ingested)
        finally:
            self._in_flight -= 1

    async def _store(self, ingested: IngestedRequest) -> None:
        batches = [part for batch in ingested.batches for part in split_batch(batch)]
        if batches:
            await asyncio.gather(*(self._publisher.publish_event(b) for b in batches))

    def _success(self, content_type: str, ingested: IngestedRequest) -> web.Response:
        response = ExportTraceServiceResponse()
        if ingested.rejected:
            response.partial_success.rejected_spans = ingested.rejected
            response.partial_success.error_message = "; ".join(ingested.reasons)
        self._metrics.requests.labels("200").inc()
        if content_type == PROTOBUF:
            return web.Response(body=response.SerializeToString(), content_type=PROTOBUF)
        body: dict[str, object] = {}
        if ingested.rejected:
            body["partialSuccess"] = {
                "rejectedSpans": str(ingested.rejected),
                "errorMessage": response.partial_success.error_message,
            }
        return web.json_response(body)
