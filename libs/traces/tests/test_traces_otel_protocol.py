"""PROTOCOL-level tests of the otel source and sink, and of `collect_trace`'s retry semantics.

The backend is a real local aiohttp server speaking a Jaeger-style query API (`GET /api/traces/{id}`,
`GET /api/traces?service=&tags=&limit=`, Jaeger's `{"data":[{"traceID","spans","processes"}]}` answer)
and an OTLP/HTTP JSON receiver (`POST /v1/traces`) that checks each request the way the documented
APIs define them. Nothing here is a live Jaeger or collector.
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from evalbus.infra.ports import free_port
from evalbus_contracts.results import TraceRef
from evalbus_contracts.specs import PlatformSink
from evalbus_contracts.trace import LlmCall, ToolCall
from evalbus_runtime.secrets import SecretStore
from evalbus_traces import (
    ExportContext,
    TraceConfigError,
    TraceUnavailableError,
    build_sink,
    build_source,
    collect_trace,
    export_trace_id,
    trace_id_for,
)

pytestmark = pytest.mark.integration

Serve = Callable[[web.Application], Awaitable[str]]
US = 1_000_000  # Jaeger times are microseconds


def _tag(key: str, value: Any) -> dict[str, Any]:
    kind = (
        "bool"
        if isinstance(value, bool)
        else "int64"
        if isinstance(value, int)
        else ("float64" if isinstance(value, float) else "string")
    )
    return {"key": key, "type": kind, "value": value}


def jaeger_trace(trace_id: str, run_id: str, *, with_root: bool = True) -> dict[str, Any]:
    """A Jaeger trace object like the OTLP agent's: AGENT root, LLM child, TOOL child."""
    t0 = 1_700_000_000 * US

    def child(span_id: str, name: str, start: int, tags: list[dict[str, Any]]) -> dict[str, Any]:
        return {
            "traceID": trace_id,
            "spanID": span_id,
            "operationName": name,
            "startTime": t0 + start,
            "duration": 1000,
            "references": [{"refType": "CHILD_OF", "traceID": trace_id, "spanID": "r000000000000001"}],
            "tags": tags,
            "logs": [],
            "processID": "p1",
        }

    spans = [
        child(
            "l000000000000001",
            "chat",
            1000,
            [
                _tag("openinference.span.kind", "LLM"),
                _tag("llm.model_name", "gpt-test"),
                _tag("llm.token_count.prompt", 42),
                _tag("llm.token_count.completion", 7),
                _tag("llm.cost.total", 0.0012),
                _tag("llm.output_messages.0.message.role", "assistant"),
                _tag("llm.output_messages.0.message.content", "I will use the calculator."),
            ],
        ),
        child(
            "t000000000000001",
            "calculator",
            3000,
            [
                _tag("openinference.span.kind", "TOOL"),
                _tag("tool.name", "calculator"),
                _tag("input.value", '{"expression": "6*7"}'),
                _tag("output.value", "42"),
            ],
        ),
    ]
    if with_root:
        spans.insert(
            0,
            {
                "traceID": trace_id,
                "spanID": "r000000000000001",
                "operationName": "agent",
                "startTime": t0,
                "duration": 5000,
                "references": [],
                "processID": "p1",
                "logs": [],
                "tags": [
                    _tag("openinference.span.kind", "AGENT"),
                    _tag("input.value", "What is 6*7?"),
                    _tag("output.value", "42"),
                    _tag("evalbus.run_id", run_id),
                ],
            },
        )
    return {
        "traceID": trace_id,
        "spans": spans,
        "processes": {
            "p1": {"serviceName": "otlp-agent", "tags": [_tag("evalbus.run_id", run_id)]},
        },
        "warnings": None,
    }


class Jaeger:
    """A scripted Jaeger query API: each GET of a trace consumes the next scripted answer."""

    def __init__(self, run_id: str, script: list[str], token: str | None = None) -> None:
        self.run_id = run_id
        self.trace_id = trace_id_for(run_id)
        self.script = list(script)
        self.token = token
        self.requests: list[web.Request] = []
        self.problems: list[str] = []

    def _answer(self, what: str) -> web.Response:
        if what == "404":
            return web.json_response({"data": None, "errors": [{"code": 404, "msg": "trace not found"}]}, status=404)
        if what == "500":
            return web.json_response({"data": None, "errors": [{"code": 500, "msg": "storage down"}]}, status=500)
        trace = jaeger_trace(self.trace_id, self.run_id, with_root=what != "partial")
        return web.json_response({"data": [trace], "total": 0, "limit": 0, "offset": 0, "errors": None})

    def _check_auth(self, request: web.Request) -> None:
        got = request.headers.get("Authorization")
        if got != self.token:
            self.problems.append(f"Authorization {got!r}")

    async def get_trace(self, request: web.Request) -> web.Response:
        self.requests.append(request)
        self._check_auth(request)
        if request.match_info["trace_id"] != self.trace_id:
            return self._answer("404")
        return self._answer(self.script.pop(0) if self.script else "404")

    async def search(self, request: web.Request) -> web.Response:
        self.requests.append(request)
        self._check_auth(request)
        q = request.query
        if "service" not in q:  # Jaeger: "parameter 'service' is required"
            return web.json_response({"data": None, "errors": [{"code": 400, "msg": "service required"}]}, status=400)
        tags = json.loads(q.get("tags", "{}"))
        if q["service"] != "otlp-agent" or tags.get("evalbus.run_id") != self.run_id or not q.get("limit"):
            return web.json_response({"data": [], "errors": None})
        what = self.script.pop(0) if self.script else "full"
        if what == "404":  # a search finds nothing: an empty list, not a 404
            return web.json_response({"data": [], "errors": None})
        trace = jaeger_trace(trace_id_for("agent-minted-" + self.run_id), self.run_id)
        return web.json_response({"data": [trace], "errors": None})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/traces/{trace_id}", self.get_trace)
        app.router.add_get("/api/traces", self.search)
        return app


