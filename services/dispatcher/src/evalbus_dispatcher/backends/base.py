"""The backend port: provision a sandbox for a case, run the harness in it, let compute graders
exec in it, snapshot it, release it.

A handle is used by one case, in this order: `run_harness` once, then any number of `exec`
calls and a `snapshot`, then `release` (idempotent, always called, also on error paths).
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime
from typing import Literal, Protocol, TypeGuard, runtime_checkable

from evalbus_contracts import CaseRequested, Snapshot
from evalbus_contracts.results import FailureClass
from evalbus_grading import ExecResult

OutputStream = Literal["stdout", "stderr"]
"""Which stream of the harness a line came from."""

OnOutput = Callable[[OutputStream, str], Awaitable[None]]
"""Called with each line of harness output (newline removed) as soon as it is read."""

OnSpawn = Callable[[int], Awaitable[None]]
"""Called with the harness's process id once it exists (before its output is read)."""


@dataclass(frozen=True, slots=True)
class RunFailure:
    """How a harness run failed when its exit code alone cannot say (a warm worker that crashed,
    was killed or broke the protocol; a worker harness's function that raised)."""

    code: str
    """Stable machine code (`worker_crashed`, `worker_killed`, `worker_protocol`, `harness_error`...)."""
    failure_class: FailureClass
    """Whose fault."""
    message: str
    """Human-readable explanation (secrets already redacted)."""
    retryable: bool = False
    """Whether running the case again may succeed."""
    never_started: bool = False
    """The harness never got the case (a worker that exited before it was ready): the run says
    nothing of the agent, so it is not graded, like a command that could not be spawned."""


@dataclass(frozen=True, slots=True)
class HarnessRun:
    """What running the harness produced. Secret values are already redacted from the text."""

    exit_code: int | None
    """Exit code (124 when killed on timeout, 128+n when killed by signal n); None if it never started."""
    stdout: str
    """Standard output, every line (the tail only, when `stdout_truncated`)."""
    stderr: str
    """Standard error (the tail only, when `stderr_truncated`)."""
    duration_s: float = 0.0
    """Seconds from spawn to exit."""
    timed_out: bool = False
    """Killed because it ran past its timeout."""
    spawn_error: str | None = None
    """Why the process could not be started (command not found, not executable...)."""
    stdout_truncated: bool = False
    """The head of stdout was dropped to respect the backend's output cap."""
    stderr_truncated: bool = False
    """The head of stderr was dropped to respect the backend's output cap."""
    signal: int | None = None
    """Signal that ended the process, when one did (SIGTERM/SIGKILL on timeout included)."""
    oom: bool | None = None
    """Whether the out-of-memory killer ended it (None: cannot tell)."""
    pid: int | None = None
    """Process id the harness ran as."""
    failure: RunFailure | None = None
    """Why the run failed, when the backend knows better than the exit code (worker harnesses)."""


@dataclass(frozen=True, slots=True)
class UnitUsage:
    """What a sandbox's running unit uses now."""

    pid: int | None
    """Process id of the harness."""
    processes: int
    """Processes alive in the unit."""
    rss_bytes: int | None
    """Resident memory, bytes."""
    cpu_seconds: float | None
    """CPU time so far, seconds."""


@dataclass(frozen=True, slots=True)
class Capacity:
    """Compute slots of a backend."""

    total: int
    """Slots this backend offers."""
    used: int
    """Slots held by provisioned, not yet released sandboxes."""

    @property
    def free(self) -> int:
        """Slots available now."""
        return max(0, self.total - self.used)


class SandboxHandle(Protocol):
    """One provisioned sandbox, owned by one case."""

    @property
    def unit(self) -> str | None:
        """Backend unit (process group, allocation, pod), once known."""
        ...

    @property
    def node(self) -> str | None:
        """Node the sandbox runs on."""
        ...

    async def run_harness(self, on_output: OnOutput, on_spawn: OnSpawn | None = None) -> HarnessRun:
        """Run the case's harness to completion or timeout, streaming each output line;
        `on_spawn(pid)` once the process exists."""
        ...

    def usage(self) -> UnitUsage | None:
        """What the harness's unit uses now (None before it started or after it ended)."""
        ...

    async def exec(self, command: str, timeout_s: float) -> ExecResult:
        """Run a shell command in the sandbox's workdir (for compute graders)."""
        ...

    async def snapshot(self, answer: str) -> Snapshot:
        """The environment at the end of the run."""
        ...

    async def release(self) -> None:
        """Free the sandbox and everything in it. Idempotent."""
        ...


