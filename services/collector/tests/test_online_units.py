"""Online evaluation, the pure parts: sampling against the real OpenTelemetry sampler, the decision
and its fates, OTLP request decoding, trace assembly with an injected clock."""

from __future__ import annotations

import gzip
import json
from datetime import UTC, datetime

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.proto.common.v1.common_pb2 import AnyValue, KeyValue
from opentelemetry.proto.resource.v1.resource_pb2 import Resource
from opentelemetry.proto.trace.v1.trace_pb2 import ResourceSpans, ScopeSpans
from opentelemetry.proto.trace.v1.trace_pb2 import Span as OtlpSpan
from opentelemetry.sdk.trace.sampling import Decision, TraceIdRatioBased

from evalbus_collector.online.assembly import NS, StoredBatch, TraceAssembler, cut
from evalbus_collector.online.decide import decide, observed_run_id, sampling_key
from evalbus_collector.online.observation import observation_of
from evalbus_collector.online.otlp_ingest import OtlpRequestError, ingest_request, read_body
from evalbus_collector.online.receiver import split_batch
from evalbus_collector.online.trace_store import datetime_ns, rfc3339_ns
from evalbus_contracts import (
    Message,
    ObservationReceived,
    ObservationSpans,
    OnlineSuiteSpec,
    OnlineTarget,
    RegexJudge,
    SpanData,
    encode,
    sampled_by_trace_id,
)
from evalbus_contracts.sampling import valid_trace_id

pytestmark = pytest.mark.unit

TRACE_IDS = st.integers(min_value=1, max_value=(1 << 128) - 1)
RATIOS = st.floats(min_value=0.0, max_value=1.0, allow_nan=False)


# ---------------------------------------------------------------- sampling


@settings(max_examples=2000, deadline=None)
@given(trace_id=TRACE_IDS, ratio=RATIOS)
def test_sampling_decides_exactly_as_the_opentelemetry_sampler(trace_id: int, ratio: float) -> None:
    otel = TraceIdRatioBased(ratio).should_sample(None, trace_id, "root").decision
    assert sampled_by_trace_id(f"{trace_id:032x}", ratio) == (otel is Decision.RECORD_AND_SAMPLE)


@settings(max_examples=2000, deadline=None)
@given(trace_id=TRACE_IDS, low=RATIOS, high=RATIOS)
def test_samples_nest_what_is_sampled_at_a_lower_ratio_is_sampled_at_a_higher(
    trace_id: int, low: float, high: float
) -> None:
    low, high = min(low, high), max(low, high)
    if sampled_by_trace_id(f"{trace_id:032x}", low):
        assert sampled_by_trace_id(f"{trace_id:032x}", high)
        assert TraceIdRatioBased(high).should_sample(None, trace_id, "root").decision is Decision.RECORD_AND_SAMPLE


def test_sampling_reads_the_low_64_bits_so_timestamped_ids_do_not_clump() -> None:
    # X-Ray style: the same high bits (a timestamp), random low bits; about half sampled at 0.5
    ids = [f"5f000000{i:08x}{(i * 0x9E3779B97F4A7C15) % (1 << 64):016x}" for i in range(2000)]
    sampled = sum(sampled_by_trace_id(t, 0.5) for t in ids)
    assert 900 <= sampled <= 1100


def test_valid_trace_ids() -> None:
    assert valid_trace_id("0af7651916cd43dd8448eb211c80319c")
    for bad in (None, "", "0" * 32, "0AF7651916CD43DD8448EB211C80319C", "xyz", "0af7651916cd43dd8448eb211c80319"):
        assert not valid_trace_id(bad)


# ---------------------------------------------------------------- the decision


def obs(trace_id: str | None = "0af7651916cd43dd8448eb211c80319c", **metadata: str) -> ObservationReceived:
    return ObservationReceived(
        target="support-bot",
        observation_id=trace_id or "obs-1",
        trace_id=trace_id,
        input="Where is my order?",
        output="Thank you, it ships today.",
        metadata={"service.name": "support-bot", **metadata},
    )


def suite(suite_id: str = "polite", ratio: float = 1.0, **target: object) -> OnlineSuiteSpec:
    return OnlineSuiteSpec(
        id=suite_id,
        target=OnlineTarget(**target) if target else OnlineTarget(service="support-bot"),  # type: ignore[arg-type]
        sample_ratio=ratio,
        judges=(RegexJudge(id="thanks", pattern="(?i)thank"),),
    )


def test_no_suite_is_a_counted_skip() -> None:
    decision = decide(obs(), [])
    assert [(f.suite_id, f.fate, f.reason) for f in decision.fates] == [(None, "skipped", "no_suite")]
    assert decision.observed == ()


