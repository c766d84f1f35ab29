"""Running one case attempt inside its job: harness, checks, snapshot, each reported as record lines.

The harness gets the same environment as on the local backend: an allow-list of the job's own
variables (`PATH`, `HOME`, locale…), the spec's plain `env`, evalbus's ids, and the secret
variables the orchestrator injected (named in `secret_vars`, never in the spec). Checks (the compute
graders' commands) run in the same workdir without the secrets. Every line printed has the secret
values masked.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path, PurePosixPath
from typing import BinaryIO, Literal
from urllib.parse import quote

from evalbus.runner.live import connect_live
from evalbus_contracts import RepoSnapshot
from evalbus_contracts.runner import (
    RECORD_TEXT_CAP,
    SEND_MISSING,
    SEND_NOT_A_FILE,
    SEND_TOO_LARGE,
    Done,
    ExecDone,
    Exited,
    Holding,
    Record,
    RunnerJob,
    SnapshotTaken,
    Started,
    StderrLine,
    StdoutLine,
    is_record_line,
    record_line,
)

TIMEOUT_EXIT = 124
"""Exit code of a process killed on its timeout (as `timeout(1)`)."""
KILL_GRACE_S = 2.0
"""Seconds between SIGTERM and SIGKILL of a timed-out process group."""
DRAIN_S = 2.0
"""Seconds to finish reading pipes a leftover process of the group still holds."""
REDACTED = "[redacted]"
"""What a secret value is replaced with."""
INHERITED_ENV: tuple[str, ...] = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "TERM",
)  # fmt: skip
"""Variables of the job's environment the harness inherits (nothing else leaks through: not the
orchestrator's service variables, not the job spec)."""

_READ_CHUNK = 64 * 1024
_MAX_LINE = 1024 * 1024
_DIFF_CAP = 256 * 1024
_RESOURCE_KEY = "evalbus.run_id"
_EVENT_PREFIX = "EVALBUS_EVENT "
_SEND_BLOCK = 1024 * 1024

Stream = Literal["stdout", "stderr"]
Write = Callable[[str], None]


def harness_environment(job: RunnerJob, environ: Mapping[str, str], input_file: Path) -> dict[str, str]:
    """The harness's environment without its secrets (the checks get exactly this)."""
    env = {name: environ[name] for name in INHERITED_ENV if name in environ}
    env.update(job.env)
    env["EVALBUS_RUN_ID"] = job.run_id
    env["EVALBUS_CASE_ID"] = job.case_id
    env["EVALBUS_TRIAL"] = str(job.trial)
    env["EVALBUS_ATTEMPT"] = str(job.attempt)
    env["EVALBUS_INPUT_FILE"] = str(input_file)
    if job.batch_id is not None:
        env["EVALBUS_BATCH_ID"] = job.batch_id
    else:
        env.pop("EVALBUS_BATCH_ID", None)
    kept = [
        part
        for part in env.get("OTEL_RESOURCE_ATTRIBUTES", "").split(",")
        if part.strip() and part.split("=", 1)[0].strip() != _RESOURCE_KEY
    ]
    kept.append(f"{_RESOURCE_KEY}={quote(job.run_id, safe='-._~')}")
    env["OTEL_RESOURCE_ATTRIBUTES"] = ",".join(kept)
    return env


def masked_values(job: RunnerJob) -> list[str]:
    """Values the runner masks besides the harness's secrets: its own NATS token (`job.live`)."""
    return [job.live.token] if job.live is not None and job.live.token else []


def _redactor(values: list[str]) -> Callable[[str], str]:
    secrets = sorted({v for v in values if v}, key=len, reverse=True)

    def redact(text: str) -> str:
        for value in secrets:
            if value in text:
                text = text.replace(value, REDACTED)
        return text

    return redact


def _cap(text: str, limit: int = RECORD_TEXT_CAP, *, keep: Literal["head", "tail"] = "head") -> str:
    data = text.encode("utf-8")
    if len(data) <= limit:
        return text
    cut = data[:limit] if keep == "head" else data[-limit:]
    return cut.decode("utf-8", errors="ignore")


