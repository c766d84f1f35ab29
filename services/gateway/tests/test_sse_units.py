"""SSE framing and parsing as pure logic: frames survive any chunking and multi-line data."""

from __future__ import annotations

import pytest

from evalbus_gateway.api.sse import end_frame, event_type, final_status, frame
from evalbus_gateway.client import SseEvent, SseParser

pytestmark = pytest.mark.unit


def test_frames_round_trip_through_the_parser_in_any_chunking() -> None:
    stream = (
        b": hello\n\n"
        + frame(b'{"type":"case.executed","x":1}', event="case.executed", event_id=41)
        + b": heartbeat\n\n"
        + frame(b"line one\nline two", event="note", event_id=42)
        + end_frame("b1", "cancelled")
    )
    expected = [
        SseEvent(41, "case.executed", '{"type":"case.executed","x":1}'),
        SseEvent(42, "note", "line one\nline two"),
        SseEvent(42, "end", '{"batch_id":"b1","status":"cancelled"}'),
    ]
    for size in (1, 2, 7, len(stream)):
        parser = SseParser()
        events = [e for i in range(0, len(stream), size) for e in parser.feed(stream[i : i + size])]
        assert events == expected, size


def test_crlf_lines_and_unknown_fields() -> None:
    parser = SseParser()
    events = parser.feed(b"retry: 10\r\nid: 7\r\nevent: x\r\ndata: a\r\n\r\n")
    assert events == [SseEvent(7, "x", "a")]


def test_event_type_from_header_or_payload() -> None:
    assert event_type({"Evalbus-Type": "case.judged"}, b"{}") == "case.judged"
    assert event_type(None, b'{"type": "batch.finalized"}') == "batch.finalized"
    assert event_type({}, b"not json") == "message"


def test_final_status() -> None:
    assert final_status(b'{"type": "batch.finalized", "status": "superseded"}') == "superseded"
    assert final_status(b"garbage") == "failed"


def test_event_names_cannot_break_the_framing() -> None:
    assert frame(b"d", event="a\nb") == b"event: a b\ndata: d\n\n"
