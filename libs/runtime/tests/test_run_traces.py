"""Each run has its own trace, linked to its batch's: the headers `case.requested` goes out with,
the spans the SDK records, and the trace id in log lines."""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator

import msgspec
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from evalbus.testing.bus import request
from evalbus_contracts import CaseExecuted, CasePlan, CaseResult
from evalbus_runtime import tracing
from evalbus_runtime.logs import JsonFormatter, run_id_var
from evalbus_runtime.publisher import event_headers

pytestmark = pytest.mark.unit

BATCH_PARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"


def trace_of(traceparent: str) -> str:
    return traceparent.split("-")[1]


def executed(run_id: str) -> CaseExecuted:
    result = CaseResult(case_id="c1", run_id=run_id, harness="h@1")
    return CaseExecuted(batch_id="b1", case_id="c1", run_id=run_id, status="succeeded", result=result, plan=CasePlan())


def test_the_run_trace_id_is_derived_from_the_run_id() -> None:
    a, b = tracing.run_trace_id("evb-b1-c1"), tracing.run_trace_id("evb-b1-c2")
    assert a == tracing.run_trace_id("evb-b1-c1")
    assert a != b
    assert len(a) == 32
    assert int(a, 16) != 0


def test_without_an_exporter_case_requested_starts_the_run_trace_and_later_stages_stay_in_it() -> None:
    case = request("b1", "c1")
    with tracing.message_span("dispatcher batch", {"traceparent": BATCH_PARENT}, {}):
        opened = event_headers(case)["traceparent"]
        other = event_headers(request("b1", "c2"))["traceparent"]
        batch_level = event_headers(executed("x"))["traceparent"]
    assert trace_of(opened) == tracing.run_trace_id(case.run_id or "")
    assert trace_of(other) != trace_of(opened)
    assert batch_level == BATCH_PARENT  # not a run-opening event: the inbound trace goes on
    with tracing.message_span("dispatcher process", {"traceparent": opened}, {}):
        assert event_headers(executed(case.run_id or ""))["traceparent"] == opened
        # a retried attempt of the same run lands in the same trace
        again = event_headers(msgspec.structs.replace(case, attempt=2))["traceparent"]
    assert trace_of(again) == trace_of(opened)


def test_an_explicit_traceparent_is_kept() -> None:
    assert event_headers(request("b1", "c1"), {"traceparent": BATCH_PARENT})["traceparent"] == BATCH_PARENT


def test_log_lines_carry_the_trace_id_of_the_message_being_handled() -> None:
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.setFormatter(JsonFormatter("dispatcher"))
    logger = logging.getLogger("evalbus.test.run_traces")
    logger.addHandler(handler)
    logger.propagate = False
    try:
        opened = event_headers(request("b1", "c1"))["traceparent"]
        token = run_id_var.set("evb-b1-c1")
        with tracing.message_span("dispatcher process", {"traceparent": opened}, {}):
            logger.warning("handling")
        run_id_var.reset(token)
        logger.warning("idle")
    finally:
        logger.removeHandler(handler)
    handling, idle = (msgspec.json.decode(line) for line in out.getvalue().splitlines())
    assert handling["trace_id"] == tracing.run_trace_id("evb-b1-c1")
    assert handling["run_id"] == "evb-b1-c1"
    assert "trace_id" not in idle


@pytest.fixture
def spans() -> Iterator[InMemorySpanExporter]:
    exporter = InMemorySpanExporter()
    if not isinstance(trace.get_tracer_provider(), trace.ProxyTracerProvider):
        pytest.fail("another test installed a tracer provider; this test needs its own")  # pragma: no cover
    tracing.install_provider("dispatcher", SimpleSpanProcessor(exporter))
    try:
        yield exporter
    finally:
        tracing._enabled = False  # the global provider stays; spans stop being made


def test_with_the_sdk_each_run_is_a_root_span_linked_to_the_batch_and_stages_are_its_children(
    spans: InMemorySpanExporter,
) -> None:
    case = request("b1", "c1")
    with tracing.message_span("dispatcher batch", {"traceparent": BATCH_PARENT}, {}):
        opened = event_headers(case)["traceparent"]
    with tracing.message_span("dispatcher process", {"traceparent": opened}, {}):
        passed_on = event_headers(executed(case.run_id or ""))["traceparent"]
    by_name = {s.name: s for s in spans.get_finished_spans()}
    batch, run, stage = by_name["dispatcher batch"], by_name["run"], by_name["dispatcher process"]
    assert batch.context is not None
    assert run.context is not None
    assert stage.context is not None
    assert format(batch.context.trace_id, "032x") == trace_of(BATCH_PARENT)
    assert format(run.context.trace_id, "032x") == tracing.run_trace_id(case.run_id or "")
    assert run.parent is None
    assert [link.context.span_id for link in run.links] == [batch.context.span_id]
    assert run.attributes is not None
    assert run.attributes["evalbus.run_id"] == case.run_id
    assert stage.parent is not None
    assert stage.parent.span_id == run.context.span_id
    assert trace_of(passed_on) == trace_of(opened)
    # outside any message the next trace ids are random again
    with tracing.message_span("loose", None, {}):
        pass
    loose = next(s for s in spans.get_finished_spans() if s.name == "loose")
    assert loose.context is not None
    assert format(loose.context.trace_id, "032x") != trace_of(opened)
