"""A harness process in its own process group: spawning it (the leader dies with the dispatcher),
pumping its output line by line into a bounded capture, the timeout's SIGTERM then SIGKILL of the
whole group, and the owner mark that lets a later dispatcher sweep the sandboxes of one that died.
Shared by the local backend's process per case and its warm workers."""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import platform
import shutil
import signal
import tempfile
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from evalbus_dispatcher.backends.base import OnOutput, OnSpawn, OutputStream

log = logging.getLogger(__name__)

TIMEOUT_EXIT = 124
"""Exit code read when a process group is killed on timeout (as `timeout(1)` does)."""

READ_CHUNK = 64 * 1024
"""How much of a pipe is read at once."""
_MAX_LINE = 1024 * 1024


@dataclass
class Capture:
    """The lines of one stream, keeping the tail when over the cap."""

    cap: int
    lines: deque[str] = field(default_factory=deque)
    size: int = 0
    truncated: bool = False

    def add(self, line: str) -> None:
        self.lines.append(line)
        self.size += len(line) + 1
        while self.size > self.cap and len(self.lines) > 1:
            self.size -= len(self.lines.popleft()) + 1
            self.truncated = True

    def text(self) -> str:
        return "\n".join(self.lines)

    def tail(self, limit: int) -> tuple[str, bool]:
        """The last `limit` bytes of the text (whole lines where they fit) and whether any was cut."""
        text = self.text()
        data = text.encode("utf-8")
        if len(data) <= limit:
            return text, self.truncated
        return data[-limit:].decode("utf-8", errors="ignore"), True


@dataclass(frozen=True, slots=True)
class Exited:
    exit_code: int
    stdout: Capture
    stderr: Capture
    duration_s: float
    timed_out: bool
    signal: int | None = None


def exit_code(returncode: int | None) -> int:
    if returncode is None:
        return -1
    return 128 - returncode if returncode < 0 else returncode


def signal_group(pgid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(pgid, sig)


async def pump(
    reader: asyncio.StreamReader,
    stream: OutputStream,
    capture: Capture,
    redact: Callable[[str], str],
    on_output: OnOutput | None,
) -> None:
    async def emit(raw: bytes) -> None:
        line = redact(raw.decode("utf-8", errors="replace").removesuffix("\r"))
        capture.add(line)
        if on_output is not None:
            try:
                await on_output(stream, line)
            except Exception:  # a live-view problem must never stall the pipe
                log.exception("output callback failed; output keeps being read")

    pending = b""
    while chunk := await reader.read(READ_CHUNK):
        pending += chunk
        *complete, pending = pending.split(b"\n")
        for raw in complete:
            await emit(raw)
        if len(pending) > _MAX_LINE:
            await emit(pending)
            pending = b""
    if pending:
        await emit(pending)


async def feed(writer: asyncio.StreamWriter, data: bytes) -> None:
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        writer.write(data)
        await writer.drain()
    with contextlib.suppress(BrokenPipeError, ConnectionResetError):
        writer.close()
        await writer.wait_closed()


OWNER_FILE = "owner"
"""File in each case root naming the dispatcher process that made it (`<pid> <start time>`)."""


def start_time(pid: int) -> str | None:
    """The kernel's start time of `pid` (field 22 of /proc/<pid>/stat), or None when it is gone."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw.rsplit(")", 1)[1].split()[19]


def owner_mark(pid: int) -> str:
    return f"{pid} {start_time(pid)}"


_SETPRIV = shutil.which("setpriv")


def die_with_parent(argv: tuple[str, ...], cwd: Path, env: Mapping[str, str]) -> tuple[str, ...]:
    """argv wrapped so the kernel SIGKILLs the leader if the dispatcher dies (`PR_SET_PDEATHSIG`
    through util-linux `setpriv`; a `preexec_fn` would make every spawn a slow full fork). The
    program is resolved first, so a missing one still fails to spawn (not as setpriv's exit 127)."""
    if _SETPRIV is None or platform.system() != "Linux":
        return argv
    program = argv[0]
    if "/" in program:
        path = Path(program) if Path(program).is_absolute() else cwd / program
        if not path.is_file():
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
        if not os.access(path, os.X_OK):
            raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), program)
        resolved = str(path)
    else:
        found = shutil.which(program, path=env.get("PATH", os.defpath))
        if found is None:
            raise FileNotFoundError(errno.ENOENT, os.strerror(errno.ENOENT), program)
        resolved = found
    return (_SETPRIV, "--pdeathsig", "KILL", "--", resolved, *argv[1:])


