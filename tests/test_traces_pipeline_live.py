"""LIVE pipeline tests of trace collection and export, against a real MLflow tracking server and a
real Arize Phoenix server (session fixtures `mlflow_server`, `phoenix_server`).

The services run as real processes on a nats-server of the test's own (`service_stack`): only the
dispatcher, collector, judge and exporter — the gateway is not needed. A test publishes
`batch.requested` with the chassis `Publisher` and reads the batch's `case.*` events back from the
CASES stream (an ordered consumer). The harness is a real OpenTelemetry-instrumented agent
(`tests/traces_pipeline_agent.py`) exporting OTLP spans to the platform; the dispatcher injects
`EVALBUS_RUN_ID` and `OTEL_RESOURCE_ATTRIBUTES=evalbus.run_id=<run>`.

The harness's trace endpoint is a recording proxy (a loopback HTTP server forwarding every request
to the real platform): it timestamps each pull, so a test can prove the pull came after the
sandbox was released, see the auth header that was sent, and hold pulls to kill the collector
while cases are being collected. The agent exports straight to the platform, not through it.

For each platform: (a) `job` mode pulls after release; (b) `control-plane` completion through the
collector, consumed by the judge; (c) a dead endpoint soft-degrades; (d) tag correlation with an
agent minting its own trace id; (e) a judged batch exported to the platform and read back through
its own API. Plus: a missing trace secret is a visible `unmeasured: missing_secret` (never an
unauthenticated pull), and the collector survives SIGKILL mid-batch.
"""

from __future__ import annotations

import asyncio
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Protocol, TypeVar
from urllib.parse import unquote

import aiohttp
import pytest
from aiohttp import web
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg

from evalbus.testing.platforms import PlatformLauncher, PlatformServer
from evalbus.testing.stack import ServiceStack
from evalbus_contracts import (
    AnswerMatchGrader,
    BatchRequested,
    BatchSpec,
    CaseCollected,
    CaseExecuted,
    CaseExported,
    CaseJudged,
    CaseResult,
    CaseSpec,
    CommandHarness,
    CostGrader,
    Error,
    ExactJudge,
    GraderSpec,
    Infra,
    JudgeSpec,
    LatencyGrader,
    LlmCall,
    Measured,
    Message,
    PlatformSink,
    Score,
    SinkSpec,
    StepsGrader,
    SuiteSpec,
    TestsPassGrader,
    ToolCall,
    ToolResult,
    TraceSpec,
    Unmeasured,
    batch_run_id,
    decode_event,
    encode_token,
)
from evalbus_contracts.events import EventBase
from evalbus_contracts.specs import CollectMode, Correlate, PlatformKind
from evalbus_grading.verdict import decide
from evalbus_runtime import Publisher, connect, ensure_topology
from evalbus_traces.ids import export_span_id, export_trace_id, trace_id_for

pytestmark = [pytest.mark.integration, pytest.mark.e2e, pytest.mark.slow]

AGENT = Path(__file__).with_name("traces_pipeline_agent.py")
PLATFORMS = ("mlflow", "phoenix")
WORKERS = ("dispatcher", "collector", "judge", "exporter")
QUESTION = "What is 6*7?"
ANSWER = "42"
BATCH_TIMEOUT_S = 120.0

E = TypeVar("E", bound=EventBase)


# ---------------------------------------------------------------- the batch's events, from the stream


class CaseLog:
    """Every `case.*` event of one batch in stream order, read by an ordered consumer on
    `case.*.<batch>.*` (raw payloads kept, to check that no secret value was published)."""

    def __init__(self, nc: NatsClient, batch_id: str) -> None:
        self._nc = nc
        self.batch_id = batch_id
        self.events: list[EventBase] = []
        self.payloads: list[bytes] = []

    async def start(self) -> None:
        async def on_msg(msg: Msg) -> None:
            self.payloads.append(msg.data)
            self.events.append(decode_event(msg.data))

        subject = f"case.*.{encode_token(self.batch_id)}.*"
        await self._nc.jetstream().subscribe(subject, cb=on_msg, ordered_consumer=True)  # until the bus closes

    def of(self, kind: type[E], case_id: str | None = None) -> list[E]:
        """The events of one type (of one case), in stream order."""
        return [e for e in self.events if isinstance(e, kind) and (case_id is None or e.case_id == case_id)]

    def one(self, kind: type[E], case_id: str = "case-1") -> E:
        """The single event of a type for a case (fails when there are several)."""
        found = self.of(kind, case_id)
        assert len(found) == 1, f"{len(found)} {kind.__name__} for {case_id}: {found}"
        return found[0]

    async def wait(self, done: Callable[[], bool], what: str, timeout_s: float = BATCH_TIMEOUT_S) -> None:
        """Wait for a condition on the events seen so far, with a deadline."""
        deadline = time.monotonic() + timeout_s
        while not done():
            if time.monotonic() > deadline:
                seen = [f"{type(e).__name__}:{e.case_id}" for e in self.events]
                raise AssertionError(f"batch {self.batch_id}: timed out waiting for {what}; saw {seen}")
            await asyncio.sleep(0.05)

    async def wait_exported(self, cases: int, timeout_s: float = BATCH_TIMEOUT_S) -> None:
        """Wait until every case has its `case.exported`."""
        await self.wait(lambda: len(self.of(CaseExported)) >= cases, f"{cases} case.exported", timeout_s)