@dataclass(frozen=True, slots=True)
class LiveExec:
    """A one-shot command run in a live sandbox on request (secrets masked in its output)."""

    exit_code: int
    """Exit code (124 on timeout, 128+n when killed by signal n)."""
    stdout: str
    """The end of its standard output (at most the cap asked for)."""
    stderr: str
    """The end of its standard error."""
    timed_out: bool = False
    """Killed on its timeout."""
    truncated: bool = False
    """The beginning of stdout or stderr was left out."""


class Shell(Protocol):
    """An interactive shell on a terminal in a live sandbox."""

    shell: str
    """Its program."""

    def write(self, data: bytes) -> None:
        """Type into it."""
        ...

    def resize(self, cols: int, rows: int) -> None:
        """Change the terminal's size."""
        ...

    def kill(self) -> None:
        """End it and everything started from it."""
        ...

    async def wait(self) -> int | None:
        """Wait until it ended (its output forwarded); its exit code."""
        ...


@runtime_checkable
class QuickUsage(Protocol):
    """A sandbox that can often tell its usage without blocking (a few `/proc` files)."""

    def quick_usage(self) -> UnitUsage | None:
        """`usage()` when it can be read at once on the event loop; None when only the blocking
        `usage()` can tell (the sampler then calls that in a thread). A reading of no processes
        says that none of the unit is left (what `usage()` answers with None)."""
        ...


@runtime_checkable
class Interactive(Protocol):
    """A sandbox a person can act in while it lives (the live actions: exec, terminal)."""

    async def exec_live(
        self, command: str, timeout_s: float, *, cap_bytes: int, on_spawn: OnSpawn | None = None
    ) -> LiveExec:
        """Run `command` with `sh -c` in the sandbox's workdir and environment (secrets included,
        masked in the output); raises `BackendError` once the sandbox is released."""
        ...

    async def open_shell(self, cols: int, rows: int, on_output: Callable[[bytes], Awaitable[None]]) -> Shell:
        """Start an interactive shell on a terminal in the sandbox, its output (masked) to
        `on_output`; raises `BackendError` once the sandbox is released."""
        ...

    def kill_group(self, pgid: int) -> None:
        """Kill one process group the sandbox started."""
        ...


class FileUnreadable(Exception):
    """A file a harness declared cannot be given: missing, not a regular file inside the workdir, too
    large, or its sandbox can no longer be read. `reason` is said in the run's trace."""

    def __init__(self, reason: str) -> None:
        super().__init__(reason)
        self.reason = reason

    @classmethod
    def missing(cls) -> FileUnreadable:
        """No such file (the same words on every backend)."""
        return cls(MISSING_FILE)

    @classmethod
    def not_a_file(cls) -> FileUnreadable:
        """A folder, a symbolic link, a device, or a path resolving outside the workdir."""
        return cls(NOT_A_FILE)

    @classmethod
    def too_large(cls, size: int, max_bytes: int) -> FileUnreadable:
        """Over the cap."""
        return cls(f"{size} bytes, more than the {max_bytes} bytes a declared file may have")


MISSING_FILE = "no such file in the workdir"
"""Why a declared path that does not exist is not stored."""
NOT_A_FILE = "not a regular file inside the workdir"
"""Why a folder, a link, or a path resolving outside the workdir is not stored."""