def sweep_orphans(root: Path | None = None) -> list[Path]:
    """Remove sandboxes left by a dispatcher that died (SIGKILL, machine crash): every case root
    under `root` whose owner process is gone has its processes killed (found by their working
    directory) and its folder removed. Sandboxes of live dispatchers are left alone."""
    base = Path(root or tempfile.gettempdir())
    swept: list[Path] = []
    for case_root in base.glob("evalbus-*"):
        owner = case_root / OWNER_FILE
        try:
            pid_text, start = owner.read_text().split()
        except (OSError, ValueError):
            continue
        if start_time(int(pid_text)) == start:
            continue  # its dispatcher is alive
        kill_processes_under(case_root.resolve())
        shutil.rmtree(case_root, ignore_errors=True)
        swept.append(case_root)
    return swept


def kill_processes_under(folder: Path) -> None:
    for proc in Path("/proc").glob("[0-9]*"):
        try:
            cwd = Path(os.readlink(proc / "cwd"))
        except OSError:
            continue
        if cwd == folder or folder in cwd.parents:
            with contextlib.suppress(OSError):
                os.killpg(os.getpgid(int(proc.name)), signal.SIGKILL)


class ExitAwareProtocol(asyncio.subprocess.SubprocessStreamProtocol):
    """asyncio's stream protocol, plus an event set when the process itself exits.

    `Process.wait()` also waits for the pipes to close, which never happens while a leftover
    process of the group holds them; the exit of the leader is what ends a run.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        super().__init__(limit=READ_CHUNK, loop=loop)
        self.exited = asyncio.Event()

    def process_exited(self) -> None:
        super().process_exited()
        self.exited.set()


async def run_process(
    argv: tuple[str, ...],
    *,
    cwd: Path,
    env: Mapping[str, str],
    stdin: bytes | None,
    timeout_s: float,
    redact: Callable[[str], str],
    on_output: OnOutput | None,
    groups: set[int],
    grace_s: float,
    drain_s: float,
    cap: int,
    on_spawn: OnSpawn | None = None,
) -> Exited:
    """Run argv in its own process group; raises OSError when it cannot be spawned."""
    loop = asyncio.get_running_loop()
    started = time.monotonic()
    transport, protocol = await loop.subprocess_exec(
        lambda: ExitAwareProtocol(loop),
        *die_with_parent(argv, cwd, env),
        cwd=cwd,
        env=dict(env),
        stdin=asyncio.subprocess.PIPE if stdin is not None else asyncio.subprocess.DEVNULL,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
        start_new_session=True,
    )
    pgid = transport.get_pid()  # the new session's process group id is the leader's pid
    groups.add(pgid)
    if on_spawn is not None:
        try:
            await on_spawn(pgid)
        except Exception:  # a live-view problem must never stop the run
            log.exception("spawn callback failed; the run goes on")
    assert protocol.stdout is not None
    assert protocol.stderr is not None
    out, err = Capture(cap), Capture(cap)
    tasks = [
        asyncio.create_task(pump(protocol.stdout, "stdout", out, redact, on_output)),
        asyncio.create_task(pump(protocol.stderr, "stderr", err, redact, on_output)),
    ]
    if stdin is not None and protocol.stdin is not None:
        tasks.append(asyncio.create_task(feed(protocol.stdin, stdin)))
    timed_out = False
    try:
        try:
            await asyncio.wait_for(protocol.exited.wait(), timeout_s)
        except TimeoutError:
            timed_out = True
            signal_group(pgid, signal.SIGTERM)
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(protocol.exited.wait(), grace_s)
            signal_group(pgid, signal.SIGKILL)  # whatever ignored SIGTERM or outlived the leader
            await protocol.exited.wait()
        duration = time.monotonic() - started
        # Processes left in the group may still hold the pipes: give them a bounded drain.
        await asyncio.wait(tasks, timeout=drain_s)
    except BaseException:  # cancelled: nothing of the group may outlive the caller
        signal_group(pgid, signal.SIGKILL)
        with contextlib.suppress(asyncio.CancelledError, TimeoutError):
            await asyncio.wait_for(asyncio.shield(protocol.exited.wait()), grace_s + drain_s)
        raise
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        transport.close()  # the pipes, even if a leftover still holds their other end
    returncode = transport.get_returncode()
    return Exited(
        exit_code=TIMEOUT_EXIT if timed_out else exit_code(returncode),
        stdout=out,
        stderr=err,
        duration_s=duration,
        timed_out=timed_out,
        signal=-returncode if returncode is not None and returncode < 0 else None,
    )
