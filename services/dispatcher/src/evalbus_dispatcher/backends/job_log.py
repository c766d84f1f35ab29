"""Reading a cluster job's log: the in-job runner's record lines (`evalbus_contracts.runner`)
decoded into what the sandbox port answers — the harness's output streamed live, how it ended, the
compute graders' results, the snapshot. Shared by every cluster backend.

A torn record is counted and skipped. The kept output is bounded (the tail of each stream, as on
the local backend); what is streamed live is every line. A runner whose `started` record says it
publishes the live view itself (`live: nats`) is told to the execution's `LiveHandoff`, which then
stops relaying the lines: they still feed the result, the failure evidence and the live screen.
"""

from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass

from evalbus_contracts import PromptSnapshot, RepoSnapshot, Snapshot
from evalbus_contracts.runner import (
    Done,
    ExecDone,
    Exited,
    Holding,
    SnapshotTaken,
    Started,
    StderrLine,
    StdoutLine,
    read_line,
)
from evalbus_dispatcher.backends.base import HarnessRun, OnOutput, OnSpawn, OutputStream, RunFailure
from evalbus_dispatcher.backends.job_spec import LiveHandoff
from evalbus_dispatcher.backends.process_group import Capture
from evalbus_grading import ExecResult

log = logging.getLogger(__name__)

OUTPUT_CAP_BYTES = 16 * 1024 * 1024
"""Most bytes kept of each stream (the tail); the live log gets every line."""


class LineSplitter:
    """Bytes as they come → whole lines (the rest waits for its newline)."""

    def __init__(self) -> None:
        self.rest = b""
        """Bytes after the last newline."""

    def push(self, chunk: bytes) -> list[str]:
        """The lines `chunk` completes."""
        self.rest += chunk
        *lines, self.rest = self.rest.split(b"\n")
        return [_text(raw) for raw in lines]

    def end(self) -> list[str]:
        """The last line, when it had no newline."""
        rest, self.rest = self.rest, b""
        return [_text(rest)] if rest else []


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", errors="replace").removesuffix("\r")


@dataclass(frozen=True, slots=True)
class UnitEnd:
    """How the orchestrator says the unit ended (when the runner could not say it)."""

    exit_code: int | None
    """The container's or task's exit code (None: unknown)."""
    reason: str | None = None
    """The orchestrator's words (`OOMKilled (exit 137)`, `DeadlineExceeded`…)."""
    oom: bool | None = None
    """Ended by the out-of-memory killer."""
    timed_out: bool = False
    """Ended by the orchestrator's deadline."""


class JobLog:
    """The decoded log of one job, fed line by line."""

    def __init__(
        self,
        on_output: OnOutput,
        on_spawn: OnSpawn | None,
        *,
        cap: int = OUTPUT_CAP_BYTES,
        handoff: LiveHandoff | None = None,
    ) -> None:
        self._on_output = on_output
        self._on_spawn = on_spawn
        self._handoff = handoff
        self._stdout = Capture(cap)
        self._stderr = Capture(cap)
        self.started: Started | None = None
        """The runner's `started` record."""
        self.exited: Exited | None = None
        """The runner's `exited` record."""
        self.done = False
        """The runner said `done`."""
        self.holding: Holding | None = None
        """The runner's `holding` record: it keeps the job alive for the declared files."""
        self.torn = 0
        """Torn record lines skipped."""
        self._execs: deque[ExecDone] = deque()
        self._snapshot: RepoSnapshot | None = None

    async def line(self, line: str) -> None:
        """One log line (no newline)."""
        item = read_line(line)
        if item is None:
            self.torn += 1
        elif isinstance(item, str):
            await self._out("stdout", item)
        elif isinstance(item, StdoutLine):
            await self._out("stdout", item.text)
        elif isinstance(item, StderrLine):
            await self._out("stderr", item.text)
        elif isinstance(item, Started):
            self.started = item
            if item.live == "nats" and self._handoff is not None:
                self._handoff.runner_publishes()
            if self._on_spawn is not None:
                try:
                    await self._on_spawn(item.pid)
                except Exception:  # a live-view problem never stops the run
                    log.exception("spawn callback failed; the run goes on")
        elif isinstance(item, Exited):
            self.exited = item
        elif isinstance(item, ExecDone):
            self._execs.append(item)
        elif isinstance(item, SnapshotTaken):
            self._snapshot = item.snapshot
        elif isinstance(item, Holding):
            self.holding = item
        elif isinstance(item, Done):
            self.done = True

    async def _out(self, stream: OutputStream, text: str) -> None:
        (self._stdout if stream == "stdout" else self._stderr).add(text)
        try:
            await self._on_output(stream, text)
        except Exception:  # a live-view problem must never stall the log
            log.exception("output callback failed; the log keeps being read")

    def harness_run(self, end: UnitEnd, waited_s: float) -> HarnessRun:
        """How the harness ended: the runner's word, else the orchestrator's."""
        stdout, stderr = self._stdout.text(), self._stderr.text()
        out_cut, err_cut = self._stdout.truncated, self._stderr.truncated
        pid = self.started.pid if self.started is not None else None
        exited = self.exited
        if exited is not None and exited.spawn_error is not None:
            return HarnessRun(exit_code=None, stdout=stdout, stderr=stderr, spawn_error=exited.spawn_error)
        if exited is not None:
            return HarnessRun(
                exit_code=exited.exit_code,
                stdout=stdout,
                stderr=stderr,
                duration_s=exited.duration_s,
                timed_out=exited.timed_out,
                signal=exited.signal,
                oom=end.oom,
                pid=pid,
                stdout_truncated=out_cut,
                stderr_truncated=err_cut,
            )
        # The runner did not get to say how the harness ended: the orchestrator's word decides.
        why = end.reason or "the unit is gone without a status"
        lost = None
        if not end.oom and not end.timed_out:  # not the case's doing: the node, an eviction, a deletion
            lost = RunFailure(
                code="unit_lost",
                failure_class="infra",
                message=f"the job's unit ended before the runner reported how the harness ended: {why}",
                retryable=True,
            )
        code = end.exit_code
        return HarnessRun(
            exit_code=124 if end.timed_out else code,
            stdout=stdout,
            stderr=stderr + f"\n[evalbus] the job ended: {why}",
            duration_s=waited_s,
            timed_out=end.timed_out,
            signal=code - 128 if code is not None and code > 128 else None,
            oom=end.oom,
            pid=pid,
            stdout_truncated=out_cut,
            stderr_truncated=err_cut,
            failure=lost,
        )

    def exec_result(self, command: str) -> ExecResult:
        """What the runner's check gave for `command` (each result answers one exec, in order)."""
        for done in list(self._execs):
            if done.command == command:
                self._execs.remove(done)
                return ExecResult(
                    exit_code=done.exit_code, stdout=done.stdout, stderr=done.stderr, timed_out=done.timed_out
                )
        finished = self.done or self.holding is not None
        why = "the runner was not asked to run this command" if finished else "the job ended before its checks ran"
        return ExecResult(exit_code=127, stdout="", stderr=f"[evalbus] {why}", timed_out=False)

    def snapshot(self, answer: str) -> Snapshot:
        """The workdir's git changes the runner recorded, else the answer."""
        return self._snapshot if self._snapshot is not None else PromptSnapshot(output=answer)
