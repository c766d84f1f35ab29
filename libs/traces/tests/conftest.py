"""Fixtures for the trace-platform tests: the live MLflow / Phoenix servers, an empty secret
store, an HTTP client session, local aiohttp servers on free loopback ports, and `kit` — the
OTLP agent subprocess, a judged case and the expected mapping of the agent's spans (tests run in
importlib mode, so shared helpers reach them as a fixture)."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from evalbus_contracts.results import CaseResult, CaseTimings
from evalbus_contracts.scores import Measured, Unmeasured
from evalbus_contracts.specs import CaseSpec
from evalbus_contracts.trace import LlmCall, Message, ToolCall, ToolResult, TraceEvent
from evalbus_runtime.secrets import SecretStore
from evalbus_traces.ports import JudgedCase

Serve = Callable[[web.Application], Awaitable[str]]


@pytest.fixture
def secrets() -> SecretStore:
    """A store that sees only what a test puts in it."""
    return SecretStore(environ={})


@pytest.fixture
async def http() -> AsyncIterator[aiohttp.ClientSession]:
    """A client session, closed at the end of the test."""
    async with aiohttp.ClientSession() as session:
        yield session


@pytest.fixture
def run_id() -> str:
    """A fresh run id in evalbus's batch form."""
    return f"evb-{uuid.uuid4().hex[:10]}-case-1"


@pytest.fixture
async def serve() -> AsyncIterator[Serve]:
    """Start an aiohttp application on a free loopback port: `base = await serve(app)`."""
    runners: list[web.AppRunner] = []

    async def start(app: web.Application) -> str:
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        return f"http://127.0.0.1:{runner.addresses[0][1]}"

    yield start
    for runner in runners:
        await runner.cleanup()


class Kit:
    """Helpers shared by the trace tests."""

    agent = Path(__file__).with_name("otlp_agent.py")

    @staticmethod
    async def run_agent(endpoint: str, run_id: str, headers: Mapping[str, str], trace_id: str = "run") -> None:
        """Run the OTLP agent as a subprocess against `endpoint` (a base URL); fail on a failed export."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("OTEL_")}
        env.update(
            OTEL_EXPORTER_OTLP_TRACES_ENDPOINT=endpoint.rstrip("/") + "/v1/traces",
            OTEL_EXPORTER_OTLP_TRACES_HEADERS=",".join(f"{k}={v}" for k, v in headers.items()),
            OTEL_RESOURCE_ATTRIBUTES=f"evalbus.run_id={run_id}",
            EVALBUS_RUN_ID=run_id,
            AGENT_TRACE_ID=trace_id,
        )
        proc = await asyncio.create_subprocess_exec(
            sys.executable, str(Kit.agent), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
        )
        output, _ = await asyncio.wait_for(proc.communicate(), timeout=60)
        assert proc.returncode == 0, f"agent failed ({proc.returncode}):\n{output.decode(errors='replace')}"

    @staticmethod
    def assert_agent_events(events: Sequence[TraceEvent]) -> None:
        """The events the OTLP agent's spans must map to, in order."""
        llm = [e for e in events if isinstance(e, LlmCall)]
        assert len(llm) == 1, events
        assert llm[0].model == "gpt-test"
        assert (llm[0].input_tokens, llm[0].output_tokens) == (42, 7)
        assert llm[0].cost_usd == 0.0012
        calls = [e for e in events if isinstance(e, ToolCall)]
        assert [(c.name, c.args) for c in calls] == [("calculator", {"expression": "6*7"})]
        results = [e for e in events if isinstance(e, ToolResult)]
        assert [(r.id, r.ok, r.output) for r in results] == [(calls[0].id, True, "42")]
        messages = [(m.role, m.text) for m in events if isinstance(m, Message)]
        assert messages[0] == ("user", "What is 6*7?")
        assert messages[-1] == ("assistant", "42")
        assert ("assistant", "I will use the calculator.") in messages
        assert [e.t for e in events] == sorted(e.t for e in events)
        assert events[0].t == 0.0
        assert events.index(llm[0]) < events.index(calls[0]) < events.index(results[0])

    @staticmethod
    def judged(run_id: str, batch_id: str = "b1", verdict: str | None = "pass") -> JudgedCase:
        """A judged case with a grader score, two judge scores (one model) and an unmeasured one."""
        started = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
        result = CaseResult(
            case_id="case-1",
            run_id=run_id,
            harness="agent@1",
            answer="42",
            trace=(
                LlmCall(t=0.1, model="gpt-test", input_tokens=42, output_tokens=7, duration_ms=50.0),
                ToolCall(t=0.2, id="c1", name="calculator", args={"expression": "6*7"}),
                ToolResult(t=0.3, id="c1", output="42"),
            ),
            scores=(
                Measured(grader_id="am", metric="answer_match", value=1.0, passed=True),
                Measured(
                    grader_id="quality",
                    metric="judge:quality",
                    value=0.8,
                    passed=True,
                    source="judge",
                    detail="correct and short",
                ),
                Measured(grader_id="exact", metric="judge:exact", value=1.0, passed=True, source="judge"),
                Unmeasured(grader_id="tone", metric="judge:tone", reason="unsupported", source="judge"),
            ),
            timings=CaseTimings(started_at=started, released_at=started + timedelta(seconds=2)),
        )
        return JudgedCase(
            batch_id=batch_id,
            result=result,
            case=CaseSpec(id="case-1", input="What is 6*7?", expected="42"),
            verdict=verdict,  # type: ignore[arg-type]
            judged_at=started + timedelta(seconds=3),
            judge_kinds={"quality": "model", "exact": "exact"},
        )


@pytest.fixture
def kit() -> type[Kit]:
    """The shared helpers."""
    return Kit
