"""MLflow trace sink (tested LIVE against a real `mlflow server` 3.17.2).

Per case (API as in shared/reference/platform-notes.md, checked against the live server):
1. the experiment: `spec.experiment` (an id is checked with `experiments/get` — MLflow accepts OTLP
   for ids that do not exist — a name is found with `experiments/get-by-name` or created), default
   `evalbus`;
2. the trace, with a deterministic id `tr-<export_trace_id(run_id)>`: `GET /api/3.0/mlflow/traces/{tid}`
   first, and only when it is missing `POST /v1/traces` (OTLP protobuf, header
   `x-mlflow-experiment-id`; resource and root attributes carry `evalbus.run_id`, which MLflow turns
   into the trace tag);
3. one assessment per measured score, `POST /api/3.0/mlflow/traces/{tid}/assessments` (feedback value,
   rationale, source LLM_JUDGE for model judges else CODE, source id = grader/judge id, on the root
   span), skipped when the trace already holds one with that name and source;
4. the verdict as the trace tag `evalbus.verdict` (`PATCH …/tags`).
A redelivered case therefore finds its trace and assessments and creates nothing twice.
Auth: the secret's value verbatim in `Authorization`.
"""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote

import aiohttp

from evalbus_contracts.specs import PlatformSink
from evalbus_contracts.summary import SinkOutcome
from evalbus_runtime.secrets import SecretStore
from evalbus_traces.auth import auth_headers
from evalbus_traces.errors import TraceConfigError
from evalbus_traces.ids import export_span_id, export_trace_id
from evalbus_traces.otlp import case_request
from evalbus_traces.ports import ExportContext, JudgedCase
from evalbus_traces.sinks import HttpTraceSink
from evalbus_traces.sources.mlflow import mlflow_missing
from evalbus_traces.transport import DEFAULT_TIMEOUT_S, expect_ok, reject, require_ok, send

DEFAULT_EXPERIMENT = "evalbus"
"""Experiment name used when the sink names none."""


def mlflow_trace_id(run_id: str) -> str:
    """The MLflow trace id of a run's exported trace."""
    return "tr-" + export_trace_id(run_id)


def assessment_body(case: JudgedCase, trace_id: str, score: Any) -> dict[str, Any]:
    """The `assessments` request body for one measured score."""
    metadata = {
        "evalbus.run_id": case.run_id,
        "evalbus.batch_id": case.batch_id,
        "evalbus.metric": score.metric,
        "evalbus.source": score.source,
    }
    if score.passed is not None:
        metadata["evalbus.pass"] = "true" if score.passed else "false"
    assessment: dict[str, Any] = {
        "trace_id": trace_id,
        "assessment_name": score.metric,
        "source": {"source_type": "LLM_JUDGE" if case.is_llm_judged(score) else "CODE", "source_id": score.grader_id},
        "feedback": {"value": float(score.value)},
        "metadata": metadata,
        "span_id": export_span_id(case.run_id),
    }
    if score.detail:
        assessment["rationale"] = score.detail
    return {"assessment": assessment}


class MlflowTraceSink(HttpTraceSink):
    """Exports judged cases to an MLflow experiment as traces with assessments."""

    name = "mlflow"

    def __init__(
        self,
        spec: PlatformSink,
        session: aiohttp.ClientSession,
        secrets: SecretStore,
        timeout_s: float = DEFAULT_TIMEOUT_S,
    ) -> None:
        super().__init__(spec, session, secrets, timeout_s)
        self._experiment_id: str | None = None

    async def _call(self, method: str, path: str, headers: dict[str, str], **kwargs: Any) -> Any:
        return await send(
            self._session, method, self._base + path, headers=headers, timeout_s=self._timeout_s, **kwargs
        )

    async def _experiment(self, headers: dict[str, str]) -> str:
        if self._experiment_id is not None:
            return self._experiment_id
        wanted = self._spec.experiment or DEFAULT_EXPERIMENT
        if wanted.isdigit():
            resp = await self._call("GET", "/api/2.0/mlflow/experiments/get", headers, params={"experiment_id": wanted})
            if mlflow_missing(resp):
                raise TraceConfigError(f"mlflow experiment {wanted} does not exist")
            expect_ok(resp, "mlflow experiments/get")
            self._experiment_id = wanted
            return wanted
        for _ in range(2):  # a concurrent exporter may create it between our lookup and create
            resp = await self._call(
                "GET", "/api/2.0/mlflow/experiments/get-by-name", headers, params={"experiment_name": wanted}
            )
            if not mlflow_missing(resp):
                self._experiment_id = str(expect_ok(resp, "mlflow get-by-name")["experiment"]["experiment_id"])
                return self._experiment_id
            resp = await self._call("POST", "/api/2.0/mlflow/experiments/create", headers, json_body={"name": wanted})
            if resp.ok:
                self._experiment_id = str(resp.json()["experiment_id"])
                return self._experiment_id
            if "RESOURCE_ALREADY_EXISTS" not in resp.text():
                raise reject(resp, "mlflow experiments/create")
        raise TraceConfigError(f"mlflow experiment {wanted!r} could not be found or created")

    async def _trace_info(self, headers: dict[str, str], trace_id: str) -> dict[str, Any] | None:
        resp = await self._call("GET", f"/api/3.0/mlflow/traces/{quote(trace_id, safe='')}", headers)
        if mlflow_missing(resp):
            return None
        info: dict[str, Any] = expect_ok(resp, "mlflow trace")["trace"]["trace_info"]
        return info

    async def _export_one(self, ctx: ExportContext, case: JudgedCase) -> SinkOutcome:
        headers = auth_headers("authorization", self._secrets, self._spec.auth_secret)
        experiment_id = await self._experiment(headers)
        trace_id = mlflow_trace_id(case.run_id)
        info = await self._trace_info(headers, trace_id)
        if info is None:
            request = case_request(case, ctx, datetime.now(UTC))
            resp = await self._call(
                "POST",
                "/v1/traces",
                {**headers, "Content-Type": "application/x-protobuf", "x-mlflow-experiment-id": experiment_id},
                data=request.SerializeToString(),
            )
            require_ok(resp, "mlflow OTLP ingest")
            info = await self._trace_info(headers, trace_id)
            if info is None:
                raise TraceConfigError(f"mlflow accepted trace {trace_id} but does not return it")
        have = {
            (a.get("assessment_name"), (a.get("source") or {}).get("source_id")) for a in info.get("assessments") or []
        }
        path = f"/api/3.0/mlflow/traces/{quote(trace_id, safe='')}"
        for score in case.measured():
            if (score.metric, score.grader_id) in have:
                continue
            resp = await self._call(
                "POST", path + "/assessments", headers, json_body=assessment_body(case, trace_id, score)
            )
            expect_ok(resp, f"mlflow assessment {score.metric}")
            have.add((score.metric, score.grader_id))
        if case.verdict is not None and (info.get("tags") or {}).get("evalbus.verdict") != case.verdict:
            resp = await self._call(
                "PATCH", path + "/tags", headers, json_body={"key": "evalbus.verdict", "value": case.verdict}
            )
            expect_ok(resp, "mlflow trace tag")
        url = f"{self._base}/#/experiments/{experiment_id}/traces?selectedEvaluationId={trace_id}"
        return SinkOutcome(sink=self.name, status="ok", external_id=trace_id, url=url)
