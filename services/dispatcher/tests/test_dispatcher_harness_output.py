"""Reading harness stdout: events, torn lines, the result line, answer fallback, stderr tail."""

from __future__ import annotations

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from evalbus_contracts import Error, Infra, LlmCall, Log, Message, ToolCall
from evalbus_dispatcher.execute import merge_marks
from evalbus_dispatcher.harness_output import (
    TAIL_BYTES,
    ParsedLine,
    complete_trace,
    is_control_line,
    log_tail,
    parse_line,
    parse_stdout,
    strip_control_lines,
    tail,
)

pytestmark = pytest.mark.unit


def event_line(obj: dict[str, object]) -> str:
    return "EVALBUS_EVENT " + json.dumps(obj)


def test_events_are_decoded_and_the_rest_is_the_answer() -> None:
    stdout = "\n".join(
        [
            "thinking...",
            event_line({"kind": "tool_call", "id": "1", "name": "calc", "args": {"x": 6}, "t": 0.5}),
            event_line({"kind": "llm_call", "model": "m", "cost_usd": 0.01, "t": 0.7}),
            "",
            "42",
            "",
        ]
    )
    out = parse_stdout(stdout)
    assert out.events == (
        ToolCall(id="1", name="calc", args={"x": 6}, t=0.5),
        LlmCall(model="m", cost_usd=0.01, t=0.7),
    )
    assert out.answer == "thinking...\n\n42"
    assert out.invalid_lines == 0
    assert out.has_result is False


def test_torn_and_invalid_event_lines_are_skipped_not_fatal() -> None:
    stdout = "\n".join(
        [
            'EVALBUS_EVENT {"kind": "tool_call", "id": "1", "na',  # torn mid-line
            'EVALBUS_EVENT {"kind": "no_such_kind"}',
            'EVALBUS_EVENT {"kind": "tool_call", "name": "missing id"}',
            "EVALBUS_EVENT",
            event_line({"kind": "message", "role": "assistant", "text": "ok"}),
            "the answer",
        ]
    )
    out = parse_stdout(stdout)
    assert out.events == (Message(role="assistant", text="ok"),)
    assert out.invalid_lines == 4
    assert out.answer == "the answer"


def test_result_line_sets_the_answer_last_one_wins() -> None:
    stdout = "\n".join(
        [
            "log line",
            'EVALBUS_RESULT {"answer": "first"}',
            'EVALBUS_RESULT {"answer": 42}',  # not a string: invalid, skipped
            'EVALBUS_RESULT {"answer": "  final\\nanswer "}',
            "trailing chatter",
        ]
    )
    out = parse_stdout(stdout)
    assert out.answer == "  final\nanswer "
    assert out.has_result is True
    assert out.invalid_lines == 1


def test_answer_falls_back_to_last_assistant_message_when_stdout_is_only_events() -> None:
    stdout = "\n".join(
        [
            event_line({"kind": "message", "role": "assistant", "text": "draft"}),
            event_line({"kind": "message", "role": "assistant", "text": "final"}),
        ]
    )
    assert parse_stdout(stdout).answer == "final"


def test_leading_spaces_before_a_control_line_are_tolerated() -> None:
    line = "  " + event_line({"kind": "error", "message": "boom"})
    assert parse_line(line).event == Error(message="boom")


def test_control_lines_are_stripped_from_user_log() -> None:
    text = "a\nEVALBUS_EVENT {torn\nb\nEVALBUS_RESULT {}\nEVALBUS_EVENTUALLY is text\n"
    assert strip_control_lines(text) == "a\nb\nEVALBUS_EVENTUALLY is text\n"
    assert is_control_line("EVALBUS_EVENT")
    assert not is_control_line("EVALBUS_EVENTS x")


