"""Live progress of a batch from its event stream: runs per stage, drawn as one bar per stage.

`BatchProgress` is the fold (pure): the batch's events in, distinct runs per stage out, plus what
the scorecard wants from the stream (each case's expected answer, how the batch ended).
`ProgressDisplay` draws it: on a terminal the bars are redrawn in place (at most every
`redraw_s`); anywhere else a plain line is printed every `interval_s` while something changed, and
once at the end, so a log stays readable. `tick` (called on a timer by the follower) draws what a
throttled update left undrawn, and says so when no stage has moved for `stall_s`.

    requested  [##############################]  30/30
    executed   [####################..........]  20/30
    judged     [##################............]  18/30
    exported   [#################.............]  17/30
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TextIO

from evalbus_api.client import END_EVENT, SseEvent
from evalbus_api.live import RunStreamEnd
from evalbus_api.models import StreamEnd
from evalbus_contracts import (
    BatchCancelled,
    BatchFinalized,
    BatchRequested,
    CaseCollected,
    CaseExecuted,
    CaseExported,
    CaseJudged,
    CaseRequested,
    DecodeError,
    Event,
    decode,
    expected_runs,
)

STAGES: tuple[str, ...] = ("requested", "executed", "collected", "judged", "exported")
"""Every stage a run passes, in order (`collected` only for deferred traces)."""
_STAGE_OF: dict[type, str] = {
    CaseRequested: "requested",
    CaseExecuted: "executed",
    CaseCollected: "collected",
    CaseJudged: "judged",
    CaseExported: "exported",
}


class BatchProgress:
    """What a batch's events say so far."""

    def __init__(self, batch_id: str, total: int | None = None) -> None:
        self.batch_id = batch_id
        self.total = total
        """Runs the batch has (cases × trials), once known."""
        self.runs: dict[str, set[str]] = {stage: set() for stage in STAGES}
        """Stage → distinct run ids that reached it."""
        self.rejudge_of: str | None = None
        """The re-judged batch (a re-judge requests nothing: its runs start executed)."""
        self.deferred = False
        """Some run's trace is completed by the collector (show the `collected` stage)."""
        self.expected: dict[str, str | None] = {}
        """Case id → expected answer, from the case events."""
        self.finalized: BatchFinalized | None = None
        """The `batch.finalized` event, once seen."""
        self.cancelled: str | None = None
        """`cancelled` or `superseded` once the batch was stopped."""
        self.end_status: str | None = None
        """The status the stream's `end` event carries."""
        self.events = 0
        """Events applied."""

    @property
    def ended(self) -> bool:
        """The stream ended (the batch is finalized)."""
        return self.end_status is not None

    @property
    def status(self) -> str | None:
        """The final status, once known."""
        if self.end_status is not None:
            return self.end_status
        return self.finalized.status if self.finalized is not None else None

    def count(self, stage: str) -> int:
        """Runs that reached `stage`."""
        return len(self.runs[stage])

    def stages(self) -> tuple[str, ...]:
        """The stages worth showing: no `requested` for a re-judge, `collected` only when a trace
        is deferred."""
        return tuple(
            s
            for s in STAGES
            if not (s == "requested" and self.rejudge_of is not None) and not (s == "collected" and not self.deferred)
        )

    def apply(self, event: Event) -> None:
        """Fold one event of the batch."""
        self.events += 1
        if isinstance(event, BatchRequested):
            self.total = expected_runs(event.spec)
            self.rejudge_of = event.rejudge_of
            for case in event.spec.suite.cases:
                self.expected.setdefault(case.id, case.expected)
        elif isinstance(event, BatchCancelled):
            self.cancelled = event.reason
        elif isinstance(event, BatchFinalized):
            self.finalized = event
        elif isinstance(event, CaseRequested | CaseExported):
            if isinstance(event, CaseRequested):  # a dataset batch's cases are known from here on
                self.expected.setdefault(event.case.id, event.case.expected)
            self._reached(event, event.run_id)
            if isinstance(event, CaseRequested):
                self.expected.setdefault(event.case.id, event.case.expected)
        elif isinstance(event, CaseExecuted | CaseCollected | CaseJudged):
            self._reached(event, event.run_id or event.result.run_id)
            if isinstance(event, CaseExecuted):
                self.deferred = self.deferred or not event.trace_complete
                self.rejudge_of = event.rejudge_of or self.rejudge_of
            if event.case is not None:
                self.expected.setdefault(event.case.id, event.case.expected)

    def _reached(self, event: Event, run_id: str | None) -> None:
        if run_id is not None:
            self.runs[_STAGE_OF[type(event)]].add(run_id)

    def apply_sse(self, sse: SseEvent) -> None:
        """Fold one server-sent event (`end` records the final status; undecodable data is skipped)."""
        if sse.event == END_EVENT:
            self.end_status = _end_status(sse.data)
            return
        try:
            event = sse.decoded()
        except DecodeError:
            return
        if not isinstance(event, StreamEnd | RunStreamEnd):
            self.apply(event)


