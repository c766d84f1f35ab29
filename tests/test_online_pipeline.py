"""Online evaluation end to end: a real OpenTelemetry SDK application exports its traces to the
collector's OTLP/HTTP receiver (protobuf, and JSON by hand), an online suite samples them by trace
id, the judge scores the sampled ones, and every trace's fate is answered by the gateway.

The services are real processes on a real nats-server and PostgreSQL (`open_pipeline`); the suite
is applied through the gateway's API, exactly as `evalbus online apply` does.
"""

from __future__ import annotations

import asyncio
import io
import json
import re
import subprocess
import sys
import time
import uuid
from collections import Counter
from collections.abc import AsyncIterator, Sequence
from datetime import UTC, datetime, timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from opentelemetry.exporter.otlp.proto.http import Compression
from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue
from opentelemetry.sdk.resources import Resource
from opentelemetry.sdk.trace import TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor

from evalbus.testing.chat_server import ChatCompletionsServer
from evalbus.testing.pipeline import Pipeline, eventually, open_pipeline, read_stream
from evalbus.testing.reliability import lost_and_duplicated, report, row
from evalbus_contracts import (
    CaseObserved,
    CasePlan,
    CaseResult,
    LlmCall,
    ObservationReceived,
    ObservationSpans,
    SpanData,
    encode,
    encode_token,
    sampled_by_trace_id,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

SUITE = "polite"
RATIO = 0.5
TRACES = 24


MEMBER_TOKEN = "member-token-of-alice"  # noqa: S105 - a test principal's token


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    root = tmp_path_factory.mktemp("online")
    tokens = root / "tokens.json"
    tokens.write_text(json.dumps({MEMBER_TOKEN: {"principal": "alice", "role": "member"}}))
    collector = {"COLLECTOR_SETTLE_S": "0.5", "COLLECTOR_MAX_WAIT_S": "20"}
    gateway = {"GATEWAY_TOKENS_FILE": str(tokens)}
    async with open_pipeline(
        pg_admin_url, root / "pipeline", service_env={"collector": collector, "gateway": gateway}
    ) as p:
        yield p


async def api(p: Pipeline, method: str, path: str, body: Any = None, *, token: str | None = None) -> tuple[int, Any]:
    headers = dict(p.stack.headers()) if token is None else {"Authorization": f"Bearer {token}"}
    async with (
        aiohttp.ClientSession(headers=headers) as session,
        session.request(method, p.stack.gateway_url + path, json=body) as resp,
    ):
        return resp.status, await resp.json()


def application(otlp_url: str, service: str, **resource: str) -> TracerProvider:
    """A production application's tracing, as a team sets it up: the OTel SDK exporting over OTLP/HTTP."""
    provider = TracerProvider(resource=Resource.create({"service.name": service, **resource}))
    exporter = OTLPSpanExporter(endpoint=f"{otlp_url}/v1/traces", compression=Compression.Gzip, timeout=10)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    return provider


def serve_request(provider: TracerProvider, question: str, answer: str) -> str:
    """One request of the application: a root span and an LLM call; its trace id."""
    tracer = provider.get_tracer("support-bot")
    with tracer.start_as_current_span("handle-request") as root:
        root.set_attribute("input.value", question)
        with tracer.start_as_current_span("llm") as llm:
            llm.set_attribute("gen_ai.request.model", "m-1")
            llm.set_attribute("gen_ai.usage.input_tokens", 12)
            llm.set_attribute("gen_ai.usage.output_tokens", 5)
        root.set_attribute("output.value", answer)
        return f"{root.get_span_context().trace_id:032x}"


async def judged(p: Pipeline, suite_id: str) -> int:
    count = await p.pool.fetchval(
        "SELECT count(*) FROM runs WHERE batch_id = $1 AND judged_status IS NOT NULL", f"online-{suite_id}"
    )
    return int(count)


async def apply_suite(p: Pipeline, suite_id: str, ratio: float, judges: list[dict[str, Any]] | None = None) -> None:
    """Apply an online suite through the API and wait until the collector samples for it."""
    status, applied = await api(
        p,
        "POST",
        "/v1/online/suites",
        {
            "id": suite_id,
            "target": {"service": "support-bot", "attributes": {"deployment.environment": "prod"}},
            "sample_ratio": ratio,
            "judges": judges or [{"kind": "regex", "id": "polite", "pattern": "(?i)thank"}],
        },
    )
    assert status == 201, applied
    status, listed = await api(p, "GET", "/v1/online/suites")
    assert status == 200
    assert suite_id in [item["suite"]["id"] for item in listed["items"]]
    # The collector follows suites from the stream: wait until it took this one (a trace of a
    # service nobody samples is `not_target` for it only once the suite is known there).
    probe = application(p.stack.otlp_url, "probe-service", **{"deployment.environment": "prod"})
    probe_trace = await asyncio.to_thread(serve_request, probe, "ping", "pong")
    probe.shutdown()

    async def probe_seen_by_suite() -> bool:
        _, answer = await api(p, "GET", f"/v1/online/observations/{probe_trace}")
        return any(f["suite_id"] == suite_id for f in answer["fates"])

    await eventually(
        probe_seen_by_suite, timeout_s=60, what="the collector to know the suite", diagnostics=p.diagnostics
    )


async def test_sampled_production_traces_are_judged_and_every_fate_is_answered(pipeline: Pipeline) -> None:
    p = pipeline
    suite_id = f"{SUITE}-{uuid.uuid4().hex[:6]}"
    await apply_suite(p, suite_id, RATIO)

    prod = application(p.stack.otlp_url, "support-bot", **{"deployment.environment": "prod"})
    staging = application(p.stack.otlp_url, "support-bot", **{"deployment.environment": "staging"})
    answers: dict[str, str] = {}
    for i in range(TRACES):
        answer = f"Thank you, order {i} ships today." if i % 3 else f"Order {i} ships today."
        answers[await asyncio.to_thread(serve_request, prod, f"Where is order {i}?", answer)] = answer
    staging_trace = await asyncio.to_thread(serve_request, staging, "Where is order 99?", "Thanks, it ships.")
    prod.shutdown()
    staging.shutdown()
    json_trace = await post_json_trace(p)

    sampled = {t for t in [*answers, json_trace] if sampled_by_trace_id(t, RATIO)}
    assert 0 < len(sampled) < TRACES + 1  # the ratio really splits this set

    async def all_judged() -> bool:
        return await judged(p, suite_id) == len(sampled)

    await eventually(all_judged, timeout_s=90, what="every sampled trace judged", diagnostics=p.diagnostics)
    await p.quiescent(timeout_s=60)
    assert await judged(p, suite_id) == len(sampled)

    # every trace's fate, with its reason (a trace not sampled settles on its own timer, so its fate
    # may be recorded after the sampled ones are judged)
    for trace_id in [*answers, json_trace]:

        async def fates(trace_id: str = trace_id) -> list[tuple[str, str]]:
            _, answer = await api(p, "GET", f"/v1/online/observations/{trace_id}")
            return sorted((f["fate"], f["reason"]) for f in answer["fates"] if f["suite_id"] == suite_id)

        async def decided(trace_id: str = trace_id) -> bool:
            return bool(await fates(trace_id)) and (trace_id not in sampled or len(await fates(trace_id)) >= 2)

        await eventually(decided, timeout_s=60, what=f"the fate of {trace_id}", diagnostics=p.diagnostics)
        mine = await fates()
        if trace_id in sampled:
            assert mine == [("judged", "judged"), ("sampled", "sampled")], trace_id
        else:
            assert mine == [("skipped", "not_sampled")], trace_id
    _, staged = await api(p, "GET", f"/v1/online/observations/{staging_trace}")
    assert [(f["fate"], f["reason"]) for f in staged["fates"] if f["suite_id"] == suite_id] == [("skipped", "filtered")]
    _, unknown = await api(p, "GET", f"/v1/online/observations/{uuid.uuid4().hex}")
    assert unknown == {"trace_id": unknown["trace_id"], "status": "unknown", "fates": []}

    # the counts add up: every trace sent is counted once for the suite
    _, stats = await api(p, "GET", f"/v1/online/stats?suite={suite_id}")
    counts = Counter({(c["fate"], c["reason"]): c["count"] for c in stats["counts"]})
    sent = TRACES + 3  # 24 prod traces, the JSON one, the staging one, the probe
    assert counts[("judged", "judged")] == counts[("sampled", "sampled")] == len(sampled)
    skipped = counts[("skipped", "not_sampled")] + counts[("skipped", "filtered")] + counts[("skipped", "not_target")]
    assert counts[("sampled", "sampled")] + skipped == sent

    # the collector's Prometheus counters say the same (no redelivery happened here)
    async with (
        aiohttp.ClientSession() as http,
        http.get(p.stack.procs["collector"].url + "/metrics") as resp,
    ):
        metrics = await resp.text()
    line = f'evalbus_online_fates_total{{fate="sampled",reason="sampled",suite="{suite_id}"}} {float(len(sampled))}'
    assert line in metrics, [m for m in metrics.splitlines() if suite_id in m]

    # one observation and one case.observed per trace, whatever was redelivered
    events = [m.event() for m in await read_stream(p.nc, "CASES", ("case.observed.>",))]
    observations = Counter(e.observation_id for e in events if isinstance(e, CaseObserved) and e.suite_id == suite_id)
    assert observations == Counter(dict.fromkeys(sampled, 1))

    # the scores: the regex judge passes exactly the polite answers
    status, detail = await api(p, "GET", f"/v1/online/suites/{suite_id}")
    assert status == 200, (detail, p.diagnostics(60))
    by_observation = {r["observation_id"]: r for r in detail["recent"]}
    if len(sampled) <= 20:
        assert set(by_observation) == sampled
    else:
        assert len(by_observation) == 20
        assert set(by_observation) <= sampled
    for trace_id, run in by_observation.items():
        [score] = [s for s in run["scores"] if s["metric"] == "judge:polite"]
        expected = answers.get(trace_id, "Thank you (json)")
        assert score["pass"] is ("thank" in expected.lower()), trace_id
    # members read online suites and their judged runs, but do not change suites
    status, mine = await api(p, "GET", f"/v1/online/suites/{suite_id}", token=MEMBER_TOKEN)
    assert status == 200, mine
    some_run = next(iter(by_observation.values()))
    status, trajectory = await api(p, "GET", some_run["trajectory"], token=MEMBER_TOKEN)
    assert status == 200, trajectory
    assert {e["type"] for e in trajectory["events"]} >= {"case.observed", "case.judged"}
    status, refused = await api(p, "DELETE", f"/v1/online/suites/{suite_id}", token=MEMBER_TOKEN)
    assert (status, refused["error"]["code"]) == (403, "forbidden")
    hour = {m["metric"]: m for m in detail["metrics"] if m["window"] == "hour"}
    polite_sampled = [t for t in sampled if "thank" in answers.get(t, "Thank you (json)").lower()]
    assert hour["judge:polite"]["count"] == len(sampled)
    assert hour["judge:polite"]["pass_rate"] == pytest.approx(len(polite_sampled) / len(sampled))


async def post_json_trace(p: Pipeline) -> str:
    """One trace posted as OTLP JSON (hex ids) by hand; its trace id."""
    trace_id = uuid.uuid4().hex
    body = {
        "resourceSpans": [
            {
                "resource": {
                    "attributes": [
                        {"key": "service.name", "value": {"stringValue": "support-bot"}},
                        {"key": "deployment.environment", "value": {"stringValue": "prod"}},
                    ]
                },
                "scopeSpans": [
                    {
                        "spans": [
                            {
                                "traceId": trace_id,
                                "spanId": uuid.uuid4().hex[:16],
                                "name": "handle-request",
                                "startTimeUnixNano": "1700000000000000000",
                                "endTimeUnixNano": "1700000001000000000",
                                "attributes": [
                                    {"key": "input.value", "value": {"stringValue": "json question"}},
                                    {"key": "output.value", "value": {"stringValue": "Thank you (json)"}},
                                ],
                            }
                        ]
                    }
                ],
            }
        ]
    }
    async with (
        aiohttp.ClientSession() as session,
        session.post(
            f"{p.stack.otlp_url}/v1/traces", data=json.dumps(body), headers={"Content-Type": "application/json"}
        ) as resp,
    ):
        assert resp.status == 200
        assert await resp.json() == {}
    return trace_id


async def test_the_receiver_answers_bad_requests_as_otlp_says(pipeline: Pipeline) -> None:
    url = f"{pipeline.stack.otlp_url}/v1/traces"
    async with aiohttp.ClientSession() as session:
        for data, content_type, status in (
            (b"\x00\xffgarbage", "application/x-protobuf", 400),
            (b"{nope", "application/json", 400),
            (b"{}", "text/plain", 415),
            (b"x" * (4 * 1024 * 1024 + 10), "application/json", 413),
        ):
            async with session.post(url, data=io.BytesIO(data), headers={"Content-Type": content_type}) as resp:
                assert resp.status == status, (content_type, await resp.text())
                doc = await resp.json()
                assert set(doc) == {"code", "message"}
        partial = {"resourceSpans": [{"scopeSpans": [{"spans": [{"traceId": "zz", "spanId": "yy", "name": "bad"}]}]}]}
        async with session.post(url, json=partial) as resp:
            assert resp.status == 200
            doc = await resp.json()
            assert doc["partialSuccess"]["rejectedSpans"] == "1"


async def stream_counts(p: Pipeline, subjects: tuple[str, ...]) -> Counter[tuple[str, str]]:
    """(type, observation id) → messages on CASES under `subjects`."""
    out: Counter[tuple[str, str]] = Counter()
    for m in await read_stream(p.nc, "CASES", subjects):
        event = m.event()
        key = getattr(event, "observation_id", None) or event.case_id or ""
        out[(event.type, key)] += 1
    return out


@pytest.mark.parametrize(
    "fault",
    [
        "before_ack:collector-spans:obs.spans:-",
        "before_ack:collector-observations:obs.received:-",
    ],
)
async def test_collector_killed_mid_stream_loses_and_doubles_nothing(pipeline: Pipeline, fault: str) -> None:
    """The collector dies by SIGKILL right after storing its output for the first trace it
    finishes — the assembled observation (spans stage), or the fates and `case.observed`
    (sampling stage) — before it acks its input. Its unacknowledged messages come back to the
    restarted collector after `ack_wait` (5 s here) and are done again: every trace is judged
    once, with one `sampled` fate and one `case.observed`, and none is called late."""
    p = pipeline
    suite_id = f"crash-{uuid.uuid4().hex[:6]}"
    await apply_suite(p, suite_id, 1.0)
    # armed after the suite is known: a restarted collector reads every suite before it consumes
    await p.restart("collector", FAULT_KILL=fault, COLLECTOR_ACK_WAIT_S="5")
    prod = application(p.stack.otlp_url, "support-bot", **{"deployment.environment": "prod"})
    traces = [await asyncio.to_thread(serve_request, prod, f"q{i}", f"Thank you {i}") for i in range(8)]
    prod.shutdown()
    assert await p.wait_exit("collector", timeout_s=60) == -9
    killed_at = time.monotonic()
    await p.start("collector", COLLECTOR_ACK_WAIT_S="5")

    async def all_judged() -> bool:
        return await judged(p, suite_id) == len(traces)

    await eventually(all_judged, timeout_s=90, what="every trace judged after the restart", diagnostics=p.diagnostics)
    await p.quiescent(timeout_s=60)

    async def observations_acknowledged() -> bool:
        # the killed replica may have stored every observation (or decided it) before its first
        # ack: what it held comes back after ack_wait, to be acknowledged without a second output
        # (and must not come back during the next test, under that test's suites)
        infos = await p.nc.jetstream().consumers_info("OBSERVATIONS")
        return all(info.num_ack_pending == info.num_pending == 0 for info in infos)

    await eventually(
        observations_acknowledged,
        timeout_s=60,
        what="every OBSERVATIONS message acknowledged",
        diagnostics=p.diagnostics,
    )
    stall_s = time.monotonic() - killed_at
    counts = await stream_counts(p, (f"case.observed.{encode_token(suite_id)}.>", f"case.judged.online-{suite_id}.>"))
    want = Counter({(kind, t): 1 for t in traces for kind in ("case.observed", "case.judged")})
    lost, duplicated = lost_and_duplicated(want, counts)
    report(  # bench/reliability.py's row (stall: the kill → every consumer idle, the restart included)
        row(
            f"SIGKILL collector (online) after storing its output, before its ack ({fault.split(':')[1]})",
            load=f"{len(traces)} traces",
            faults=1,
            lost=lost,
            duplicated=duplicated,
            stall_s=stall_s,
            passed=lost == 0 and duplicated == 0,
        )
    )
    observed = Counter({k: n for (kind, k), n in counts.items() if kind == "case.observed"})
    assert observed == Counter(dict.fromkeys(traces, 1))
    judged_runs = Counter({k: n for (kind, k), n in counts.items() if kind == "case.judged"})
    assert judged_runs == Counter(dict.fromkeys(traces, 1))
    for trace_id in traces:
        _, answer = await api(p, "GET", f"/v1/online/observations/{trace_id}")
        mine = sorted((f["fate"], f["reason"]) for f in answer["fates"] if f["suite_id"] == suite_id)
        assert mine == [("judged", "judged"), ("sampled", "sampled")], (trace_id, answer)
        assert not [f for f in answer["fates"] if f["fate"] == "late"], answer


def split_request(trace_id: str, spans: Sequence[tuple[str, str | None, str]]) -> bytes:
    """An OTLP/HTTP protobuf export request of `spans` (span id, parent id, model) of one trace of
    support-bot in prod; the root span (no parent) carries the conversation."""
    request = ExportTraceServiceRequest()
    resource_spans = request.resource_spans.add()
    for key, value in (("service.name", "support-bot"), ("deployment.environment", "prod")):
        resource_spans.resource.attributes.add(key=key, value=AnyValue(string_value=value))
    scope = resource_spans.scope_spans.add()
    for span_id, parent, model in spans:
        span = scope.spans.add(
            trace_id=bytes.fromhex(trace_id),
            span_id=bytes.fromhex(span_id),
            parent_span_id=bytes.fromhex(parent) if parent else b"",
            name="handle-request" if parent is None else "llm",
            start_time_unix_nano=time.time_ns(),
            end_time_unix_nano=time.time_ns() + 1_000_000,
        )
        if parent is None:
            span.attributes.add(key="input.value", value=AnyValue(string_value=f"question of {trace_id}"))
            span.attributes.add(key="output.value", value=AnyValue(string_value="Thank you, it ships."))
        else:
            span.attributes.add(key="gen_ai.request.model", value=AnyValue(string_value=model))
    return bytes(request.SerializeToString())


async def export(session: aiohttp.ClientSession, base_url: str, body: bytes) -> None:
    async with session.post(
        f"{base_url}/v1/traces", data=body, headers={"Content-Type": "application/x-protobuf"}
    ) as resp:
        assert resp.status == 200, await resp.text()


async def test_a_trace_split_across_two_collector_replicas_is_assembled_whole_and_judged_once(
    pipeline: Pipeline,
) -> None:
    """Two collector replicas behind two addresses; each trace's spans are exported in two requests,
    half to each (the root sometimes in the first, sometimes in the second). Each trace becomes
    exactly one observation holding every span — whichever replica assembled it — judged once,
    and a span sent to either replica after its trace was assembled is counted late, not judged."""
    p = pipeline
    suite_id = f"split-{uuid.uuid4().hex[:6]}"
    await apply_suite(p, suite_id, 1.0)
    await p.start("collector@2", COLLECTOR_SETTLE_S="0.5", COLLECTOR_MAX_WAIT_S="20")
    urls = [p.stack.otlp_url, p.stack.otlp_url_of("collector@2")]
    traces: dict[str, set[str]] = {}
    try:
        async with aiohttp.ClientSession() as session:
            for i in range(8):
                trace_id = uuid.uuid4().hex
                root = uuid.uuid4().hex[:16]
                children: list[tuple[str, str | None, str]] = [
                    (uuid.uuid4().hex[:16], root, f"m-{i}-{k}") for k in range(4)
                ]
                traces[trace_id] = {model for _, _, model in children}
                first: list[tuple[str, str | None, str]] = [(root, None, ""), *children[:2]]
                second = children[2:]
                if i % 2:
                    first, second = second, first
                # the halves go to different replicas, in either order, one right after the other
                await export(session, urls[i % 2], split_request(trace_id, first))
                await export(session, urls[(i + 1) % 2], split_request(trace_id, second))

            async def all_judged() -> bool:
                return await judged(p, suite_id) == len(traces)

            await eventually(all_judged, timeout_s=90, what="every split trace judged", diagnostics=p.diagnostics)
            # late spans: one to each replica, after their traces were assembled
            late = list(traces)[:2]
            for n, trace_id in enumerate(late):
                straggler = [(uuid.uuid4().hex[:16], "00000000000000aa", "m-late")]
                await export(session, urls[n], split_request(trace_id, straggler))

            async def late_counted() -> bool:
                for trace_id in late:
                    _, answer = await api(p, "GET", f"/v1/online/observations/{trace_id}")
                    if not any(f["fate"] == "late" for f in answer["fates"]):
                        return False
                return True

            await eventually(late_counted, timeout_s=60, what="the late spans counted", diagnostics=p.diagnostics)
        await p.quiescent(timeout_s=60)
    finally:
        await p.kill("collector@2")
    events = [m.event() for m in await read_stream(p.nc, "CASES", (f"case.observed.{encode_token(suite_id)}.>",))]
    observed = [e for e in events if isinstance(e, CaseObserved)]
    assert Counter(e.observation_id for e in observed) == Counter(dict.fromkeys(traces, 1))
    for event in observed:
        models = {e.model for e in event.result.trace if isinstance(e, LlmCall)}
        assert models == traces[event.observation_id], "an observation assembled from part of its trace"
    counts = await stream_counts(p, (f"case.judged.online-{suite_id}.>",))
    assert Counter({k: n for (_, k), n in counts.items()}) == Counter(dict.fromkeys(traces, 1))
    for trace_id in traces:
        _, answer = await api(p, "GET", f"/v1/online/observations/{trace_id}")
        mine = sorted((f["fate"], f["reason"]) for f in answer["fates"] if f["suite_id"] == suite_id)
        assert mine == [("judged", "judged"), ("sampled", "sampled")], (trace_id, answer)
        lates = [f for f in answer["fates"] if f["fate"] == "late"]
        assert len(lates) == (1 if trace_id in late else 0), answer


async def test_a_span_batch_on_the_older_per_service_subject_is_still_assembled(pipeline: Pipeline) -> None:
    """A batch a collector from before split-trace assembly stored (on `obs.spans.<service>`, no
    trace token) during a rolling upgrade: assembled from what the replica holds, and judged."""
    p = pipeline
    suite_id = f"legacy-{uuid.uuid4().hex[:6]}"
    await apply_suite(p, suite_id, 1.0)
    trace_id = uuid.uuid4().hex
    root = SpanData(
        trace_id=trace_id,
        span_id=uuid.uuid4().hex[:16],
        name="handle-request",
        start_ns=time.time_ns(),
        end_ns=time.time_ns() + 1_000_000,
        attributes={"input.value": "legacy question", "output.value": "Thank you (legacy)"},
    )
    batch = ObservationSpans(
        target="support-bot",
        trace_id=trace_id,
        spans=(root,),
        resource={"service.name": "support-bot", "deployment.environment": "prod"},
    )
    assert batch.subject() == "obs.spans.support-bot"
    await p.nc.jetstream().publish(batch.subject(), encode(batch), headers={"Nats-Msg-Id": batch.msg_id()})

    async def judged_once() -> bool:
        return await judged(p, suite_id) == 1

    await eventually(judged_once, timeout_s=60, what="the legacy batch judged", diagnostics=p.diagnostics)
    _, answer = await api(p, "GET", f"/v1/online/observations/{trace_id}")
    mine = sorted((f["fate"], f["reason"]) for f in answer["fates"] if f["suite_id"] == suite_id)
    assert mine == [("judged", "judged"), ("sampled", "sampled")], answer


async def test_an_observation_the_judge_gives_up_on_is_dead_lettered_with_its_reason(pipeline: Pipeline) -> None:
    """A `case.observed` the judge cannot take (here: published on another observation's
    subject, which every stage refuses as poison) lands in the DLQ; its fate becomes
    `dead_lettered` with the reason of the service that gave up."""
    p = pipeline
    suite_id = f"dlq-{uuid.uuid4().hex[:6]}"
    observation_id = uuid.uuid4().hex
    event = CaseObserved(
        suite_id=suite_id,
        observation_id=observation_id,
        run_id=f"obs-{suite_id}-{observation_id}",
        result=CaseResult(case_id=observation_id, run_id=f"obs-{suite_id}-{observation_id}", harness="online@1"),
        plan=CasePlan(),
    )
    wrong_subject = f"case.observed.{suite_id}.somebody-else"
    ack = await p.nc.jetstream().publish(wrong_subject, encode(event), headers={"Nats-Msg-Id": event.msg_id()})
    assert ack.seq > 0

    async def dead_lettered() -> list[dict[str, Any]]:
        _, answer = await api(p, "GET", f"/v1/online/observations/{observation_id}")
        return [f for f in answer["fates"] if f["fate"] == "dead_lettered"]

    async def arrived() -> bool:
        return bool(await dead_lettered())

    await eventually(arrived, timeout_s=60, what="the dead-lettered fate", diagnostics=p.diagnostics)
    [fate] = await dead_lettered()
    assert (fate["suite_id"], fate["reason"]) == (suite_id, "poison")
    # the judge and the recorder both refuse it; the first dead letter decides the fate
    assert re.match(r"(judge|gateway): poison: case\.observed belongs on ", fate["detail"]), fate


def evalbus(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "evalbus.cli", *args], capture_output=True, text=True, timeout=60, check=False
    )