def test_tail_caps_bytes_without_splitting_characters() -> None:
    text = "é" * TAIL_BYTES  # 2 bytes each
    capped = tail(text)
    assert len(capped.encode()) <= TAIL_BYTES
    assert capped == "é" * (TAIL_BYTES // 2)
    assert tail("short") == "short"
    assert tail("abcdef", 3) == "def"


def test_log_tail_puts_stderr_first_and_strips_control_lines() -> None:
    assert log_tail("out", "err\n") == "[stderr]\nerr\n[stdout]\nout"
    assert log_tail("", "err\n") == "err"
    assert log_tail("out\n", "") == "out"
    assert log_tail(event_line({"kind": "error", "message": "x"}) + "\nvisible", "") == "visible"
    assert log_tail("", "") is None


def test_log_tail_of_both_streams_fits_16_kib_stderr_first() -> None:
    # A little stderr leaves room for the end of stdout.
    out_lines = [f"stdout line {i}" for i in range(5000)]
    both = log_tail("\n".join(out_lines), "Traceback: boom")
    assert both is not None
    assert both.startswith("[stderr]\nTraceback: boom\n[stdout]\n")
    assert both.endswith("stdout line 4999")
    assert len(both.encode()) <= TAIL_BYTES
    # A stderr that fills the budget leaves stdout out.
    big_err = "e" * (2 * TAIL_BYTES)
    only_err = log_tail("\n".join(out_lines), big_err)
    assert only_err == "e" * TAIL_BYTES


def test_complete_trace_for_a_harness_without_platform_trace() -> None:
    stderr = "x" * (3 * TAIL_BYTES) + "\nthe end"
    trace = complete_trace(
        (ToolCall(id="1", name="t", t=1.0),), answer="42", trace_kind="none", stderr=stderr, t_end=5.0
    )
    assert trace[0] == ToolCall(id="1", name="t", t=1.0)
    assert trace[1] == Message(role="assistant", text="42", t=5.0)
    assert isinstance(trace[2], Log)
    assert trace[2].stream == "stderr"
    assert trace[2].text.endswith("the end")
    assert len(trace[2].text.encode()) <= TAIL_BYTES


def test_complete_trace_stderr_log_on_success_too_but_not_for_platform_traces() -> None:
    none = complete_trace((), answer="", trace_kind="none", stderr="progress 1/2\n", t_end=1.0)
    assert none == (Log(stream="stderr", text="progress 1/2", t=1.0),)
    assert complete_trace((), answer="", trace_kind="otel", stderr="progress", t_end=1.0) == ()


def test_complete_trace_keeps_an_existing_assistant_message() -> None:
    events = (Message(role="assistant", text="mine", t=2.0),)
    assert complete_trace(events, answer="other", trace_kind="otel", stderr="", t_end=3.0) == events


def test_merge_marks_places_marks_by_time_keeping_event_order() -> None:
    accepted = Infra(scope="placement", event="accepted", t=0.0)
    started = Infra(scope="placement", event="started", t=0.2)
    released = Infra(scope="placement", event="released", t=3.0)
    e1, e2, e3 = Message(role="user", text="q", t=0.2), ToolCall(id="1", name="x", t=1.0), Error(message="late", t=3.5)
    assert merge_marks([accepted, started, released], [e1, e2, e3]) == (accepted, started, e1, e2, released, e3)
    assert merge_marks([accepted], []) == (accepted,)


@given(st.text(max_size=400))
def test_parse_stdout_never_raises(text: str) -> None:
    out = parse_stdout(text)
    assert out.answer == out.answer.strip() or out.has_result


def test_a_declared_devtools_endpoint_is_a_control_line() -> None:
    assert parse_line("EVALBUS_CDP http://127.0.0.1:9222") == ParsedLine(kind="cdp", cdp="http://127.0.0.1:9222")
    assert parse_line("EVALBUS_CDP not a url").kind == "invalid"
    out = parse_stdout("EVALBUS_CDP http://127.0.0.1:9222\nthe answer\n")
    assert (out.answer, out.invalid_lines) == ("the answer", 0)
    assert strip_control_lines("EVALBUS_CDP http://127.0.0.1:9222\nvisible") == "visible"
