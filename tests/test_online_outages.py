"""Online evaluation under outages, end to end: a steady 200 sampled observations/s for 30 s — an
in-process `Recorder` (160 offered/s) and OTLP/HTTP exports (90 traces/s), sampled at 0.8 by an
online suite whose judge is a model judge — while (a) the pipeline's PostgreSQL database refuses
every connection for 10 s (`ALLOW_CONNECTIONS false` and its sessions terminated: the server is
shared with other tests, so it is not stopped) and then (b) the judge's provider answers 429 with
`Retry-After` for 5 s, then 500 for 5 s. A second scenario has the provider answer 500 to
everything for 10 s at 120 sampled/s — longer than a model judge's own retries — so observations
the judge could not score are judged again later (nak with a delay), not recorded as judged with
an error.

What must hold: ingest is unaffected (every `record()` accepted, every OTLP export answered 200,
during the outages too); nothing is lost (the recorder published everything, no dead letter
anywhere); everything sampled is judged after recovery, with a measured score (not an error
recorded as a result); and the counts add up exactly — `GET /v1/online/stats` says sampled ==
judged == the number the deterministic sampling decision gives, every other observation
`skipped: not_sampled`.

The services are real processes on a real nats-server and PostgreSQL (`open_pipeline`); the
provider is the scripted chat-completions server of `evalbus.testing.chat_server`.
"""

from __future__ import annotations

import asyncio
import json
import os
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import asyncpg
import msgspec
import pytest

from evalbus.online import Outcome, Recorder, RecorderStats
from evalbus.testing.chat_server import ChatCompletionsServer, Reply, error_body, judge_env, serving
from evalbus.testing.pipeline import Pipeline, eventually, open_pipeline
from evalbus_contracts import Measured, Score, sampled_by_trace_id

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

RATIO = 0.8
"""The suite's sample ratio."""
OTLP_PER_REQUEST = 9
"""Traces per OTLP export request."""
DATABASE_DOWN = (5.0, 15.0)
"""Seconds after the load starts: the database refuses connections."""
PROVIDER_429 = (17.0, 22.0)
"""The provider answers 429 + Retry-After."""
PROVIDER_500 = (22.0, 27.0)
"""The provider answers 500."""
API_KEY = "sk-outage-test-7d1f3a"  # noqa: S105 - the scripted provider's test key
SERVICE = "support-bot"
ENVIRONMENT = {"deployment.environment": "prod"}


@dataclass(frozen=True)
class Load:
    """A steady load: observations offered per second by each way in, for how long."""

    recorded_per_s: int
    """Through the `Recorder`."""
    otlp_per_s: int
    """Over OTLP/HTTP (a multiple of `OTLP_PER_REQUEST` per 0.1 s… or fewer requests)."""
    seconds: float

    @property
    def offered(self) -> int:
        return round(self.seconds * (self.recorded_per_s + self.otlp_per_s))


BOTH_OUTAGES = Load(recorded_per_s=160, otlp_per_s=90, seconds=30.0)
"""(160 + 90) × 0.8 = 200 sampled observations/s for 30 s."""
SERVER_ERRORS = Load(recorded_per_s=150, otlp_per_s=0, seconds=15.0)
"""120 sampled observations/s for 15 s."""
SERVER_ERRORS_DOWN = (2.0, 12.0)
"""Seconds after that load starts: the provider answers 500 to everything."""


@dataclass
class Ingest:
    """What the application saw while it sent."""

    recorded: list[str] = field(default_factory=list)
    """Trace ids offered to `record()`."""
    outcomes: Counter[str] = field(default_factory=Counter)
    """`record()` outcomes."""
    exported: list[str] = field(default_factory=list)
    """Trace ids exported over OTLP."""
    statuses: Counter[int] = field(default_factory=Counter)
    """OTLP export answers."""
    slowest_export_s: float = 0.0