async def test_the_online_and_dlq_commands(pipeline: Pipeline, tmp_path: Path) -> None:
    p = pipeline
    gateway = ("--gateway", p.stack.gateway_url, "--token", p.stack.admin_token)
    suite_id = f"cli-{uuid.uuid4().hex[:6]}"
    good = tmp_path / "suites.yaml"
    good.write_text(
        f"suites:\n  - id: {suite_id}\n    target: {{service: support-bot}}\n    sample_ratio: 0.2\n"
        "    judges: [{kind: regex, id: polite, pattern: '(?i)thank'}]\n"
    )
    done = await asyncio.to_thread(evalbus, "online", "apply", str(good), *gateway)
    assert done.returncode == 0, done.stderr
    assert f"online suite {suite_id} applied (ratio 0.2)" in done.stdout
    bad = tmp_path / "bad.yaml"
    bad.write_text(f"id: {suite_id}-bad\ntarget: {{service: support-bot}}\njudges: []\n")
    refused = await asyncio.to_thread(evalbus, "online", "apply", str(bad), *gateway)
    assert refused.returncode == 2
    assert "at $.judges: an online suite needs at least one judge" in refused.stderr
    listed = await asyncio.to_thread(evalbus, "online", "ls", "--json", *gateway)
    assert suite_id in [item["suite"]["id"] for item in json.loads(listed.stdout)["items"]]
    why = await asyncio.to_thread(evalbus, "online", "why", uuid.uuid4().hex, *gateway)
    assert (why.returncode, "unknown — evalbus never received it" in why.stdout) == (1, True)
    removed = await asyncio.to_thread(evalbus, "online", "rm", suite_id, *gateway)
    assert removed.returncode == 0, removed.stderr

    # a poison message: dead-lettered, listed, shown, redriven once
    subject = f"case.observed.{suite_id}.garbage"
    await p.nc.jetstream().publish(subject, b"not an event", headers={"Nats-Msg-Id": f"garbage:{suite_id}"})
    nats_args = ("--nats", p.nats.url)

    async def letters() -> list[dict[str, Any]]:
        done = await asyncio.to_thread(evalbus, "dlq", "ls", "--json", *nats_args)
        assert done.returncode == 0, done.stderr
        return [x for x in json.loads(done.stdout) if x["subject"] == subject]

    async def dead_lettered() -> bool:
        return len(await letters()) == 2  # the judge and the recorder both refuse it

    await eventually(dead_lettered, timeout_s=60, what="the poison message in the DLQ")
    first = (await letters())[0]
    assert first["reason"].startswith("poison: undecodable payload")
    shown = await asyncio.to_thread(evalbus, "dlq", "show", str(first["seq"]), "--json", *nats_args)
    assert json.loads(shown.stdout)["payload"] == "not an event"
    for _ in range(2):  # the second redrive of the same letter is deduplicated
        redriven = await asyncio.to_thread(evalbus, "dlq", "redrive", str(first["seq"]), *nats_args)
        assert redriven.returncode == 0, redriven.stderr
    stored = await read_stream(p.nc, "CASES", (subject,))
    assert len(stored) == 2  # the original and one redrive
    nothing = await asyncio.to_thread(evalbus, "dlq", "redrive", *nats_args)
    assert nothing.returncode == 2


