"""What a local sandbox uses, read from Linux's `/proc` and the memory cgroup: the processes of a
process group, their resident memory and CPU time, and the cgroup's count of OOM kills (from which
the OOM verdict of an exited harness follows). Every read is best effort: on a system without
`/proc` (or a process gone mid-read) the answer is None, never an error."""

from __future__ import annotations

import functools
import os
import signal
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
CGROUP_ROOT = Path("/sys/fs/cgroup")

_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
_TICKS = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


@dataclass(frozen=True, slots=True)
class GroupUsage:
    """The processes of one process group, summed."""

    processes: int
    """Processes in the group."""
    rss_bytes: int
    """Resident memory, bytes."""
    cpu_seconds: float
    """User + system CPU time, with that of children already waited for, seconds."""


@dataclass(frozen=True, slots=True)
class _Stat:
    pgrp: int
    cpu_ticks: int
    rss_pages: int


def _stat(text: str) -> _Stat | None:
    """Fields of `/proc/<pid>/stat` after the command (which may hold spaces and parentheses)."""
    try:
        fields = text.rsplit(")", 1)[1].split()
        # fields[0] is field 3 (state): pgrp is field 5, utime..cstime 14-17, rss 24.
        return _Stat(
            pgrp=int(fields[2]),
            cpu_ticks=sum(int(f) for f in fields[11:15]),
            rss_pages=int(fields[21]),
        )
    except (IndexError, ValueError):
        return None


def group_usage(pgid: int, proc: Path = PROC) -> GroupUsage | None:
    """Processes, memory and CPU of process group `pgid` (None when none of it is left, or `/proc`
    cannot be read)."""
    processes = rss = ticks = 0
    try:
        entries = list(proc.iterdir())
    except OSError:
        return None
    for entry in entries:
        if not entry.name.isdigit():
            continue
        try:
            stat = _stat((entry / "stat").read_text())
        except OSError:
            continue  # gone meanwhile
        if stat is None or stat.pgrp != pgid:
            continue
        processes += 1
        rss += stat.rss_pages
        ticks += stat.cpu_ticks
    if processes == 0:
        return None
    return GroupUsage(processes=processes, rss_bytes=rss * _PAGE, cpu_seconds=ticks / _TICKS)


def tree_usage(pgid: int, proc: Path = PROC) -> GroupUsage | None:
    """What `group_usage` says, read from the process tree under the group's leader (its members'
    children, from `/proc/<pid>/task/<tid>/children`): a few reads where `group_usage` reads every
    process on the machine. None when the leader is gone or the kernel does not list children — then
    `members_usage` (on a subreaper) or `group_usage` can tell (members whose parent died are
    reparented out of the tree)."""
    return _walk(pgid, [pgid], proc, leader=True)


def group_alive(pgid: int) -> bool:
    """Whether any process of group `pgid` is left (a signal 0 to the group: one system call)."""
    try:
        os.killpg(pgid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # it exists, owned by another user
    return True


def members_usage(pgid: int, roots: Iterable[int], proc: Path = PROC) -> GroupUsage | None:
    """What `group_usage` says once the group's leader is gone, read from the trees under `roots`
    (a child subreaper's children: where the members whose parents died were re-parented, see
    `orphans.py`) instead of every process on the machine. None when no member is left."""
    found = _walk(pgid, list(roots), proc, leader=False)
    return found if found is not None and found.processes else None


def _walk(pgid: int, todo: list[int], proc: Path, *, leader: bool) -> GroupUsage | None:
    """The members of group `pgid` in the trees under `todo` (a tree is followed through members
    only); with `leader`, None when `pgid` itself is gone or its children are not listed."""
    processes = rss = ticks = 0
    seen: set[int] = set()
    while todo:
        pid = todo.pop()
        if pid in seen:
            continue
        seen.add(pid)
        base = proc / str(pid)
        try:
            stat = _stat((base / "stat").read_text())
            tasks = list((base / "task").iterdir())
        except OSError:
            if leader and pid == pgid:
                return None
            continue  # gone meanwhile
        if stat is None or stat.pgrp != pgid:
            if leader and pid == pgid:
                return None
            continue
        processes += 1
        rss += stat.rss_pages
        ticks += stat.cpu_ticks
        for task in tasks:
            try:
                todo.extend(int(child) for child in (task / "children").read_text().split())
            except FileNotFoundError:
                if leader and pid == pgid and task.name == str(pgid):
                    return None  # this kernel does not list children
            except (OSError, ValueError):
                continue
    return GroupUsage(processes=processes, rss_bytes=rss * _PAGE, cpu_seconds=ticks / _TICKS)


@functools.cache
def _own_memory_cgroup() -> tuple[str, str] | None:
    """This process's memory cgroup, read once (two reads of `/proc` per harness run otherwise)."""
    return _memory_cgroup(PROC)


def _memory_cgroup(proc: Path) -> tuple[str, str] | None:
    """(`v1` or `v2`, path) of this process's memory cgroup."""
    try:
        lines = (proc / "self" / "cgroup").read_text().splitlines()
    except OSError:
        return None
    unified: str | None = None
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if "memory" in parts[1].split(","):
            return "v1", parts[2]
        if parts[0] == "0" and parts[1] == "":
            unified = parts[2]
    return ("v2", unified) if unified is not None else None


def oom_kills(proc: Path = PROC, root: Path = CGROUP_ROOT) -> int | None:
    """How many processes the kernel's OOM killer has killed in this process's memory cgroup (its
    sandboxes run in it), or None when the cgroup does not say."""
    found = _own_memory_cgroup() if proc == PROC else _memory_cgroup(proc)
    if found is None:
        return None
    version, path = found
    rel = path.lstrip("/")
    candidates = (
        [root / "memory" / rel / "memory.oom_control", root / "memory" / "memory.oom_control"]
        if version == "v1"
        else [root / rel / "memory.events", root / "memory.events"]
    )
    for file in candidates:
        try:
            text = file.read_text()
        except OSError:
            continue
        for line in text.splitlines():
            key, _, value = line.partition(" ")
            if key == "oom_kill" and value.strip().isdigit():
                return int(value)
    return None


def oom_verdict(sig: int | None, *, timed_out: bool, before: int | None, after: int | None) -> bool | None:
    """Whether the out-of-memory killer ended a harness.

    False when it exited by itself (no signal) or was killed on its timeout by the dispatcher;
    for a SIGKILL from elsewhere, True when the cgroup's OOM-kill count rose meanwhile, False when
    it did not, None when the cgroup does not count; any other signal is not the OOM killer's.
    """
    if sig is None or timed_out:
        return False
    if sig != signal.SIGKILL:
        return False
    if before is None or after is None:
        return None
    return after > before
