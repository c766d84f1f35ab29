"""Collecting a run's platform trace with the flush-lag retry (D4).

An empty pull is the shape of flush lag, so it is retried: 3 attempts, 2 s apart by default.
A pull whose spans lack their root is flush lag too (an SDK exports a root span when it ends,
after its children), so it is retried the same way; still rootless after the last attempt, the
partial trace is kept and an `error` event says so.
A hard error (`TraceSourceError`) is conclusive and not retried; a missing secret is reported
distinctly, so the caller records an unmeasured `missing_secret` score and never pulls
unauthenticated. Every outcome is data: nothing escapes as an exception except cancellation.
"""

from __future__ import annotations

import asyncio
from collections.abc import Sequence
from typing import Literal

import msgspec

from evalbus_contracts.results import TraceRef
from evalbus_contracts.trace import Error, TraceEvent
from evalbus_runtime.secrets import MissingSecretError
from evalbus_traces.errors import TraceSourceError
from evalbus_traces.ports import TraceSource

COLLECT_ATTEMPTS = 3
"""Pulls before an empty trace is reported."""
COLLECT_DELAY_S = 2.0
"""Seconds between pulls of an empty trace."""

CollectStatus = Literal["ok", "partial", "empty", "unavailable", "missing_secret"]
"""`ok`: a complete trace; `partial`: spans but no root after every attempt (events kept, plus an
error event); `empty`: still nothing after every attempt; `unavailable`: a hard error;
`missing_secret`: the reference names a secret the store lacks (nothing was pulled)."""


class CollectOutcome(msgspec.Struct, frozen=True, kw_only=True):
    """What a collection produced."""

    status: CollectStatus
    """How it ended."""
    events: tuple[TraceEvent, ...] = ()
    """The platform's events (`ok` and `partial`)."""
    error_event: Error | None = None
    """The `error` trace event to append when the trace could not be collected."""
    attempts: int = 0
    """Pulls made."""
    error: str | None = None
    """The hard error's text (`unavailable`) or the missing secret's message."""
    missing_secret: str | None = None
    """Name of the missing secret (`missing_secret`)."""

    @property
    def hard_error(self) -> bool:
        """Whether the pull failed conclusively (not merely empty)."""
        return self.status == "unavailable"


def has_root(events: Sequence[TraceEvent]) -> bool:
    """Whether a pulled trace contains its root span (an event with a span id and no parent)."""
    return any(e.span_id is not None and e.parent_id is None for e in events) or all(e.span_id is None for e in events)


def empty_message(ref: TraceRef, attempts: int) -> str:
    """The error text of a trace that stayed empty, naming the correlation key."""
    noun = "attempt" if attempts == 1 else "attempts"
    return f"collected 0 traces for evalbus.run_id={ref.run_id} ({attempts} {noun})"


async def collect_trace(
    source: TraceSource,
    ref: TraceRef,
    *,
    attempts: int = COLLECT_ATTEMPTS,
    delay_s: float = COLLECT_DELAY_S,
) -> CollectOutcome:
    """Pull `ref` from `source`, retrying an empty pull `attempts` times in all, `delay_s` apart."""
    if attempts < 1:
        raise ValueError("attempts must be at least 1")
    partial: list[TraceEvent] = []
    for attempt in range(1, attempts + 1):
        try:
            events = await source.pull(ref)
        except MissingSecretError as e:
            return CollectOutcome(
                status="missing_secret",
                attempts=attempt,
                error=str(e),
                missing_secret=e.name,
                error_event=Error(message=f"trace not collected: {e}"),
            )
        except TraceSourceError as e:
            message = f"trace pull from {ref.kind} failed for evalbus.run_id={ref.run_id}: {e}"
            return CollectOutcome(
                status="unavailable",
                attempts=attempt,
                error=str(e),
                error_event=Error(message=message),
            )
        if events and has_root(events):
            return CollectOutcome(status="ok", events=tuple(events), attempts=attempt)
        partial = events or partial
        if attempt < attempts:
            await asyncio.sleep(delay_s)  # flush lag: give the platform time to ingest
    if partial:
        message = f"collected a partial trace for evalbus.run_id={ref.run_id}: no root span ({attempts} attempts)"
        return CollectOutcome(
            status="partial", events=tuple(partial), attempts=attempts, error_event=Error(message=message)
        )
    return CollectOutcome(status="empty", attempts=attempts, error_event=Error(message=empty_message(ref, attempts)))
