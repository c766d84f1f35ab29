"""Langfuse trace source (tested at the PROTOCOL level: a local server checks the documented API).

API (Langfuse public REST API, per its OpenAPI spec `/api/public/*` and the tagging changelog):
- id correlation: `GET /api/public/traces/{traceId}` (id = `trace_id_for(run_id)`, the 32-hex
  id Langfuse's OpenTelemetry ingestion and SDK v3 use) → `TraceWithFullDetails` with
  `observations[]` (`id, traceId, type GENERATION|SPAN|EVENT|TOOL|AGENT…, name, startTime, endTime,
  parentObservationId, model, usage{input,output}, usageDetails, costDetails, calculatedTotalCost,
  input, output, level, statusMessage, metadata`). 404 is "nothing yet".
- tag correlation: the agent tags its trace `evalbus.run_id:<run>`; `GET /api/public/traces?tags=…`
  lists the matching traces (`{"data":[{id…}],"meta":{…}}`), each then read in full.
- auth: HTTP Basic with the public key as user and the secret key as password; the secret holds
  `<public key>:<secret key>`.
The trace itself becomes the root span (its input and output are the user and answer messages).
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

SEARCH_LIMIT = 20
"""Most traces one tag search returns."""
_KINDS = {"GENERATION": "LLM", "EMBEDDING": "LLM", "TOOL": "TOOL", "AGENT": "AGENT", "CHAIN": "CHAIN"}


def run_tag(run_id: str) -> str:
    """The Langfuse trace tag an agent sets for tag correlation."""
    return f"evalbus.run_id:{run_id}"


def _text(value: Any) -> Any:
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, default=str, ensure_ascii=False)


def langfuse_spans(trace: dict[str, Any]) -> list[SpanRecord]:
    """A `TraceWithFullDetails` as spans: the trace as root, its observations beneath."""
    root_id = str(trace.get("id", ""))
    observations = trace.get("observations") or []
    spans: list[SpanRecord] = []
    ends: list[int] = []
    for obs in observations:
        if not isinstance(obs, dict):  # list endpoints give ids only
            continue
        attrs = flatten_attributes(obs.get("metadata") or {}) if isinstance(obs.get("metadata"), dict) else {}
        kind = _KINDS.get(str(obs.get("type", "")).upper())
        usage = obs.get("usageDetails") or obs.get("usage") or {}
        cost = (obs.get("costDetails") or {}).get("total", obs.get("calculatedTotalCost"))
        attrs.update(
            {
                k: v
                for k, v in {
                    "openinference.span.kind": kind,
                    "llm.model_name": obs.get("model"),
                    "llm.token_count.prompt": usage.get("input"),
                    "llm.token_count.completion": usage.get("output"),
                    "llm.cost.total": cost,
                    "tool.name": obs.get("name") if kind == "TOOL" else None,
                    "input.value": _text(obs.get("input")),
                    "output.value": _text(obs.get("output")),
                }.items()
                if v is not None
            }
        )
        start = iso_nanos(obs.get("startTime")) or 0
        end = iso_nanos(obs.get("endTime"))
        ends.append(end or start)
        spans.append(
            SpanRecord(
                span_id=str(obs.get("id", "")),
                trace_id=root_id,
                parent_id=obs.get("parentObservationId") or root_id,
                name=str(obs.get("name") or obs.get("type") or "observation"),
                start_ns=start,
                end_ns=end,
                attributes=attrs,
                error=obs.get("level") == "ERROR",
                status_message=obs.get("statusMessage"),
            )
        )
    start = iso_nanos(trace.get("timestamp")) or min((s.start_ns for s in spans), default=0)
    root_attrs = {
        k: v
        for k, v in {
            "openinference.span.kind": "CHAIN",
            "input.value": _text(trace.get("input")),
            "output.value": _text(trace.get("output")),
        }.items()
        if v is not None
    }
    if isinstance(trace.get("metadata"), dict):
        root_attrs = {**flatten_attributes(trace["metadata"]), **root_attrs}
    spans.append(
        SpanRecord(
            span_id=root_id,
            trace_id=root_id,
            name=str(trace.get("name") or "trace"),
            start_ns=start,
            end_ns=max([start, *ends]),
            attributes=root_attrs,
        )
    )
    return spans


class LangfuseTraceSource(HttpTraceSource):
    """Pulls a run's trace from Langfuse."""

    async def pull(self, ref: TraceRef) -> list[TraceEvent]:
        """The run's trace events; `[]` when Langfuse has none yet."""
        base = ref.endpoint.rstrip("/")
        headers = auth_headers("basic-pair", self._secrets, ref.auth_secret)
        if ref.correlate == "tag":
            resp = await send(
                self._session,
                "GET",
                f"{base}/api/public/traces",
                headers=headers,
                params={"tags": run_tag(ref.run_id), "limit": str(SEARCH_LIMIT)},
                timeout_s=self._timeout_s,
            )
            listed = expect_ok(resp, "langfuse traces list").get("data") or []
            trace_ids = [str(t["id"]) for t in listed if t.get("id")]
        else:
            trace_ids = [trace_id_for(ref.run_id)]
        spans: list[SpanRecord] = []
        for trace_id in trace_ids:
            resp = await send(
                self._session,
                "GET",
                f"{base}/api/public/traces/{quote(trace_id, safe='')}",
                headers=headers,
                timeout_s=self._timeout_s,
            )
            if resp.status == 404:
                continue
            spans.extend(langfuse_spans(expect_ok(resp, "langfuse trace")))
        return map_spans(spans, ref.mapping)
