"""Detached processes known only by pid: start them in a session of their own, tell whether they
still run, stop them (SIGTERM, then SIGKILL of their process group after a grace period).

`evalbus up` exits after starting the stack, so `status` and `down` run in other processes and can
only find what `up` started by the pid it recorded. The kernel's start time of a process is
recorded beside its pid, so a pid the kernel reused for an unrelated process is never mistaken
for ours. A process that has exited but was not reaped (a zombie: its parent is gone and pid 1
does not reap) counts as stopped.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

_POLL_S = 0.05


@dataclass(frozen=True)
class ProcessId:
    """A process as `up` recorded it: its pid and the kernel's start time for it (None when unknown)."""

    pid: int
    started: int | None = None


def _stat_fields(pid: int) -> list[str] | None:
    """Fields of `/proc/<pid>/stat` after the command name, or None when there is no such process."""
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    # The command name is in parentheses and may itself contain spaces or parentheses.
    return raw[raw.rindex(")") + 2 :].split()


def start_time(pid: int) -> int | None:
    """The kernel's start time of `pid` in clock ticks since boot (None without /proc or process)."""
    fields = _stat_fields(pid)
    # After the name: state is field 3 of stat(5), so starttime (field 22) is index 19 here.
    return int(fields[19]) if fields is not None and len(fields) > 19 else None


def identify(pid: int) -> ProcessId:
    """`pid` with its start time, for recording."""
    return ProcessId(pid=pid, started=start_time(pid))


def is_alive(proc: ProcessId) -> bool:
    """Whether the recorded process still runs (not exited, not a zombie, not a reused pid)."""
    if not Path("/proc").is_dir():  # no procfs (macOS): the signal-0 probe is all there is
        try:
            os.kill(proc.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
        return True
    fields = _stat_fields(proc.pid)
    if fields is None or fields[0] in ("Z", "X"):
        return False
    return proc.started is None or int(fields[19]) == proc.started


def spawn_detached(argv: Sequence[str], env: Mapping[str, str], log_file: Path, cwd: Path | None = None) -> ProcessId:
    """Start `argv` in a new session (its own process group), stdout and stderr appended to `log_file`."""
    log_file.parent.mkdir(parents=True, exist_ok=True)
    with log_file.open("ab") as log:
        proc = subprocess.Popen(
            list(argv),
            stdin=subprocess.DEVNULL,
            stdout=log,
            stderr=subprocess.STDOUT,
            env=dict(env),
            cwd=cwd,
            start_new_session=True,
        )
    # The child outlives us; Popen would warn about it on collection and we never wait for it.
    proc.returncode = 0
    return identify(proc.pid)


def _signal(proc: ProcessId, sig: int, *, group: bool) -> None:
    try:
        if group:
            os.killpg(proc.pid, sig)
        else:
            os.kill(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def wait_gone(procs: Iterable[ProcessId], timeout_s: float) -> list[ProcessId]:
    """Wait until none of `procs` is alive or `timeout_s` passes; return those still alive."""
    pending = [p for p in procs if is_alive(p)]
    deadline = time.monotonic() + timeout_s
    while pending and time.monotonic() < deadline:
        time.sleep(_POLL_S)
        pending = [p for p in pending if is_alive(p)]
    return pending


def group_members(pgid: int) -> list[int]:
    """Pids of the live processes in process group `pgid` (empty without /proc)."""
    proc = Path("/proc")
    if not proc.is_dir():
        return []
    members = []
    for entry in proc.iterdir():
        if entry.name.isdigit():
            fields = _stat_fields(int(entry.name))
            # After the name: state, ppid, pgrp.
            if fields is not None and fields[0] not in ("Z", "X") and int(fields[2]) == pgid:
                members.append(int(entry.name))
    return members


def _orphans(proc: ProcessId) -> list[int]:
    """Members left in the group `proc` led, once that leader is gone.

    While any member lives the group id stays reserved, so no other process can lead a group with
    that id. A live process holding the pid that is not `proc` (a reused pid) owns whatever group
    carries the id now: not ours, so nothing is returned.
    """
    fields = _stat_fields(proc.pid)
    if fields is not None and fields[0] not in ("Z", "X"):
        return []
    return group_members(proc.pid)


def stop(procs: Sequence[ProcessId], timeout_s: float = 10.0, sig: int = signal.SIGTERM) -> list[ProcessId]:
    """Stop process-group leaders and everything in their groups.

    `sig` goes to each leader only, so it can shut down gracefully (finish in-flight work, stop its
    own children); the whole group of a leader still alive after `timeout_s` gets SIGKILL, and so
    does any member left in the group of a leader that is gone (also one that died before this
    call). Returns the leaders that needed SIGKILL. Raises `RuntimeError` when something survives.
    """
    alive = [p for p in procs if is_alive(p)]
    for p in alive:
        _signal(p, sig, group=False)
    stubborn = wait_gone(alive, timeout_s)
    for p in stubborn:
        _signal(p, signal.SIGKILL, group=True)
    deadline = time.monotonic() + 5.0
    while True:
        for p in procs:
            if _orphans(p):
                _signal(p, signal.SIGKILL, group=True)
        left = [p.pid for p in procs if is_alive(p)] + [m for p in procs for m in _orphans(p)]
        if not left:
            return stubborn
        if time.monotonic() > deadline:
            raise RuntimeError(f"processes survived SIGKILL: {sorted(set(left))}")
        time.sleep(_POLL_S)