def test_a_sampled_observation_becomes_case_observed_with_its_conversation() -> None:
    decision = decide(obs(), [suite()])
    assert [(f.suite_id, f.fate, f.reason) for f in decision.fates] == [("polite", "sampled", "sampled")]
    [observed] = decision.observed
    assert observed.suite_id == "polite"
    assert observed.run_id == observed_run_id("polite", observed.observation_id)
    assert observed.plan.judges == suite().judges
    assert observed.result.answer == "Thank you, it ships today."
    assert [(m.role, m.text) for m in observed.result.trace if isinstance(m, Message)] == [
        ("user", "Where is my order?"),
        ("assistant", "Thank you, it ships today."),
    ]
    # deterministic dedup ids: the same observation twice gives the same ids
    again = decide(obs(), [suite()])
    assert [e.msg_id() for e in again.observed] == [e.msg_id() for e in decision.observed]
    assert [e.msg_id() for e in again.fates] == [e.msg_id() for e in decision.fates]


def test_every_suite_gets_its_own_fate_and_reason() -> None:
    suites = [
        suite("a-prod", service="support-bot", attributes={"deployment.environment": "prod"}),
        suite("b-other", service="billing-bot"),
        suite("c-agent", agent="triage"),
        suite("d-none", ratio=0.0),
        suite("e-all", ratio=1.0),
    ]
    decision = decide(obs(**{"deployment.environment": "staging"}), suites)
    got = {f.suite_id: (f.fate, f.reason) for f in decision.fates}
    assert got == {
        "a-prod": ("skipped", "filtered"),
        "b-other": ("skipped", "not_target"),
        "c-agent": ("skipped", "not_target"),
        "d-none": ("skipped", "not_sampled"),
        "e-all": ("sampled", "sampled"),
    }
    assert [o.suite_id for o in decision.observed] == ["e-all"]
    detail = {f.suite_id: f.detail for f in decision.fates}
    assert detail["a-prod"] == "deployment.environment is 'staging', the suite takes 'prod'"


def test_a_malformed_trace_id_is_dropped_and_a_missing_one_sampled_by_observation_id() -> None:
    dropped = decide(obs("not-a-trace-id"), [suite()])
    assert [(f.fate, f.reason) for f in dropped.fates] == [("dropped", "invalid_trace_id")]
    assert dropped.observed == ()
    missing = obs(None)
    key = sampling_key(missing)
    assert key is not None
    assert valid_trace_id(key)
    assert sampling_key(missing) == key  # deterministic
    assert len(decide(missing, [suite()]).observed) == 1


# ---------------------------------------------------------------- OTLP decoding


TRACE = "5b8efff798038103d269b633813fc60c"
ROOT = "eee19b7ec3c1b174"
CHILD = "eee19b7ec3c1b173"


def _kv(key: str, value: str | int) -> KeyValue:
    any_value = AnyValue(string_value=value) if isinstance(value, str) else AnyValue(int_value=value)
    return KeyValue(key=key, value=any_value)


def proto_request() -> bytes:
    root = OtlpSpan(
        trace_id=bytes.fromhex(TRACE),
        span_id=bytes.fromhex(ROOT),
        name="chat",
        start_time_unix_nano=1_000_000_000,
        end_time_unix_nano=3_000_000_000,
        attributes=[_kv("input.value", "hello"), _kv("output.value", "thank you")],
    )
    child = OtlpSpan(
        trace_id=bytes.fromhex(TRACE),
        span_id=bytes.fromhex(CHILD),
        parent_span_id=bytes.fromhex(ROOT),
        name="llm",
        start_time_unix_nano=1_500_000_000,
        end_time_unix_nano=2_500_000_000,
        attributes=[_kv("gen_ai.request.model", "m-1"), _kv("gen_ai.usage.input_tokens", 12)],
    )
    bad = OtlpSpan(name="no ids")
    request = ExportTraceServiceRequest(
        resource_spans=[
            ResourceSpans(
                resource=Resource(
                    attributes=[_kv("service.name", "support-bot"), _kv("deployment.environment", "prod")]
                ),
                scope_spans=[ScopeSpans(spans=[root, child, bad])],
            )
        ]
    )
    return bytes(request.SerializeToString())


def json_request() -> bytes:
    return json.dumps(
        {
            "resourceSpans": [
                {
                    "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "support-bot"}}]},
                    "scopeSpans": [
                        {
                            "spans": [
                                {
                                    "traceId": TRACE,
                                    "spanId": ROOT,
                                    "name": "chat",
                                    "startTimeUnixNano": "1000000000",
                                    "endTimeUnixNano": "3000000000",
                                    "attributes": [{"key": "input.value", "value": {"stringValue": "hello"}}],
                                    "status": {"code": 2, "message": "boom"},
                                },
                                {"traceId": "zz", "spanId": CHILD, "name": "bad"},
                            ]
                        }
                    ],
                }
            ]
        }
    ).encode()


