"""LangSmith trace source (tested at the PROTOCOL level: a local server checks the documented API).

API (LangSmith REST `/api/v1`, per its API reference and "Query traces" guide):
- id correlation: `POST /api/v1/runs/query {"trace": <uuid>, "limit": 100}` (uuid = `trace_id_for(run_id)`
  as a UUID) → `{"runs":[Run…], "cursors":{"next": …}}`, paged with `cursor`.
- tag correlation: the project id from `GET /api/v1/sessions?name=<project>`, then
  `POST /api/v1/runs/query {"session":[id], "is_root": true, "filter": 'and(eq(metadata_key,
  "evalbus.run_id"), eq(metadata_value, "<run>"))'}` for the root runs, then each trace as above.
- Run fields used: `id, trace_id, parent_run_id, name, run_type (llm|tool|chain|…), start_time,
  end_time, inputs, outputs, error, extra.metadata, extra.invocation_params, prompt_tokens,
  completion_tokens, total_cost`.
- auth: `x-api-key: <secret>`.
"""

from __future__ import annotations

import json
from typing import Any

from evalbus_contracts.results import TraceRef
from evalbus_contracts.trace import TraceEvent
from evalbus_traces.auth import auth_headers
from evalbus_traces.errors import TraceConfigError
from evalbus_traces.ids import as_uuid, trace_id_for
from evalbus_traces.mapping import SpanRecord, flatten_attributes, iso_nanos, map_spans
from evalbus_traces.sources import HttpTraceSource
from evalbus_traces.transport import expect_ok, send

PAGE_LIMIT = 100
"""Runs per page."""
MAX_PAGES = 20
"""Pages read per trace before giving up on the rest."""
_KINDS = {"llm": "LLM", "embedding": "LLM", "tool": "TOOL", "chain": "CHAIN", "retriever": "RETRIEVER"}


def _text(value: Any) -> Any:
    """A run's inputs/outputs as text: the lone string value of a one-key object, else JSON."""
    if isinstance(value, dict) and len(value) == 1:
        (only,) = value.values()
        if isinstance(only, str):
            return only
    if value is None or isinstance(value, str):
        return value
    return json.dumps(value, default=str, ensure_ascii=False)


def _json(value: Any) -> Any:
    return value if value is None or isinstance(value, str) else json.dumps(value, default=str, ensure_ascii=False)


def langsmith_span(run: dict[str, Any]) -> SpanRecord:
    """One LangSmith run as a `SpanRecord`."""
    extra = run.get("extra") or {}
    metadata = extra.get("metadata") or {}
    params = extra.get("invocation_params") or {}
    kind = _KINDS.get(str(run.get("run_type", "")).lower())
    attrs = flatten_attributes(metadata) if isinstance(metadata, dict) else {}
    attrs.update(
        {
            k: v
            for k, v in {
                "openinference.span.kind": kind,
                "llm.model_name": params.get("model") or params.get("model_name") or metadata.get("ls_model_name"),
                "llm.token_count.prompt": run.get("prompt_tokens"),
                "llm.token_count.completion": run.get("completion_tokens"),
                "llm.cost.total": run.get("total_cost"),
                "tool.name": run.get("name") if kind == "TOOL" else None,
                # a tool's inputs are its arguments: keep the object; elsewhere a lone string is the text
                "input.value": _json(run.get("inputs")) if kind == "TOOL" else _text(run.get("inputs")),
                "output.value": _text(run.get("outputs")),
            }.items()
            if v is not None
        }
    )
    return SpanRecord(
        span_id=str(run.get("id", "")),
        trace_id=run.get("trace_id"),
        parent_id=run.get("parent_run_id") or None,
        name=str(run.get("name", "")),
        start_ns=iso_nanos(run.get("start_time")) or 0,
        end_ns=iso_nanos(run.get("end_time")),
        attributes=attrs,
        error=bool(run.get("error")),
        status_message=str(run["error"]) if run.get("error") else None,
    )


class LangsmithTraceSource(HttpTraceSource):
    """Pulls a run's trace from LangSmith."""

    async def pull(self, ref: TraceRef) -> list[TraceEvent]:
        """The run's trace events; `[]` when LangSmith has none yet."""
        base = ref.endpoint.rstrip("/")
        headers = auth_headers("x-api-key", self._secrets, ref.auth_secret)
        if ref.correlate == "tag":
            trace_ids = await self._tagged(base, headers, ref)
        else:
            trace_ids = [as_uuid(trace_id_for(ref.run_id))]
        spans: list[SpanRecord] = []
        for trace_id in trace_ids:
            runs = await self._query(base, headers, {"trace": trace_id})
            spans.extend(langsmith_span(r) for r in runs)
        return map_spans(spans, ref.mapping)

    async def _query(self, base: str, headers: dict[str, str], body: dict[str, Any]) -> list[dict[str, Any]]:
        runs: list[dict[str, Any]] = []
        cursor: str | None = None
        for _ in range(MAX_PAGES):
            page = {**body, "limit": PAGE_LIMIT, **({"cursor": cursor} if cursor else {})}
            resp = await send(
                self._session,
                "POST",
                f"{base}/api/v1/runs/query",
                headers=headers,
                json_body=page,
                timeout_s=self._timeout_s,
            )
            if resp.status == 404:
                return runs
            answer = expect_ok(resp, "langsmith runs/query")
            runs.extend(answer.get("runs") or [])
            cursor = (answer.get("cursors") or {}).get("next")
            if not cursor:
                break
        return runs

    async def _tagged(self, base: str, headers: dict[str, str], ref: TraceRef) -> list[str]:
        if not ref.project:
            raise TraceConfigError("langsmith tag correlation needs the project (trace.project)")
        resp = await send(
            self._session,
            "GET",
            f"{base}/api/v1/sessions",
            headers=headers,
            params={"name": ref.project},
            timeout_s=self._timeout_s,
        )
        if resp.status == 404:
            return []
        sessions = expect_ok(resp, "langsmith sessions")
        if not sessions:
            return []
        body = {
            "session": [str(sessions[0]["id"])],
            "is_root": True,
            "filter": f'and(eq(metadata_key, "evalbus.run_id"), eq(metadata_value, {json.dumps(ref.run_id)}))',
        }
        roots = await self._query(base, headers, body)
        return sorted({str(r.get("trace_id") or r.get("id")) for r in roots})
