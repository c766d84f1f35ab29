"""The in-job runner's contract: the job spec it is given and the records it prints (pure data).

On a cluster backend the case image runs `python -m evalbus.runner`; the job's only channel back is
its log. The runner prints the harness's stdout lines as they are (so the job log stays readable
and the harness's own `EVALBUS_EVENT` / `EVALBUS_RESULT` lines keep their meaning) and everything
else as one **record line** each:

    EVALBUS_RUNNER {"kind": "...", ...}

`kind` is one of `started`, `stdout` (a harness stdout line that itself began with the marker,
escaped so a harness cannot forge records), `stderr` (a harness stderr line: orchestrators such
as Kubernetes merge the two streams in the job log), `exited`, `exec` (a compute grader's command
and what it gave), `snapshot`, `holding` (the runner keeps the job alive so the dispatcher can
read the files the harness declared), `done`. A reader decodes the log line by line; a torn record (cut
by a log read while the job writes, or by a crash) is skipped, never fatal.

With `RunnerJob.live` the runner also publishes the harness's live log and trace straight to NATS
(`LiveLog`, `LiveTrace`, as the dispatcher would from the log) when it connects; its `started`
record says so (`live: nats`), and the dispatcher then leaves the live view to it.
"""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec

from evalbus_contracts.results import RepoSnapshot

RECORD_PREFIX = "EVALBUS_RUNNER "
"""Starts every record line (the JSON follows on the same line)."""
JOB_ENV = "EVALBUS_JOB"
"""Environment variable holding the job spec (JSON) when no `--job` file is given."""
RECORD_TEXT_CAP = 64 * 1024
"""Most bytes of one text field (a stderr line, an exec's stdout or stderr tail) in a record."""
SEND_MISSING = 3
"""Exit code of `python -m evalbus.runner --send-file PATH` when there is no such file."""
SEND_NOT_A_FILE = 4
"""... when PATH is no regular file inside the workdir (a folder, a link leading out of it)."""
SEND_TOO_LARGE = 5
"""... when the file is larger than `--max-bytes` (its stderr says `size=<bytes>`)."""


class RunnerCheck(msgspec.Struct, frozen=True, kw_only=True):
    """A compute grader's command, run by the runner after the harness (it needs the sandbox)."""

    command: str
    """Run with `sh -c` in the workdir, without the harness's secrets."""
    timeout_s: float
    """Killed past this (the record says `timed_out`)."""


class RunnerLive(msgspec.Struct, frozen=True, kw_only=True):
    """Where the runner publishes the run's live log and live trace itself (core NATS, best effort)
    and how it continues the live view the dispatcher started: the same `LiveLog` / `LiveTrace`
    payloads, subjects and sequence the dispatcher would publish from the job log."""

    nats_url: str
    """The NATS server as reachable from inside the job."""
    token: str | None = None
    """The run token the runner connects with (None: as the URL says): nats-server asks the
    dispatchers about it (auth callout), and the user it gets may publish this run's live log and
    trace only, until the job's longest life is over. Worth nothing else, so it may ride in the
    job spec; masked in every line the runner prints."""
    connect_timeout_s: float = 2.0
    """Longest the runner waits for the connection before it leaves the live view to the job log."""
    execution: str | None = None
    """The dispatcher's id of this execution (`LiveLog.execution`, `LiveTrace.execution`)."""
    offset: int = 0
    """UTF-8 bytes of the run's live log before this execution's first chunk (`LiveLog.offset`)."""
    t_offset: float = 0.0
    """Seconds added to the `t` of the harness's trace events, to put them on the run's clock (the
    dispatcher's, when it submitted the job)."""


class RunnerJob(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=False):
    """What the runner runs: one case attempt's harness and the checks that need its sandbox."""

    run_id: str
    """The run (`EVALBUS_RUN_ID` in the harness's environment)."""
    case_id: str
    """The case (`EVALBUS_CASE_ID`)."""
    batch_id: str | None = None
    """The batch, when the run belongs to one (`EVALBUS_BATCH_ID`)."""
    trial: int = 1
    """Trial number (`EVALBUS_TRIAL`)."""
    attempt: int = 1
    """Attempt number (`EVALBUS_ATTEMPT`)."""
    command: tuple[str, ...]
    """The harness's argv (no shell)."""
    input: str = ""
    """The case input: on the harness's stdin and in the file `EVALBUS_INPUT_FILE` names."""
    env: dict[str, str] = msgspec.field(default_factory=dict)
    """Plain environment of the harness (and of the checks)."""
    secret_vars: tuple[str, ...] = ()
    """Names of variables the orchestrator put in the runner's environment from its own secret
    store: passed to the harness only, their values masked in every line the runner prints."""
    files: dict[str, str] = msgspec.field(default_factory=dict)
    """Relative path → content, written into the workdir first."""
    timeout_s: float = 600.0
    """The harness is killed past this (exit 124)."""
    checks: tuple[RunnerCheck, ...] = ()
    """Compute graders' commands, in grader order."""
    hold_s: float = 0.0
    """When the harness declared artifact files (`EVALBUS_EVENT` lines of kind `artifact`), keep
    the job alive after the snapshot for at most this many seconds (a `holding` record says so)
    so the dispatcher can read them from the running job; it ends the hold with SIGUSR1 (or
    SIGTERM). 0: never hold (a backend that reads a finished job's files)."""
    live: RunnerLive | None = None
    """Publish the live log and trace straight to NATS when it can be reached (the `started` record
    says whether it was); None: the job log is the live view's only source."""