def test_a_protobuf_request_is_grouped_per_trace_and_bad_spans_counted() -> None:
    got = ingest_request(proto_request(), "application/x-protobuf", received_ns=5)
    assert got.rejected == 1
    assert got.reasons == ["span 'no ids' has no valid trace id and span id"]
    [batch] = got.batches
    assert (batch.target, batch.trace_id, batch.received_ns) == ("support-bot", TRACE, 5)
    assert batch.resource == {"service.name": "support-bot", "deployment.environment": "prod"}
    spans = {s.span_id: s for s in batch.spans}
    assert spans[ROOT].parent_id is None
    assert spans[ROOT].end_ns == 3_000_000_000
    assert spans[CHILD].parent_id == ROOT
    assert spans[CHILD].attributes == {"gen_ai.request.model": "m-1", "gen_ai.usage.input_tokens": 12}


def test_a_json_request_reads_hex_ids_and_error_status() -> None:
    got = ingest_request(json_request(), "application/json; charset=utf-8", received_ns=0)
    assert got.rejected == 1
    [batch] = got.batches
    [span] = batch.spans
    assert (span.trace_id, span.span_id, span.error, span.status_message) == (TRACE, ROOT, True, "boom")
    assert span.attributes == {"input.value": "hello"}


@pytest.mark.parametrize(
    ("body", "content_type", "status"),
    [
        (b"\x00\xff garbage", "application/x-protobuf", 400),
        (b"{not json", "application/json", 400),
        (b"[1, 2]", "application/json", 400),
        (b"{}", "text/plain", 415),
        (b"{}", None, 415),
    ],
)
def test_unreadable_requests_are_refused_with_the_otlp_status(
    body: bytes, content_type: str | None, status: int
) -> None:
    with pytest.raises(OtlpRequestError) as caught:
        ingest_request(body, content_type, received_ns=0)
    assert caught.value.status == status


def test_bodies_are_limited_after_decompression() -> None:
    small = gzip.compress(b"x" * 10_000)
    assert len(small) < 1000
    assert read_body(small, "gzip", 10_000) == b"x" * 10_000
    with pytest.raises(OtlpRequestError) as over:
        read_body(small, "gzip", 9_999)
    assert over.value.status == 413
    with pytest.raises(OtlpRequestError) as plain:
        read_body(b"x" * 101, None, 100)
    assert plain.value.status == 413
    with pytest.raises(OtlpRequestError) as broken:
        read_body(b"not gzip", "gzip", 100)
    assert broken.value.status == 400
    with pytest.raises(OtlpRequestError) as unknown:
        read_body(b"x", "br", 100)
    assert unknown.value.status == 415


def test_large_span_batches_are_split_under_the_message_limit() -> None:
    spans = tuple(
        SpanData(trace_id=TRACE, span_id=f"{i + 1:016x}", name="s", attributes={"payload": "y" * 1000})
        for i in range(600)
    )
    batch = ObservationSpans(target="t", trace_id=TRACE, spans=spans)
    parts = split_batch(batch, limit=64 * 1024)
    assert len(parts) > 1
    assert all(len(encode(p)) <= 64 * 1024 for p in parts)
    assert [s for p in parts for s in p.spans] == list(spans)


# ---------------------------------------------------------------- assembly


class Clock:
    """Bus time in nanoseconds, moved by hand."""

    def __init__(self) -> None:
        self.now = 100 * NS

    def __call__(self) -> int:
        return self.now


def span(span_id: str, parent: str | None = None, end: int | None = 2) -> SpanData:
    return SpanData(trace_id=TRACE, span_id=span_id, parent_id=parent, start_ns=1, end_ns=end)


def batch(*spans: SpanData) -> ObservationSpans:
    return ObservationSpans(target="support-bot", trace_id=TRACE, spans=spans, trace_subject=True)


def stored(seq: int, at_s: float, *spans: SpanData) -> StoredBatch:
    return StoredBatch(seq=seq, stored_ns=int(at_s * NS), batch=batch(*spans))


SUBJECT = f"obs.spans.support-bot.{TRACE}"


def test_a_trace_is_whole_once_its_root_ended_and_nothing_came_for_settle_s() -> None:
    child, root = stored(1, 100, span(CHILD, ROOT)), stored(7, 110, span(ROOT))
    view = cut([child], settle_ns=5 * NS, max_wait_ns=60 * NS)
    assert (view.root_ended, view.due_ns) == (False, 160 * NS)  # no root yet: up to max_wait_s
    view = cut([root, child], settle_ns=5 * NS, max_wait_ns=60 * NS)  # any order in: stream order out
    assert (view.included, view.late, view.root_ended, view.due_ns) == ((child, root), (), True, 115 * NS)
    assert view.last_seq == 7
    assert {s.span_id for s in view.spans()} == {ROOT, CHILD}