@dataclass
class Bus:
    """The test's own connection to the stack's nats-server."""

    nc: NatsClient
    publisher: Publisher

    async def submit(self, spec: BatchSpec) -> CaseLog:
        """Publish `batch.requested` for `spec` (fresh batch id); return its event log, already following."""
        batch_id = f"tp-{uuid.uuid4().hex[:12]}"
        log = CaseLog(self.nc, batch_id)
        await log.start()
        await self.publisher.publish_event(BatchRequested(batch_id=batch_id, spec=spec, submitted_by="pipeline-test"))
        return log


# ---------------------------------------------------------------- the recording proxy in front of a platform


@dataclass(frozen=True)
class Pull:
    """One request the proxy forwarded."""

    at: datetime
    method: str
    target: str
    """Path and query string."""
    body: str
    authorization: str | None


@dataclass
class PlatformProxy:
    """A loopback HTTP server forwarding every request to `upstream`, recording each one.

    `hold_after`: once that many requests have been forwarded, later ones wait until `open()`."""

    upstream: str
    http: aiohttp.ClientSession
    hold_after: int | None = None
    pulls: list[Pull] = field(default_factory=list)
    held: int = 0
    _gate: asyncio.Event = field(default_factory=asyncio.Event)
    _runner: web.AppRunner | None = None
    url: str = ""

    async def start(self) -> str:
        app = web.Application()
        app.router.add_route("*", "/{tail:.*}", self._forward)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        self.url = f"http://127.0.0.1:{self._runner.addresses[0][1]}"
        return self.url

    async def stop(self) -> None:
        self._gate.set()
        if self._runner is not None:
            await self._runner.cleanup()

    def open(self) -> None:
        """Let held and later requests through."""
        self._gate.set()

    def pulls_for(self, run_id: str) -> list[Pull]:
        """The requests that named this run (by its run id or its id-correlation trace id)."""
        keys = (run_id, trace_id_for(run_id))
        return [p for p in self.pulls if any(k in p.target or k in p.body for k in keys)]

    async def _forward(self, request: web.Request) -> web.StreamResponse:
        body = await request.read()
        self.pulls.append(
            Pull(
                at=datetime.now(UTC),
                method=request.method,
                target=unquote(str(request.rel_url)),
                body=body.decode(errors="replace"),
                authorization=request.headers.get("Authorization"),
            )
        )
        if self.hold_after is not None and len(self.pulls) > self.hold_after and not self._gate.is_set():
            self.held += 1
            await self._gate.wait()
        headers = {k: v for k, v in request.headers.items() if k.lower() not in {"host", "content-length"}}
        async with self.http.request(
            request.method, self.upstream + str(request.rel_url), headers=headers, data=body or None
        ) as resp:
            payload = await resp.read()
            return web.Response(status=resp.status, body=payload, content_type=resp.content_type)


MakeProxy = Callable[..., Awaitable[PlatformProxy]]
"""`await proxies(upstream, hold_after=None)`."""


# ---------------------------------------------------------------- the two platforms


class Target(Protocol):
    """What a test needs to know about one live platform."""

    name: PlatformKind
    server: PlatformServer

    async def scope(self, http: aiohttp.ClientSession) -> str:
        """A fresh place for the test's traces (an MLflow experiment id, a Phoenix project)."""
        ...

    def export_env(self, scope: str) -> dict[str, str]:
        """The agent's OTLP exporter settings for that place."""
        ...

    def trace(
        self, endpoint: str, scope: str, *, collect: CollectMode, correlate: Correlate = "id", secret: str | None = None
    ) -> TraceSpec:
        """The harness's trace spec (pulled from `endpoint`)."""
        ...

    def sink(self, scope: str) -> PlatformSink:
        """A platform sink exporting into a fresh place."""
        ...

    async def exported(
        self, http: aiohttp.ClientSession, sink: PlatformSink, external_id: str, run_id: str
    ) -> tuple[dict[str, float], str | None]:
        """Scores (metric → value) and verdict of an exported case, read through the platform's API."""
        ...


