"""What the live reads of a run answer: its log tail, its live trace, their event streams' data,
and its placement (`GET /v1/runs/{run_id}/placement`)."""

from __future__ import annotations

from typing import Literal

import msgspec

from evalbus_contracts import DEFAULT_LANE, Infra, PlacementSample, TraceEvent

RunStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
"""Where a run is: requested but not accepted by a dispatcher (`queued`), accepted and not
settled (`running`), or its execution outcome once `case.executed` is on the stream."""

LOG_TAIL_BYTES = 64 * 1024
"""Most log text (UTF-8 bytes) a tail snapshot holds, and the tail an event stream starts with."""


class LogTail(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /v1/runs/{run_id}/logs`: the end of the run's live log."""

    run_id: str
    """The run."""
    status: RunStatus
    """`queued`, `running`, or the execution outcome (`succeeded`, `failed`, `cancelled`)."""
    found: bool
    """Whether any output of the run was found: on the LIVE stream (the last 2,000 chunks of the
    last 15 minutes, and a settled run's for 2 minutes after it settled) or, once the stream no
    longer holds it, in the event store (`source`)."""
    text: str
    """The last 64 KiB of stdout and stderr as written, control lines removed; from the store, the
    end of the output its `case.executed` recorded (at most 16 KiB; `[stderr]` and `[stdout]`
    headers when both streams printed)."""
    source: Literal["live", "store"] = "live"
    """Where `text` was read: the LIVE stream, or the event store for a settled run whose output
    has left the stream (`last_event_id` is then null: there is nothing more to follow)."""
    truncated: bool = False
    """Older output exists before `text`."""
    last_event_id: int | None = None
    """LIVE stream sequence of the last chunk in `text`: send it as `Last-Event-ID` to
    `/logs/stream` to follow on from exactly here."""


class LogChunk(msgspec.Struct, frozen=True, kw_only=True):
    """Data of an SSE `log` event: one chunk of output."""

    stream: Literal["stdout", "stderr", "recorded"]
    """Which stream; `recorded`: a settled run whose output has left the LIVE stream, the end of it
    as the event store holds it (`LogTail.text` from the store), sent once with no `id`."""
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
    the order they were published; the last 2,000 harness events of the last 15 minutes, and a
    settled run's only until 2 minutes after it settled (then the sealed trajectory is the record)."""
    last_event_id: int | None = None
    """LIVE stream sequence of the last event: `Last-Event-ID` for `/trajectory/live/stream`."""


class RunStreamEnd(msgspec.Struct, frozen=True, kw_only=True):
    """Data of the SSE `end` event of a run's live stream: the run settled."""

    run_id: str
    """The run."""
    status: RunStatus
    """Its execution outcome."""


Phase = Literal["queued", "blocked", "starting", "running", "dead"]
"""Where the run's sandbox is."""


class Asked(msgspec.Struct, frozen=True, kw_only=True):
    """What the run asked for."""

    slots: int = 1
    """Compute slots (one sandbox)."""
    timeout_s: float | None = None
    """Its time limit, seconds."""


class QueueState(msgspec.Struct, frozen=True, kw_only=True):
    """The dispatchers' queue as a queued run sees it."""

    ahead: int | None = None
    """Requests ahead of it that no dispatcher took yet (None: it was handed to a dispatcher)."""
    lane: str = DEFAULT_LANE
    """The lane whose queue it is (its harness's or case's `lane`)."""
    dispatchers: int = 0
    """Dispatcher replicas running that serve the lane."""
    slots: int = 0
    """Their compute slots."""
    used: int = 0
    """Slots held now."""


class RunPlacement(msgspec.Struct, frozen=True, kw_only=True):
    """`GET /v1/runs/{run_id}/placement`: where the run's sandbox is, and why."""

    run_id: str
    """The run."""
    status: RunStatus
    """`queued`, `running`, or the execution outcome (`succeeded`, `failed`, `cancelled`)."""
    phase: Phase
    """`queued`, `blocked`, `starting`, `running` or `dead`."""
    reason: str | None = None
    """Why it is queued, blocked or dead, in words."""
    attempt: int = 1
    """The attempt this describes."""
    dispatcher: str | None = None
    """The dispatcher replica holding (or that held) it."""
    unit: str | None = None
    """Backend unit (`pgid:<n>` on the local backend)."""
    node: str | None = None
    """Node of the sandbox."""
    asked: Asked = msgspec.field(default_factory=Asked)
    """What it asked for."""
    used: PlacementSample | None = None
    """The latest resource sample of its harness (pid, processes, memory, CPU, age; the exit sample
    once it exited, with the exit code, the signal and the OOM verdict)."""
    restarts: int = 0
    """Executions before the latest one (retries and redeliveries)."""
    oom: bool | None = None
    """OOM verdict of the latest execution's harness, once it exited."""
    queue: QueueState | None = None
    """The dispatchers' queue, while it is queued or blocked for want of a dispatcher."""
    events: tuple[Infra, ...] = ()
    """The backend's event feed: every infra mark of the run (accepted, waiting, started, placed,
    exited, released), every execution's, in order."""