def _end_status(data: str) -> str:
    try:
        return decode(data, StreamEnd).status
    except DecodeError:
        return "unknown"


# ---------------------------------------------------------------- drawing


def bar(done: int, total: int | None, width: int = 30) -> str:
    """`[#####.....]` filled in proportion (empty while the total is unknown)."""
    if not total:
        return "[" + "." * width + "]"
    filled = min(width, round(width * min(done, total) / total))
    return "[" + "#" * filled + "." * (width - filled) + "]"


def stage_lines(progress: BatchProgress, width: int = 30) -> list[str]:
    """One line per shown stage: name, bar, count out of the total."""
    total = progress.total
    digits = len(str(total)) if total else 1
    out = []
    for stage in progress.stages():
        done = progress.count(stage)
        of = str(total) if total is not None else "?"
        out.append(f"{stage:<10} {bar(done, total, width)}  {done:>{digits}}/{of}")
    return out


def plain_line(progress: BatchProgress, elapsed_s: float) -> str:
    """Every stage on one line, for logs: `[  3.2s] requested 30/30  executed 12/30 …`."""
    of = str(progress.total) if progress.total is not None else "?"
    parts = [f"{stage} {progress.count(stage)}/{of}" for stage in progress.stages()]
    return f"[{elapsed_s:6.1f}s] " + "  ".join(parts)


STALL_S = 30.0
"""How long no stage may move before the display says so."""
STALL_NOTE = "no stage has moved for {seconds:g} s: `evalbus status` shows whether every service is up"
"""What it says then (once, until something moves)."""


class ProgressDisplay:
    """Draws a `BatchProgress` on `out`: in place on a terminal, as periodic lines elsewhere."""

    def __init__(
        self,
        out: TextIO,
        *,
        tty: bool,
        interval_s: float = 2.0,
        redraw_s: float = 0.1,
        stall_s: float = STALL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.out = out
        self.tty = tty
        self.interval_s = interval_s
        self.redraw_s = redraw_s
        self.stall_s = stall_s
        self._clock = clock
        self._start = clock()
        self._drawn_at: float | None = None
        self._drawn_lines = 0
        self._last: tuple[int, ...] | None = None
        self._seen: tuple[int, ...] | None = None
        self._moved_at = self._start
        self._stall_said = False

    @property
    def tick_s(self) -> float:
        """How often the follower should call `tick`."""
        return self.redraw_s if self.tty else self.interval_s

    def tick(self, progress: BatchProgress) -> None:
        """Draw what a throttled `update` left undrawn; note a stall once per stall."""
        self.update(progress)
        if self._stall_said or progress.end_status is not None or self._clock() - self._moved_at < self.stall_s:
            return
        self._stall_said = True
        note = STALL_NOTE.format(seconds=self.stall_s)
        if self.tty:
            self._redraw(progress, note)
        else:
            self.out.write(note + "\n")
        self.out.flush()

    def _state(self, progress: BatchProgress) -> tuple[int, ...]:
        return (progress.total or -1, *(progress.count(s) for s in progress.stages()))

    def update(self, progress: BatchProgress, *, force: bool = False) -> None:
        """Draw if it is time (and, for plain lines, something changed)."""
        now = self._clock()
        state = self._state(progress)
        if state != self._seen:
            self._seen, self._moved_at, self._stall_said = state, now, False
        if not force:
            if state == self._last:
                return
            wait = self.redraw_s if self.tty else self.interval_s
            if self._drawn_at is not None and now - self._drawn_at < wait:
                return
        if self.tty:
            self._redraw(progress)
        elif state != self._last or force:
            self.out.write(plain_line(progress, now - self._start) + "\n")
        self.out.flush()
        self._drawn_at = now
        self._last = state

    def finish(self, progress: BatchProgress) -> None:
        """The final drawing (always, unless nothing changed since the last one)."""
        if self._state(progress) != self._last:
            self.update(progress, force=True)

    def _redraw(self, progress: BatchProgress, note: str | None = None) -> None:
        lines = stage_lines(progress) + ([note] if note else [])
        if self._drawn_lines:
            self.out.write(f"\x1b[{self._drawn_lines}F")  # to the start of the first bar
        for line in lines:
            self.out.write("\x1b[2K" + line + "\n")
        for _ in range(self._drawn_lines - len(lines)):  # a stage disappeared: blank its old line
            self.out.write("\x1b[2K\n")
        self._drawn_lines = max(len(lines), self._drawn_lines)
