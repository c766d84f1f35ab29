"""OTLP/HTTP trace requests → span batches per trace (pure, no I/O).

Both encodings of the OTLP/HTTP specification: binary protobuf (`application/x-protobuf`) and
JSON (`application/json`, where trace and span ids are hex strings, not base64), optionally gzip
compressed (`Content-Encoding: gzip`). The body is refused past `max_bytes` AFTER decompression,
so a small gzip bomb cannot exhaust memory. Spans without a valid trace id or span id are rejected
and counted (the OTLP partial-success answer reports them); the others are grouped per
(service, trace) into `ObservationSpans`, each with its resource attributes as text.
"""

from __future__ import annotations

import zlib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

import msgspec
from google.protobuf.message import DecodeError as ProtobufDecodeError  # type: ignore[import-untyped]
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue

from evalbus_contracts import ObservationSpans, SpanData
from evalbus_contracts.sampling import valid_trace_id
from evalbus_traces.otlp import key_values, unix_nanos

PROTOBUF = "application/x-protobuf"
JSON = "application/json"
UNKNOWN_SERVICE = "unknown_service"
"""OpenTelemetry's service name for a resource that sets none."""
_STATUS_ERROR = 2


class OtlpRequestError(ValueError):
    """A request the receiver answers with a 4xx: `status` and the reason."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


@dataclass
class IngestedRequest:
    """What one export request holds."""

    batches: list[ObservationSpans] = field(default_factory=list)
    """Span batches, one per (service, trace)."""
    rejected: int = 0
    """Spans refused (no valid trace or span id)."""
    reasons: list[str] = field(default_factory=list)
    """Why, for the partial-success message."""

    @property
    def spans(self) -> int:
        """Spans accepted."""
        return sum(len(b.spans) for b in self.batches)


def read_body(body: bytes, content_encoding: str | None, max_bytes: int) -> bytes:
    """The request body, decompressed (gzip or identity), refused (413) past `max_bytes`."""
    encoding = (content_encoding or "identity").strip().lower()
    if encoding in ("", "identity"):
        if len(body) > max_bytes:
            raise OtlpRequestError(413, f"body of {len(body)} bytes is over the limit of {max_bytes}")
        return body
    if encoding != "gzip":
        raise OtlpRequestError(415, f"content encoding {encoding!r} is not supported (gzip or identity)")
    inflater = zlib.decompressobj(wbits=16 + zlib.MAX_WBITS)
    try:
        out = inflater.decompress(body, max_bytes + 1)
    except zlib.error as e:
        raise OtlpRequestError(400, f"the gzip body cannot be read: {e}") from e
    if len(out) > max_bytes:
        raise OtlpRequestError(413, f"decompressed body is over the limit of {max_bytes} bytes")
    if not inflater.eof:
        raise OtlpRequestError(400, "the gzip body is truncated")
    return out


def _proto_value(value: AnyValue) -> Any:
    kind = value.WhichOneof("value")
    if kind is None:
        return None
    if kind == "array_value":
        return [_proto_value(v) for v in value.array_value.values]
    if kind == "kvlist_value":
        return {kv.key: _proto_value(kv.value) for kv in value.kvlist_value.values}
    if kind == "bytes_value":
        return value.bytes_value.hex()
    return getattr(value, kind)


def _as_text(value: Any) -> str:
    return value if isinstance(value, str) else msgspec.json.encode(value).decode()


@dataclass(frozen=True, slots=True)
class _Span:
    service: str
    resource: Mapping[str, str]
    span: SpanData


def _proto_spans(body: bytes) -> Iterable[_Span | str]:
    request = ExportTraceServiceRequest()
    try:
        request.ParseFromString(body)
    except (ProtobufDecodeError, RuntimeError) as e:
        raise OtlpRequestError(400, f"the protobuf body is not an ExportTraceServiceRequest: {e}") from e
    for rs in request.resource_spans:
        resource = {kv.key: _as_text(_proto_value(kv.value)) for kv in rs.resource.attributes}
        service = resource.get("service.name") or UNKNOWN_SERVICE
        for ss in rs.scope_spans:
            for span in ss.spans:
                trace_id, span_id = span.trace_id.hex(), span.span_id.hex()
                if not valid_trace_id(trace_id) or len(span_id) != 16 or span_id == "0" * 16:
                    yield f"span {span.name!r} has no valid trace id and span id"
                    continue
                yield _Span(
                    service,
                    resource,
                    SpanData(
                        trace_id=trace_id,
                        span_id=span_id,
                        parent_id=span.parent_span_id.hex() or None,
                        name=span.name,
                        start_ns=span.start_time_unix_nano,
                        end_ns=span.end_time_unix_nano or None,
                        attributes={kv.key: _proto_value(kv.value) for kv in span.attributes},
                        error=span.status.code == _STATUS_ERROR,
                        status_message=span.status.message or None,
                    ),
                )


def _hex_id(value: Any, size: int) -> str | None:
    if not isinstance(value, str):
        return None
    text = value.lower()
    if len(text) != size or any(c not in "0123456789abcdef" for c in text) or text == "0" * size:
        return None
    return text


def _json_spans(body: bytes) -> Iterable[_Span | str]:
    try:
        doc = msgspec.json.decode(body)
    except msgspec.DecodeError as e:
        raise OtlpRequestError(400, f"the JSON body cannot be read: {e}") from e
    if not isinstance(doc, dict):
        raise OtlpRequestError(400, "the JSON body must be an ExportTraceServiceRequest object")
    resource_spans = doc.get("resourceSpans", doc.get("resource_spans", []))
    if not isinstance(resource_spans, list):
        raise OtlpRequestError(400, "resourceSpans must be a list")
    for rs in resource_spans:
        if not isinstance(rs, dict):
            raise OtlpRequestError(400, "every resourceSpans entry must be an object")
        attrs = key_values((rs.get("resource") or {}).get("attributes") or [])
        resource = {k: _as_text(v) for k, v in attrs.items()}
        service = resource.get("service.name") or UNKNOWN_SERVICE
        for ss in rs.get("scopeSpans", rs.get("scope_spans", [])) or []:
            for span in (ss or {}).get("spans", []) or []:
                if not isinstance(span, dict):
                    raise OtlpRequestError(400, "every span must be an object")
                trace_id = _hex_id(span.get("traceId", span.get("trace_id")), 32)
                span_id = _hex_id(span.get("spanId", span.get("span_id")), 16)
                if trace_id is None or span_id is None:
                    yield f"span {span.get('name')!r} has no valid trace id and span id"
                    continue
                status = span.get("status") or {}
                code = status.get("code")
                yield _Span(
                    service,
                    resource,
                    SpanData(
                        trace_id=trace_id,
                        span_id=span_id,
                        parent_id=_hex_id(span.get("parentSpanId", span.get("parent_span_id")), 16),
                        name=str(span.get("name") or ""),
                        start_ns=unix_nanos(span.get("startTimeUnixNano", span.get("start_time_unix_nano"))) or 0,
                        end_ns=unix_nanos(span.get("endTimeUnixNano", span.get("end_time_unix_nano"))) or None,
                        attributes=key_values(span.get("attributes") or []),
                        error=code in (_STATUS_ERROR, "STATUS_CODE_ERROR"),
                        status_message=status.get("message") or None,
                    ),
                )


def ingest_request(body: bytes, content_type: str | None, *, received_ns: int) -> IngestedRequest:
    """The span batches of one (decompressed) export request; `OtlpRequestError` when it cannot be
    read at all (400) or has an unsupported content type (415)."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    if media == PROTOBUF:
        items = _proto_spans(body)
    elif media == JSON:
        items = _json_spans(body)
    else:
        raise OtlpRequestError(415, f"content type {media or 'none'!r} is not supported ({PROTOBUF} or {JSON})")
    out = IngestedRequest()
    grouped: dict[tuple[str, str], tuple[Mapping[str, str], list[SpanData]]] = {}
    for item in items:
        if isinstance(item, str):
            out.rejected += 1
            if len(out.reasons) < 5:
                out.reasons.append(item)
            continue
        key = (item.service, item.span.trace_id)
        entry = grouped.get(key)
        if entry is None:
            grouped[key] = (item.resource, [item.span])
        else:
            entry[1].append(item.span)
    for (service, trace_id), (resource, spans) in grouped.items():
        out.batches.append(
            ObservationSpans(
                target=service,
                trace_id=trace_id,
                spans=tuple(spans),
                resource=dict(resource),
                received_ns=received_ns,
                trace_subject=True,
            )
        )
    return out
