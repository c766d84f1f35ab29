"""What a run leaves that is too large for its event, stored in the `artifacts` bucket.

- **Declared files.** A harness declares a file by printing an `artifact` trace event whose `ref`
  is a path relative to its workdir (`EVALBUS_EVENT {"kind": "artifact", "name": "report",
  "ref": "out/report.html"}`). Before the sandbox is released the file is stored as
  `runs/<run>/a<attempt>/files/<path>` and the event rewritten with the object's `ref`
  (`artifacts/<name>`), `size` and `sha256`. A declaration that cannot be honoured (a path leaving
  the workdir, a missing file, a backend without a local workdir) stays as it was and an `error`
  event beside it says why.
- **Large logs.** A stdout or stderr (control lines removed) above the inline threshold is stored
  whole as `.../stdout.log` / `.../stderr.log`, named by an `artifact` event with role `stdout` /
  `stderr` (events keep only 16 KiB tails).
- **The result's bulk.** `evalbus_runtime.payloads.offload_result` moves a large answer, trace and
  snapshot into one object.

Names are deterministic per run attempt, so a redelivered case writes the same names again.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import Protocol, runtime_checkable

import msgspec
from nats.js import JetStreamContext

from evalbus_contracts import Artifact, CaseExecuted, CaseFailure, Error, TraceEvent, encode
from evalbus_contracts.streams import ARTIFACTS
from evalbus_dispatcher.backends.base import FileUnreadable, ReadsFiles
from evalbus_dispatcher.errors import BackendError
from evalbus_dispatcher.harness_output import strip_control_lines
from evalbus_runtime.objects import put_object
from evalbus_runtime.payloads import DEFAULT_INLINE_MAX_BYTES, offload_result, run_prefix

READ_BLOCK = 1024 * 1024
"""Bytes read from a declared file at a time."""
MAX_FILE_BYTES = 256 * 1024 * 1024
"""Largest declared file stored (bytes), on every backend; a larger one is refused, saying so."""
_SEGMENT = re.compile(r"^[-_.A-Za-z0-9=]+$")
_MAX_PATH = 200


@runtime_checkable
class HasWorkdir(Protocol):
    """A sandbox whose workdir this process can read (the local backend)."""

    workdir: Path
    """Where the harness ran."""


def declared_path(ref: str) -> str | None:
    """The normalised relative path a declaration names, or None when it may not be stored: absolute,
    leaving the workdir, empty, too long, or with characters outside `[-_.=A-Za-z0-9]` (pure)."""
    if not ref or len(ref) > _MAX_PATH or ref.startswith("/") or "\\" in ref:
        return None
    parts = [p for p in PurePosixPath(ref).parts if p != "."]
    if not parts or any(p == ".." or not _SEGMENT.match(p) for p in parts):
        return None
    return "/".join(parts)


def is_declaration(event: TraceEvent) -> bool:
    """An `artifact` event the harness printed, not yet stored."""
    return isinstance(event, Artifact) and event.sha256 is None


@dataclass(frozen=True, slots=True)
class WorkdirFiles:
    """`ReadsFiles` for a workdir on this machine (the local backend's sandboxes)."""

    workdir: Path
    """Where the harness ran."""

    async def open_file(self, rel: str, *, max_bytes: int) -> AsyncIterator[bytes]:
        """The file's blocks; `FileUnreadable` when it is missing, resolves (through a link) outside
        the workdir, is no regular file, or is larger than `max_bytes`."""
        try:
            resolved = (self.workdir / rel).resolve(strict=True)
        except OSError as e:
            raise FileUnreadable.missing() from e
        if not resolved.is_relative_to(self.workdir.resolve()) or not resolved.is_file():
            raise FileUnreadable.not_a_file()
        size = resolved.stat().st_size
        if size > max_bytes:
            raise FileUnreadable.too_large(size, max_bytes)
        return _blocks(resolved, max_bytes)


async def _blocks(path: Path, max_bytes: int) -> AsyncIterator[bytes]:
    seen = 0
    with path.open("rb") as f:
        while block := f.read(READ_BLOCK):
            seen += len(block)
            if seen > max_bytes:  # grew since it was looked at
                raise FileUnreadable.too_large(seen, max_bytes)
            yield block


def files_of(sandbox: object) -> ReadsFiles | None:
    """How the dispatcher reads `sandbox`'s files (None: it cannot)."""
    if isinstance(sandbox, ReadsFiles):
        return sandbox
    if isinstance(sandbox, HasWorkdir):
        return WorkdirFiles(sandbox.workdir)
    return None


@dataclass(frozen=True, slots=True)
class RunObjects:
    """Where a dispatcher stores a run's large outputs."""

    js: JetStreamContext
    """The JetStream context of the `artifacts` bucket."""
    inline_max: int = DEFAULT_INLINE_MAX_BYTES
    """Largest log, and answer + trace + snapshot, carried inline (bytes)."""
    max_event_bytes: int = 0
    """The bus's `max_payload` (0: unknown, not checked)."""
    max_file_bytes: int = MAX_FILE_BYTES
    """Largest declared file stored (bytes)."""

    async def store_declared(
        self, events: Sequence[TraceEvent], sandbox: object, *, run_id: str, attempt: int, t: float
    ) -> list[TraceEvent]:
        """`events` with every declared artifact stored and its event rewritten (or an `error` event
        after it saying why it was not)."""
        out: list[TraceEvent] = []
        for event in events:
            out.append(event)
            if not isinstance(event, Artifact) or event.sha256 is not None:
                continue
            stored, problem = await self._store_one(event, sandbox, run_id=run_id, attempt=attempt)
            if stored is not None:
                out[-1] = stored
            else:
                out.append(Error(message=f"artifact {event.name!r} ({event.ref}) not stored: {problem}", t=t))
        return out

    async def _store_one(
        self, event: Artifact, sandbox: object, *, run_id: str, attempt: int
    ) -> tuple[Artifact | None, str]:
        files = files_of(sandbox)
        if files is None:
            return None, "this backend's sandboxes have no files the dispatcher can read"
        rel = declared_path(event.ref)
        if rel is None:
            return None, "the path must be relative, stay inside the workdir and use only [-_.=A-Za-z0-9/]"
        name = f"{run_prefix(run_id, attempt)}/files/{rel}"
        try:
            blocks = await files.open_file(rel, max_bytes=self.max_file_bytes)
            ref = await put_object(self.js, ARTIFACTS, name, blocks, headers={"Evalbus-Run": run_id})
        except FileUnreadable as e:
            return None, e.reason
        except BackendError as e:
            return None, f"unreadable: {e.message}"
        except OSError as e:
            return None, f"unreadable: {e}"
        return Artifact(
            name=event.name,
            ref=f"{ref.bucket}/{ref.name}",
            sha256=ref.sha256,
            size=ref.size,
            media_type=event.media_type,
            role=event.role,
            t=event.t,
            span_id=event.span_id,
            parent_id=event.parent_id,
            duration_ms=event.duration_ms,
        ), ""

    async def store_logs(self, stdout: str, stderr: str, *, run_id: str, attempt: int, t: float) -> list[Artifact]:
        """An `artifact` event for each of stdout and stderr (control lines removed) larger than the
        threshold, stored whole."""
        out: list[Artifact] = []
        for stream, text in (("stdout", stdout), ("stderr", stderr)):
            if len(text) <= self.inline_max:  # characters ≤ bytes: cheap test before encoding
                continue
            data = strip_control_lines(text).encode("utf-8")
            if len(data) <= self.inline_max:
                continue
            name = f"{run_prefix(run_id, attempt)}/{stream}.log"
            ref = await put_object(self.js, ARTIFACTS, name, data, headers={"Evalbus-Run": run_id})
            out.append(
                Artifact(
                    name=f"{stream}.log",
                    ref=f"{ref.bucket}/{ref.name}",
                    sha256=ref.sha256,
                    size=ref.size,
                    media_type="text/plain; charset=utf-8",
                    role=stream,
                    t=t,
                )
            )
        return out

    async def offload(self, executed: CaseExecuted) -> CaseExecuted:
        """The event with its result's bulk in the bucket when it is too large to ride inline; a
        failed `result_too_large` execution when even that does not fit the bus."""
        result = await offload_result(self.js, executed.result, attempt=executed.attempt, inline_max=self.inline_max)
        out = executed if result is executed.result else msgspec.structs.replace(executed, result=result)
        if self.max_event_bytes:
            size = len(encode(out))
            if size > self.max_event_bytes - EVENT_HEADROOM and out.output_tail is not None:
                # the end of the output is a convenience for the log view: never why a result is lost
                out = msgspec.structs.replace(out, output_tail=None)
                size = len(encode(out))
            if size > self.max_event_bytes - EVENT_HEADROOM:
                return too_large(out, size, self.max_event_bytes)
        return out


EVENT_HEADROOM = 8 * 1024
"""Bytes of `max_payload` left for headers."""


def too_large(executed: CaseExecuted, size: int, limit: int) -> CaseExecuted:
    """A `case.executed` that still does not fit the bus with its bulk offloaded (its scores, failure
    evidence or case spec are too large), as a failed execution that does (pure): the scores are
    dropped and the failure says so, so the case settles instead of being retried or lost."""
    result = executed.result
    failure = CaseFailure(
        stage="run",
        failure_class="harness",
        code="result_too_large",
        message=f"the case's result is {size} bytes even with its answer, trace and snapshot in the object store "
        f"({len(result.scores)} scores), more than the bus takes ({limit} bytes)",
    )
    slim = msgspec.structs.replace(result, scores=(), failure=failure)
    return msgspec.structs.replace(executed, status="failed", result=slim)
