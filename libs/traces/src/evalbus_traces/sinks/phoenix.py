"""Arize Phoenix trace sink (tested LIVE against a real `phoenix serve` 20.26.1).

Per case (API as in shared/reference/platform-notes.md, checked against the live server):
1. the case's root span has a deterministic id (`export_span_id(run_id)`); when
   `GET /v1/projects/{project}/spans?span_id=` does not find it, the case is sent as OTLP protobuf
   to `POST /v1/traces` with `x-project-name` (Phoenix creates the project), and the sink polls until
   the span appears (ingestion is queued);
2. every measured score becomes a span annotation, `POST /v1/span_annotations?sync=true`, with
   `identifier = evalbus:<run_id>`: Phoenix upserts on (name, span_id, identifier), so a redelivered
   case replaces its annotations instead of adding new ones. The verdict is the annotation
   `evalbus.verdict`.
Project: `spec.project`, default `evalbus`. Auth: `Authorization: Bearer <secret>`.
"""

from __future__ import annotations

import asyncio
import time
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import aiohttp

from evalbus_contracts.scores import Measured
from evalbus_contracts.specs import PlatformSink
from evalbus_contracts.summary import SinkOutcome
from evalbus_runtime.secrets import SecretStore
from evalbus_traces.auth import auth_headers
from evalbus_traces.errors import TraceUnavailableError
from evalbus_traces.ids import export_span_id, export_trace_id
from evalbus_traces.otlp import case_request
from evalbus_traces.ports import ExportContext, JudgedCase
from evalbus_traces.sinks import HttpTraceSink
from evalbus_traces.transport import DEFAULT_TIMEOUT_S, expect_ok, require_ok, send

DEFAULT_PROJECT = "evalbus"
"""Project used when the sink names none."""
APPEAR_TIMEOUT_S = 20.0
"""How long to wait for an ingested span to become readable."""


def annotation_identifier(run_id: str) -> str:
    """The annotation identifier that makes re-exports upserts."""
    return f"evalbus:{run_id}"


def score_annotation(case: JudgedCase, score: Measured) -> dict[str, Any]:
    """The span annotation for one measured score."""
    result: dict[str, Any] = {"score": float(score.value)}
    label = score.label or (None if score.passed is None else ("pass" if score.passed else "fail"))
    if label is not None:
        result["label"] = label
    if score.detail:
        result["explanation"] = score.detail
    return {
        "span_id": export_span_id(case.run_id),
        "name": score.metric,
        "annotator_kind": "LLM" if case.is_llm_judged(score) else "CODE",
        "result": result,
        "metadata": {
            "evalbus.run_id": case.run_id,
            "evalbus.batch_id": case.batch_id,
            "evalbus.grader_id": score.grader_id,
            "evalbus.source": score.source,
        },
        "identifier": annotation_identifier(case.run_id),
    }


def verdict_annotation(case: JudgedCase) -> dict[str, Any] | None:
    """The `evalbus.verdict` annotation, when the case has a verdict."""
    if case.verdict is None:
        return None
    return {
        "span_id": export_span_id(case.run_id),
        "name": "evalbus.verdict",
        "annotator_kind": "CODE",
        "result": {"label": case.verdict, "score": 1.0 if case.verdict == "pass" else 0.0},
        "metadata": {"evalbus.run_id": case.run_id, "evalbus.batch_id": case.batch_id},
        "identifier": annotation_identifier(case.run_id),
    }


class PhoenixTraceSink(HttpTraceSink):
    """Exports judged cases to a Phoenix project as spans with annotations."""

    name = "phoenix"

    def __init__(
        self,
        spec: PlatformSink,
        session: aiohttp.ClientSession,
        secrets: SecretStore,
        timeout_s: float = DEFAULT_TIMEOUT_S,
        appear_timeout_s: float = APPEAR_TIMEOUT_S,
    ) -> None:
        super().__init__(spec, session, secrets, timeout_s)
        self._project = spec.project or DEFAULT_PROJECT
        self._appear_timeout_s = appear_timeout_s
        self._project_id: str | None = None

    async def _span_exists(self, headers: dict[str, str], span_id: str) -> bool:
        url = f"{self._base}/v1/projects/{quote(self._project, safe='')}/spans"
        resp = await send(
            self._session,
            "GET",
            url,
            headers=headers,
            params={"span_id": span_id, "limit": "1"},
            timeout_s=self._timeout_s,
        )
        if resp.status == 404:
            return False
        return bool(expect_ok(resp, "phoenix spans").get("data"))

    async def _await_span(self, headers: dict[str, str], span_id: str) -> None:
        deadline = time.monotonic() + self._appear_timeout_s
        pause = 0.05
        while not await self._span_exists(headers, span_id):
            if time.monotonic() > deadline:
                raise TraceUnavailableError(f"phoenix did not show span {span_id} within {self._appear_timeout_s}s")
            await asyncio.sleep(pause)  # ingestion is queued on the server; poll with a deadline
            pause = min(pause * 2, 0.5)

    async def _project_url(self, headers: dict[str, str], trace_id: str) -> str | None:
        if self._project_id is None:
            resp = await send(
                self._session,
                "GET",
                f"{self._base}/v1/projects/{quote(self._project, safe='')}",
                headers=headers,
                timeout_s=self._timeout_s,
            )
            if not resp.ok:
                return None
            self._project_id = str((resp.json().get("data") or {}).get("id") or "") or None
        return f"{self._base}/projects/{self._project_id}/traces/{trace_id}" if self._project_id else None

    async def _export_one(self, ctx: ExportContext, case: JudgedCase) -> SinkOutcome:
        headers = auth_headers("bearer", self._secrets, self._spec.auth_secret)
        span_id = export_span_id(case.run_id)
        trace_id = export_trace_id(case.run_id)
        if not await self._span_exists(headers, span_id):
            request = case_request(case, ctx, datetime.now(UTC))
            resp = await send(
                self._session,
                "POST",
                f"{self._base}/v1/traces",
                headers={**headers, "Content-Type": "application/x-protobuf", "x-project-name": self._project},
                data=request.SerializeToString(),
                timeout_s=self._timeout_s,
            )
            require_ok(resp, "phoenix OTLP ingest")
            await self._await_span(headers, span_id)
        annotations = [score_annotation(case, s) for s in case.measured()]
        verdict = verdict_annotation(case)
        if verdict is not None:
            annotations.append(verdict)
        if annotations:
            resp = await send(
                self._session,
                "POST",
                f"{self._base}/v1/span_annotations",
                headers=headers,
                params={"sync": "true"},
                json_body={"data": annotations},
                timeout_s=self._timeout_s,
            )
            expect_ok(resp, "phoenix span annotations")
        url = await self._project_url(headers, trace_id)
        return SinkOutcome(sink=self.name, status="ok", external_id=trace_id, url=url)
