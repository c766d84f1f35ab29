"""OpenTelemetry trace source over a Jaeger-style query API (tested at the PROTOCOL level).

The OTLP protocol has no read side, so evalbus reads back from the query API that Jaeger (and
Jaeger-compatible stores) expose; the shape follows Jaeger's HTTP query API (`/api/traces`):
- id correlation: `GET /api/traces/{trace_id}` (hex = `trace_id_for(run_id)`); 404 is "nothing yet".
- tag correlation: `GET /api/traces?service=<service>&tags={"evalbus.run_id":"<run>"}&limit=20`;
  `service` is required by the API, the tag filter matches span and process (resource) tags, and
  the answer embeds full spans.
- answer: `{"data":[{"traceID","spans":[{"traceID","spanID","operationName","references":[{"refType",
  "spanID"}],"startTime"(µs),"duration"(µs),"tags":[{"key","type","value"}],"processID"}],
  "processes":{...}}]}`.
- auth: the secret's value verbatim in `Authorization`.
Tests: `libs/traces/tests/test_protocol_otel.py` runs a local server that checks these requests.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from evalbus_contracts.results import TraceRef
from evalbus_contracts.trace import TraceEvent
from evalbus_traces.auth import auth_headers
from evalbus_traces.errors import TraceConfigError
from evalbus_traces.ids import trace_id_for
from evalbus_traces.mapping import SpanRecord, map_spans
from evalbus_traces.sources import HttpTraceSource
from evalbus_traces.transport import expect_ok, send

SEARCH_LIMIT = 20
"""Most traces one tag search returns."""


def jaeger_spans(trace: dict[str, Any]) -> list[SpanRecord]:
    """The spans of one Jaeger trace object as `SpanRecord`s."""
    out: list[SpanRecord] = []
    for raw in trace.get("spans") or []:
        tags = {str(t["key"]): t.get("value") for t in raw.get("tags") or [] if "key" in t}
        parent = next((r.get("spanID") for r in raw.get("references") or [] if r.get("refType") == "CHILD_OF"), None)
        start_ns = int(raw.get("startTime", 0)) * 1000
        duration = raw.get("duration")
        error = tags.get("error") in (True, "true") or tags.get("otel.status_code") == "ERROR"
        out.append(
            SpanRecord(
                span_id=str(raw.get("spanID", "")),
                trace_id=raw.get("traceID"),
                parent_id=parent,
                name=str(raw.get("operationName", "")),
                start_ns=start_ns,
                end_ns=start_ns + int(duration) * 1000 if duration is not None else None,
                attributes=tags,
                error=error,
                status_message=tags.get("otel.status_description"),
            )
        )
    return out


class OtelTraceSource(HttpTraceSource):
    """Pulls a run's trace from a Jaeger-style query API."""

    async def pull(self, ref: TraceRef) -> list[TraceEvent]:
        """The run's trace events; `[]` when the store has none yet."""
        base = ref.endpoint.rstrip("/")
        headers = auth_headers("authorization", self._secrets, ref.auth_secret)
        if ref.correlate == "tag":
            if not ref.service:
                raise TraceConfigError("otel tag correlation needs the service name (trace.service)")
            params = {
                "service": ref.service,
                "tags": json.dumps({"evalbus.run_id": ref.run_id}),
                "limit": str(SEARCH_LIMIT),
            }
            resp = await send(
                self._session,
                "GET",
                f"{base}/api/traces",
                headers=headers,
                params=params,
                timeout_s=self._timeout_s,
            )
        else:
            url = f"{base}/api/traces/{quote(trace_id_for(ref.run_id), safe='')}"
            resp = await send(self._session, "GET", url, headers=headers, timeout_s=self._timeout_s)
        if resp.status == 404:
            return []
        body = expect_ok(resp, "jaeger query")
        spans = [s for trace in body.get("data") or [] for s in jaeger_spans(trace)]
        return map_spans(spans, ref.mapping)