async def _source(
    serve: Serve, jaeger: Jaeger, http: aiohttp.ClientSession, secrets: SecretStore, **ref_fields: Any
) -> tuple[Any, TraceRef]:
    base = await serve(jaeger.app())
    ref = TraceRef(kind="otel", endpoint=base, run_id=jaeger.run_id, **ref_fields)
    return build_source(ref, secrets, http), ref


async def test_id_pull_maps_the_trace(
    serve: Serve, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str, kit: Any
) -> None:
    jaeger = Jaeger(run_id, ["full"])
    source, ref = await _source(serve, jaeger, http, secrets)
    kit.assert_agent_events(await source.pull(ref))
    assert jaeger.requests[0].path == f"/api/traces/{trace_id_for(run_id)}"
    assert jaeger.problems == []


async def test_tag_search_needs_service_and_finds_by_run_id(
    serve: Serve, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str, kit: Any
) -> None:
    jaeger = Jaeger(run_id, [])
    source, ref = await _source(serve, jaeger, http, secrets, correlate="tag", service="otlp-agent")
    kit.assert_agent_events(await source.pull(ref))
    assert json.loads(jaeger.requests[0].query["tags"]) == {"evalbus.run_id": run_id}
    no_service = TraceRef(kind="otel", endpoint=ref.endpoint, run_id=run_id, correlate="tag")
    with pytest.raises(TraceConfigError):
        await source.pull(no_service)


async def test_verbatim_authorization_from_the_secret_store(
    serve: Serve, http: aiohttp.ClientSession, run_id: str
) -> None:
    store = SecretStore(environ={"EVALBUS_SECRET_JAEGER_TOKEN": "Basic dTpw"})
    jaeger = Jaeger(run_id, ["full"], token="Basic dTpw")
    source, ref = await _source(serve, jaeger, http, store, auth_secret="jaeger-token")
    assert await source.pull(ref)
    assert jaeger.problems == []


async def test_collect_retries_empty_three_times_then_reports(
    serve: Serve, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str
) -> None:
    jaeger = Jaeger(run_id, ["404", "404", "404", "full"])
    source, ref = await _source(serve, jaeger, http, secrets)
    outcome = await collect_trace(source, ref, delay_s=0.01)
    assert (outcome.status, outcome.attempts, len(jaeger.requests)) == ("empty", 3, 3)
    assert outcome.events == ()
    assert outcome.error_event is not None
    assert outcome.error_event.message == f"collected 0 traces for evalbus.run_id={run_id} (3 attempts)"


async def test_collect_finds_the_trace_on_attempt_two(
    serve: Serve, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str
) -> None:
    jaeger = Jaeger(run_id, ["404", "full"])
    source, ref = await _source(serve, jaeger, http, secrets)
    outcome = await collect_trace(source, ref, delay_s=0.01)
    assert (outcome.status, outcome.attempts, len(jaeger.requests)) == ("ok", 2, 2)
    assert outcome.error_event is None
    assert any(isinstance(e, LlmCall) for e in outcome.events)


async def test_collect_waits_for_the_root_span(
    serve: Serve, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str
) -> None:
    jaeger = Jaeger(run_id, ["partial", "full"])
    source, ref = await _source(serve, jaeger, http, secrets)
    outcome = await collect_trace(source, ref, delay_s=0.01)
    assert (outcome.status, outcome.attempts) == ("ok", 2)

    still = Jaeger(run_id, ["partial"] * 3)
    source, ref = await _source(serve, still, http, secrets)
    outcome = await collect_trace(source, ref, delay_s=0.01)
    assert (outcome.status, outcome.attempts) == ("partial", 3)
    assert any(isinstance(e, ToolCall) for e in outcome.events)  # the partial evidence is kept
    assert outcome.error_event is not None
    assert "no root span" in outcome.error_event.message


