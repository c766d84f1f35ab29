"""Reading what a command harness prints (pure).

On stdout, a line `EVALBUS_EVENT {json}` is one trace event, a line `EVALBUS_RESULT {json}`
carries `{"answer": ...}`, a line `EVALBUS_CDP <url>` declares the Chrome DevTools endpoint of the
browser the harness drives and a line `EVALBUS_DISPLAY :<n>` the X display it works on (both for
the live screen); all are control lines, hidden from the log users see. A torn or invalid control
line is skipped, never fatal. Without a result line the answer is the rest of
stdout, stripped.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from evalbus_contracts import Log, Message, TraceEvent
from evalbus_contracts.specs import TraceKind

EVENT_PREFIX = "EVALBUS_EVENT"
"""Marks a trace event line."""
RESULT_PREFIX = "EVALBUS_RESULT"
"""Marks the result line."""
CDP_PREFIX = "EVALBUS_CDP"
"""Marks the line declaring the harness's browser's DevTools endpoint (`http://host:port`)."""
DISPLAY_PREFIX = "EVALBUS_DISPLAY"
"""Marks the line declaring the X display the harness works on (`:99`)."""
TAIL_BYTES = 16 * 1024
"""Cap on log tails (stderr log event, failure evidence)."""

_CONTROL = re.compile(r"^\s*(EVALBUS_EVENT|EVALBUS_RESULT|EVALBUS_CDP|EVALBUS_DISPLAY)(?:\s+(.*))?$", re.DOTALL)
_CDP_URL = re.compile(r"^(https?|wss?)://[^\s]+$")
_DISPLAY = re.compile(r"^[A-Za-z0-9._-]*:[0-9]+(\.[0-9]+)?$")
_event_decoder: msgspec.json.Decoder[TraceEvent] = msgspec.json.Decoder(TraceEvent)


class _ResultLine(msgspec.Struct, frozen=True):
    answer: str


_result_decoder = msgspec.json.Decoder(_ResultLine)


@dataclass(frozen=True, slots=True)
class ParsedLine:
    """One classified stdout line."""

    kind: Literal["text", "event", "result", "cdp", "display", "invalid"]
    """Plain text, a decoded event, a decoded result, a DevTools endpoint, an X display, or a
    torn/invalid control line."""
    event: TraceEvent | None = None
    """The event, for `event`."""
    answer: str | None = None
    """The answer, for `result`."""
    cdp: str | None = None
    """The DevTools endpoint, for `cdp`."""
    display: str | None = None
    """The X display, for `display`."""


@dataclass(frozen=True, slots=True)
class HarnessOutput:
    """What a harness's stdout says."""

    answer: str
    """The final answer."""
    events: tuple[TraceEvent, ...]
    """Trace events, in printed order."""
    invalid_lines: int = 0
    """Control lines that could not be decoded (skipped)."""
    has_result: bool = False
    """The answer came from a result line."""


def parse_line(line: str) -> ParsedLine:
    """Classify one stdout line (without its newline)."""
    m = _CONTROL.match(line)
    if m is None:
        return ParsedLine(kind="text")
    payload = (m.group(2) or "").strip()
    if m.group(1) == CDP_PREFIX:
        return ParsedLine(kind="cdp", cdp=payload) if _CDP_URL.match(payload) else ParsedLine(kind="invalid")
    if m.group(1) == DISPLAY_PREFIX:
        return ParsedLine(kind="display", display=payload) if _DISPLAY.match(payload) else ParsedLine(kind="invalid")
    try:
        if m.group(1) == EVENT_PREFIX:
            return ParsedLine(kind="event", event=_event_decoder.decode(payload))
        return ParsedLine(kind="result", answer=_result_decoder.decode(payload).answer)
    except msgspec.DecodeError:
        return ParsedLine(kind="invalid")


def is_control_line(line: str) -> bool:
    """Whether a line is an event or result line (valid or torn): such lines are not user log."""
    return _CONTROL.match(line) is not None


def strip_control_lines(text: str) -> str:
    """The text without its control lines."""
    return "\n".join(line for line in text.split("\n") if not is_control_line(line))


def parse_stdout(stdout: str) -> HarnessOutput:
    """Events, answer and invalid-line count of a harness's whole stdout.

    The answer is the last result line's; else the non-control stdout, stripped; else (when that
    is empty) the text of the last assistant message among the events.
    """
    events: list[TraceEvent] = []
    text: list[str] = []
    answer: str | None = None
    invalid = 0
    for line in stdout.split("\n"):
        parsed = parse_line(line)
        if parsed.kind == "text":
            text.append(line)
        elif parsed.kind == "event" and parsed.event is not None:
            events.append(parsed.event)
        elif parsed.kind == "result":
            answer = parsed.answer
        elif parsed.kind in ("cdp", "display"):
            continue
        else:
            invalid += 1
    has_result = answer is not None
    if answer is None:
        answer = "\n".join(text).strip() or (last_assistant_text(events) or "")
    return HarnessOutput(answer=answer, events=tuple(events), invalid_lines=invalid, has_result=has_result)


def last_assistant_text(events: Iterable[TraceEvent]) -> str | None:
    """Text of the last assistant message, if any."""
    found: str | None = None
    for event in events:
        if isinstance(event, Message) and event.role == "assistant":
            found = event.text
    return found


def tail(text: str, limit_bytes: int = TAIL_BYTES) -> str:
    """The last `limit_bytes` bytes of `text` (UTF-8), never splitting a character."""
    data = text.encode("utf-8")
    if len(data) <= limit_bytes:
        return text
    return data[-limit_bytes:].decode("utf-8", errors="ignore")


STDERR_HEADER = "[stderr]\n"
STDOUT_HEADER = "\n[stdout]\n"
_MIN_STDOUT_ROOM = 256


def log_tail(stdout: str, stderr: str, limit_bytes: int = TAIL_BYTES) -> str | None:
    """Failure evidence, control lines stripped, at most `limit_bytes` (UTF-8): stderr first.

    With output on one stream only, its tail. With both, `[stderr]` and the stderr tail, then
    `[stdout]` and as much of stdout's end as still fits (stdout is left out when less than
    256 bytes of room remain).
    """
    err = strip_control_lines(stderr).strip()
    out = strip_control_lines(stdout).strip()
    if not err and not out:
        return None
    if not out or not err:
        return tail(err or out, limit_bytes)
    budget = limit_bytes - len(STDERR_HEADER) - len(STDOUT_HEADER)
    err_tail = tail(err, budget)
    room = budget - len(err_tail.encode("utf-8"))
    if room < _MIN_STDOUT_ROOM:
        return tail(err, limit_bytes)
    return STDERR_HEADER + err_tail + STDOUT_HEADER + tail(out, room)


def complete_trace(
    events: Sequence[TraceEvent],
    *,
    answer: str,
    trace_kind: TraceKind,
    stderr: str,
    t_end: float,
) -> tuple[TraceEvent, ...]:
    """The trace with what a harness leaves implicit made explicit.

    Without an assistant message, the answer is appended as one (when there is an answer). For a
    harness without a platform trace (`none`), the stderr tail — on success and failure alike —
    is appended as a `log` event, since it is the only record of what the agent did.
    """
    out = list(events)
    if answer and last_assistant_text(out) is None:
        out.append(Message(role="assistant", text=answer, t=t_end))
    if trace_kind == "none":
        err = strip_control_lines(stderr).strip("\n")
        if err.strip():
            out.append(Log(stream="stderr", text=tail(err), t=t_end))
    return tuple(out)