@pytest.fixture(scope="module")
async def provider() -> AsyncIterator[ChatCompletionsServer]:
    async with serving(api_key=API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
async def pipeline(
    pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory, provider: ChatCompletionsServer
) -> AsyncIterator[Pipeline]:
    judge = {**judge_env(provider), "JUDGE_CONCURRENCY": "64", "JUDGE_GLOBAL_LIMIT": "64"}
    collector = {"COLLECTOR_SETTLE_S": "0.2"}
    async with open_pipeline(
        pg_admin_url, tmp_path_factory.mktemp("outages"), service_env={"judge": judge, "collector": collector}
    ) as p:
        yield p


async def api(p: Pipeline, method: str, path: str, body: Any = None) -> tuple[int, Any]:
    async with (
        aiohttp.ClientSession(headers=dict(p.stack.headers())) as session,
        session.request(method, p.stack.gateway_url + path, json=body) as resp,
    ):
        return resp.status, await resp.json()


async def stats(p: Pipeline, suite_id: str) -> Counter[tuple[str, str]]:
    status, body = await api(p, "GET", f"/v1/online/stats?suite={suite_id}")
    assert status == 200, body
    return Counter({(c["fate"], c["reason"]): int(c["count"]) for c in body["counts"]})


def sampled_trace(ratio: float) -> str:
    trace_id = os.urandom(16).hex()
    while not sampled_by_trace_id(trace_id, ratio):
        trace_id = os.urandom(16).hex()
    return trace_id


async def wait_for_suite(p: Pipeline, recorder: Recorder, suite_id: str) -> int:
    """Offer probes of another service until the collector decides one for the suite; how many."""
    probes: list[str] = []

    async def known() -> bool:
        for probe in probes:
            _, answer = await api(p, "GET", f"/v1/online/observations/{probe}")
            if any(f["suite_id"] == suite_id for f in answer["fates"]):
                return True
        probes.append(sampled_trace(recorder.sample_ratio))
        assert recorder.record(trace_id=probes[-1], target="probe-service", output="pong")
        return False

    await eventually(known, timeout_s=60, what="the collector to know the suite", diagnostics=p.diagnostics)
    return len(probes)


def otlp_body(trace_ids: list[str]) -> bytes:
    """One OTLP/JSON export request: one ended root span per trace, with its input and output."""
    now = time.time_ns()
    spans = [
        {
            "traceId": trace_id,
            "spanId": os.urandom(8).hex(),
            "name": "handle-request",
            "startTimeUnixNano": str(now - 50_000_000),
            "endTimeUnixNano": str(now),
            "attributes": [
                {"key": "input.value", "value": {"stringValue": f"Where is order {trace_id[:6]}?"}},
                {"key": "output.value", "value": {"stringValue": "Thank you, it ships today."}},
            ],
        }
        for trace_id in trace_ids
    ]
    resource = [
        {"key": "service.name", "value": {"stringValue": SERVICE}},
        *({"key": k, "value": {"stringValue": v}} for k, v in ENVIRONMENT.items()),
    ]
    return json.dumps(
        {"resourceSpans": [{"resource": {"attributes": resource}, "scopeSpans": [{"spans": spans}]}]}
    ).encode()


async def export(session: aiohttp.ClientSession, url: str, trace_ids: list[str], ingest: Ingest) -> None:
    started = time.monotonic()
    async with session.post(url, data=otlp_body(trace_ids), headers={"Content-Type": "application/json"}) as resp:
        await resp.read()
        ingest.statuses[resp.status] += 1
    ingest.slowest_export_s = max(ingest.slowest_export_s, time.monotonic() - started)


async def steady_load(p: Pipeline, recorder: Recorder, load: Load, started: float) -> Ingest:
    """Offer observations at `load`'s steady rates, in ticks of 0.1 s (the pacing is the load's
    shape; nothing waits on the pipeline)."""
    ingest = Ingest()
    url = f"{p.stack.otlp_url}/v1/traces"
    exports: set[asyncio.Task[None]] = set()
    tick_s = 0.1
    per_tick = round(load.recorded_per_s * tick_s)
    otlp_every = round(OTLP_PER_REQUEST / load.otlp_per_s / tick_s) if load.otlp_per_s else 0
    async with aiohttp.ClientSession() as session:
        for tick in range(round(load.seconds / tick_s)):
            delay = started + tick * tick_s - time.monotonic()
            if delay > 0:
                await asyncio.sleep(delay)
            for i in range(per_tick):
                trace_id = os.urandom(16).hex()
                ingest.recorded.append(trace_id)
                outcome = recorder.record(trace_id=trace_id, input=f"Where is order {tick}-{i}?", output="Thank you!")
                ingest.outcomes[outcome.value] += 1
            if otlp_every and tick % otlp_every == 0:
                trace_ids = [os.urandom(16).hex() for _ in range(OTLP_PER_REQUEST)]
                ingest.exported += trace_ids
                task = asyncio.create_task(export(session, url, trace_ids, ingest))
                exports.add(task)
                task.add_done_callback(exports.discard)
        await asyncio.gather(*exports)
    return ingest


def database_name(url: str) -> str:
    return urlsplit(url).path.lstrip("/")


@asynccontextmanager
async def database_refusing(admin_url: str, database_url: str) -> AsyncIterator[int]:
    """The pipeline's database refuses every connection (and its open sessions are terminated)
    until the block ends; yields how many sessions were terminated."""
    name = database_name(database_url)
    quoted = '"' + name.replace('"', '""') + '"'
    admin = await asyncpg.connect(admin_url)
    try:
        await admin.execute(f"ALTER DATABASE {quoted} WITH ALLOW_CONNECTIONS false")
        rows = await admin.fetch(
            "SELECT pg_terminate_backend(pid) AS done FROM pg_stat_activity WHERE datname = $1 AND pid <> pg_backend_pid()",
            name,
        )
        yield sum(1 for r in rows if r["done"])
    finally:
        await admin.execute(f"ALTER DATABASE {quoted} WITH ALLOW_CONNECTIONS true")
        await admin.close()


@dataclass
class Faults:
    terminated_sessions: int = 0
    refused_during_outage: bool = False
    provider_down_s: tuple[float, float] = (0.0, 0.0)
    """Monotonic start and end of the provider outage."""
    database_back_at: float = 0.0


async def at(started: float, offset: float) -> None:
    """Until `offset` seconds after `started` (a fault's schedule, not a synchronisation)."""
    delay = started + offset - time.monotonic()
    if delay > 0:
        await asyncio.sleep(delay)


async def inject_faults(p: Pipeline, admin_url: str, provider: ChatCompletionsServer, started: float) -> Faults:
    """The outages, at their times after `started` (each lasts its fault's duration)."""
    faults = Faults()
    await at(started, DATABASE_DOWN[0])
    async with database_refusing(admin_url, p.database_url) as terminated:
        faults.terminated_sessions = terminated
        try:
            connection = await asyncpg.connect(p.database_url)
        except asyncpg.PostgresError:
            faults.refused_during_outage = True
        else:
            await connection.close()
        await at(started, DATABASE_DOWN[1])
    faults.database_back_at = time.monotonic()

    await at(started, PROVIDER_429[0])
    down_at = time.monotonic()
    provider.outage = Reply(
        status=429,
        body=error_body("Rate limit reached", "requests", "rate_limit_exceeded"),
        headers={"Retry-After": "1"},
    )
    await at(started, PROVIDER_500[0])
    provider.outage = Reply(status=500, body=error_body("The server had an error", "server_error"))
    await at(started, PROVIDER_500[1])
    provider.outage = None
    faults.provider_down_s = (down_at, time.monotonic())
    return faults


def scores_of(raw: Any) -> Iterator[Score]:
    decoded = msgspec.json.decode(raw, type=list[Score]) if isinstance(raw, str | bytes) else raw
    yield from decoded


async def apply_suite(p: Pipeline) -> str:
    """An online suite of the support bot at `RATIO`, judged by a model judge; its id."""
    suite_id = f"outage-{uuid.uuid4().hex[:6]}"
    status, applied = await api(
        p,
        "POST",
        "/v1/online/suites",
        {
            "id": suite_id,
            "target": {"service": SERVICE, "attributes": ENVIRONMENT},
            "sample_ratio": RATIO,
            "judges": [
                {
                    "kind": "model",
                    "id": "quality",
                    "model": "judge-test-model",
                    "rubric": "The answer is polite and says when the order ships.",
                    "timeout_s": 5.0,
                }
            ],
        },
    )
    assert status == 201, applied
    return suite_id


@dataclass(frozen=True)
class Accounted:
    """What a scenario measured once the checks passed."""

    offered: int
    judged: int
    caught_up_s: float
    """From the end of the last outage until the stats showed everything judged."""


async def check_nothing_lost(
    p: Pipeline,
    suite_id: str,
    load: Load,
    ingest: Ingest,
    recorded: RecorderStats,
    probes: int,
    recovered_at: float,
) -> Accounted:
    """Ingest unaffected, nothing lost, everything sampled judged with a measured score, the
    counts exact."""
    # ingest unaffected: every call accepted, every export answered 200, nothing lost on the way
    offered = len(ingest.recorded) + len(ingest.exported)
    assert offered == load.offered
    assert ingest.outcomes == Counter({Outcome.ACCEPTED.value: len(ingest.recorded)}), ingest.outcomes
    assert ingest.statuses == Counter({200: len(ingest.exported) // OTLP_PER_REQUEST} if ingest.exported else {})
    assert (recorded.published, recorded.pending, dict(recorded.lost), dict(recorded.dropped)) == (
        recorded.accepted,
        0,
        {},
        {},
    ), recorded
    assert recorded.accepted == len(ingest.recorded) + probes

    # everything sampled is judged after recovery
    expected = {t for t in [*ingest.recorded, *ingest.exported] if sampled_by_trace_id(t, RATIO)}
    assert 0.75 * offered < len(expected) < 0.85 * offered  # the ratio really splits the load

    async def all_judged() -> bool:
        try:
            counts = await stats(p, suite_id)
        except (AssertionError, aiohttp.ClientError):
            return False
        return counts[("judged", "judged")] >= len(expected) and counts[("sampled", "sampled")] >= len(expected)

    await eventually(all_judged, timeout_s=120, what="every sampled observation judged", diagnostics=p.diagnostics)
    caught_up_s = time.monotonic() - recovered_at
    await p.quiescent(timeout_s=60)

    # the counts add up exactly
    counts = await stats(p, suite_id)
    assert counts[("sampled", "sampled")] == counts[("judged", "judged")] == len(expected), counts
    assert counts[("skipped", "not_sampled")] == offered - len(expected), counts
    assert counts[("skipped", "not_target")] == probes, counts
    assert sum(counts.values()) == offered + probes + len(expected), counts  # sampled ones: sampled + judged

    rows = await p.pool.fetch(
        "SELECT case_id, scores FROM runs WHERE batch_id = $1 AND judged_status IS NOT NULL", f"online-{suite_id}"
    )
    assert {str(r["case_id"]) for r in rows} == expected
    quality = Counter(
        type(s).__name__ if isinstance(s, Measured) else f"{type(s).__name__}: {s.reason}: {s.detail}"
        for r in rows
        for s in scores_of(r["scores"])
        if s.metric == "judge:quality"
    )
    assert quality == Counter({"Measured": len(expected)}), f"judged with errors during the provider outage: {quality}"
    for service in ("collector", "judge", "gateway"):
        assert await p.dead_letters(service) == [], service
    return Accounted(offered=offered, judged=len(expected), caught_up_s=caught_up_s)


async def test_database_and_provider_outages_lose_nothing_and_the_counts_add_up(
    pipeline: Pipeline, provider: ChatCompletionsServer, pg_admin_url: str
) -> None:
    p = pipeline
    suite_id = await apply_suite(p)
    before = Counter(provider.statuses)
    recorder = Recorder(p.stack.nats_url, target=SERVICE, metadata=ENVIRONMENT, close_at_exit=False)
    async with recorder:
        probes = await wait_for_suite(p, recorder, suite_id)
        started = time.monotonic()
        ingest, faults = await asyncio.gather(
            steady_load(p, recorder, BOTH_OUTAGES, started), inject_faults(p, pg_admin_url, provider, started)
        )
    load_s = time.monotonic() - started
    answered = provider.statuses - before

    # the outages really happened (the provider's answers during the load)
    assert faults.terminated_sessions >= 1, "no session of the pipeline's database was terminated"
    assert faults.refused_during_outage, "the database accepted a connection during its outage"
    assert answered[429] > 0, answered
    assert answered[500] > 0, answered
    assert load_s < BOTH_OUTAGES.seconds + 5, f"the load took {load_s:.1f} s: ingest was held up"

    done = await check_nothing_lost(
        p, suite_id, BOTH_OUTAGES, ingest, recorder.stats(), probes, faults.provider_down_s[1]
    )
    print(  # noqa: T201 - the figures, for whoever runs it with -s
        f"\noutages: {done.offered} offered, {done.judged} sampled and judged; caught up {done.caught_up_s:.1f} s "
        f"after the provider recovered; slowest export {ingest.slowest_export_s:.2f} s; "
        f"provider {dict(provider.statuses - before)}"
    )


async def test_a_provider_answering_500_for_10_s_is_waited_for_not_recorded_as_judged(
    pipeline: Pipeline, provider: ChatCompletionsServer
) -> None:
    """Every request fails with 500 for 10 s — longer than a model judge's own retries (3, about
    3.5 s of backoff): what the judge could not score then is judged again later, not recorded as
    judged with a `grader_error` score."""
    p = pipeline
    suite_id = await apply_suite(p)
    before = Counter(provider.statuses)
    recorder = Recorder(p.stack.nats_url, target=SERVICE, metadata=ENVIRONMENT, close_at_exit=False)
    async with recorder:
        probes = await wait_for_suite(p, recorder, suite_id)
        started = time.monotonic()

        async def server_errors() -> float:
            await at(started, SERVER_ERRORS_DOWN[0])
            provider.outage = Reply(status=500, body=error_body("The server had an error", "server_error"))
            await at(started, SERVER_ERRORS_DOWN[1])
            provider.outage = None
            return time.monotonic()

        ingest, recovered_at = await asyncio.gather(steady_load(p, recorder, SERVER_ERRORS, started), server_errors())
    answered = provider.statuses - before
    assert answered[500] > 0, answered
    done = await check_nothing_lost(p, suite_id, SERVER_ERRORS, ingest, recorder.stats(), probes, recovered_at)
    print(  # noqa: T201
        f"\nserver errors: {done.offered} offered, {done.judged} judged; caught up {done.caught_up_s:.1f} s "
        f"after the provider recovered; provider {dict(provider.statuses - before)}"
    )
