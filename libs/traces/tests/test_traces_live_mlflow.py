"""LIVE tests against a real MLflow tracking server (3.17.2, started by `mlflow_server`).

(a) id correlation after a real OTLP agent exported its spans; (d) tag correlation with an agent
that mints its own trace id; (c) a dead endpoint is a hard error, fast; an absent trace is empty;
(e) export of a judged case, read back through MLflow's own API, and a second export adds nothing.
"""

from __future__ import annotations

import time
import uuid
from typing import Any

import aiohttp
import pytest

from evalbus.infra.ports import free_port
from evalbus.testing.platforms import PlatformServer
from evalbus_contracts.results import TraceRef
from evalbus_contracts.specs import PlatformSink
from evalbus_runtime.secrets import SecretStore
from evalbus_traces import (
    ExportContext,
    TraceUnavailableError,
    build_sink,
    build_source,
    collect_trace,
    empty_message,
)
from evalbus_traces.ids import export_span_id

pytestmark = [pytest.mark.integration, pytest.mark.slow]


async def _experiment(http: aiohttp.ClientSession, base: str) -> str:
    async with http.post(f"{base}/api/2.0/mlflow/experiments/create", json={"name": f"live-{uuid.uuid4().hex}"}) as r:
        assert r.status == 200, await r.text()
        return str((await r.json())["experiment_id"])


async def test_pull_by_id_after_agent_export(
    mlflow_server: PlatformServer, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str, kit: Any
) -> None:
    experiment = await _experiment(http, mlflow_server.url)
    await kit.run_agent(mlflow_server.url, run_id, {"x-mlflow-experiment-id": experiment})
    ref = TraceRef(kind="mlflow", endpoint=mlflow_server.url, run_id=run_id)
    outcome = await collect_trace(build_source(ref, secrets, http), ref, delay_s=0.2)
    assert outcome.status == "ok", outcome
    assert outcome.attempts == 1  # MLflow's OTLP write is synchronous
    kit.assert_agent_events(outcome.events)


async def test_tag_correlation_finds_agent_minted_trace(
    mlflow_server: PlatformServer, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str, kit: Any
) -> None:
    experiment = await _experiment(http, mlflow_server.url)
    await kit.run_agent(mlflow_server.url, run_id, {"x-mlflow-experiment-id": experiment}, trace_id="random")
    by_id = TraceRef(kind="mlflow", endpoint=mlflow_server.url, run_id=run_id)
    assert await build_source(by_id, secrets, http).pull(by_id) == []  # the id is not derivable
    ref = TraceRef(kind="mlflow", endpoint=mlflow_server.url, run_id=run_id, correlate="tag", experiment=experiment)
    events = await build_source(ref, secrets, http).pull(ref)
    kit.assert_agent_events(events)
    other = TraceRef(
        kind="mlflow", endpoint=mlflow_server.url, run_id=run_id + "-x", correlate="tag", experiment=experiment
    )
    assert await build_source(other, secrets, http).pull(other) == []


async def test_absent_trace_is_empty_then_an_error_event(
    mlflow_server: PlatformServer, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str
) -> None:
    ref = TraceRef(kind="mlflow", endpoint=mlflow_server.url, run_id=run_id)
    outcome = await collect_trace(build_source(ref, secrets, http), ref, delay_s=0.05)
    assert outcome.status == "empty"
    assert outcome.attempts == 3
    assert outcome.error_event is not None
    assert outcome.error_event.message == empty_message(ref, 3)
    assert f"evalbus.run_id={run_id}" in outcome.error_event.message


async def test_dead_endpoint_is_a_fast_hard_error(
    http: aiohttp.ClientSession, secrets: SecretStore, run_id: str
) -> None:
    ref = TraceRef(kind="mlflow", endpoint=f"http://127.0.0.1:{free_port()}", run_id=run_id)
    source = build_source(ref, secrets, http)
    began = time.monotonic()
    with pytest.raises(TraceUnavailableError):
        await source.pull(ref)
    pull_s = time.monotonic() - began  # the baseline: one pull, refused
    delay_s = 30.0
    began = time.monotonic()
    outcome = await collect_trace(source, ref, delay_s=delay_s)
    collect_s = time.monotonic() - began
    # Not retried: as quick as the one pull, no pause of `delay_s` taken.
    assert collect_s < pull_s + delay_s / 2, (collect_s, pull_s)
    assert outcome.status == "unavailable"
    assert outcome.hard_error
    assert outcome.attempts == 1
    assert outcome.error_event is not None


async def test_export_reads_back_and_is_idempotent(
    mlflow_server: PlatformServer, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str, kit: Any
) -> None:
    base = mlflow_server.url
    experiment_name = f"export-{uuid.uuid4().hex}"
    sink = build_sink(PlatformSink(platform="mlflow", endpoint=base, experiment=experiment_name), secrets, http)
    case = kit.judged(run_id)
    ctx = ExportContext(batch_id=case.batch_id, suite_id="suite-1")
    [first] = await sink.export(ctx, [case])
    assert first.status == "ok", first
    assert first.external_id is not None
    assert first.external_id.startswith("tr-")

    async with http.get(f"{base}/api/3.0/mlflow/traces/{first.external_id}") as r:
        assert r.status == 200, await r.text()
        info = (await r.json())["trace"]["trace_info"]
    assert info["tags"]["evalbus.run_id"] == run_id
    assert info["tags"]["evalbus.verdict"] == "pass"
    assessments = {a["assessment_name"]: a for a in info["assessments"]}
    assert set(assessments) == {"answer_match", "judge:quality", "judge:exact"}  # unmeasured not exported
    quality = assessments["judge:quality"]
    assert quality["feedback"]["value"] == 0.8
    assert quality["source"] == {"source_type": "LLM_JUDGE", "source_id": "quality"}
    assert quality["rationale"] == "correct and short"
    assert quality["span_id"] == export_span_id(run_id)
    assert assessments["judge:exact"]["source"]["source_type"] == "CODE"

    # a redelivered case: same external id, no second trace, no second assessment
    [second] = await sink.export(ctx, [case])
    assert second == first
    async with http.get(
        f"{base}/api/2.0/mlflow/experiments/get-by-name", params={"experiment_name": experiment_name}
    ) as r:
        experiment_id = (await r.json())["experiment"]["experiment_id"]
    search = {
        "locations": [{"type": "MLFLOW_EXPERIMENT", "mlflow_experiment": {"experiment_id": experiment_id}}],
        "filter": f"tags.`evalbus.run_id` = '{run_id}'",
        "max_results": 10,
    }
    async with http.post(f"{base}/api/3.0/mlflow/traces/search", json=search) as r:
        traces = (await r.json()).get("traces", [])
    assert [t["trace_id"] for t in traces] == [first.external_id]
    assert len(traces[0]["assessments"]) == 3

    # the exported trace is itself a pullable trace whose steps map back
    ref = TraceRef(kind="mlflow", endpoint=base, run_id=run_id, correlate="tag", experiment=experiment_name)
    events = await build_source(ref, secrets, http).pull(ref)
    assert [type(e).__name__ for e in events if type(e).__name__ in {"LlmCall", "ToolCall", "ToolResult"}] == [
        "LlmCall",
        "ToolCall",
        "ToolResult",
    ]
