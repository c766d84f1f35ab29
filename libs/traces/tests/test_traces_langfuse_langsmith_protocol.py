"""PROTOCOL-level tests of the Langfuse and LangSmith adapters (no live platform).

Each platform is a real local aiohttp server that checks every request against the documented
public API — path, method, auth header shape, required body fields — and answers with the
documented response shapes, keeping what it was sent so re-exports can be checked:
- Langfuse: Basic auth (public:secret key); `GET /api/public/traces/{id}`, `GET /api/public/traces?tags=`,
  `POST /api/public/ingestion` (`{batch:[{id,timestamp,type,body}]}` → 207 `{successes, errors}`).
- LangSmith: `x-api-key`; `POST /api/v1/runs/query` (`{runs, cursors}`), `GET /api/v1/sessions?name=`,
  `POST /api/v1/runs` and `POST /api/v1/feedback` (409 for an id that exists).
"""

from __future__ import annotations

import base64
import uuid
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
import pytest
from aiohttp import web

from evalbus_contracts.results import TraceRef
from evalbus_contracts.specs import PlatformSink
from evalbus_runtime.secrets import SecretStore
from evalbus_traces import ExportContext, build_sink, build_source, trace_id_for
from evalbus_traces.ids import as_uuid

pytestmark = pytest.mark.integration

Serve = Callable[[web.Application], Awaitable[str]]
T0 = "2026-01-02T03:04:05.000000Z"


def _at(ms: int) -> str:
    return f"2026-01-02T03:04:05.{ms:03d}000Z"


class Langfuse:
    """Langfuse's public API as documented (a subset), with Basic auth checked on every request."""

    def __init__(self, public: str, secret: str) -> None:
        self.auth = "Basic " + base64.b64encode(f"{public}:{secret}".encode()).decode()
        self.traces: dict[str, dict[str, Any]] = {}
        self.scores: dict[str, dict[str, Any]] = {}
        self.event_ids: set[str] = set()
        self.problems: list[str] = []

    def seed(self, trace_id: str, run_id: str) -> None:
        obs = [
            {
                "id": "o1",
                "traceId": trace_id,
                "type": "GENERATION",
                "name": "chat",
                "startTime": _at(100),
                "endTime": _at(400),
                "parentObservationId": None,
                "model": "gpt-test",
                "usageDetails": {"input": 42, "output": 7, "total": 49},
                "costDetails": {"total": 0.0012},
                "input": [{"role": "user", "content": "What is 6*7?"}],
                "output": "I will use the calculator.",
                "level": "DEFAULT",
            },
            {
                "id": "o2",
                "traceId": trace_id,
                "type": "TOOL",
                "name": "calculator",
                "startTime": _at(500),
                "endTime": _at(700),
                "parentObservationId": None,
                "input": {"expression": "6*7"},
                "output": "42",
                "level": "DEFAULT",
            },
        ]
        self.traces[trace_id] = {
            "id": trace_id,
            "timestamp": T0,
            "name": "agent",
            "input": "What is 6*7?",
            "output": "42",
            "tags": [f"evalbus.run_id:{run_id}"],
            "observations": obs,
            "scores": [],
            "htmlPath": f"/trace/{trace_id}",
            "latency": 1.0,
            "totalCost": 0.0012,
        }

    def _authorized(self, request: web.Request) -> bool:
        if request.headers.get("Authorization") != self.auth:
            self.problems.append(f"{request.path}: bad auth")
            return False
        return True

    async def get_trace(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"message": "Unauthorized"}, status=401)
        found = self.traces.get(request.match_info["trace_id"])
        if found is None:
            return web.json_response({"message": "Trace not found", "error": "LangfuseNotFoundError"}, status=404)
        return web.json_response(found)

    async def list_traces(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"message": "Unauthorized"}, status=401)
        tags = request.query.getall("tags", [])
        data = [
            {k: v for k, v in t.items() if k != "observations"} | {"observations": [o["id"] for o in t["observations"]]}
            for t in self.traces.values()
            if all(tag in t.get("tags", []) for tag in tags)
        ]
        return web.json_response(
            {"data": data, "meta": {"page": 1, "limit": 50, "totalItems": len(data), "totalPages": 1}}
        )

    async def ingestion(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"message": "Unauthorized"}, status=401)
        body = await request.json()
        successes, errors = [], []
        for event in body.get("batch", []):
            missing = [k for k in ("id", "timestamp", "type", "body") if k not in event]
            if missing:
                errors.append({"id": event.get("id"), "status": 400, "message": f"missing {missing}"})
                continue
            inner = event["body"]
            if event["type"] == "trace-create":
                self.traces.setdefault(inner["id"], {"observations": []}).update(inner)
            elif event["type"] == "score-create":
                if not {"traceId", "name", "value"} <= inner.keys() or inner.get("dataType") not in {
                    None,
                    "NUMERIC",
                    "CATEGORICAL",
                    "BOOLEAN",
                }:
                    errors.append({"id": event["id"], "status": 400, "message": "invalid score"})
                    continue
                self.scores[inner.get("id") or str(uuid.uuid4())] = inner
            else:
                errors.append({"id": event["id"], "status": 400, "message": f"unknown type {event['type']}"})
                continue
            self.event_ids.add(event["id"])
            successes.append({"id": event["id"], "status": 201})
        return web.json_response({"successes": successes, "errors": errors}, status=207)

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/api/public/traces/{trace_id}", self.get_trace)
        app.router.add_get("/api/public/traces", self.list_traces)
        app.router.add_post("/api/public/ingestion", self.ingestion)
        return app