async def test_a_rate_cap_and_a_delay_hold_for_a_suite(pipeline: Pipeline) -> None:
    """A suite capped at 3 observations a minute and deciding 1 s after receipt: of 8 traces, per
    clock minute (the collector's, as the fates carry it) exactly min(3, decided that minute) are
    sampled and judged, the rest skipped `over_rate_cap`; and none is decided before its delay."""
    p = pipeline
    suite_id = f"cap-{uuid.uuid4().hex[:6]}"
    status, applied = await api(
        p,
        "POST",
        "/v1/online/suites",
        {
            "id": suite_id,
            "target": {"service": "capped-bot"},
            "sample_ratio": 1.0,
            "rate_per_min": 3,
            "delay_s": 1.0,
            "judges": [{"kind": "regex", "id": "polite", "pattern": "(?i)thank"}],
        },
    )
    assert status == 201, applied
    # the collector learns suites from the stream: wait until it samples for this one
    probe = application(p.stack.otlp_url, "capped-bot")
    probe_trace = await asyncio.to_thread(serve_request, probe, "ping", "Thanks")

    async def known() -> bool:
        _, answer = await api(p, "GET", f"/v1/online/observations/{probe_trace}")
        return any(f["suite_id"] == suite_id for f in answer["fates"])

    await eventually(known, timeout_s=60, what="the collector to know the suite", diagnostics=p.diagnostics)
    sent_at = time.time()
    traces = [await asyncio.to_thread(serve_request, probe, f"q{i}", f"Thank you {i}") for i in range(8)]
    probe.shutdown()
    everything = [probe_trace, *traces]

    async def all_decided() -> bool:
        # each of these traces decided for the suite (the suite's counts also hold other tests'
        # traces, skipped not_target, so they cannot tell when these are all decided)
        for trace_id in everything:
            _, answer = await api(p, "GET", f"/v1/online/observations/{trace_id}")
            if not any(f["suite_id"] == suite_id and f["fate"] in ("sampled", "skipped") for f in answer["fates"]):
                return False
        return True

    await eventually(all_decided, timeout_s=90, what="every trace decided", diagnostics=p.diagnostics)
    await p.quiescent(timeout_s=60)
    per_minute: dict[int, Counter[str]] = {}
    for trace_id in everything:
        _, answer = await api(p, "GET", f"/v1/online/observations/{trace_id}")
        [decided] = [f for f in answer["fates"] if f["suite_id"] == suite_id and f["fate"] in ("sampled", "skipped")]
        at = datetime.fromisoformat(decided["at"]).timestamp()
        if trace_id != probe_trace:
            assert at >= sent_at + 1.0, "decided before the suite's delay"
        per_minute.setdefault(int(at // 60), Counter())[decided["reason"]] += 1
    for minute, reasons in per_minute.items():
        decided_n = reasons["sampled"] + reasons["over_rate_cap"]
        assert reasons["sampled"] == min(3, decided_n), (minute, reasons)
    sampled = sum(r["sampled"] for r in per_minute.values())
    assert await judged(p, suite_id) == sampled


async def test_the_delay_before_judging_holds_whatever_the_application_clock_says(pipeline: Pipeline) -> None:
    """A suite deciding 2 s after receipt; observations published straight to `obs.received` whose
    own timestamps are 5 minutes ahead and 5 minutes behind (a skewed application clock). The
    delay runs on the bus's clock — from when JetStream stored each — so each is decided after 2 s,
    neither skipped (the clock behind) nor held 5 minutes more (the clock ahead)."""
    p = pipeline
    suite_id = f"skew-{uuid.uuid4().hex[:6]}"
    status, applied = await api(
        p,
        "POST",
        "/v1/online/suites",
        {
            "id": suite_id,
            "target": {"service": "skewed-bot"},
            "delay_s": 2.0,
            "judges": [{"kind": "regex", "id": "polite", "pattern": "(?i)thank"}],
        },
    )
    assert status == 201, applied
    probe = application(p.stack.otlp_url, "skewed-bot")
    probe_trace = await asyncio.to_thread(serve_request, probe, "ping", "Thanks")
    probe.shutdown()

    async def fate_of(trace_id: str) -> dict[str, Any] | None:
        _, answer = await api(p, "GET", f"/v1/online/observations/{trace_id}")
        return next((f for f in answer["fates"] if f["suite_id"] == suite_id and f["fate"] == "sampled"), None)

    async def known() -> bool:
        return await fate_of(probe_trace) is not None

    await eventually(known, timeout_s=60, what="the collector to know the suite", diagnostics=p.diagnostics)
    js = p.nc.jetstream()
    published: dict[str, float] = {}
    for skew in (timedelta(minutes=5), timedelta(minutes=-5)):
        trace_id = uuid.uuid4().hex
        obs = ObservationReceived(
            target="skewed-bot",
            observation_id=trace_id,
            trace_id=trace_id,
            input="where is my order?",
            output="Thank you, it ships.",
            ts=datetime.now(UTC) + skew,
        )
        before = time.time()
        await js.publish(obs.subject(), encode(obs), headers={"Nats-Msg-Id": obs.msg_id()})
        published[trace_id] = before

    async def decided() -> bool:
        return all([await fate_of(t) is not None for t in published])

    await eventually(decided, timeout_s=30, what="both observations decided", diagnostics=p.diagnostics)
    for trace_id, before in published.items():
        fate = await fate_of(trace_id)
        assert fate is not None
        waited = datetime.fromisoformat(fate["at"]).timestamp() - before
        assert 2.0 <= waited < 10.0, (trace_id, waited)


async def test_a_daily_budget_stops_model_judges_and_spares_rule_judges(pipeline: Pipeline) -> None:
    """Two suites on the same traces, each with a daily budget of three model-judge calls (the
    provider reports 10 + 5 tokens a call, priced at $100 per million: $0.0015 a call): a suite of a
    rule and a model judge, and one of a model judge only. Traces sent one after another: per suite
    exactly three get a model score, every later one is `skipped: over_budget` — the mixed suite's
    still judged by its rule judge, the other's not judged at all — the provider got exactly those
    six calls, and the stats, the per-trace answer and the judge's Prometheus counter say so."""
    p = pipeline
    provider = ChatCompletionsServer()
    await provider.start()
    try:
        tag = uuid.uuid4().hex[:6]
        service = f"budget-bot-{tag}"
        model = {
            "kind": "model",
            "id": "quality",
            "base_url": f"{provider.root}/v1",
            "rubric": "polite and correct",
            "price": {"input_per_mtok": 100.0, "output_per_mtok": 100.0},
        }
        polite = {"kind": "regex", "id": "polite", "pattern": "(?i)thank"}
        suites = {f"mixed-{tag}": [polite, model], f"model-{tag}": [model]}
        for suite_id, judges in suites.items():
            status, applied = await api(
                p,
                "POST",
                "/v1/online/suites",
                {"id": suite_id, "target": {"service": service}, "judges": judges, "budget_usd_per_day": 0.0045},
            )
            assert status == 201, applied
            assert applied["suite"]["budget_usd_per_day"] == 0.0045
        # the collector follows suites from the stream: a trace of another service tells when it knows both
        probe = application(p.stack.otlp_url, f"probe-{tag}")
        probe_trace = await asyncio.to_thread(serve_request, probe, "ping", "pong")
        probe.shutdown()

        async def known() -> bool:
            _, answer = await api(p, "GET", f"/v1/online/observations/{probe_trace}")
            return {f["suite_id"] for f in answer["fates"]} >= set(suites)

        await eventually(known, timeout_s=60, what="the collector to know both suites", diagnostics=p.diagnostics)
        app = application(p.stack.otlp_url, service)

        async def settled(trace_id: str) -> bool:
            """Each suite has decided the trace: judged, or skipped over its budget."""
            _, answer = await api(p, "GET", f"/v1/online/observations/{trace_id}")
            done = {f["suite_id"] for f in answer["fates"] if f["fate"] == "judged" or f["reason"] == "over_budget"}
            return done >= set(suites)

        traces: list[str] = []
        for i in range(6):  # one at a time, so the budget is met exactly (no call in flight races the check)
            trace_id = await asyncio.to_thread(serve_request, app, f"q{i}", f"Thank you {i}")
            await eventually(
                lambda t=trace_id: settled(t), timeout_s=60, what=f"trace {i} settled", diagnostics=p.diagnostics
            )
            traces.append(trace_id)
        app.shutdown()
        await p.quiescent(timeout_s=60)

        fates: dict[str, dict[str, list[tuple[str, str]]]] = {s: {} for s in suites}
        for trace_id in traces:
            _, answer = await api(p, "GET", f"/v1/online/observations/{trace_id}")
            for f in answer["fates"]:
                if f["suite_id"] in suites:
                    fates[f["suite_id"]].setdefault(trace_id, []).append((f["fate"], f["reason"]))
        for suite_id in suites:
            mine = [t for t in traces if ("sampled", "sampled") in fates[suite_id].get(t, [])]
            assert mine == traces, fates[suite_id]
            over = [t for t in mine if ("skipped", "over_budget") in fates[suite_id][t]]
            assert over == mine[3:], fates[suite_id]  # the first three spend the budget, the rest are over it
            runs = {
                r["case_id"]: json.loads(r["scores"])
                for r in await p.pool.fetch(
                    "SELECT case_id, scores::text AS scores FROM runs WHERE batch_id = $1", f"online-{suite_id}"
                )
            }
            measured = [
                t
                for t, scores in runs.items()
                if any(s["metric"] == "judge:quality" and s["status"] == "measured" for s in scores)
            ]
            assert sorted(measured) == sorted(mine[:3])
            for t in mine[:3]:
                [quality] = [s for s in runs[t] if s["metric"] == "judge:quality"]
                assert quality["usage"] == {
                    "model": "gpt-4o-mini",
                    "input_tokens": 10,
                    "output_tokens": 5,
                    "cost_usd": 0.0015,
                    "cost_source": "price",
                }
            if suite_id.startswith("mixed-"):  # the rule judge ran on every one, over budget too
                assert set(runs) == set(mine)
                for t in over:
                    by_metric = {s["metric"]: s for s in runs[t]}
                    assert by_metric["judge:polite"]["pass"] is True
                    assert (by_metric["judge:quality"]["status"], by_metric["judge:quality"]["reason"]) == (
                        "unmeasured",
                        "policy_skip",
                    )
                    assert fates[suite_id][t].count(("judged", "judged")) == 1
            else:  # nothing else to run: not judged at all
                assert set(runs) == set(mine[:3])
                for t in over:
                    assert ("judged", "judged") not in fates[suite_id][t]
            status, body = await api(p, "GET", f"/v1/online/stats?suite={suite_id}")
            assert status == 200
            counts = {(c["fate"], c["reason"]): c["count"] for c in body["counts"]}
            assert counts[("skipped", "over_budget")] == len(over)
            # what its model judges cost, per window, from the judged scores
            status, detail = await api(p, "GET", f"/v1/online/suites/{suite_id}")
            assert status == 200, detail
            usage = {w["window"]: w["usage"] for w in detail["judge_usage"]}
            assert set(usage) == {"hour", "day", "week"}
            assert usage["day"].pop("cost_usd") == pytest.approx(3 * 0.0015)
            assert usage["day"] == {"calls": 3, "input_tokens": 30, "output_tokens": 15}
        assert len(provider.requests) == 6  # three per suite, none over a budget

        async with (
            aiohttp.ClientSession() as http,
            http.get(p.stack.procs["judge"].url + "/metrics") as resp,
        ):
            metrics = await resp.text()
        for suite_id in suites:
            over_n = sum(("skipped", "over_budget") in v for v in fates[suite_id].values())
            line = (
                f'evalbus_online_fates_total{{fate="skipped",reason="over_budget",suite="{suite_id}"}} {float(over_n)}'
            )
            assert line in metrics, [m for m in metrics.splitlines() if suite_id in m]
    finally:
        await provider.stop()
