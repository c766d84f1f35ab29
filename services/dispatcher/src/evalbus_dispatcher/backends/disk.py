"""A full disk under the case workdirs, told apart from a harness's own failure.

The workdirs of a local backend share one filesystem (`DISPATCHER_WORKDIR_ROOT`, else the system
temp folder), so one case that writes until it is full makes the writes of every other case fail,
and the dispatcher's own (a workdir's owner mark, its input file, the harness files). Each such
failure is a `disk_full` failure naming the filesystem — `infra` and retryable, since the space
comes back when the workdirs holding it are released — instead of an agent's `exit_nonzero` or a
generic workdir error. Every read here is best effort: a filesystem that cannot be asked is never
an error of its own.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from pathlib import Path

from evalbus_dispatcher.backends.base import HarnessRun, RunFailure

NO_SPACE = os.strerror(errno.ENOSPC)
"""What the C library says for ENOSPC (`No space left on device`), as a harness prints it."""
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""Errors that mean the filesystem (or the user's quota on it) has no room left."""
FULL_BELOW_BYTES = 1024 * 1024
"""A filesystem with less than this available counts as full (a write of any size fails soon)."""
DISK_FULL = "disk_full"
"""The failure code."""


@dataclass(frozen=True, slots=True)
class DiskSpace:
    """The filesystem holding a path."""

    mount: Path
    """Its mount point (what names the disk in a message)."""
    available_bytes: int
    """Bytes an unprivileged writer may still use."""
    total_bytes: int
    """Its size."""

    @property
    def full(self) -> bool:
        """Whether it has (almost) nothing left."""
        return self.available_bytes < FULL_BELOW_BYTES

    def describe(self) -> str:
        """`<mount> has <n> free of <size>`."""
        return f"{self.mount} has {_size(self.available_bytes)} free of {_size(self.total_bytes)}"


def disk_space(path: Path) -> DiskSpace | None:
    """The filesystem holding `path` (or its nearest existing parent); None when it cannot be read."""
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    try:
        stat = os.statvfs(probe)
    except OSError:
        return None
    return DiskSpace(
        mount=_mount_point(probe),
        available_bytes=stat.f_bavail * stat.f_frsize,
        total_bytes=stat.f_blocks * stat.f_frsize,
    )


def is_no_space(error: BaseException) -> bool:
    """Whether `error` (or what it was raised from) is a full filesystem or quota."""
    seen: BaseException | None = error
    while seen is not None:
        if isinstance(seen, OSError) and seen.errno in NO_SPACE_ERRNOS:
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def no_space_message(path: Path, what: str, error: BaseException) -> str:
    """`<what> failed: the workdir's disk is full (<mount> has … free of …): <error>`."""
    space = disk_space(path)
    where = f" ({space.describe()})" if space is not None else f" (under {path})"
    return f"{what} failed: the workdir's disk is full{where}: {error}"


def disk_full_failure(run: HarnessRun, workdir: Path) -> RunFailure | None:
    """The `disk_full` failure of a harness run that failed on a full disk, else None.

    A run that failed on its own terms (a non-zero exit, or a worker harness's function raising)
    failed on a full disk when, at its exit and before its workdir is released, the workdir's
    filesystem is (almost) full, or its output (or the error a worker harness's function raised)
    says `No space left on device`. A run that
    succeeded, timed out or was killed by the out-of-memory killer keeps its own verdict.
    """
    if run.spawn_error is not None or run.timed_out or run.oom is True:
        return None
    failed = run.exit_code not in (0, None) or (run.failure is not None and run.failure.code == "harness_error")
    if not failed:
        return None
    space = disk_space(workdir)
    said = any(NO_SPACE in text for text in (run.stderr, run.stdout, run.failure.message if run.failure else ""))
    if not said and (space is None or not space.full):
        return None
    state = space.describe() if space is not None else f"under {workdir}"
    how = f"exited with {run.exit_code}" if run.exit_code not in (0, None) else "raised"
    return RunFailure(
        code=DISK_FULL,
        failure_class="infra",
        message=f"the workdir's disk is full ({NO_SPACE}): {state}; the harness {how}",
        retryable=True,
    )


def _mount_point(path: Path) -> Path:
    current = path.resolve()
    while not os.path.ismount(current) and current != current.parent:
        current = current.parent
    return current


def _size(n: int) -> str:
    if n < 1024:
        return f"{n} B"
    value, units = n / 1024, ("KiB", "MiB", "GiB", "TiB")
    step = 0
    while value >= 1024 and step < len(units) - 1:
        value /= 1024
        step += 1
    return f"{value:.1f} {units[step]}"