@dataclass
class MlflowTarget:
    """MLflow: an experiment per test; OTLP needs `x-mlflow-experiment-id`; scores are assessments."""

    server: PlatformServer
    name: PlatformKind = "mlflow"

    async def scope(self, http: aiohttp.ClientSession) -> str:
        body = {"name": f"pipeline-{uuid.uuid4().hex}"}
        async with http.post(f"{self.server.url}/api/2.0/mlflow/experiments/create", json=body) as r:
            assert r.status == 200, await r.text()
            return str((await r.json())["experiment_id"])

    def export_env(self, scope: str) -> dict[str, str]:
        return {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{self.server.url}/v1/traces",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"x-mlflow-experiment-id={scope}",
        }

    def trace(
        self, endpoint: str, scope: str, *, collect: CollectMode, correlate: Correlate = "id", secret: str | None = None
    ) -> TraceSpec:
        return TraceSpec(
            kind="mlflow", endpoint=endpoint, collect=collect, correlate=correlate, experiment=scope, auth_secret=secret
        )

    def sink(self, scope: str) -> PlatformSink:
        return PlatformSink(platform="mlflow", endpoint=self.server.url, experiment=f"export-{scope}")

    async def exported(
        self, http: aiohttp.ClientSession, sink: PlatformSink, external_id: str, run_id: str
    ) -> tuple[dict[str, float], str | None]:
        async with http.get(f"{self.server.url}/api/3.0/mlflow/traces/{external_id}") as r:
            assert r.status == 200, await r.text()
            info = (await r.json())["trace"]["trace_info"]
        assert info["tags"]["evalbus.run_id"] == run_id
        scores = {a["assessment_name"]: float(a["feedback"]["value"]) for a in info.get("assessments", [])}
        return scores, info["tags"].get("evalbus.verdict")


@dataclass
class PhoenixTarget:
    """Phoenix: a project per test (`x-project-name`); scores are span annotations."""

    server: PlatformServer
    name: PlatformKind = "phoenix"

    async def scope(self, http: aiohttp.ClientSession) -> str:
        return f"pipeline-{uuid.uuid4().hex[:12]}"

    def export_env(self, scope: str) -> dict[str, str]:
        return {
            "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT": f"{self.server.url}/v1/traces",
            "OTEL_EXPORTER_OTLP_TRACES_HEADERS": f"x-project-name={scope}",
        }

    def trace(
        self, endpoint: str, scope: str, *, collect: CollectMode, correlate: Correlate = "id", secret: str | None = None
    ) -> TraceSpec:
        return TraceSpec(
            kind="phoenix", endpoint=endpoint, collect=collect, correlate=correlate, project=scope, auth_secret=secret
        )

    def sink(self, scope: str) -> PlatformSink:
        return PlatformSink(platform="phoenix", endpoint=self.server.url, project=f"export-{scope}")

    async def exported(
        self, http: aiohttp.ClientSession, sink: PlatformSink, external_id: str, run_id: str
    ) -> tuple[dict[str, float], str | None]:
        base, project = self.server.url, sink.project
        async with http.get(f"{base}/v1/projects/{project}/spans", params={"trace_id": external_id}) as r:
            assert r.status == 200, await r.text()
            spans = (await r.json())["data"]
        root = next(s for s in spans if s["context"]["span_id"] == export_span_id(run_id))
        assert root["attributes"]["evalbus.run_id"] == run_id
        params = {"span_ids": export_span_id(run_id)}
        async with http.get(f"{base}/v1/projects/{project}/span_annotations", params=params) as r:
            assert r.status == 200, await r.text()
            notes = (await r.json())["data"]
        verdict = next((n["result"]["label"] for n in notes if n["name"] == "evalbus.verdict"), None)
        scores = {n["name"]: float(n["result"]["score"]) for n in notes if n["name"] != "evalbus.verdict"}
        return scores, verdict


def _wanted_platforms(request: pytest.FixtureRequest) -> list[str]:
    """Platforms this session's collected pipeline tests use, so both start in parallel."""
    wanted: set[str] = set()
    for item in request.session.items:
        callspec = getattr(item, "callspec", None)
        if callspec is not None and callspec.params.get("platform") in PLATFORMS:
            wanted.add(callspec.params["platform"])
    return sorted(wanted)