def test_what_came_after_the_trace_was_whole_is_late_the_same_for_every_reader() -> None:
    root, child = stored(1, 100, span(ROOT)), stored(2, 104.9, span(CHILD, ROOT))
    after_settle = stored(3, 110, span("0000000000000009", ROOT))
    straggler = stored(4, 110.1, span("000000000000000a", ROOT))
    view = cut([straggler, after_settle, child, root], settle_ns=5 * NS, max_wait_ns=60 * NS)
    assert (view.included, view.late) == ((root, child), (after_settle, straggler))
    # without an ended root the trace is whole max_wait_s after its first batch
    open_root = stored(1, 100, span(ROOT, end=None))
    late = stored(6, 160, span(CHILD, ROOT))
    view = cut(
        [open_root, stored(5, 159.9, span("000000000000000b", ROOT)), late], settle_ns=5 * NS, max_wait_ns=60 * NS
    )
    assert [b.seq for b in view.included] == [1, 5]
    assert view.late == (late,)
    assert cut([], settle_ns=1, max_wait_ns=1).last_seq == 0


def test_the_assembler_wakes_a_trace_when_it_may_be_whole_and_again_as_scheduled() -> None:
    clock = Clock()
    asm = TraceAssembler(settle_s=5, max_wait_s=60, clock=clock)
    trace, owner = asm.add(StoredBatch(seq=3, stored_ns=clock.now, batch=batch(span(CHILD, ROOT))), SUBJECT)
    assert owner
    assert trace.trace_subject
    assert trace.subject == SUBJECT
    clock.now += int(4.9 * NS)
    assert asm.due() == []
    clock.now += int(0.2 * NS)
    assert asm.due() == [trace]  # maybe whole: the owner reads the stream
    assert trace.wake.is_set()
    trace.wake.clear()
    # the stream has no root either (held by another replica, or not sent yet): look again within settle_s
    asm.schedule(trace, asm.cut(list(trace.local.values())))
    clock.now += 4 * NS
    assert asm.due() == []
    clock.now += 1 * NS
    assert asm.due() == [trace]
    _, second = asm.add(StoredBatch(seq=9, stored_ns=clock.now, batch=batch(span(ROOT))), SUBJECT)
    assert not second
    asm.finish(trace, 9)
    assert asm.pending == 0
    assert asm.assembled(batch(span("0000000000000009", ROOT))) == 9


def test_an_abandoned_trace_is_not_remembered_when_its_batches_come_again() -> None:
    clock = Clock()
    asm = TraceAssembler(clock=clock)
    trace, _ = asm.add(StoredBatch(seq=1, stored_ns=clock.now, batch=batch(span(ROOT))), SUBJECT)
    asm.abandon(trace)
    assert asm.assembled(batch(span(ROOT))) is None
    assert asm.pending == 0


def test_bus_times_read_to_the_nanosecond() -> None:
    assert rfc3339_ns("2026-12-01T15:25:57.94966555Z") == 1_796_138_757_949_665_550
    assert rfc3339_ns("2026-12-01T15:25:57Z") == 1_796_138_757 * NS
    assert datetime_ns(datetime(2026, 12, 1, 15, 25, 57, 949665, tzinfo=UTC)) == 1_796_138_757_949_665_000


def test_an_assembled_trace_maps_to_an_observation() -> None:
    root = SpanData(
        trace_id=TRACE,
        span_id=ROOT,
        name="chat",
        start_ns=1_000_000_000,
        end_ns=3_000_000_000,
        attributes={"input.value": "hello", "output.value": "thank you", "gen_ai.agent.name": "triage"},
    )
    llm = SpanData(
        trace_id=TRACE,
        span_id=CHILD,
        parent_id=ROOT,
        name="llm",
        start_ns=1_500_000_000,
        end_ns=2_500_000_000,
        attributes={"gen_ai.request.model": "m-1", "gen_ai.usage.input_tokens": 12},
    )
    got = observation_of("support-bot", TRACE, [llm, root], {"service.name": "support-bot"})
    assert (got.observation_id, got.trace_id, got.input, got.output) == (TRACE, TRACE, "hello", "thank you")
    assert got.metadata["gen_ai.agent.name"] == "triage"
    assert got.metadata["service.name"] == "support-bot"
    assert [type(e).__name__ for e in got.trace] == ["Message", "Span", "LlmCall", "Message"]