LANGFUSE_SECRETS = SecretStore(environ={"EVALBUS_SECRET_LANGFUSE": "pk-lf-1:sk-lf-2"})


async def test_langfuse_pull_by_id_and_tag(serve: Serve, http: aiohttp.ClientSession, run_id: str) -> None:
    lf = Langfuse("pk-lf-1", "sk-lf-2")
    lf.seed(trace_id_for(run_id), run_id)
    base = await serve(lf.app())
    for correlate in ("id", "tag"):
        ref = TraceRef(kind="langfuse", endpoint=base, run_id=run_id, auth_secret="langfuse", correlate=correlate)
        events = await build_source(ref, LANGFUSE_SECRETS, http).pull(ref)
        kinds = [type(e).__name__ for e in events]
        assert kinds == ["Message", "Span", "LlmCall", "Message", "ToolCall", "ToolResult", "Message"], correlate
        llm = events[2]
        assert (llm.model, llm.input_tokens, llm.output_tokens, llm.cost_usd) == ("gpt-test", 42, 7, 0.0012)  # type: ignore[union-attr]
        assert events[4].args == {"expression": "6*7"}  # type: ignore[union-attr]
        assert events[-1].text == "42"  # type: ignore[union-attr]
    missing = TraceRef(kind="langfuse", endpoint=base, run_id=run_id + "-x", auth_secret="langfuse")
    assert await build_source(missing, LANGFUSE_SECRETS, http).pull(missing) == []
    assert lf.problems == []


async def test_langfuse_export_is_one_trace_and_upserted_scores(
    serve: Serve, http: aiohttp.ClientSession, run_id: str, kit: Any
) -> None:
    lf = Langfuse("pk-lf-1", "sk-lf-2")
    base = await serve(lf.app())
    sink = build_sink(PlatformSink(platform="langfuse", endpoint=base, auth_secret="langfuse"), LANGFUSE_SECRETS, http)
    case = kit.judged(run_id)
    ctx = ExportContext(batch_id="b1")
    [first] = await sink.export(ctx, [case])
    [second] = await sink.export(ctx, [case])
    assert first.status == "ok", first
    assert first.external_id is not None
    assert second == first
    assert list(lf.traces) == [first.external_id]
    assert lf.traces[first.external_id]["metadata"]["evalbus.run_id"] == run_id
    scores = {s["name"]: s for s in lf.scores.values()}
    assert set(scores) == {"answer_match", "judge:quality", "judge:exact", "evalbus.verdict"}
    assert len(lf.scores) == 4  # the second export upserted the same score ids
    assert scores["judge:quality"]["value"] == 0.8
    assert scores["judge:quality"]["comment"] == "correct and short"
    assert scores["evalbus.verdict"] == scores["evalbus.verdict"] | {"value": "pass", "dataType": "CATEGORICAL"}
    assert lf.problems == []

    wrong = SecretStore(environ={"EVALBUS_SECRET_LANGFUSE": "pk-lf-1:wrong"})
    [refused] = await build_sink(
        PlatformSink(platform="langfuse", endpoint=base, auth_secret="langfuse"), wrong, http
    ).export(ctx, [case])
    assert refused.status == "failed"
    assert refused.error is not None
    assert "401" in refused.error
    assert "wrong" not in refused.error  # no secret in an error