@pytest.fixture
def target(platform: str, platform_launcher: PlatformLauncher, request: pytest.FixtureRequest) -> Target:
    """The live platform of a parametrized test (servers started once per session)."""
    platform_launcher.launch(*_wanted_platforms(request))
    server = platform_launcher.get(platform)
    return MlflowTarget(server) if platform == "mlflow" else PhoenixTarget(server)


# ---------------------------------------------------------------- fixtures: HTTP, the bus, the services


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """An HTTP client for the test (platform APIs, the proxy's upstream calls)."""
    async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=60)) as session:
        yield session


@pytest.fixture
def dead_endpoint() -> Iterator[str]:
    """A loopback URL nothing answers on: its port stays bound (never listening) for the test, so
    connections are refused and no other process can take it meanwhile."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"


@pytest.fixture
async def bus(service_stack: ServiceStack) -> AsyncIterator[Bus]:
    """A connection to the stack's nats-server, with the topology created."""
    nc = await connect(service_stack.nats_url, "pipeline-test")
    await ensure_topology(nc.jetstream())
    publisher = Publisher(nc)
    await publisher.start()
    yield Bus(nc, publisher)
    await publisher.stop()
    await nc.close()


@pytest.fixture
async def proxies(http: aiohttp.ClientSession) -> AsyncIterator[MakeProxy]:
    """`await proxy(upstream, hold_after=None)`: a recording proxy, stopped at the end of the test."""
    started: list[PlatformProxy] = []

    async def make(upstream: str, hold_after: int | None = None) -> PlatformProxy:
        proxy = PlatformProxy(upstream=upstream.rstrip("/"), http=http, hold_after=hold_after)
        await proxy.start()
        started.append(proxy)
        return proxy

    yield make
    for proxy in started:
        await proxy.stop()


async def start_workers(stack: ServiceStack, **service_env: dict[str, str]) -> None:
    """Start dispatcher, collector, judge and exporter (no gateway), one after another.

    Each is ready (its HTTP port bound) before the next picks a free port: started together, two
    services can be handed the same "free" port, and the loser's readiness is then answered by
    the winner."""
    for name in WORKERS:
        stack.service_env[name] = {"LOG_FORMAT": "text", **service_env.get(name, {})}
        await asyncio.to_thread(stack.start, name)


# ---------------------------------------------------------------- specs and assertions


GRADERS: tuple[GraderSpec, ...] = (
    TestsPassGrader(id="tests", command="test -s answer.txt"),
    StepsGrader(id="steps", max_steps=3),
    CostGrader(id="cost"),
    AnswerMatchGrader(id="answer"),
)
OBSERVATION_IDS = ("steps", "cost", "answer")


def batch(
    target: Target,
    scope: str,
    trace: TraceSpec,
    *,
    cases: int = 1,
    judges: tuple[JudgeSpec, ...] = (ExactJudge(id="exact"),),
    sinks: tuple[SinkSpec, ...] = (),
    agent: dict[str, str] | None = None,
) -> BatchSpec:
    """A batch of `cases` copies of the 6*7 case, run by the OTLP agent exporting to `scope`."""
    harness = CommandHarness(
        id="otlp-agent",
        command=(sys.executable, str(AGENT)),
        env={**target.export_env(scope), **(agent or {})},
        timeout_s=60.0,
        trace=trace,
    )
    suite = SuiteSpec(
        id="pipeline",
        cases=tuple(
            CaseSpec(id=f"case-{i}", input=QUESTION, expected=ANSWER, graders=GRADERS) for i in range(1, cases + 1)
        ),
    )
    return BatchSpec(suite=suite, harness=harness, judges=judges, sinks=sinks)


def scores_of(result: CaseResult) -> dict[str, Score]:
    """Scores by grader id."""
    return {s.grader_id: s for s in result.scores}


def measured(result: CaseResult, grader_id: str) -> Measured:
    """The measured score of a grader (fails on anything else)."""
    score = scores_of(result)[grader_id]
    assert isinstance(score, Measured), score
    return score


def assert_agent_trace(trace: Sequence[object], *, with_messages: bool = True) -> None:
    """The platform's events of the agent's spans are in the trace."""
    llm = [e for e in trace if isinstance(e, LlmCall)]
    assert [(c.model, c.input_tokens, c.output_tokens, c.cost_usd) for c in llm] == [("gpt-test", 42, 7, 0.0012)]
    calls = [e for e in trace if isinstance(e, ToolCall)]
    assert [(c.name, c.args) for c in calls] == [("calculator", {"expression": "6*7"})]
    results = [e for e in trace if isinstance(e, ToolResult)]
    assert [(r.id, r.output) for r in results] == [(calls[0].id, ANSWER)]
    messages = [(m.role, m.text) for m in trace if isinstance(m, Message)]
    assert ("user", QUESTION) in messages
    if with_messages:
        assert ("assistant", "I will use the calculator.") in messages


