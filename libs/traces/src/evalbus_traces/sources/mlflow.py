"""MLflow trace source (tested LIVE against a real `mlflow server` 3.17.2).

API (MLflow 3 REST, as in shared/reference/platform-notes.md, checked against the live server):
- id correlation: `GET /api/3.0/mlflow/traces/get?trace_id=tr-<hex>` where `<hex>` is
  `trace_id_for(run_id)`; the answer's spans carry base64 ids (protobuf JSON), converted to hex,
  and typed attribute values (a JSON object attribute comes back as a `kvlist_value`).
- tag correlation: `POST /api/3.0/mlflow/traces/search` with `locations` (required) scoped to the
  reference's experiment and ``filter: tags.`evalbus.run_id` = '<run>'``, then `traces/get` for
  each match. An experiment given by name is resolved with `experiments/get-by-name`.
- auth: the secret's value verbatim in `Authorization`.
A missing trace or experiment is "nothing yet" (`[]`); 5xx / unreachable is `TraceUnavailableError`.
"""

from __future__ import annotations

from typing import Any

from evalbus_contracts.results import TraceRef
from evalbus_contracts.trace import TraceEvent
from evalbus_traces.auth import auth_headers
from evalbus_traces.errors import TraceConfigError, TraceRejectedError
from evalbus_traces.ids import trace_id_for
from evalbus_traces.mapping import SpanRecord, map_spans
from evalbus_traces.otlp import b64_to_hex, key_values, unix_nanos
from evalbus_traces.sources import HttpTraceSource
from evalbus_traces.transport import HttpResponse, expect_ok, reject, send

SEARCH_LIMIT = 20
"""Most traces one tag search returns (a run normally has one)."""


def mlflow_missing(resp: HttpResponse) -> bool:
    """Whether MLflow answered "no such trace/experiment" (404, or 400 RESOURCE_DOES_NOT_EXIST)."""
    if resp.status == 404:
        return True
    if resp.status == 400:
        try:
            body = resp.json()
        except TraceRejectedError:  # a non-JSON 400 is simply not a "missing" answer
            return False
        return isinstance(body, dict) and body.get("error_code") == "RESOURCE_DOES_NOT_EXIST"
    return False


def mlflow_span(raw: dict[str, Any]) -> SpanRecord:
    """One span of a `traces/get` answer as a `SpanRecord` (hex ids, decoded attributes)."""
    attrs = key_values(raw.get("attributes", []))
    status = raw.get("status") or {}
    code = str(status.get("code", ""))
    parent = raw.get("parent_span_id") or None
    start = unix_nanos(raw.get("start_time_unix_nano")) or 0
    return SpanRecord(
        span_id=b64_to_hex(str(raw.get("span_id", ""))),
        trace_id=b64_to_hex(str(raw.get("trace_id", ""))) or None,
        parent_id=b64_to_hex(str(parent)) if parent else None,
        name=str(raw.get("name", "")),
        start_ns=start,
        end_ns=unix_nanos(raw.get("end_time_unix_nano")),
        attributes=attrs,
        error=code in {"STATUS_CODE_ERROR", "2", "ERROR"},
        status_message=status.get("message") or None,
    )


class MlflowTraceSource(HttpTraceSource):
    """Pulls a run's trace from an MLflow tracking server."""

    async def pull(self, ref: TraceRef) -> list[TraceEvent]:
        """The run's trace events; `[]` when MLflow has no such trace yet."""
        base = ref.endpoint.rstrip("/")
        headers = auth_headers("authorization", self._secrets, ref.auth_secret)
        if ref.correlate == "tag":
            trace_ids = await self._search(base, headers, ref)
        else:
            trace_ids = ["tr-" + trace_id_for(ref.run_id)]
        spans: list[SpanRecord] = []
        for trace_id in trace_ids:
            spans.extend(await self._spans(base, headers, trace_id))
        return map_spans(spans, ref.mapping)

    async def _spans(self, base: str, headers: dict[str, str], trace_id: str) -> list[SpanRecord]:
        resp = await send(
            self._session,
            "GET",
            f"{base}/api/3.0/mlflow/traces/get",
            headers=headers,
            params={"trace_id": trace_id},
            timeout_s=self._timeout_s,
        )
        if mlflow_missing(resp):
            return []
        body = expect_ok(resp, "mlflow traces/get")
        return [mlflow_span(s) for s in (body.get("trace") or {}).get("spans", [])]

    async def _experiment_id(self, base: str, headers: dict[str, str], experiment: str) -> str | None:
        if experiment.isdigit():
            return experiment
        resp = await send(
            self._session,
            "GET",
            f"{base}/api/2.0/mlflow/experiments/get-by-name",
            headers=headers,
            params={"experiment_name": experiment},
            timeout_s=self._timeout_s,
        )
        if mlflow_missing(resp):
            return None
        return str(expect_ok(resp, "mlflow experiments/get-by-name")["experiment"]["experiment_id"])

    async def _search(self, base: str, headers: dict[str, str], ref: TraceRef) -> list[str]:
        if not ref.experiment:
            raise TraceConfigError("mlflow tag correlation needs the trace's experiment (trace.experiment)")
        if "'" in ref.run_id or "\\" in ref.run_id:
            raise TraceConfigError(f"run id {ref.run_id!r} cannot be used in an MLflow filter")
        experiment_id = await self._experiment_id(base, headers, ref.experiment)
        if experiment_id is None:
            return []
        body = {
            "locations": [{"type": "MLFLOW_EXPERIMENT", "mlflow_experiment": {"experiment_id": experiment_id}}],
            "filter": f"tags.`evalbus.run_id` = '{ref.run_id}'",
            "max_results": SEARCH_LIMIT,
            "order_by": ["timestamp_ms ASC"],
        }
        resp = await send(
            self._session,
            "POST",
            f"{base}/api/3.0/mlflow/traces/search",
            headers=headers,
            json_body=body,
            timeout_s=self._timeout_s,
        )
        if mlflow_missing(resp):
            return []
        if not resp.ok:
            raise reject(resp, "mlflow traces/search")
        # an empty result is `{}` (protobuf JSON leaves out empty lists)
        return [str(t["trace_id"]) for t in resp.json().get("traces", []) if t.get("trace_id")]
