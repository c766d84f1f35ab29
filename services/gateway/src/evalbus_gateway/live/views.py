"""The pure parts of projecting the LIVE stream into what the live reads answer (`evalbus_api.live`).

A run's live log is the `run.<run>.live.log` chunks in stream order; its live trace is the
`.infra` marks and `.trace` events in stream order. Frames and snapshots are built here from
messages already read (`Stored`), so the logic is testable without a bus.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from evalbus_api.live import LOG_TAIL_BYTES, LiveTraceView, LogChunk, LogTail, RunStatus, RunStreamEnd
from evalbus_contracts import InfraMark, LiveLog, LivePlacement, LiveTrace, TraceEvent, encode

LiveEvent = LiveLog | LiveTrace | InfraMark | LivePlacement
"""Any LIVE stream event."""


@dataclass(frozen=True, slots=True)
class Stored:
    """One LIVE message as read: its stream sequence (the SSE event id) and its event."""

    seq: int
    event: LiveEvent


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
    """The trace events one LIVE message holds (its marks, its events; a log chunk none)."""
    if isinstance(event, InfraMark):
        return event.marks
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


def recorded_frame(text: str, attempt: int) -> bytes:
    """The one `log` frame of a settled run's recorded output (no `id`: nothing follows it)."""
    return frame(encode(LogChunk(stream="recorded", text=text, attempt=attempt)), event="log")


def trace_frames(stored: Stored) -> list[bytes]:
    """One `trace` frame per trace event of a mark or trace message; the last carries its sequence
    (a client cut off between the frames of one message resumes before it, not after)."""
    events = trace_events(stored.event)
    last = len(events) - 1
    return [frame(encode(e), event="trace", event_id=stored.seq if i == last else None) for i, e in enumerate(events)]


def end_frame(run_id: str, status: RunStatus) -> bytes:
    """The `end` frame: the run settled."""
    return frame(encode(RunStreamEnd(run_id=run_id, status=status)), event="end")
