"""The pure parts of the live views: byte-exact tails that never cut a character, the tail
snapshot of a run's chunks, the live trace of its marks and events, and the SSE frames."""

from __future__ import annotations

from typing import Literal

import msgspec
import pytest

from evalbus_api.client import SseParser
from evalbus_api.live import LogChunk, RunStreamEnd
from evalbus_contracts import Infra, InfraMark, LiveLog, LiveTrace, ToolCall, decode
from evalbus_gateway.live import Stored
from evalbus_gateway.live.views import (
    chunk_end,
    drop_head,
    end_frame,
    live_trace,
    log_frames,
    log_tail,
    tail_target,
    trace_frames,
    utf8_tail,
)

pytestmark = pytest.mark.unit

RUN = "evb-b1-c1"


def chunk(seq: int, text: str, offset: int, stream: Literal["stdout", "stderr"] = "stdout") -> Stored:
    return Stored(seq=seq, event=LiveLog(run_id=RUN, seq=seq, stream=stream, text=text, offset=offset))


def test_drop_head_and_tail_never_cut_a_character() -> None:
    text = "aé日🙂z"  # 1 + 2 + 3 + 4 + 1 bytes
    assert drop_head(text, 0) == text
    assert drop_head(text, 1) == "é日🙂z"
    assert drop_head(text, 2) == "日🙂z"  # inside é: the rest of it goes too
    assert drop_head(text, 4) == "🙂z"
    assert drop_head(text, 11) == ""
    assert utf8_tail(text, 100) == (text, False)
    assert utf8_tail(text, 5) == ("🙂z", True)
    assert utf8_tail(text, 4) == ("z", True)


def test_the_tail_starts_limit_bytes_before_the_end_of_the_last_chunk() -> None:
    last = LiveLog(run_id=RUN, seq=9, stream="stdout", text="日本", offset=100)
    assert chunk_end(last) == 106
    assert tail_target(last, 50) == 56


def test_a_log_tail_cuts_its_first_chunk_and_holds_at_most_the_limit() -> None:
    chunks = [chunk(10, "0123456789", 90), chunk(12, "abcdé\n", 100, "stderr"), chunk(15, "end\n", 106)]
    tail = log_tail(RUN, "running", chunks, skip=4, limit=1000)
    assert tail.text == "456789abcdé\nend\n"
    assert (tail.found, tail.truncated, tail.last_event_id) == (True, True, 15)
    capped = log_tail(RUN, "running", chunks, skip=0, limit=6)
    assert capped.text == "\nend\n"  # é is 2 bytes: never half of it
    whole = log_tail(RUN, "succeeded", [chunk(3, "all of it\n", 0)], skip=0, limit=1000)
    assert (whole.text, whole.truncated, whole.status) == ("all of it\n", False, "succeeded")
    empty = log_tail(RUN, "queued", [], skip=0, limit=1000)
    assert (empty.found, empty.text, empty.last_event_id) == (False, "", None)


def test_the_live_trace_is_marks_and_events_in_stream_order() -> None:
    accepted = Infra(scope="placement", event="accepted")
    call = ToolCall(id="1", name="x", t=0.5)
    messages = [
        Stored(seq=4, event=InfraMark(run_id=RUN, mark=accepted)),
        chunk(5, "log lines are not trace\n", 0),
        Stored(seq=7, event=LiveTrace(run_id=RUN, seq=1, events=(call,))),
    ]
    view = live_trace(RUN, "running", messages)
    assert view.events == (accepted, call)
    assert (view.found, view.last_event_id) == (True, 7)
    assert live_trace(RUN, "queued", []).found is False


def test_a_message_of_several_marks_or_events_is_each_of_them_and_resumes_after_the_last() -> None:
    accepted, started = Infra(scope="placement", event="accepted"), Infra(scope="placement", event="started")
    calls = (ToolCall(id="1", name="x"), ToolCall(id="2", name="y"))
    marks = Stored(seq=4, event=InfraMark(run_id=RUN, mark=accepted, more=(started,)))
    trace = Stored(seq=5, event=LiveTrace(run_id=RUN, seq=1, events=calls))
    assert live_trace(RUN, "running", [marks, trace]).events == (accepted, started, *calls)
    parsed = SseParser().feed(b"".join([*trace_frames(marks), *trace_frames(trace)]))
    # only a message's last frame carries its sequence: a client cut off inside it gets it again
    assert [(e.id, msgspec.json.decode(e.data).get("event") or msgspec.json.decode(e.data)["id"]) for e in parsed] == [
        (None, "accepted"),
        (4, "started"),
        (None, "1"),
        (5, "2"),
    ]


def test_frames_parse_back_to_what_was_sent() -> None:
    parser = SseParser()
    data = b"".join(
        [
            *log_frames(chunk(21, "line one\nline two\n", 0), skip=5),
            *trace_frames(Stored(seq=22, event=LiveTrace(run_id=RUN, seq=1, events=(ToolCall(id="1", name="x"),)))),
            *log_frames(Stored(seq=23, event=InfraMark(run_id=RUN, mark=Infra(scope="placement")))),  # not a log
            end_frame(RUN, "failed"),
        ]
    )
    events = parser.feed(data)
    assert [(e.id, e.event) for e in events] == [(21, "log"), (22, "trace"), (None, "end")]
    assert decode(events[0].data, LogChunk) == LogChunk(stream="stdout", text="one\nline two\n")
    assert msgspec.json.decode(events[1].data)["kind"] == "tool_call"
    assert decode(events[2].data, RunStreamEnd) == RunStreamEnd(run_id=RUN, status="failed")
    assert log_frames(chunk(30, "abc", 0), skip=3) == []  # nothing left of it: no empty frame