async def test_collect_does_not_retry_a_hard_error(
    serve: Serve, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str
) -> None:
    jaeger = Jaeger(run_id, ["500", "full"])
    source, ref = await _source(serve, jaeger, http, secrets)
    began = time.monotonic()
    with pytest.raises(TraceUnavailableError):
        await source.pull(ref)
    pull_s = time.monotonic() - began  # the baseline: one pull answered 500
    jaeger.script = ["500", "full"]
    delay_s = 30.0
    began = time.monotonic()
    outcome = await collect_trace(source, ref, delay_s=delay_s)
    collect_s = time.monotonic() - began
    # As quick as the one pull: no retry pause (of `delay_s`) was taken before or after the attempt.
    assert collect_s < pull_s + delay_s / 2, (collect_s, pull_s)
    assert (outcome.status, outcome.attempts, outcome.hard_error) == ("unavailable", 1, True)
    assert len(jaeger.requests) == 2  # one direct pull, one collect attempt
    assert outcome.error is not None
    assert "HTTP 500" in outcome.error


async def test_collect_reports_a_missing_secret_without_pulling(
    serve: Serve, http: aiohttp.ClientSession, secrets: SecretStore, run_id: str
) -> None:
    jaeger = Jaeger(run_id, ["full"])
    source, ref = await _source(serve, jaeger, http, secrets, auth_secret="jaeger-token")
    outcome = await collect_trace(source, ref, delay_s=0.01)
    assert (outcome.status, outcome.missing_secret, outcome.attempts) == ("missing_secret", "jaeger-token", 1)
    assert jaeger.requests == []  # never an unauthenticated pull


async def test_dead_endpoint_is_a_hard_error(http: aiohttp.ClientSession, secrets: SecretStore, run_id: str) -> None:
    ref = TraceRef(kind="otel", endpoint=f"http://127.0.0.1:{free_port()}", run_id=run_id)
    outcome = await collect_trace(build_source(ref, secrets, http), ref, delay_s=10.0)
    assert (outcome.status, outcome.attempts) == ("unavailable", 1)


class OtlpReceiver:
    """An OTLP/HTTP JSON receiver checking requests against the OTLP specification."""

    def __init__(self, token: str | None = None, fail: bool = False) -> None:
        self.bodies: list[dict[str, Any]] = []
        self.problems: list[str] = []
        self.token = token
        self.fail = fail

    async def traces(self, request: web.Request) -> web.Response:
        if request.content_type != "application/json":
            self.problems.append(f"content type {request.content_type}")
        if request.headers.get("Authorization") != self.token:
            self.problems.append("authorization")
        body = await request.json()
        for rs in body.get("resourceSpans", []):
            for ss in rs.get("scopeSpans", []):
                for span in ss.get("spans", []):
                    if len(span.get("traceId", "")) != 32 or len(span.get("spanId", "")) != 16:
                        self.problems.append("ids must be hex (OTLP JSON)")
                    if not isinstance(span.get("kind"), int):
                        self.problems.append("enums must be integers (OTLP JSON)")
                    if not span.get("startTimeUnixNano") or not span.get("name"):
                        self.problems.append("span without name/start")
        self.bodies.append(body)
        if self.fail:
            return web.json_response({"code": 8, "message": "resource exhausted"}, status=429)
        return web.json_response({"partialSuccess": {}})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/v1/traces", self.traces)
        return app


async def test_otel_sink_posts_otlp_json(serve: Serve, http: aiohttp.ClientSession, run_id: str, kit: Any) -> None:
    receiver = OtlpReceiver(token="Bearer abc")
    base = await serve(receiver.app())
    store = SecretStore(environ={"EVALBUS_SECRET_OTLP": "Bearer abc"})
    sink = build_sink(PlatformSink(platform="otel", endpoint=base, auth_secret="otlp"), store, http)
    case = kit.judged(run_id)
    [outcome] = await sink.export(ExportContext(batch_id="b1"), [case])
    assert outcome.status == "ok", outcome
    assert outcome.external_id == export_trace_id(run_id)
    assert receiver.problems == []
    root = receiver.bodies[0]["resourceSpans"][0]["scopeSpans"][0]["spans"][0]
    assert {a["key"] for a in root["attributes"]} >= {"evalbus.run_id", "evalbus.score.judge:quality"}


async def test_sinks_never_throw(serve: Serve, http: aiohttp.ClientSession, run_id: str, kit: Any) -> None:
    receiver = OtlpReceiver(fail=True)
    base = await serve(receiver.app())
    empty = SecretStore(environ={})
    case = kit.judged(run_id)
    ctx = ExportContext(batch_id="b1")
    [rejected] = await build_sink(PlatformSink(platform="otel", endpoint=base), empty, http).export(ctx, [case])
    assert rejected.status == "failed"
    assert rejected.error is not None
    assert "HTTP 429" in rejected.error
    dead = f"http://127.0.0.1:{free_port()}"
    for platform in ("otel", "mlflow", "phoenix", "langfuse", "langsmith"):
        sink = build_sink(PlatformSink(platform=platform, endpoint=dead), empty, http)
        outcomes = await sink.export(ctx, [case, case])
        assert [o.status for o in outcomes] == ["failed", "failed"], platform
        assert all(o.sink == platform for o in outcomes)
        secret = build_sink(PlatformSink(platform=platform, endpoint=dead, auth_secret="nope"), empty, http)
        [missing] = await secret.export(ctx, [case])
        assert missing.status == "failed"
        assert missing.error is not None
        assert "MissingSecretError" in missing.error