class Langsmith:
    """LangSmith's REST API as documented (a subset), with `x-api-key` checked on every request."""

    def __init__(self, key: str) -> None:
        self.key = key
        self.runs: dict[str, dict[str, Any]] = {}
        self.feedback: dict[str, dict[str, Any]] = {}
        self.sessions = {"agents": str(uuid.uuid4())}
        self.problems: list[str] = []
        self.queries: list[dict[str, Any]] = []

    def seed(self, trace_id: str, run_id: str) -> None:
        session = self.sessions["agents"]
        common = {"trace_id": trace_id, "session_id": session}
        self.runs[trace_id] = common | {
            "id": trace_id,
            "name": "agent",
            "run_type": "chain",
            "start_time": "2026-01-02T03:04:05.000000",
            "end_time": "2026-01-02T03:04:06.000000",
            "inputs": {"question": "What is 6*7?"},
            "outputs": {"output": "42"},
            "parent_run_id": None,
            "extra": {"metadata": {"evalbus.run_id": run_id}},
        }
        llm, tool = str(uuid.uuid4()), str(uuid.uuid4())
        self.runs[llm] = common | {
            "id": llm,
            "name": "ChatOpenAI",
            "run_type": "llm",
            "start_time": "2026-01-02T03:04:05.100000",
            "end_time": "2026-01-02T03:04:05.400000",
            "parent_run_id": trace_id,
            "prompt_tokens": 42,
            "completion_tokens": 7,
            "total_cost": "0.0012",
            "inputs": {"messages": []},
            "outputs": {"output": "I will use the calculator."},
            "extra": {"invocation_params": {"model": "gpt-test"}, "metadata": {"ls_model_name": "gpt-test"}},
        }
        self.runs[tool] = common | {
            "id": tool,
            "name": "calculator",
            "run_type": "tool",
            "start_time": "2026-01-02T03:04:05.500000",
            "end_time": "2026-01-02T03:04:05.700000",
            "parent_run_id": trace_id,
            "inputs": {"expression": "6*7"},
            "outputs": {"output": "42"},
            "extra": {},
        }

    def _authorized(self, request: web.Request) -> bool:
        if request.headers.get("x-api-key") != self.key or "Authorization" in request.headers:
            self.problems.append(f"{request.path}: bad auth")
            return False
        return True

    async def query(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"detail": "Invalid token"}, status=401)
        body = await request.json()
        self.queries.append(body)
        runs = list(self.runs.values())
        if "trace" in body:
            runs = [r for r in runs if r.get("trace_id") == body["trace"]]
        if "session" in body:
            runs = [r for r in runs if r.get("session_id") in body["session"]]
        if body.get("is_root"):
            runs = [r for r in runs if not r.get("parent_run_id")]
        if "filter" in body:
            wanted = body["filter"].rsplit('eq(metadata_value, "', 1)[1].split('"')[0]
            runs = [r for r in runs if ((r.get("extra") or {}).get("metadata") or {}).get("evalbus.run_id") == wanted]
        if not ({"trace", "session", "id"} & body.keys()):
            return web.json_response({"detail": "must specify session, trace or id"}, status=400)
        return web.json_response({"runs": runs[: body.get("limit", 100)], "cursors": {"next": None}})

    async def sessions_list(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"detail": "Invalid token"}, status=401)
        name = request.query.get("name")
        return web.json_response([{"id": i, "name": n} for n, i in self.sessions.items() if n == name])

    async def create_run(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"detail": "Invalid token"}, status=401)
        body = await request.json()
        missing = [k for k in ("id", "name", "run_type", "start_time", "trace_id", "dotted_order") if k not in body]
        if missing or body["run_type"] not in {"llm", "chain", "tool", "retriever", "embedding", "prompt", "parser"}:
            self.problems.append(f"run body missing {missing}")
            return web.json_response({"detail": "invalid run"}, status=422)
        if not body["dotted_order"].endswith(body["id"]):
            self.problems.append("dotted_order must end with the run id")
        if body["id"] in self.runs:
            return web.json_response({"detail": "Run already exists"}, status=409)
        self.runs[body["id"]] = body
        return web.json_response({}, status=202)

    async def create_feedback(self, request: web.Request) -> web.Response:
        if not self._authorized(request):
            return web.json_response({"detail": "Invalid token"}, status=401)
        body = await request.json()
        if "key" not in body or not ({"run_id", "trace_id"} & body.keys()):
            self.problems.append("feedback without key/run_id")
            return web.json_response({"detail": "invalid feedback"}, status=422)
        if body.get("id") in self.feedback:
            return web.json_response({"detail": "Feedback already exists"}, status=409)
        self.feedback[body["id"]] = body
        return web.json_response(body | {"created_at": T0, "modified_at": T0})

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_post("/api/v1/runs/query", self.query)
        app.router.add_get("/api/v1/sessions", self.sessions_list)
        app.router.add_post("/api/v1/runs", self.create_run)
        app.router.add_post("/api/v1/feedback", self.create_feedback)
        return app


