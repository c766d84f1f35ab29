"""OpenTelemetry trace sink: OTLP/HTTP JSON (tested at the PROTOCOL level).

Each case is one `POST <endpoint>/v1/traces` (OTLP/HTTP, JSON encoding: camelCase fields, hex
ids, integer enums — per the OTLP specification's JSON mapping) holding the case's root span with
its scores as `evalbus.score.<metric>` attributes and its LLM/tool steps as child spans. Ids are
deterministic (`export_trace_id(run_id)`), so a redelivered case re-sends the same span ids; OTLP
has no read side, so de-duplicating them is the receiving store's job.
Auth: the secret's value verbatim in `Authorization`. The external id is the trace id (hex).
"""

from __future__ import annotations

from datetime import UTC, datetime

from evalbus_contracts.summary import SinkOutcome
from evalbus_traces.auth import auth_headers
from evalbus_traces.ids import export_trace_id
from evalbus_traces.otlp import case_request, request_json
from evalbus_traces.ports import ExportContext, JudgedCase
from evalbus_traces.sinks import HttpTraceSink
from evalbus_traces.transport import require_ok, send


def traces_url(endpoint: str) -> str:
    """The OTLP/HTTP traces URL of an endpoint (a base URL, or one already ending in `/v1/traces`)."""
    base = endpoint.rstrip("/")
    return base if base.endswith("/v1/traces") else base + "/v1/traces"


class OtelTraceSink(HttpTraceSink):
    """Exports judged cases as OTLP/HTTP JSON spans."""

    name = "otel"

    async def _export_one(self, ctx: ExportContext, case: JudgedCase) -> SinkOutcome:
        headers = auth_headers("authorization", self._secrets, self._spec.auth_secret)
        body = request_json(case_request(case, ctx, datetime.now(UTC)))
        resp = await send(
            self._session,
            "POST",
            traces_url(self._spec.endpoint),
            headers=headers,
            json_body=body,
            timeout_s=self._timeout_s,
        )
        require_ok(resp, "OTLP export")
        return SinkOutcome(sink=self.name, status="ok", external_id=export_trace_id(case.run_id))