def assert_observations_measured(result: CaseResult) -> None:
    """tests-pass from the sandbox, and the observation graders measured from the pulled trace."""
    assert measured(result, "tests").passed is True
    steps = measured(result, "steps")
    assert (steps.value, steps.passed) == (1.0, True)
    assert measured(result, "cost").value == pytest.approx(0.0012)
    assert measured(result, "answer").passed is True
    assert [s.grader_id for s in result.scores[:4]] == ["tests", "steps", "cost", "answer"]


def marks(result: CaseResult) -> list[str | None]:
    """The infra marks of a trace, in order."""
    return [e.event for e in result.trace if isinstance(e, Infra)]


# ---------------------------------------------------------------- (a) job mode


@pytest.mark.parametrize("platform", PLATFORMS)
async def test_job_mode_pulls_after_release(
    target: Target, service_stack: ServiceStack, bus: Bus, http: aiohttp.ClientSession, proxies: MakeProxy
) -> None:
    """The dispatcher pulls the platform trace after the sandbox is released and grades the
    observation graders from it; the trace secret is resolved at use, sent in the platform's own
    header convention, and never published."""
    secret_name, secret_value = "platform-token", f"tok-{uuid.uuid4().hex}"
    await start_workers(service_stack, dispatcher={"EVALBUS_SECRET_PLATFORM_TOKEN": secret_value})
    scope = await target.scope(http)
    proxy = await proxies(target.server.url)
    log = await bus.submit(batch(target, scope, target.trace(proxy.url, scope, collect="job", secret=secret_name)))
    await log.wait_exported(1)

    executed = log.one(CaseExecuted)
    result = executed.result
    assert executed.status == "succeeded", result.failure
    assert executed.trace_complete is True
    assert executed.deferred_graders == ()
    assert_agent_trace(result.trace)
    assert_observations_measured(result)
    assert marks(result) == ["accepted", "started", "placed", "exited", "released"]

    # The pull happened after the release and before the event was built.
    pulls = proxy.pulls_for(result.run_id)
    assert pulls, proxy.pulls
    queued, released, executed_at = result.timings.queued_at, result.timings.released_at, result.timings.executed_at
    assert queued is not None
    assert released is not None
    assert executed_at is not None
    assert released <= min(p.at for p in pulls) <= executed_at
    assert queued < released

    # Auth at use, in the platform's convention; the value is in no event.
    expected_header = secret_value if target.name == "mlflow" else f"Bearer {secret_value}"
    assert {p.authorization for p in proxy.pulls} == {expected_header}
    assert not any(secret_value.encode() in raw for raw in log.payloads)

    judged = log.one(CaseJudged)
    assert judged.status == "judged"
    assert measured(judged.result, "exact").passed is True
    assert log.one(CaseExported).status == "skipped"  # no sink in this batch
    assert log.of(CaseCollected) == []  # nothing was left to the collector


# ---------------------------------------------------------------- (b) control-plane completion