@runtime_checkable
class ReadsFiles(Protocol):
    """A sandbox the dispatcher can read a file of, by a path relative to its workdir, between the
    harness's end and the release (how a declared artifact is collected)."""

    async def open_file(self, rel: str, *, max_bytes: int) -> AsyncIterator[bytes]:
        """The file's bytes, block by block, once it is known to be a regular file inside the
        workdir of at most `max_bytes`; `FileUnreadable` (raised here, before any byte) when it
        is not. `rel` is already normalised (`artifacts.declared_path`). A failure while the blocks
        are read raises from the iterator (`FileUnreadable` or `BackendError`)."""
        ...


class Backend(Protocol):
    """Where sandboxes come from."""

    async def provision(self, job: CaseRequested) -> SandboxHandle:
        """A sandbox ready to run `job`'s harness; raises `BackendError` when it cannot."""
        ...

    def capacity(self) -> Capacity:
        """Slots offered and in use."""
        ...


# ---------------------------------------------------------------- cluster backends

PlacementPhase = Literal["queued", "blocked", "starting", "running", "dead"]
"""Where a case's orchestrator unit is: not scheduled yet, unschedulable (or failing to start),
scheduled and starting, running, gone."""

Mark = Callable[[str, str], Awaitable[None]]
"""Adds an infra mark (event, message) to the run's trace, live and sealed (failure evidence)."""


@dataclass(frozen=True, slots=True)
class OrchestratorEvent:
    """One event of the orchestrator's own feed about the unit (a Kubernetes Event, a Nomad task event)."""

    at: datetime | None
    """When the orchestrator recorded it (its clock)."""
    kind: str
    """`Normal` or `Warning` (Kubernetes), the task event type (Nomad)."""
    reason: str
    """Short machine word: `Scheduled`, `Pulling`, `FailedScheduling`, `Killing`…"""
    message: str
    """What the orchestrator said."""


@dataclass(frozen=True, slots=True)
class UnitPlacement:
    """A cluster unit (pod, allocation) as the orchestrator reports it, normalised."""

    phase: PlacementPhase
    """queued / blocked / starting / running / dead."""
    reason: str | None = None
    """Why blocked or dead (the scheduler's message, `OOMKilled`, `ErrImagePull: …`)."""
    unit: str | None = None
    """The pod or allocation."""
    node: str | None = None
    """The node it was placed on."""
    restarts: int = 0
    """Container or task restarts."""
    oom: bool | None = None
    """Whether the out-of-memory killer ended it (None: not ended, or cannot tell)."""
    exit_code: int | None = None
    """The container's or task's exit code, once it ended."""
    events: tuple[OrchestratorEvent, ...] = ()
    """The orchestrator's event feed, oldest first."""


@runtime_checkable
class Observed(Protocol):
    """A sandbox on an orchestrator: it marks the run's trace as the orchestrator reports the unit
    (submitted, blocked, placed, its own events) and can say where the unit is now."""

    def observe(self, mark: Mark) -> None:
        """Report placement to `mark` from now on (called once the sandbox exists)."""
        ...

    async def placement(self) -> UnitPlacement:
        """Where the unit is now, from the orchestrator."""
        ...


_IMPLEMENTS: dict[tuple[type, type], bool] = {}


def _implements(obj: object, protocol: type) -> bool:
    """`isinstance(obj, protocol)` for a runtime-checkable protocol of methods, answered once per
    class: the check looks up every member of the protocol (tens of µs each in Python 3.11), and
    the dispatcher asked it several times per case."""
    key = (type(obj), protocol)
    found = _IMPLEMENTS.get(key)
    if found is None:
        found = _IMPLEMENTS[key] = isinstance(obj, protocol)
    return found


def is_observed(handle: object) -> TypeGuard[Observed]:
    """Whether `handle` reports its orchestrator's placement (`Observed`), cached per class."""
    return _implements(handle, Observed)


def is_interactive(handle: object) -> TypeGuard[Interactive]:
    """Whether a person can act in `handle` (`Interactive`), cached per class."""
    return _implements(handle, Interactive)


def has_quick_usage(handle: object) -> TypeGuard[QuickUsage]:
    """Whether `handle` can often tell its usage on the event loop (`QuickUsage`), cached per class."""
    return _implements(handle, QuickUsage)
