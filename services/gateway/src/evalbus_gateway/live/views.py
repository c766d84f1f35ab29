"""What the live reads answer, and the pure parts of projecting the LIVE stream into them.

A run's live log is the `run.<run>.live.log` chunks in stream order; its live trace is the
`.infra` marks and `.trace` events in stream order. Frames and snapshots are built here from
messages already read (`Stored`), so the logic is testable without a bus.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal

import msgspec

from evalbus_contracts import InfraMark, LiveLog, LivePlacement, LiveTrace, TraceEvent, encode

RunStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
"""Where a run is: requested but not accepted by a dispatcher (`queued`), accepted and not
settled (`running`), or its execution outcome once `case.executed` is on the stream."""

LOG_TAIL_BYTES = 64 * 1024
"""Most log text (UTF-8 bytes) a tail snapshot holds, and the tail an event stream starts with."""

LiveEvent = LiveLog | LiveTrace | InfraMark | LivePlacement
"""Any LIVE stream event."""


@dataclass(frozen=True, slots=True)
class Stored:
    """One LIVE message as read: its stream sequence (the SSE event id) and its event."""

    seq: int
    event: LiveEvent


class LogTail(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /v1/runs/{run_id}/logs`: the end of the run's live log."""

    run_id: str
    """The run."""
    status: RunStatus
    """`queued`, `running`, or the execution outcome (`succeeded`, `failed`, `cancelled`)."""
    found: bool
    """Whether the LIVE stream holds any output of the run (it keeps 15 minutes, 2,000 chunks)."""
    text: str
    """The last 64 KiB of stdout and stderr as written, control lines removed."""
    truncated: bool = False
    """Older output exists before `text`."""
    last_event_id: int | None = None
    """LIVE stream sequence of the last chunk in `text`: send it as `Last-Event-ID` to
    `/logs/stream` to follow on from exactly here."""


class LogChunk(msgspec.Struct, frozen=True, kw_only=True):
    """Data of an SSE `log` event: one chunk of output."""

    stream: Literal["stdout", "stderr"]
    """Which stream."""
    text: str
    """The text (whole lines except where a line over 16 KiB was split)."""
    attempt: int = 1
    """Execution attempt that wrote it."""


class LiveTraceView(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /v1/runs/{run_id}/trajectory/live`: the run's own trace before it seals."""

    run_id: str
    """The run."""
    status: RunStatus
    """`queued`, `running`, or the execution outcome."""
    found: bool
    """Whether the LIVE stream holds any mark or event of the run."""
    events: tuple[TraceEvent, ...]
    """Infra marks (accepted, waiting, started, released) and the events the harness printed, in
    the order they were published; the last 2,000 harness events of the last 15 minutes."""
    last_event_id: int | None = None
    """LIVE stream sequence of the last event: `Last-Event-ID` for `/trajectory/live/stream`."""


class RunStreamEnd(msgspec.Struct, frozen=True, kw_only=True):
    """Data of the SSE `end` event of a run's live stream: the run settled."""

    run_id: str
    """The run."""
    status: RunStatus
    """Its execution outcome."""


# ---------------------------------------------------------------- text


def utf8_len(text: str) -> int:
    """Length of `text` in UTF-8 bytes."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def drop_head(text: str, n_bytes: int) -> str:
    """`text` without its first `n_bytes` UTF-8 bytes (and the rest of a character they cut)."""
    if n_bytes <= 0:
        return text
    return text.encode("utf-8")[n_bytes:].decode("utf-8", errors="ignore")


def utf8_tail(text: str, limit: int) -> tuple[str, bool]:
    """The last `limit` UTF-8 bytes of `text`, never starting inside a character; and whether
    anything was cut."""
    size = utf8_len(text)
    if size <= limit:
        return text, False
    return drop_head(text, size - limit), True


def tail_target(last: LiveLog, limit: int = LOG_TAIL_BYTES) -> int:
    """The log offset the tail starts at: `limit` bytes before the end of the last chunk."""
    return last.offset + utf8_len(last.text) - limit


def chunk_end(chunk: LiveLog) -> int:
    """Offset just past `chunk` in the run's log."""
    return chunk.offset + utf8_len(chunk.text)


def log_tail(run_id: str, status: RunStatus, chunks: Sequence[Stored], *, skip: int, limit: int) -> LogTail:
    """The tail snapshot of `chunks` (log messages in stream order, the first one to be cut by
    `skip` bytes), at most `limit` bytes. `skip > 0` or an oldest chunk past offset 0 means
    older output exists."""
    logs = [(s.seq, s.event) for s in chunks if isinstance(s.event, LiveLog)]
    if not logs:
        return LogTail(run_id=run_id, status=status, found=False, text="")
    parts = [event.text for _, event in logs]
    parts[0] = drop_head(parts[0], skip)
    text, cut = utf8_tail("".join(parts), limit)
    older = cut or skip > 0 or logs[0][1].offset > 0
    return LogTail(run_id=run_id, status=status, found=True, text=text, truncated=older, last_event_id=logs[-1][0])


def trace_events(event: LiveEvent) -> tuple[TraceEvent, ...]:
    """The trace events one LIVE message holds (a mark is one; a log chunk none)."""
    if isinstance(event, InfraMark):
        return (event.mark,)
    if isinstance(event, LiveTrace):
        return event.events
    return ()


def live_trace(run_id: str, status: RunStatus, messages: Iterable[Stored]) -> LiveTraceView:
    """The live trace snapshot of `messages` (marks and trace messages in stream order)."""
    events: list[TraceEvent] = []
    last: int | None = None
    for stored in messages:
        found = trace_events(stored.event)
        if found:
            events.extend(found)
            last = stored.seq
    return LiveTraceView(run_id=run_id, status=status, found=bool(events), events=tuple(events), last_event_id=last)


# ---------------------------------------------------------------- SSE frames


def frame(data: bytes, *, event: str, event_id: int | None = None) -> bytes:
    """One SSE frame (data split into `data:` lines, so any payload is safe)."""
    lines = [] if event_id is None else [b"id: %d" % event_id]
    lines.append(b"event: " + event.encode("utf-8"))
    lines.extend(b"data: " + line for line in (data.splitlines() or [b""]))
    return b"\n".join(lines) + b"\n\n"


def log_frames(stored: Stored, *, skip: int = 0) -> list[bytes]:
    """The `log` frame of a log message (its first `skip` bytes left out); none for others."""
    event = stored.event
    if not isinstance(event, LiveLog):
        return []
    text = drop_head(event.text, skip)
    if not text:
        return []
    chunk = LogChunk(stream=event.stream, text=text, attempt=event.attempt)
    return [frame(encode(chunk), event="log", event_id=stored.seq)]


def trace_frames(stored: Stored) -> list[bytes]:
    """One `trace` frame per trace event of a mark or trace message (all with its sequence)."""
    return [frame(encode(e), event="trace", event_id=stored.seq) for e in trace_events(stored.event)]


def end_frame(run_id: str, status: RunStatus) -> bytes:
    """The `end` frame: the run settled."""
    return frame(encode(RunStreamEnd(run_id=run_id, status=status)), event="end")