@pytest.mark.parametrize("platform", PLATFORMS)
async def test_control_plane_completion_through_the_collector(
    target: Target, service_stack: ServiceStack, bus: Bus, http: aiohttp.ClientSession, proxies: MakeProxy
) -> None:
    """`case.executed` leaves the trace to the collector; `case.collected` carries the pulled
    events, the deferred graders' scores and the final answer as the trace's assistant message
    (the agent's spans carry none); the judge consumes `case.collected`."""
    await start_workers(service_stack, collector={"COLLECTOR_EMPTY_PULL_DELAY_S": "0.5"})
    scope = await target.scope(http)
    proxy = await proxies(target.server.url)
    trace = target.trace(proxy.url, scope, collect="control-plane")
    log = await bus.submit(batch(target, scope, trace, agent={"AGENT_MESSAGES": "0"}))
    await log.wait_exported(1)

    executed = log.one(CaseExecuted)
    assert executed.status == "succeeded", executed.result.failure
    assert executed.trace_complete is False
    assert executed.deferred_graders == OBSERVATION_IDS
    ref = executed.result.trace_ref
    assert ref is not None
    assert (ref.kind, ref.endpoint, ref.run_id) == (target.name, proxy.url, executed.result.run_id)
    assert [s.grader_id for s in executed.result.scores] == ["tests"]  # only the sandbox's grader
    assert not any(isinstance(e, LlmCall | ToolCall) for e in executed.result.trace)
    released = executed.result.timings.released_at
    assert released is not None
    assert released <= min(p.at for p in proxy.pulls_for(ref.run_id))

    collected = log.one(CaseCollected)
    assert_agent_trace(collected.result.trace, with_messages=False)
    assert_observations_measured(collected.result)
    last = [e for e in collected.result.trace if isinstance(e, Message)][-1]
    assert (last.role, last.text) == ("assistant", ANSWER)  # appended by the collector
    assert last.t >= max(e.t for e in collected.result.trace if not isinstance(e, Message))
    assert marks(collected.result) == ["accepted", "started", "placed", "exited", "released"]

    # The judge consumed case.collected: its result is the completed one, plus the judge's score.
    judged = log.one(CaseJudged)
    assert judged.status == "judged"
    assert judged.result.trace == collected.result.trace
    assert judged.result.scores[: len(collected.result.scores)] == collected.result.scores
    assert measured(judged.result, "exact").passed is True
    assert log.events.index(judged) > log.events.index(collected)
    log.one(CaseExported)


# ---------------------------------------------------------------- (c) a dead endpoint


@pytest.mark.parametrize("platform", PLATFORMS)
async def test_dead_endpoint_soft_degrades(
    target: Target, service_stack: ServiceStack, bus: Bus, http: aiohttp.ClientSession, dead_endpoint: str
) -> None:
    """With the trace endpoint down, both collect modes keep tests-pass (and the verdict it
    decides), record an `error` trace event, and still take the case to `case.exported`."""
    await start_workers(service_stack, collector={"COLLECTOR_RETRY_DELAY_S": "0.2"})
    scope = await target.scope(http)
    dead = dead_endpoint
    job = await bus.submit(batch(target, scope, target.trace(dead, scope, collect="job")))
    cp = await bus.submit(batch(target, scope, target.trace(dead, scope, collect="control-plane")))
    await asyncio.gather(job.wait_exported(1), cp.wait_exported(1))

    # job mode: a retryable collect failure that keeps the trace reference and the ground truth.
    executed = job.one(CaseExecuted)
    failure = executed.result.failure
    assert failure is not None
    assert (failure.stage, failure.failure_class, failure.code, failure.retryable) == (
        "collect",
        "infra",
        "collect_failed",
        True,
    )
    assert executed.result.trace_ref is not None
    assert executed.attempt == 1  # never re-executed: the sandbox's scores stand
    assert measured(executed.result, "tests").passed is True
    for grader_id in OBSERVATION_IDS:
        score = scores_of(executed.result)[grader_id]
        assert isinstance(score, Unmeasured)
        assert (score.reason, score.retryable) == ("missing_evidence", True)
    errors = [e for e in executed.result.trace if isinstance(e, Error)]
    assert any(dead in e.message for e in errors), executed.result.trace
    judged = job.one(CaseJudged)
    assert judged.status == "judged"
    assert decide(judged.result.scores, failure=judged.result.failure).outcome == "pass"
    job.one(CaseExported)

    # control-plane: the collector soft-degrades after its retries.
    cp_exec = cp.one(CaseExecuted)
    assert (cp_exec.status, cp_exec.trace_complete) == ("succeeded", False)
    collected = cp.one(CaseCollected)
    errors = [e for e in collected.result.trace if isinstance(e, Error)]
    assert any(dead in e.message for e in errors), collected.result.trace
    assert collected.result.failure is None
    assert measured(collected.result, "tests").passed is True
    assert measured(collected.result, "answer").passed is True
    assert not any(isinstance(e, LlmCall) for e in collected.result.trace)
    cp_judged = cp.one(CaseJudged)
    assert decide(cp_judged.result.scores).outcome == "pass"
    cp.one(CaseExported)


# ---------------------------------------------------------------- (d) tag correlation