class _Record(msgspec.Struct, frozen=True, kw_only=True, tag_field="kind"):
    pass


class Started(_Record, frozen=True, kw_only=True, tag="started"):
    """The harness process exists."""

    pid: int
    """Its process id inside the job."""
    at: datetime
    """When it started (UTC)."""
    live: Literal["nats", "log"] = "log"
    """Who publishes the live log and trace: the runner itself (`nats`, connected), or the
    dispatcher from the job log (`log`: no `live` in the job spec, or NATS not reachable)."""


class StdoutLine(_Record, frozen=True, kw_only=True, tag="stdout"):
    """A harness stdout line that began with the record marker (printed escaped)."""

    text: str
    """The line, secrets masked."""


class StderrLine(_Record, frozen=True, kw_only=True, tag="stderr"):
    """A harness stderr line."""

    text: str
    """The line, secrets masked (at most `RECORD_TEXT_CAP` bytes; a longer line is cut)."""


class Exited(_Record, frozen=True, kw_only=True, tag="exited"):
    """How the harness ended."""

    exit_code: int | None
    """Exit code (124 on timeout, 128+n when killed by signal n); None when it never started."""
    duration_s: float = 0.0
    """Seconds from spawn to exit."""
    timed_out: bool = False
    """Killed because it ran past its timeout."""
    signal: int | None = None
    """Signal that ended it."""
    spawn_error: str | None = None
    """Why it could not start."""


class ExecDone(_Record, frozen=True, kw_only=True, tag="exec"):
    """A check's command and what it gave (the dispatcher answers the grader's exec with it)."""

    command: str
    """The command, as in the job spec."""
    exit_code: int
    """Its exit code (124 on timeout)."""
    stdout: str = ""
    """The end of its stdout (at most `RECORD_TEXT_CAP` bytes)."""
    stderr: str = ""
    """The end of its stderr."""
    timed_out: bool = False
    """Killed past its timeout."""


class SnapshotTaken(_Record, frozen=True, kw_only=True, tag="snapshot"):
    """The workdir's changes, when it is a git repository."""

    snapshot: RepoSnapshot
    """Diff, changed files, head."""


class Holding(_Record, frozen=True, kw_only=True, tag="holding"):
    """The runner keeps the job alive for the dispatcher to read the declared files (after the
    snapshot, before `done`)."""

    files: tuple[str, ...]
    """The paths the harness declared (as it wrote them), relative to the workdir."""
    timeout_s: float
    """Longest the hold lasts; the runner then says `done` and exits."""
    pid: int
    """The runner's process id inside the job: SIGUSR1 (or SIGTERM) to it ends the hold at once."""


class Done(_Record, frozen=True, kw_only=True, tag="done"):
    """The runner finished: nothing more needs the job."""


Record = Started | StdoutLine | StderrLine | Exited | ExecDone | SnapshotTaken | Holding | Done
"""Any record line's payload."""

_encoder = msgspec.json.Encoder()
_decoder: msgspec.json.Decoder[Record] = msgspec.json.Decoder(Record)


def record_line(record: Record) -> str:
    """The line (without newline) that carries `record`."""
    return RECORD_PREFIX + _encoder.encode(record).decode("utf-8")


def is_record_line(line: str) -> bool:
    """Whether `line` is a record line (whole or torn)."""
    return line.startswith(RECORD_PREFIX) or line == RECORD_PREFIX.rstrip()


def read_line(line: str) -> Record | str | None:
    """A job log line: its record, the harness stdout text it is, or None for a torn record."""
    if not is_record_line(line):
        return line
    try:
        return _decoder.decode(line[len(RECORD_PREFIX) :])
    except msgspec.DecodeError:
        return None
