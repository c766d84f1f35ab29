"""LangSmith trace sink (tested at the PROTOCOL level: a local server checks the documented API).

Per case (LangSmith REST `/api/v1`, per its API reference):
1. `POST /api/v1/runs` — the case as a root `chain` run: `id` = `trace_id` = uuid5 of the run id,
   `dotted_order` = `<start %Y%m%dT%H%M%S%fZ><id>`, `session_name` = project (default `evalbus`),
   `inputs`, `outputs`, `start_time`, `end_time`, `extra.metadata` (`evalbus.run_id`…), `tags`;
2. `POST /api/v1/feedback` per measured score — `id` (uuid5), `run_id`, `key` = metric, `score`,
   `comment`, `feedback_source {type: "api"}`; the verdict as feedback `evalbus.verdict` (`value`).
Ids are deterministic, so a redelivered case meets `409 Conflict` for what already exists, which
counts as done. Auth: `x-api-key: <secret>`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any

from evalbus_contracts.summary import SinkOutcome
from evalbus_traces.auth import auth_headers
from evalbus_traces.ids import export_uuid
from evalbus_traces.otlp import case_window
from evalbus_traces.ports import ExportContext, JudgedCase
from evalbus_traces.sinks import HttpTraceSink
from evalbus_traces.transport import HttpResponse, reject, send

DEFAULT_PROJECT = "evalbus"
"""Project (session) used when the sink names none."""


def run_uuid(run_id: str) -> str:
    """The LangSmith run (and trace) id of a run's exported case."""
    return export_uuid(run_id, "langsmith", "run")


def _moment(ns: int) -> datetime:
    return datetime.fromtimestamp(ns / 1e9, UTC)


def run_body(case: JudgedCase, ctx: ExportContext, now: datetime, project: str) -> dict[str, Any]:
    """The `POST /runs` body for one case."""
    start, end = case_window(case, now)
    rid = run_uuid(case.run_id)
    began = _moment(start)
    metadata: dict[str, Any] = {
        "evalbus.run_id": case.run_id,
        "evalbus.batch_id": case.batch_id,
        "evalbus.case_id": case.case_id,
        "evalbus.harness": case.result.harness,
        "evalbus.suite_id": ctx.suite_id,
        "evalbus.verdict": case.verdict,
        **{f"evalbus.label.{k}": v for k, v in ctx.labels.items()},
    }
    return {
        "id": rid,
        "trace_id": rid,
        "dotted_order": began.strftime("%Y%m%dT%H%M%S%fZ") + rid,
        "name": f"evalbus case {case.case_id}",
        "run_type": "chain",
        "start_time": began.isoformat(),
        "end_time": _moment(end).isoformat(),
        "inputs": {"input": case.case.input if case.case is not None else None},
        "outputs": {"output": case.result.answer},
        "session_name": project,
        "extra": {"metadata": {k: v for k, v in metadata.items() if v is not None}},
        "tags": ["evalbus", f"batch:{case.batch_id}"],
        **({"error": case.result.failure.message} if case.result.failure is not None else {}),
    }


def feedback_bodies(case: JudgedCase) -> list[dict[str, Any]]:
    """The `POST /feedback` bodies: one per measured score, plus the verdict."""
    rid = run_uuid(case.run_id)
    out: list[dict[str, Any]] = []
    for score in case.measured():
        body: dict[str, Any] = {
            "id": export_uuid(case.run_id, "langsmith", "feedback", score.metric, score.grader_id),
            "run_id": rid,
            "trace_id": rid,
            "key": score.metric,
            "score": float(score.value),
            "feedback_source": {"type": "api", "metadata": {"evalbus.grader_id": score.grader_id}},
        }
        if score.detail:
            body["comment"] = score.detail
        out.append(body)
    if case.verdict is not None:
        out.append(
            {
                "id": export_uuid(case.run_id, "langsmith", "feedback", "evalbus.verdict"),
                "run_id": rid,
                "trace_id": rid,
                "key": "evalbus.verdict",
                "value": case.verdict,
                "score": 1.0 if case.verdict == "pass" else 0.0,
                "feedback_source": {"type": "api"},
            }
        )
    return out


def _created(resp: HttpResponse, what: str) -> None:
    """2xx is created; 409 means an earlier delivery created it; anything else is rejected."""
    if not (resp.ok or resp.status == 409):
        raise reject(resp, what)


class LangsmithTraceSink(HttpTraceSink):
    """Exports judged cases to a LangSmith project as runs with feedback."""

    name = "langsmith"

    async def _export_one(self, ctx: ExportContext, case: JudgedCase) -> SinkOutcome:
        headers = auth_headers("x-api-key", self._secrets, self._spec.auth_secret)
        project = self._spec.project or DEFAULT_PROJECT
        resp = await send(
            self._session,
            "POST",
            f"{self._base}/api/v1/runs",
            headers=headers,
            json_body=run_body(case, ctx, datetime.now(UTC), project),
            timeout_s=self._timeout_s,
        )
        _created(resp, "langsmith run")
        for body in feedback_bodies(case):
            resp = await send(
                self._session,
                "POST",
                f"{self._base}/api/v1/feedback",
                headers=headers,
                json_body=body,
                timeout_s=self._timeout_s,
            )
            _created(resp, f"langsmith feedback {body['key']}")
        return SinkOutcome(sink=self.name, status="ok", external_id=run_uuid(case.run_id))