@pytest.mark.parametrize("platform", PLATFORMS)
async def test_tag_correlation_with_an_agent_minted_trace_id(
    target: Target, service_stack: ServiceStack, bus: Bus, http: aiohttp.ClientSession
) -> None:
    """The agent mints its own trace id and only carries the run id as an attribute; both collect
    modes find its trace by searching for that tag."""
    await start_workers(service_stack, collector={"COLLECTOR_EMPTY_PULL_DELAY_S": "0.5"})
    scope = await target.scope(http)
    url = target.server.url
    agent = {"AGENT_TRACE_ID": "random"}
    job = await bus.submit(batch(target, scope, target.trace(url, scope, collect="job", correlate="tag"), agent=agent))
    cp = await bus.submit(
        batch(target, scope, target.trace(url, scope, collect="control-plane", correlate="tag"), agent=agent)
    )
    await asyncio.gather(job.wait_exported(1), cp.wait_exported(1))

    for result in (job.one(CaseExecuted).result, cp.one(CaseCollected).result):
        assert result.failure is None
        assert result.trace_ref is not None
        assert result.trace_ref.correlate == "tag"
        assert_agent_trace(result.trace)
        assert_observations_measured(result)
        # the trace the agent minted is not the one id correlation would derive
        assert all(trace_id_for(result.run_id) not in (e.span_id or "") for e in result.trace)


# ---------------------------------------------------------------- (e) export


@pytest.mark.parametrize("platform", PLATFORMS)
async def test_judged_batch_is_exported_and_read_back(
    target: Target, service_stack: ServiceStack, bus: Bus, http: aiohttp.ClientSession
) -> None:
    """A batch with a platform sink: every judged case lands on the platform with its grader and
    judge scores and its verdict, as the platform's own API reads them back."""
    await start_workers(service_stack)
    scope = await target.scope(http)
    sink = target.sink(scope)
    trace = target.trace(target.server.url, scope, collect="job")
    log = await bus.submit(batch(target, scope, trace, cases=2, sinks=(sink,)))
    await log.wait_exported(2)

    for case_id in ("case-1", "case-2"):
        exported = log.one(CaseExported, case_id)
        assert exported.status == "exported", exported.outcomes
        [outcome] = exported.outcomes
        assert (outcome.sink, outcome.status) == (target.name, "ok")
        run_id = batch_run_id(log.batch_id, case_id)
        assert outcome.external_id is not None
        assert outcome.external_id.removeprefix("tr-") == export_trace_id(run_id)
        assert outcome.url is not None
        assert outcome.url.startswith(target.server.url)

        scores, verdict = await target.exported(http, sink, outcome.external_id, run_id)
        assert scores == {
            "tests_pass": 1.0,
            "tool_calls": 1.0,
            "cost_usd": pytest.approx(0.0012),
            "answer_match": 1.0,
            "judge:exact": 1.0,
        }
        assert verdict == "pass"


# ---------------------------------------------------------------- a missing trace secret


@pytest.mark.parametrize("platform", ["mlflow"])
async def test_missing_trace_secret_is_unmeasured_and_never_pulled(
    target: Target, service_stack: ServiceStack, bus: Bus, http: aiohttp.ClientSession, proxies: MakeProxy
) -> None:
    """A trace spec naming a secret the services do not hold: in both collect modes the
    observation graders are `unmeasured: missing_secret`, the trace says which secret, nothing is
    pulled (no unauthenticated request reaches the platform), and the ground truth stands."""
    secret = f"absent-{uuid.uuid4().hex[:8]}"
    await start_workers(service_stack)
    scope = await target.scope(http)
    proxy = await proxies(target.server.url)
    job = await bus.submit(batch(target, scope, target.trace(proxy.url, scope, collect="job", secret=secret)))
    cp = await bus.submit(batch(target, scope, target.trace(proxy.url, scope, collect="control-plane", secret=secret)))
    await asyncio.gather(job.wait_exported(1), cp.wait_exported(1))

    executed = job.one(CaseExecuted)
    assert (executed.status, executed.result.failure, executed.trace_complete) == ("succeeded", None, True)
    collected = cp.one(CaseCollected)
    for result in (executed.result, collected.result):
        assert measured(result, "tests").passed is True
        for grader_id in OBSERVATION_IDS:
            score = scores_of(result)[grader_id]
            assert isinstance(score, Unmeasured), score
            assert (score.reason, score.retryable) == ("missing_secret", False)
            assert score.detail is not None
            assert secret in score.detail
        assert any(isinstance(e, Error) and secret in e.message for e in result.trace), result.trace
        assert [m.text for m in result.trace if isinstance(m, Message) and m.role == "assistant"] == [ANSWER]
    for log in (job, cp):
        judged = log.one(CaseJudged)
        assert decide(judged.result.scores, failure=judged.result.failure).outcome == "pass"
        log.one(CaseExported)
    assert proxy.pulls == []  # never an unauthenticated pull


# ---------------------------------------------------------------- the collector killed mid-batch


