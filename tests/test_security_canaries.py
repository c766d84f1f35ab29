"""Secrets stay secret, end to end through the real services.

One batch names a secret in each place a spec can — the harness's `secret_env`, its trace spec's
`auth_secret` (an OpenTelemetry/Jaeger trace store the collector pulls from), a model judge's
`api_key_secret` (a chat-completions endpoint) and a sink's `auth_secret` (an OTLP endpoint) —
each with a known random canary value, given to every service as `EVALBUS_SECRET_<NAME>`. The
platforms are one local server that checks each request carries its canary (so the secrets were
really resolved and sent) and then tries to make the services repeat it: the judge's verdict
quotes the key it was called with, and the OTLP endpoint refuses one case quoting its token, as
careless providers do, and the trace store refuses one case's trace the same way. The trace is
pulled by the collector (`control-plane`) in one run of the module and by the dispatcher (`job`)
in the other. The harness prints its own secret on stdout and stderr, in a trace event and in its
answer.

Afterwards every place evalbus keeps or shows anything is searched for every canary: every message
of every JetStream stream (CASES, LIVE, OBSERVATIONS, DLQ and the KV/object buckets, headers and
payloads, raw and JSON-decoded), every row of every event-store table (as text, jsonb decoded),
every service's log file, the jsonl export, and the API's answers about the batch and its runs
(reads, trajectories, live reads, placement, the batch's event stream): 0 hits. What the harness
printed comes back masked (`[redacted]`).

The harness's environment is built from an allow-list (`test_the_harness_environment_is_an_allow_list`):
it dumps what it sees and tries every value as a bearer token on the gateway.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path

import aiohttp
import msgspec
import pytest
from aiohttp import web

from evalbus.testing.pipeline import REPO_ROOT, Pipeline, open_pipeline
from evalbus_contracts import (
    BatchSpec,
    CaseSpec,
    CommandGrader,
    CommandHarness,
    JsonlSink,
    Measured,
    ModelJudge,
    PlatformSink,
    SuiteSpec,
    TraceSpec,
)
from evalbus_contracts.specs import CollectMode
from evalbus_gateway.api.auth import ADMIN_PRINCIPAL
from evalbus_gateway.api.routes import idempotent_batch_id
from evalbus_runtime.secrets import env_name
from evalbus_traces.ids import trace_id_for

pytestmark = pytest.mark.e2e

AGENT = REPO_ROOT / "tests" / "harnesses" / "secrets_agent.py"
HARNESS_SECRET, TRACE_SECRET, JUDGE_SECRET, SINK_SECRET = (
    "canary-harness",
    "canary-trace",
    "canary-judge",
    "canary-sink",
)
UNNAMED_SECRET = "canary-unnamed"
"""A secret the dispatcher holds that no spec names: the harness must never see it."""
CANARIES = {name: f"cnry{name.split('-')[1]}{uuid.uuid4().hex}" for name in (
    HARNESS_SECRET, TRACE_SECRET, JUDGE_SECRET, SINK_SECRET, UNNAMED_SECRET
)}  # fmt: skip
"""Secret name → its value for this run (random, so a hit can only come from this test)."""
CASES = ("c1", "c2")
REFUSED_CASE = "c2"
"""The case whose export the OTLP endpoint refuses, quoting the token it got."""


# ---------------------------------------------------------------- the platforms


@dataclass
class Platforms:
    """A Jaeger-style trace store, a chat-completions endpoint and an OTLP/HTTP receiver on one
    loopback port, each requiring its canary."""

    url: str = ""
    seen: dict[str, list[str]] = field(default_factory=lambda: {"trace": [], "judge": [], "sink": []})
    """The credential each endpoint received, per request."""
    refused: int = 0
    refused_traces: set[str] = field(default_factory=set)
    """Trace ids whose pull is refused, quoting the token (the refused case's runs)."""

    async def jaeger(self, request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        self.seen["trace"].append(auth)
        if auth != CANARIES[TRACE_SECRET]:
            return web.json_response({"errors": [{"msg": "unauthorized"}]}, status=401)
        trace_id = request.match_info["trace_id"]
        if trace_id in self.refused_traces:
            return web.json_response({"errors": [{"msg": f"token {auth} may not read this trace"}]}, status=403)
        span = {
            "traceID": trace_id,
            "spanID": "00f067aa0ba902b7",
            "operationName": "search",
            "references": [],
            "startTime": 1_700_000_000_000_000,
            "duration": 1000,
            "tags": [
                {"key": "gen_ai.tool.name", "type": "string", "value": "search"},
                {"key": "gen_ai.tool.call.result", "type": "string", "value": "42"},
            ],
            "processID": "p1",
        }
        return web.json_response({"data": [{"traceID": trace_id, "spans": [span], "processes": {}}]})

    async def chat(self, request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        self.seen["judge"].append(auth)
        if auth != f"Bearer {CANARIES[JUDGE_SECRET]}":
            return web.json_response({"error": {"message": f"Incorrect API key provided: {auth}"}}, status=401)
        verdict = {"score": 1.0, "pass": True, "reasoning": f"fine; you called me with {auth}"}
        return web.json_response(
            {
                "id": "chatcmpl-canary",
                "object": "chat.completion",
                "model": "judge-model",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": json.dumps(verdict)}}],
            }
        )

    async def otlp(self, request: web.Request) -> web.StreamResponse:
        auth = request.headers.get("Authorization", "")
        self.seen["sink"].append(auth)
        body = await request.read()
        if auth != CANARIES[SINK_SECRET]:
            return web.json_response({"error": "unauthorized"}, status=401)
        if f"-{REFUSED_CASE}".encode() in body:
            self.refused += 1
            return web.Response(status=403, text=f"token {auth} may not write to this project")
        return web.json_response({})


@pytest.fixture(scope="module")
async def platforms() -> AsyncIterator[Platforms]:
    found = Platforms()
    app = web.Application()
    app.router.add_get("/api/traces/{trace_id}", found.jaeger)
    app.router.add_post("/v1/chat/completions", found.chat)
    app.router.add_post("/v1/traces", found.otlp)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    found.url = f"http://127.0.0.1:{port}"
    yield found
    await runner.cleanup()


# ---------------------------------------------------------------- the batch


@dataclass
class Outcome:
    """What the test kept of the batch."""

    pipeline: Pipeline
    batch_id: str
    workdir: Path
    dumps: dict[str, Path]
    collect: CollectMode


def spec(
    platforms: Platforms, gateway_url: str, dumps: dict[str, Path], exports: Path, collect: CollectMode
) -> BatchSpec:
    harness = CommandHarness(
        id="secrets-agent",
        command=(sys.executable, str(AGENT)),
        env={"PIPELINE_GATEWAY_URL": gateway_url},
        secret_env={"AGENT_TOKEN": HARNESS_SECRET},
        timeout_s=60,
        trace=TraceSpec(kind="otel", endpoint=platforms.url, collect=collect, auth_secret=TRACE_SECRET),
    )
    cases = tuple(
        CaseSpec(
            id=case,
            input=json.dumps({"secret_var": "AGENT_TOKEN", "dump": str(dumps[case])}),
            graders=(CommandGrader(id="env", command=f"env > {dumps[case]}.grader"),),
        )
        for case in CASES
    )
    return BatchSpec(
        suite=SuiteSpec(id="canaries", cases=cases),
        harness=harness,
        judges=(
            ModelJudge(
                id="quality",
                base_url=f"{platforms.url}/v1",
                model="judge-model",
                api_key_secret=JUDGE_SECRET,
                rubric="Is the answer fine?",
                timeout_s=10,
                max_retries=0,
            ),
        ),
        sinks=(
            JsonlSink(path=str(exports / "{batch}.jsonl")),
            PlatformSink(platform="otel", endpoint=platforms.url, auth_secret=SINK_SECRET),
        ),
    )


@pytest.fixture(scope="module", params=["control-plane", "job"])
async def outcome(
    request: pytest.FixtureRequest, pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory, platforms: Platforms
) -> AsyncIterator[Outcome]:
    """The batch, its trace pulled by the collector (`control-plane`) or by the dispatcher (`job`)."""
    collect: CollectMode = request.param
    workdir = tmp_path_factory.mktemp(f"canaries-{collect}")
    secrets = {env_name(name): value for name, value in CANARIES.items()}
    env = {**secrets, "JUDGE_ALLOWED_BASE_URLS": f"{platforms.url}/v1"}
    async with open_pipeline(pg_admin_url, workdir, env=env) as p:
        dumps = {case: workdir / f"env-{case}.json" for case in CASES}
        key = f"canaries-{uuid.uuid4().hex}"
        batch_id = idempotent_batch_id(ADMIN_PRINCIPAL, key)  # known before it runs: its refused trace too
        platforms.refused_traces.add(trace_id_for(f"evb-{batch_id}-{REFUSED_CASE}"))
        accepted = await p.gw.submit(
            spec(platforms, p.stack.gateway_url, dumps, workdir / "exports", collect), idempotency_key=key
        )
        assert accepted.batch_id == batch_id
        await p.finalized(batch_id)
        await p.quiescent()
        yield Outcome(pipeline=p, batch_id=batch_id, workdir=workdir, dumps=dumps, collect=collect)


# ---------------------------------------------------------------- where to look


def hits(text: str | bytes, where: str) -> list[str]:
    """`where` for every canary that `text` holds."""
    data = text.encode("utf-8", "surrogateescape") if isinstance(text, str) else text
    return [f"{name} in {where}" for name, value in CANARIES.items() if value.encode() in data]


def decoded(data: bytes) -> str:
    """A payload as JSON text with every string unescaped (so `\\u0063…` hides nothing)."""
    try:
        return json.dumps(json.loads(data), ensure_ascii=False)
    except ValueError:
        return ""


async def stream_hits(p: Pipeline) -> tuple[list[str], dict[str, int]]:
    js = p.nc.jetstream()
    out: list[str] = []
    counts: dict[str, int] = {}
    for info in await js.streams_info():
        name = str(info.config.name)
        last = info.state.last_seq
        counts[name] = 0
        if not info.state.messages:
            continue
        sub = await js.subscribe(">", stream=name, ordered_consumer=True)
        try:
            while True:
                msg = await sub.next_msg(timeout=10)
                counts[name] += 1
                where = f"{name} #{msg.metadata.sequence.stream} {msg.subject}"
                out += hits(msg.data, where) + hits(decoded(msg.data), where + " (decoded)")
                out += hits(json.dumps(msg.headers or {}), where + " headers")
                if msg.metadata.sequence.stream >= last:
                    break
        finally:
            await sub.unsubscribe()
    return out, counts


async def store_hits(p: Pipeline) -> tuple[list[str], dict[str, int]]:
    tables = [
        r["table_name"]
        for r in await p.pool.fetch(
            "SELECT table_name FROM information_schema.tables WHERE table_schema = 'public' AND table_type = 'BASE TABLE'"
        )
    ]
    out: list[str] = []
    counts: dict[str, int] = {}
    for table in tables:
        rows = await p.pool.fetch(f'SELECT t::text AS row FROM "{table}" t')  # noqa: S608 - names from the catalog
        counts[table] = len(rows)
        for i, row in enumerate(rows):
            out += hits(row["row"], f"table {table} row {i}")
    return out, counts


async def api_answers(p: Pipeline, batch_id: str) -> dict[str, bytes]:
    """Every read of the batch and its runs, as the admin sees them."""
    base = p.stack.gateway_url
    paths = [
        f"/v1/batches/{batch_id}",
        f"/v1/batches/{batch_id}/cases",
        "/v1/batches",
        f"/v1/batches/{batch_id}/events",
    ]
    for case in CASES:
        run = f"/v1/runs/evb-{batch_id}-{case}"
        paths += [run, f"{run}/trajectory", f"{run}/logs", f"{run}/logs/stream", f"{run}/trajectory/live"]
        paths += [f"{run}/trajectory/live/stream", f"{run}/placement"]
    out: dict[str, bytes] = {}
    async with aiohttp.ClientSession(headers=p.stack.headers(), timeout=aiohttp.ClientTimeout(total=60)) as http:
        for path in paths:
            async with http.get(base + path) as resp:
                assert resp.status == 200, (path, resp.status, await resp.text())
                out[path] = await resp.read()  # the streams end by themselves: the batch is finalized
    return out


# ---------------------------------------------------------------- the tests


async def test_the_secrets_were_resolved_and_sent(outcome: Outcome, platforms: Platforms) -> None:
    """Not vacuous: each platform got its own canary, the harness read its own, and the batch
    went through every stage (judged by the model judge, exported, one export refused)."""
    p = outcome.pipeline
    assert CANARIES[TRACE_SECRET] in platforms.seen["trace"]
    assert f"Bearer {CANARIES[JUDGE_SECRET]}" in platforms.seen["judge"]
    assert CANARIES[SINK_SECRET] in platforms.seen["sink"]
    if outcome.collect == "control-plane":  # in `job` mode the refused case fails before its export
        assert platforms.refused >= 1
    runs = await p.runs(outcome.batch_id)
    assert set(runs) == set(CASES)
    for case, run in runs.items():
        if outcome.collect == "job" and case == REFUSED_CASE:
            # The dispatcher fails a run whose trace pull is refused (the collector soft-degrades it
            # instead); either way the store's quote of the token is masked.
            assert run.executed_status == "failed", run
            assert run.failure is not None, run
            assert run.failure.code == "collect_failed", run.failure
            assert "token [redacted] may not read this trace" in run.failure.message, run.failure
            continue
        assert run.executed_status == "succeeded", run
        assert run.judged_status == "judged", run
        judge = next(s for s in run.scores if s.metric == "judge:quality")
        assert isinstance(judge, Measured), judge
        assert any(o.sink == "jsonl" and o.status == "ok" for o in run.export_outcomes), run.export_outcomes
        otlp = next(o for o in run.export_outcomes if o.sink == "otel")
        assert otlp.status == ("failed" if case == REFUSED_CASE else "ok"), otlp
        if case == REFUSED_CASE:  # the platform's quote of the token, masked (it was stored verbatim)
            assert "token [redacted] may not write" in (otlp.error or ""), otlp
        assert "you called me with Bearer ***" in (judge.detail or ""), judge  # the judge masks as `***`
    for dump in outcome.dumps.values():
        assert json.loads(dump.read_text())["env"]["AGENT_TOKEN"] == CANARIES[HARNESS_SECRET]


async def test_no_canary_anywhere_evalbus_keeps_or_shows_anything(outcome: Outcome) -> None:
    p, batch_id = outcome.pipeline, outcome.batch_id
    found, streams = await stream_hits(p)
    assert streams.get("CASES", 0) > 0, streams
    assert streams.get("LIVE", 0) > 0, streams
    rows, tables = await store_hits(p)
    assert tables.get("events", 0) > 0, tables
    assert tables.get("seals", 0) > 0, tables
    found += rows
    logs = sorted(outcome.workdir.glob("*.log"))
    assert {log.name.split("-")[0] for log in logs} >= {"gateway", "dispatcher", "collector", "judge", "exporter"}
    for log in logs:
        found += hits(log.read_bytes(), f"log {log.name}")
    exports = sorted((outcome.workdir / "exports").glob("*.jsonl"))
    assert [e.name for e in exports] == [f"{batch_id}.jsonl"]
    found += hits(exports[0].read_bytes(), "the jsonl export")
    answers = await api_answers(p, batch_id)
    for path, body in answers.items():
        found += hits(body, f"GET {path}")
    assert found == [], "\n".join(found)


async def test_what_the_harness_printed_comes_back_masked(outcome: Outcome) -> None:
    p, batch_id = outcome.pipeline, outcome.batch_id
    run_id = f"evb-{batch_id}-c1"
    logs = await p.gw.logs(run_id)
    assert "my token is [redacted]" in logs.text, logs.text
    assert "stderr also sees [redacted]" in logs.text, logs.text
    run = await p.gw.run(run_id)
    assert run.answer == "done ([redacted])", run.answer
    trajectory = msgspec.json.encode(await p.gw.trajectory(run_id))
    assert b"thinking with [redacted]" in trajectory
    refused = msgspec.json.encode(await p.gw.trajectory(f"evb-{batch_id}-{REFUSED_CASE}"))
    assert b"token [redacted] may not read this trace" in refused  # the store's quote, in the error event


# ---------------------------------------------------------------- the harness's environment


HARNESS_VARIABLES = {
    "EVALBUS_RUN_ID",
    "EVALBUS_CASE_ID",
    "EVALBUS_BATCH_ID",
    "EVALBUS_TRIAL",
    "EVALBUS_ATTEMPT",
    "EVALBUS_INPUT_FILE",
    "OTEL_RESOURCE_ATTRIBUTES",
}
"""What evalbus itself sets (docs/harness.md)."""
INHERITED = {
    "PATH",
    "HOME",
    "USER",
    "LOGNAME",
    "SHELL",
    "LANG",
    "LANGUAGE",
    "LC_ALL",
    "LC_CTYPE",
    "TZ",
    "TMPDIR",
    "TERM",
}
"""What a harness may inherit from the dispatcher's environment."""


def env_file(path: Path) -> dict[str, str]:
    """The variables `env` wrote to `path`."""
    return dict(line.split("=", 1) for line in path.read_text().splitlines() if "=" in line)


async def test_the_harness_environment_is_an_allow_list(outcome: Outcome) -> None:
    """The harness sees evalbus's variables, the few inherited ones, its plain `env` and the one
    secret it named — no `DATABASE_URL`, no NATS URL or credentials, no `GATEWAY_ADMIN_TOKEN`, no
    `EVALBUS_SECRET_*`, no value of a secret it did not name — and none of what it sees makes the
    gateway answer it (every value tried as a bearer token: 401). A sandbox grader's command sees
    the same minus the secret."""
    services = outcome.pipeline.stack
    for case, path in outcome.dumps.items():
        seen = json.loads(path.read_text())
        env: dict[str, str] = seen["env"]
        allowed = HARNESS_VARIABLES | INHERITED | {"PIPELINE_GATEWAY_URL", "AGENT_TOKEN"}
        assert set(env) <= allowed, f"{case}: not on the allow-list: {sorted(set(env) - allowed)}"
        for forbidden in ("DATABASE_URL", "NATS_URL", "GATEWAY_ADMIN_TOKEN"):
            assert forbidden not in env, case
        assert not [k for k in env if k.startswith("EVALBUS_SECRET_") or "NATS" in k or "PG" in k], env
        values = "\n".join(env.values())
        for name, value in CANARIES.items():
            assert (value in values) == (name == HARNESS_SECRET), f"{case} sees {name}"
        for leaked in (services.admin_token, services.database_url, services.nats_url):
            assert leaked not in values, case
        tries: dict[str, int] = seen["gateway"]
        assert tries["none"] == 401, tries
        assert all(status in (401, 0) for status in tries.values()), tries
        # A sandbox grader's command runs in the same sandbox without even the named secret.
        grader = env_file(Path(f"{path}.grader"))
        shell = {"PWD", "OLDPWD", "SHLVL", "_"}  # what `sh -c` sets itself
        assert set(grader) <= (allowed - {"AGENT_TOKEN"}) | shell, sorted(set(grader) - allowed - shell)
        assert not [name for name, value in CANARIES.items() if value in "\n".join(grader.values())], case