LANGSMITH_SECRETS = SecretStore(environ={"EVALBUS_SECRET_LANGSMITH": "lsv2_pt_key"})


async def test_langsmith_pull_by_id_and_tag(serve: Serve, http: aiohttp.ClientSession, run_id: str) -> None:
    ls = Langsmith("lsv2_pt_key")
    ls.seed(as_uuid(trace_id_for(run_id)), run_id)
    base = await serve(ls.app())
    for correlate in ("id", "tag"):
        ref = TraceRef(
            kind="langsmith",
            endpoint=base,
            run_id=run_id,
            auth_secret="langsmith",
            correlate=correlate,
            project="agents",
        )
        events = await build_source(ref, LANGSMITH_SECRETS, http).pull(ref)
        kinds = [type(e).__name__ for e in events]
        assert kinds == ["Message", "Span", "LlmCall", "Message", "ToolCall", "ToolResult", "Message"], correlate
        llm = events[2]
        assert (llm.model, llm.input_tokens, llm.output_tokens, llm.cost_usd) == ("gpt-test", 42, 7, 0.0012)  # type: ignore[union-attr]
        assert events[4].args == {"expression": "6*7"}  # type: ignore[union-attr]
        assert events[0].text == "What is 6*7?"  # type: ignore[union-attr]
    assert ls.queries[-1] == {"trace": as_uuid(trace_id_for(run_id)), "limit": 100}
    assert ls.problems == []


async def test_langsmith_export_uses_deterministic_ids(
    serve: Serve, http: aiohttp.ClientSession, run_id: str, kit: Any
) -> None:
    ls = Langsmith("lsv2_pt_key")
    base = await serve(ls.app())
    spec = PlatformSink(platform="langsmith", endpoint=base, auth_secret="langsmith", project="evals")
    sink = build_sink(spec, LANGSMITH_SECRETS, http)
    case = kit.judged(run_id)
    [first] = await sink.export(ExportContext(batch_id="b1"), [case])
    [second] = await sink.export(ExportContext(batch_id="b1"), [case])  # every create now answers 409
    assert first.status == "ok", first
    assert first.external_id is not None
    assert second == first
    assert list(ls.runs) == [first.external_id]
    run = ls.runs[first.external_id]
    assert (run["session_name"], run["run_type"], run["outputs"]) == ("evals", "chain", {"output": "42"})
    assert run["extra"]["metadata"]["evalbus.run_id"] == run_id
    keys = sorted(f["key"] for f in ls.feedback.values())
    assert keys == ["answer_match", "evalbus.verdict", "judge:exact", "judge:quality"]
    assert all(f["run_id"] == first.external_id for f in ls.feedback.values())
    assert ls.problems == []