@pytest.mark.parametrize("platform", ["mlflow"])
async def test_collector_survives_sigkill_mid_batch(
    target: Target, service_stack: ServiceStack, bus: Bus, http: aiohttp.ClientSession, proxies: MakeProxy
) -> None:
    """Six control-plane cases; the proxy lets two pulls through and holds the rest, so the
    collector is SIGKILLed with cases collected, cases in the middle of their pull and cases not
    yet delivered. Restarted, it completes them all: one `case.collected` per case in the stream
    (with the platform's events, not a degraded trace), and every case reaches `case.exported`."""
    cases = 6
    await start_workers(service_stack)
    scope = await target.scope(http)
    proxy = await proxies(target.server.url, hold_after=2)
    log = await bus.submit(batch(target, scope, target.trace(proxy.url, scope, collect="control-plane"), cases=cases))
    await log.wait(lambda: len(log.of(CaseCollected)) == 2 and proxy.held >= 2, "2 collected, 2 pulls held")
    in_flight = {p.target for p in proxy.pulls[2:]}
    await asyncio.to_thread(service_stack.kill, "collector")
    proxy.open()
    await asyncio.to_thread(service_stack.start, "collector")
    await log.wait_exported(cases, timeout_s=150.0)

    run_ids = {batch_run_id(log.batch_id, f"case-{i}") for i in range(1, cases + 1)}
    for i in range(1, cases + 1):
        case_id = f"case-{i}"
        collected = log.one(CaseCollected, case_id)  # exactly one, though some were pulled twice
        assert_agent_trace(collected.result.trace)
        assert_observations_measured(collected.result)
        assert not any(isinstance(e, Error) for e in collected.result.trace)
        log.one(CaseJudged, case_id)
        log.one(CaseExported, case_id)
    assert {e.run_id for e in log.of(CaseCollected)} == run_ids
    # the pulls in flight at the kill were made again by the restarted collector
    repeated = [r for r in run_ids if len(proxy.pulls_for(r)) > 1]
    assert len(repeated) >= 2, [p.target for p in proxy.pulls]
    assert all(any(trace_id_for(r) in t for r in repeated) for t in in_flight)


# ---------------------------------------------------------------- the example agent's own OTLP export

EXAMPLE_AGENT = Path(__file__).resolve().parents[1] / "examples" / "agent.py"


@pytest.mark.parametrize("platform", PLATFORMS)
async def test_example_agent_exports_its_trace(
    target: Target, service_stack: ServiceStack, bus: Bus, http: aiohttp.ClientSession
) -> None:
    """`examples/agent.py` with the standard OTLP variables set: its spans reach the platform under
    the run's id, and the pulled trace alone describes the run once (no step counted twice)."""
    await start_workers(service_stack)
    scope = await target.scope(http)
    env = target.export_env(scope)
    harness = CommandHarness(
        id="demo-agent",
        command=(sys.executable, str(EXAMPLE_AGENT)),
        env={
            "OTEL_EXPORTER_OTLP_ENDPOINT": target.server.url,
            "OTEL_EXPORTER_OTLP_HEADERS": env["OTEL_EXPORTER_OTLP_TRACES_HEADERS"],
        },
        timeout_s=60.0,
        trace=target.trace(target.server.url, scope, collect="job"),
    )
    graders: tuple[GraderSpec, ...] = (
        AnswerMatchGrader(id="answer"),
        StepsGrader(id="steps", max_steps=3),
        CostGrader(id="cost"),
        LatencyGrader(id="latency"),
    )
    case = CaseSpec(id="case-1", input="What is 17 * 23?", expected="391", graders=graders)
    log = await bus.submit(BatchSpec(suite=SuiteSpec(id="demo", cases=(case,)), harness=harness))
    await log.wait_exported(1)

    result = log.one(CaseExecuted).result
    assert result.failure is None, result.failure
    assert not any(isinstance(e, Error) for e in result.trace), result.trace
    llm = [e for e in result.trace if isinstance(e, LlmCall)]
    assert len(llm) == 1
    assert llm[0].model == "demo-planner-1"
    assert llm[0].span_id is not None  # from the platform, not a printed line
    calls = [e for e in result.trace if isinstance(e, ToolCall)]
    assert [(c.name, c.args, c.span_id is not None) for c in calls] == [("calculator", {"expression": "17 * 23"}, True)]
    outputs = [r.output for r in result.trace if isinstance(r, ToolResult)]
    assert outputs == ["391.0"]
    assert measured(result, "answer").passed is True
    assert measured(result, "steps").value == 1.0
    assert measured(result, "cost").value == llm[0].cost_usd
    assert measured(result, "latency").value > 0.0