@dataclass
class _Tail:
    """The last lines of one stream, at most `RECORD_TEXT_CAP` bytes."""

    lines: deque[str] = field(default_factory=deque)
    size: int = 0

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.size += len(line.encode("utf-8")) + 1
        while self.size > RECORD_TEXT_CAP and len(self.lines) > 1:
            self.size -= len(self.lines.popleft().encode("utf-8")) + 1

    def text(self) -> str:
        return _cap("\n".join(self.lines), keep="tail")


@dataclass(frozen=True, slots=True)
class _Ended:
    exit_code: int
    timed_out: bool
    signal: int | None
    duration_s: float
    stdout: str
    stderr: str


class _ExitAware(asyncio.subprocess.SubprocessStreamProtocol):
    """Stream protocol with an event set when the process itself exits (a leftover process of the
    group may hold the pipes open long after)."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=_READ_CHUNK, loop=loop)
        self.exited = asyncio.Event()

    def process_exited(self) -> None:
        super().process_exited()
        self.exited.set()


async def _pump(reader: asyncio.StreamReader, emit: Callable[[str], Awaitable[None]]) -> None:
    pending = b""
    while chunk := await reader.read(_READ_CHUNK):
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            await emit(raw.decode("utf-8", errors="replace").removesuffix("\r"))
        if len(pending) > _MAX_LINE:
            await emit(pending.decode("utf-8", errors="replace"))
            pending = b""
    if pending:
        await emit(pending.decode("utf-8", errors="replace").removesuffix("\r"))


def _signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def _run(
    argv: tuple[str, ...],
    *,
    cwd: Path,
    env: Mapping[str, str],
    stdin: bytes | None,
    timeout_s: float,
    on_line: Callable[[Stream, str], Awaitable[None]],
    on_spawn: Callable[[int], None] | None = None,
) -> _Ended:
    """Run argv in its own process group, every line to `on_line`; OSError when it cannot start."""
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    transport, protocol = await loop.subprocess_exec(
        lambda: _ExitAware(loop),
        *argv,
        cwd=cwd,
        env=dict(env),
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    pgid = transport.get_pid()
    if on_spawn is not None:
        on_spawn(pgid)
    assert protocol.stdout is not None
    assert protocol.stderr is not None
    tails = {"stdout": _Tail(), "stderr": _Tail()}

    def reader(stream: Stream) -> Callable[[str], Awaitable[None]]:
        async def emit(line: str) -> None:
            tails[stream].add(line)
            await on_line(stream, line)

        return emit

    tasks = [
        asyncio.create_task(_pump(protocol.stdout, reader("stdout"))),
        asyncio.create_task(_pump(protocol.stderr, reader("stderr"))),
    ]
    if stdin is not None and protocol.stdin is not None:
        tasks.append(asyncio.create_task(_feed(protocol.stdin, stdin)))
    timed_out = False
    try:
        try:
            await asyncio.wait_for(protocol.exited.wait(), timeout_s)
        except TimeoutError:
            timed_out = True
            _signal_group(pgid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(protocol.exited.wait(), KILL_GRACE_S)
            _signal_group(pgid, signal.SIGKILL)
            await protocol.exited.wait()
        duration = time.monotonic() - started
        await asyncio.wait(tasks, timeout=DRAIN_S)
    finally:
        _signal_group(pgid, signal.SIGKILL)  # nothing of the group outlives its step
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        transport.close()
    code = transport.get_returncode()
    return _Ended(
        exit_code=TIMEOUT_EXIT if timed_out else (-1 if code is None else (128 - code if code < 0 else code)),
        timed_out=timed_out,
        signal=-code if code is not None and code < 0 else None,
        duration_s=duration,
        stdout=tails["stdout"].text(),
        stderr=tails["stderr"].text(),
    )


async def _feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        writer.write(data)
        await writer.drain()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        writer.close()
        await writer.wait_closed()


def _write_files(workdir: Path, files: Mapping[str, str]) -> str | None:
    """Lay the harness files out; the reason when they cannot be (nothing is run then)."""
    for raw, content in files.items():
        rel = PurePosixPath(raw)
        if not raw or rel.is_absolute() or ".." in rel.parts or str(rel) in ("", "."):
            return f"harness file path {raw!r} must be relative and stay inside the workdir"
        target = workdir / rel
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_text(content, encoding="utf-8")
        except OSError as e:
            return f"cannot write harness file {raw!r}: {e}"
    return None


async def _snapshot(workdir: Path, env: Mapping[str, str]) -> RepoSnapshot | None:
    if not (workdir / ".git").exists() or shutil.which("git", path=env.get("PATH")) is None:
        return None

    async def git(*args: str) -> str | None:
        out: list[str] = []

        async def keep(stream: Stream, line: str) -> None:
            if stream == "stdout":
                out.append(line)

        ended = await _run(
            ("git", "-C", str(workdir), *args), cwd=workdir, env=env, stdin=None, timeout_s=60.0, on_line=keep
        )
        return "\n".join(out) if ended.exit_code == 0 else None

    status = await git("status", "--porcelain=v1", "--untracked-files=all")
    if status is None:
        return None
    changed = tuple(line[3:] for line in status.split("\n") if len(line) > 3)
    head = await git("rev-parse", "HEAD")
    diff = (await git("diff", "HEAD") if head is not None else None) or ""
    return RepoSnapshot(diff=_cap(diff, _DIFF_CAP), changed_files=changed, head_sha=head.strip() if head else None)


async def run_job(job: RunnerJob, *, workdir: Path, environ: Mapping[str, str], write: Write) -> int:
    """Run `job` in `workdir`, every record and harness stdout line to `write` (one line, no
    newline, each call); 0 once everything is reported (the harness's own exit is in a record)."""
    secrets = {var: environ[var] for var in job.secret_vars if var in environ}
    redact = _redactor([*secrets.values(), *masked_values(job)])

    def emit(record: Record) -> None:
        write(record_line(record))

    fd, input_name = tempfile.mkstemp(prefix="evalbus-input-", suffix=".txt")
    input_file = Path(input_name)
    with os.fdopen(fd, "w", encoding="utf-8") as handle:
        handle.write(job.input)
    try:
        env = harness_environment(job, environ, input_file)
        problem = _write_files(workdir, job.files)
        if problem is not None:
            emit(Exited(exit_code=None, spawn_error=problem))
            emit(Done())
            return 0
        if not job.command:
            emit(Exited(exit_code=None, spawn_error="the harness command is empty"))
            emit(Done())
            return 0

        declared: list[str] = []
        live = await connect_live(job)

        async def harness_line(stream: Stream, line: str) -> None:
            text = redact(line)
            if stream == "stderr":
                text = _cap(text)
                emit(StderrLine(text=text))
            elif is_record_line(text):
                emit(StdoutLine(text=text))  # escaped: a harness cannot forge records
            else:
                if (ref := declared_file(text)) is not None:
                    declared.append(ref)
                write(text)
            if live is not None:
                live.line(stream, text)

        def spawned(pid: int) -> None:
            emit(Started(pid=pid, at=datetime.now(UTC), live="nats" if live is not None else "log"))

        try:
            ended = await _run(
                job.command,
                cwd=workdir,
                env={**env, **secrets},
                stdin=job.input.encode("utf-8"),
                timeout_s=job.timeout_s,
                on_line=harness_line,
                on_spawn=spawned,
            )
        except OSError as e:
            emit(Exited(exit_code=None, spawn_error=redact(f"cannot start {job.command[0]!r}: {e}")))
            emit(Done())
            return 0
        finally:
            if live is not None:
                await live.close()  # the live view is complete once the harness ended
        emit(
            Exited(
                exit_code=ended.exit_code,
                duration_s=ended.duration_s,
                timed_out=ended.timed_out,
                signal=ended.signal,
            )
        )
        for check in job.checks:
            emit(await _check(check.command, check.timeout_s, workdir=workdir, env=env, redact=redact))
        snapshot = await _snapshot(workdir, env)
        if snapshot is not None:
            emit(SnapshotTaken(snapshot=snapshot))
        if declared and job.hold_s > 0:
            holding = Holding(files=tuple(declared), timeout_s=job.hold_s, pid=os.getpid())
            await hold(job.hold_s, announce=lambda: emit(holding))
        emit(Done())
        return 0
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(input_name)


def declared_file(line: str) -> str | None:
    """The path an `EVALBUS_EVENT` line of kind `artifact` declares (not yet stored: no `sha256`),
    else None (pure)."""
    if not line.startswith(_EVENT_PREFIX):
        return None
    try:
        event = json.loads(line[len(_EVENT_PREFIX) :])
    except ValueError:
        return None
    if not isinstance(event, dict) or event.get("kind") != "artifact" or event.get("sha256") is not None:
        return None
    ref = event.get("ref")
    return ref if isinstance(ref, str) and ref else None


async def hold(seconds: float, announce: Callable[[], None] | None = None) -> None:
    """Wait `seconds`, or until SIGUSR1 or SIGTERM (the dispatcher has read the files, or the job is
    being deleted) — whichever comes first; `announce` is called once the signals are handled (so a
    SIGUSR1 sent as soon as the `holding` record is read ends the hold instead of the runner)."""
    loop = asyncio.get_running_loop()
    released = asyncio.Event()
    signals = (signal.SIGUSR1, signal.SIGTERM)
    for sig in signals:
        loop.add_signal_handler(sig, released.set)
    try:
        if announce is not None:
            announce()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(released.wait(), seconds)
    finally:
        for sig in signals:
            loop.remove_signal_handler(sig)


def send_file(workdir: Path, rel: str, max_bytes: int, out: BinaryIO, err: Write) -> int:
    """Write the workdir's file `rel` to `out` — how the dispatcher reads a declared file from a
    job it cannot reach otherwise (an exec); 0, or `SEND_MISSING` / `SEND_NOT_A_FILE` (a folder, a
    link leading out of the workdir) / `SEND_TOO_LARGE` with the reason to `err` and nothing
    written."""
    try:
        path = (workdir / rel).resolve(strict=True)
    except OSError:
        err(f"no such file: {rel}")
        return SEND_MISSING
    if not path.is_relative_to(workdir.resolve()) or not path.is_file():
        err(f"not a regular file inside the workdir: {rel}")
        return SEND_NOT_A_FILE
    size = path.stat().st_size
    if size > max_bytes:
        err(f"size={size}")
        return SEND_TOO_LARGE
    with path.open("rb") as f:
        while block := f.read(_SEND_BLOCK):
            out.write(block)
    out.flush()
    return 0


async def _check(
    command: str, timeout_s: float, *, workdir: Path, env: Mapping[str, str], redact: Callable[[str], str]
) -> ExecDone:
    async def quiet(_stream: Stream, _line: str) -> None:
        return None

    try:
        ended = await _run(
            ("/bin/sh", "-c", command), cwd=workdir, env=env, stdin=None, timeout_s=timeout_s, on_line=quiet
        )
    except OSError as e:
        return ExecDone(command=command, exit_code=127, stderr=f"cannot run the check: {e}")
    return ExecDone(
        command=command,
        exit_code=ended.exit_code,
        stdout=redact(ended.stdout),
        stderr=redact(ended.stderr),
        timed_out=ended.timed_out,
    )


async def exec_masked(
    command: str, *, workdir: Path, environ: Mapping[str, str], secret_vars: tuple[str, ...], write_out: Write,
    write_err: Write, masked: tuple[str, ...] = (),
) -> int:  # fmt: skip
    """Run `command` with `sh -c` in `workdir` with the job's whole environment (secrets included) —
    a person's exec into the live sandbox — its lines masked as the runner masks the harness's
    (and `masked`, the runner's run token); its exit code."""
    redact = _redactor([*(environ[var] for var in secret_vars if var in environ), *masked])

    async def line(stream: Stream, text: str) -> None:
        (write_out if stream == "stdout" else write_err)(redact(text))

    ended = await _run(
        ("/bin/sh", "-c", command), cwd=workdir, env=environ, stdin=None, timeout_s=24 * 3600.0, on_line=line
    )
    return ended.exit_code
