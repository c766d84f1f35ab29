"""Arize Phoenix trace source (tested LIVE against a real `phoenix serve` 20.26.1).

API (Phoenix REST v1, as in shared/reference/platform-notes.md, checked against the live server):
- id correlation: `GET /v1/projects/{project}/spans?trace_id=<hex>` (hex = `trace_id_for(run_id)`),
  paged with `cursor`.
- tag correlation: `GET /v1/projects/{project}/spans?attribute=evalbus.run_id:"<run>"` (the value is
  JSON-parsed by Phoenix, so it is sent JSON-quoted); the trace ids found are then pulled whole.
  Phoenix drops resource attributes, so the agent sets `evalbus.run_id` on its root span.
- project: the reference's `project`, else Phoenix's `default`; an unknown project (404) is "nothing yet".
- auth: `Authorization: Bearer <secret>`.
"""

from __future__ import annotations

import json
from typing import Any
from urllib.parse import quote

from evalbus_contracts.results import TraceRef
from evalbus_contracts.trace import TraceEvent
from evalbus_traces.auth import auth_headers
from evalbus_traces.ids import trace_id_for
from evalbus_traces.mapping import SpanRecord, flatten_attributes, iso_nanos, map_spans
from evalbus_traces.sources import HttpTraceSource
from evalbus_traces.transport import expect_ok, send

DEFAULT_PROJECT = "default"
"""Phoenix's project when the reference names none."""
PAGE_LIMIT = 1000
"""Spans per page (Phoenix's maximum)."""
MAX_PAGES = 20
"""Pages read per query before giving up on the rest."""


def phoenix_span(raw: dict[str, Any]) -> SpanRecord:
    """One span of Phoenix's `/spans` answer as a `SpanRecord`."""
    context = raw.get("context") or {}
    attrs = flatten_attributes(raw.get("attributes") or {})
    kind = raw.get("span_kind")
    if kind and kind != "UNKNOWN":
        attrs.setdefault("openinference.span.kind", kind)
    return SpanRecord(
        span_id=str(context.get("span_id", "")),
        trace_id=context.get("trace_id"),
        parent_id=raw.get("parent_id") or None,
        name=str(raw.get("name", "")),
        start_ns=iso_nanos(raw.get("start_time")) or 0,
        end_ns=iso_nanos(raw.get("end_time")),
        attributes=attrs,
        error=raw.get("status_code") == "ERROR",
        status_message=raw.get("status_message") or None,
    )


class PhoenixTraceSource(HttpTraceSource):
    """Pulls a run's spans from a Phoenix project."""

    async def pull(self, ref: TraceRef) -> list[TraceEvent]:
        """The run's trace events; `[]` when Phoenix has none yet."""
        base = ref.endpoint.rstrip("/")
        url = f"{base}/v1/projects/{quote(ref.project or DEFAULT_PROJECT, safe='')}/spans"
        headers = auth_headers("bearer", self._secrets, ref.auth_secret)
        if ref.correlate == "tag":
            tagged = await self._query(url, headers, [("attribute", f"evalbus.run_id:{json.dumps(ref.run_id)}")])
            trace_ids = sorted({s.trace_id for s in tagged if s.trace_id})
        else:
            trace_ids = [trace_id_for(ref.run_id)]
        spans: list[SpanRecord] = []
        for trace_id in trace_ids:
            spans.extend(await self._query(url, headers, [("trace_id", trace_id)]))
        return map_spans(spans, ref.mapping)

    async def _query(self, url: str, headers: dict[str, str], filters: list[tuple[str, str]]) -> list[SpanRecord]:
        spans: list[SpanRecord] = []
        cursor: str | None = None
        for _ in range(MAX_PAGES):
            params = [*filters, ("limit", str(PAGE_LIMIT))] + ([("cursor", cursor)] if cursor else [])
            resp = await send(self._session, "GET", url, headers=headers, params=params, timeout_s=self._timeout_s)
            if resp.status == 404:  # the project is created by its first span
                return spans
            body = expect_ok(resp, "phoenix spans")
            spans.extend(phoenix_span(s) for s in body.get("data", []))
            cursor = body.get("next_cursor")
            if not cursor:
                break
        return spans
