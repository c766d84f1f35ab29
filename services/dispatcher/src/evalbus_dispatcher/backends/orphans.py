"""Daemons a harness leaves behind: adopted by the dispatcher, killed with their sandbox.

A harness that forks a daemon (fork, `setsid`, fork again, exit) escapes its process group, so
killing the group at release leaves the daemon running — holding memory, maybe a port, and writing
into a deleted workdir. On Linux the dispatcher makes itself a *child subreaper*
(`PR_SET_CHILD_SUBREAPER`): an orphan of any of its descendants is re-parented to the dispatcher
instead of to init, so the daemons of every sandbox are the dispatcher's own children, found by
reading `/proc/self/task/*/children` (a few small files, not a scan of `/proc`). Each one names
its sandbox through its environment (`EVALBUS_INPUT_FILE`, a path inside the case root) or its
working directory; `kill_adopted(case_root)` SIGKILLs and reaps the ones of one sandbox.

Adopted orphans that exit on their own would stay zombies (asyncio waits only for the processes it
spawned): `reap_exited()` collects a zombie child once it has stayed a zombie for
`ZOMBIE_GRACE_S` — asyncio reaps its own children the moment they exit, so one still unreaped
after that is an orphan nobody else waits for. `kill_adopted` calls it. The processes asyncio
spawned for the sandbox being released are never touched — the caller passes them as `spawned`.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import logging
import os
import signal
import time
from collections.abc import Collection
from pathlib import Path

log = logging.getLogger("evalbus.dispatcher.orphans")

_PR_SET_CHILD_SUBREAPER = 36
_PR_GET_CHILD_SUBREAPER = 37
_MARKER = b"EVALBUS_INPUT_FILE="

ZOMBIE_GRACE_S = 2.0
"""How long a child stays a zombie before it is taken for an orphan and reaped here."""

_zombies: dict[int, float] = {}
"""Zombie children seen, and since when (monotonic)."""


def become_subreaper() -> bool:
    """Make this process the child subreaper of its descendants; False where the kernel (or the
    platform) does not support it."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        return int(libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)) == 0
    except (OSError, AttributeError):
        return False


def is_subreaper() -> bool:
    """Whether this process is the child subreaper of its descendants."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        flag = ctypes.c_int(0)
        return int(libc.prctl(_PR_GET_CHILD_SUBREAPER, ctypes.byref(flag), 0, 0, 0)) == 0 and flag.value != 0
    except (OSError, AttributeError):
        return False


def children() -> set[int]:
    """The pids of this process's children (every thread's; read with plain `os` calls: it runs
    for every sample and release)."""
    found: set[int] = set()
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return found
    for tid in tids:
        try:
            with open(f"/proc/self/task/{tid}/children", "rb") as f:
                found.update(int(p) for p in f.read().split())
        except (OSError, ValueError):
            continue
    return found


def others(spawned: Collection[int]) -> set[int]:
    """This process's children other than `spawned`: where adopted orphans (and the processes of
    other sandboxes) would be. Cheap (a few small `/proc` files), so it can run on the event loop:
    when it is empty there is nothing for `kill_adopted` to do."""
    return children() - set(spawned)


def _belongs(pid: int, case_root: Path) -> bool:
    """Whether process `pid` was started in the sandbox at `case_root` (by its environment, or
    by its working directory)."""
    root = str(case_root)
    try:
        environ = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        environ = b""
    for entry in environ.split(b"\0"):
        if entry.startswith(_MARKER) and entry[len(_MARKER) :].decode(errors="replace").startswith(root + os.sep):
            return True
    try:
        cwd = os.readlink(f"/proc/{pid}/cwd").removesuffix(" (deleted)")
    except OSError:
        return False
    return cwd == root or cwd.startswith(root + os.sep)


def _zombie(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def _reap(pid: int) -> None:
    with contextlib.suppress(ChildProcessError, OSError):
        os.waitpid(pid, 0)


def reap_exited(spawned: Collection[int], *, grace_s: float = ZOMBIE_GRACE_S) -> int:
    """Reap the children that have been zombies for `grace_s` or longer (orphans that exited on
    their own); returns how many."""
    now = time.monotonic()
    current = {pid for pid in children() - set(spawned) if _zombie(pid)}
    for gone in set(_zombies) - current:
        del _zombies[gone]
    n = 0
    for pid in current:
        since = _zombies.setdefault(pid, now)
        if now - since >= grace_s:
            _reap(pid)
            del _zombies[pid]
            n += 1
    return n


def kill_adopted(case_root: Path, spawned: Collection[int]) -> list[int]:
    """SIGKILL and reap every adopted orphan of the sandbox at `case_root` (and the zombies of
    any sandbox); returns the pids killed. Blocking (reading /proc, waiting): run in a thread."""
    reap_exited(spawned)
    killed: list[int] = []
    for pid in children() - set(spawned):
        if not _belongs(pid, case_root):
            continue
        try:
            os.killpg(pid, signal.SIGKILL)  # a daemon is the leader of its own session and group
        except OSError as e:
            if e.errno != errno.ESRCH:
                with contextlib.suppress(OSError):
                    os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(OSError):
            os.kill(pid, signal.SIGKILL)
        _reap(pid)
        killed.append(pid)
    if killed:
        log.info("killed %d process(es) a harness left behind in %s: %s", len(killed), case_root, killed)
    return killed
