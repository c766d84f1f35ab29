"""Langfuse trace sink (tested at the PROTOCOL level: a local server checks the documented API).

Per case, one `POST /api/public/ingestion` (Langfuse's batch ingestion API, per its OpenAPI spec):
`{"batch": [trace-create, score-create…]}`, each event `{id, timestamp, type, body}`. The trace id is
`export_trace_id(run_id)`, score ids and event ids are uuid5s of the run, so a redelivered case
updates the same trace and scores (Langfuse upserts on body id and de-duplicates event ids).
The answer is HTTP 207 `{"successes":[{id,status}], "errors":[{id,status,message,error}]}`; any error
fails the case. Every measured score is a NUMERIC score; the verdict a CATEGORICAL `evalbus.verdict`.
Auth: HTTP Basic, public key as user and secret key as password (the secret holds `pk:sk`).
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from evalbus_contracts.summary import SinkOutcome
from evalbus_traces.auth import auth_headers
from evalbus_traces.errors import TraceRejectedError
from evalbus_traces.ids import export_trace_id, export_uuid
from evalbus_traces.otlp import case_window
from evalbus_traces.ports import ExportContext, JudgedCase
from evalbus_traces.sinks import HttpTraceSink
from evalbus_traces.transport import expect_ok, send


def _iso(ns: int) -> str:
    return datetime.fromtimestamp(ns / 1e9, UTC).isoformat().replace("+00:00", "Z")


def ingestion_batch(case: JudgedCase, ctx: ExportContext, now: datetime) -> dict[str, Any]:
    """The ingestion request for one case: its trace and one score per measured score."""
    trace_id = export_trace_id(case.run_id)
    start, _ = case_window(case, now)
    stamp = _iso(start)
    metadata: dict[str, Any] = {
        "evalbus.run_id": case.run_id,
        "evalbus.batch_id": case.batch_id,
        "evalbus.case_id": case.case_id,
        "evalbus.harness": case.result.harness,
        "evalbus.suite_id": ctx.suite_id,
        "evalbus.verdict": case.verdict,
        **{f"evalbus.label.{k}": v for k, v in ctx.labels.items()},
    }
    trace_body: dict[str, Any] = {
        "id": trace_id,
        "timestamp": stamp,
        "name": f"evalbus case {case.case_id}",
        "input": case.case.input if case.case is not None else None,
        "output": case.result.answer,
        "sessionId": case.batch_id,
        "metadata": {k: v for k, v in metadata.items() if v is not None},
        "tags": ["evalbus", f"evalbus.batch_id:{case.batch_id}", f"evalbus.run_id:{case.run_id}"],
    }
    batch: list[dict[str, Any]] = [
        {
            "id": export_uuid(case.run_id, "langfuse", "trace-create"),
            "timestamp": stamp,
            "type": "trace-create",
            "body": trace_body,
        }
    ]
    for score in case.measured():
        body: dict[str, Any] = {
            "id": export_uuid(case.run_id, "langfuse", "score", score.metric, score.grader_id),
            "traceId": trace_id,
            "name": score.metric,
            "value": float(score.value),
            "dataType": "NUMERIC",
            "metadata": {
                "evalbus.grader_id": score.grader_id,
                "evalbus.source": score.source,
                **({"evalbus.pass": score.passed} if score.passed is not None else {}),
            },
        }
        if score.detail:
            body["comment"] = score.detail
        batch.append(
            {
                "id": export_uuid(case.run_id, "langfuse", "score-create", score.metric, score.grader_id),
                "timestamp": stamp,
                "type": "score-create",
                "body": body,
            }
        )
    if case.verdict is not None:
        batch.append(
            {
                "id": export_uuid(case.run_id, "langfuse", "score-create", "evalbus.verdict"),
                "timestamp": stamp,
                "type": "score-create",
                "body": {
                    "id": export_uuid(case.run_id, "langfuse", "score", "evalbus.verdict"),
                    "traceId": trace_id,
                    "name": "evalbus.verdict",
                    "value": case.verdict,
                    "dataType": "CATEGORICAL",
                },
            }
        )
    return {"batch": batch, "metadata": {"sdk_name": "evalbus"}}


class LangfuseTraceSink(HttpTraceSink):
    """Exports judged cases to Langfuse through batch ingestion."""

    name = "langfuse"

    async def _export_one(self, ctx: ExportContext, case: JudgedCase) -> SinkOutcome:
        headers = auth_headers("basic-pair", self._secrets, self._spec.auth_secret)
        resp = await send(
            self._session,
            "POST",
            f"{self._base}/api/public/ingestion",
            headers=headers,
            json_body=ingestion_batch(case, ctx, datetime.now(UTC)),
            timeout_s=self._timeout_s,
        )
        answer = expect_ok(resp, "langfuse ingestion")
        errors = answer.get("errors") or []
        if errors:
            first = errors[0]
            raise TraceRejectedError(
                f"langfuse rejected {len(errors)} event(s); first {first.get('id')}: "
                f"{first.get('status')} {first.get('message') or first.get('error')}"
            )
        trace_id = export_trace_id(case.run_id)
        return SinkOutcome(sink=self.name, status="ok", external_id=trace_id, url=f"{self._base}/trace/{trace_id}")
