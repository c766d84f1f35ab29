"""LIVE tests against a real Arize Phoenix server (20.26.1, started by `phoenix_server`).

(a) id correlation after a real OTLP agent exported its spans (ingestion is queued, so the
collector's empty-pull retry is what waits for them); (d) tag correlation by the root-span
attribute with an agent that mints its own trace id; (c) a dead endpoint is a hard error, fast;
an unknown project is empty; (e) export of a judged case, read back through Phoenix's own API,
and a second export adds neither a span nor an annotation (annotations are upserts).
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
from evalbus_traces import ExportContext, TraceUnavailableError, build_sink, build_source, collect_trace
from evalbus_traces.ids import export_span_id, export_trace_id

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def _project() -> str:
    return f"live-{uuid.uuid4().hex[:12]}"


async def test_pull_by_id_after_agent_export(
    phoenix_server: PlatformServer, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str, kit: Any
) -> None:
    project = _project()
    await kit.run_agent(phoenix_server.url, run_id, {"x-project-name": project})
    ref = TraceRef(kind="phoenix", endpoint=phoenix_server.url, run_id=run_id, project=project)
    outcome = await collect_trace(build_source(ref, secrets, http), ref, attempts=10, delay_s=0.5)
    assert outcome.status == "ok", outcome
    kit.assert_agent_events(outcome.events)


async def test_tag_correlation_finds_agent_minted_trace(
    phoenix_server: PlatformServer, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str, kit: Any
) -> None:
    project = _project()
    await kit.run_agent(phoenix_server.url, run_id, {"x-project-name": project}, trace_id="random")
    ref = TraceRef(kind="phoenix", endpoint=phoenix_server.url, run_id=run_id, correlate="tag", project=project)
    outcome = await collect_trace(build_source(ref, secrets, http), ref, attempts=10, delay_s=0.5)
    assert outcome.status == "ok", outcome
    kit.assert_agent_events(outcome.events)
    by_id = TraceRef(kind="phoenix", endpoint=phoenix_server.url, run_id=run_id, project=project)
    assert await build_source(by_id, secrets, http).pull(by_id) == []  # the agent's id is its own
    other = TraceRef(
        kind="phoenix", endpoint=phoenix_server.url, run_id=run_id + "-x", correlate="tag", project=project
    )
    assert await build_source(other, secrets, http).pull(other) == []


async def test_unknown_project_is_empty(
    phoenix_server: PlatformServer, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str
) -> None:
    ref = TraceRef(kind="phoenix", endpoint=phoenix_server.url, run_id=run_id, project=_project())
    outcome = await collect_trace(build_source(ref, secrets, http), ref, delay_s=0.05)
    assert outcome.status == "empty"
    assert outcome.attempts == 3
    assert outcome.error_event is not None
    assert outcome.error_event.message == f"collected 0 traces for evalbus.run_id={run_id} (3 attempts)"


async def test_dead_endpoint_is_a_fast_hard_error(
    http: aiohttp.ClientSession, secrets: SecretStore, run_id: str
) -> None:
    ref = TraceRef(kind="phoenix", endpoint=f"http://127.0.0.1:{free_port()}", run_id=run_id, project="p")
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
    assert (outcome.status, outcome.attempts) == ("unavailable", 1)


async def _annotations(http: aiohttp.ClientSession, base: str, project: str, span_id: str) -> list[dict[str, Any]]:
    async with http.get(f"{base}/v1/projects/{project}/span_annotations", params={"span_ids": span_id}) as r:
        assert r.status == 200, await r.text()
        return list((await r.json())["data"])


async def _spans(http: aiohttp.ClientSession, base: str, project: str, trace_id: str) -> list[dict[str, Any]]:
    async with http.get(f"{base}/v1/projects/{project}/spans", params={"trace_id": trace_id}) as r:
        assert r.status == 200, await r.text()
        return list((await r.json())["data"])


async def test_export_reads_back_and_is_idempotent(
    phoenix_server: PlatformServer, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str, kit: Any
) -> None:
    base, project = phoenix_server.url, _project()
    sink = build_sink(PlatformSink(platform="phoenix", endpoint=base, project=project), secrets, http)
    case = kit.judged(run_id)
    ctx = ExportContext(batch_id=case.batch_id, suite_id="suite-1")
    [first] = await sink.export(ctx, [case])
    assert first.status == "ok", first
    assert first.external_id == export_trace_id(run_id)
    assert first.url is not None
    assert first.url.endswith(f"/traces/{first.external_id}")

    span_id = export_span_id(run_id)
    spans = await _spans(http, base, project, first.external_id)
    assert len(spans) == 3  # the case root, its LLM call and its tool call
    root = next(s for s in spans if s["context"]["span_id"] == span_id)
    assert root["attributes"]["evalbus.run_id"] == run_id
    notes = {a["name"]: a for a in await _annotations(http, base, project, span_id)}
    assert set(notes) == {"answer_match", "judge:quality", "judge:exact", "evalbus.verdict"}
    quality = notes["judge:quality"]
    assert quality["result"]["score"] == 0.8
    assert quality["result"]["label"] == "pass"
    assert quality["result"]["explanation"] == "correct and short"
    assert quality["annotator_kind"] == "LLM"
    assert quality["identifier"] == f"evalbus:{run_id}"
    assert notes["judge:exact"]["annotator_kind"] == "CODE"
    assert notes["evalbus.verdict"]["result"]["label"] == "pass"

    [second] = await sink.export(ctx, [case])
    assert second == first
    assert len(await _spans(http, base, project, first.external_id)) == 3
    again = await _annotations(http, base, project, span_id)
    assert sorted(a["id"] for a in again) == sorted(a["id"] for a in notes.values())
