"""A full disk under the case workdirs, told apart from a harness's own failure.

The workdirs of a local backend share one filesystem (`DISPATCHER_WORKDIR_ROOT`, else the system
temp folder), so one case that writes until it is full makes the writes of every other case fail,
and the dispatcher's own (a workdir's owner mark, its input file, the harness files). Each such
failure is a `disk_full` failure naming the filesystem — `infra` and retryable, since the space
comes back when the workdirs holding it are released — instead of an agent's `exit_nonzero` or a
generic workdir error.

A harness's words alone are not evidence: one that prints `No space left on device` may have
filled its own /tmp quota or a mounted volume, and retrying it as evalbus's fault would hide its
own bug. So a `DiskWatch` reads the workdir's filesystem while the harness runs — at its start,
every second, and at once when a line of its output reports a full disk (a neighbour that filled
the disk may release its space before the run exits) — and `disk_verdict` decides, from those
readings and the one at exit, with no I/O of its own. Every read is best effort: a filesystem that
cannot be asked is never an error of its own.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import os
import re
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

from evalbus_dispatcher.backends.base import HarnessRun, OnOutput, OutputStream, RunFailure

NO_SPACE = os.strerror(errno.ENOSPC)
"""What the C library says for ENOSPC (`No space left on device`), as a harness prints it."""
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})
"""Errors that mean the filesystem (or the user's quota on it) has no room left."""
FULL_BELOW_BYTES = 1024 * 1024
"""A filesystem with less than this available counts as full (a write of any size fails soon)."""
FULL_BELOW_FRACTION = 0.001
"""…as does one with less than this part of its size available (a large disk's last 0.1%)."""
LOW_BELOW_FRACTION = 0.02
"""A filesystem with less than this part of its size available (2%, at least `FULL_BELOW_BYTES`)
is low: with a harness reporting `No space left on device`, the write it failed may well have been
larger than what was left."""
SHRUNK_TO_FRACTION = 0.5
"""A filesystem whose free space fell to this part of what it had when the run started, or less,
shrank substantially while the run ran."""
WATCH_INTERVAL_S = 1.0
"""Seconds between two readings of the workdir's filesystem while a harness runs."""
LINE_READ_GAP_S = 0.05
"""The least seconds between two readings taken for output lines reporting a full disk (a harness
printing it in a loop reads the disk twenty times a second at most)."""
DISK_FULL = "disk_full"
"""The failure code."""

_NO_SPACE_TEXT = re.compile(re.escape(NO_SPACE), re.IGNORECASE)


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
        """Whether it has (almost) nothing left: under 1 MiB, or under 0.1% of its size."""
        return self.available_bytes < full_below(self.total_bytes)

    def describe(self) -> str:
        """`<mount> has <n> free of <size>`."""
        return f"{self.mount} has {_size(self.available_bytes)} free of {_size(self.total_bytes)}"


@dataclass(frozen=True, slots=True)
class DiskHistory:
    """What a workdir's filesystem had free while a harness ran (None: never read)."""

    start_bytes: int | None = None
    """Available when the run started."""
    lowest_bytes: int | None = None
    """The least available at any reading while it ran (the start's included)."""


def full_below(total_bytes: int) -> int:
    """The free space under which a filesystem of `total_bytes` counts as full."""
    return max(FULL_BELOW_BYTES, int(total_bytes * FULL_BELOW_FRACTION))


def low_below(total_bytes: int) -> int:
    """The free space under which a filesystem of `total_bytes` counts as low."""
    return max(FULL_BELOW_BYTES, int(total_bytes * LOW_BELOW_FRACTION))


def disk_space(path: Path) -> DiskSpace | None:
    """The filesystem holding `path` (or its nearest existing parent); None when it cannot be read."""
    probe = _existing(path)
    available = _available(probe)
    if available is None:
        return None
    return DiskSpace(mount=_mount_point(probe), available_bytes=available[0], total_bytes=available[1])


class DiskWatch:
    """Readings of the free space of the filesystem holding a workdir while its harness runs.

    A reading is one `statvfs` of the workdir, taken on the event loop (one system call, as the
    exit check has always been); one that fails is skipped.
    """

    def __init__(self, workdir: Path, *, interval_s: float = WATCH_INTERVAL_S) -> None:
        self._workdir = workdir
        self._interval_s = interval_s
        self._start: int | None = None
        self._lowest: int | None = None
        self._line_read_at = float("-inf")

    def read(self) -> None:
        """Read the free space now (the first reading is the start's)."""
        found = _available(self._workdir)
        if found is None:
            return
        if self._start is None:
            self._start = found[0]
        self._lowest = found[0] if self._lowest is None else min(self._lowest, found[0])

    def history(self) -> DiskHistory:
        """The readings so far."""
        return DiskHistory(start_bytes=self._start, lowest_bytes=self._lowest)

    @contextlib.asynccontextmanager
    async def watching(self) -> AsyncIterator[None]:
        """Read now, then every `interval_s` until the block ends (a timer, not a task: a case
        served by a warm worker in a millisecond pays one `statvfs` and nothing else)."""
        self.read()
        loop = asyncio.get_running_loop()
        timer: asyncio.TimerHandle | None = None

        def tick() -> None:
            nonlocal timer
            self.read()
            timer = loop.call_later(self._interval_s, tick)

        timer = loop.call_later(self._interval_s, tick)
        try:
            yield
        finally:
            timer.cancel()

    def on_output(self, inner: OnOutput) -> OnOutput:
        """`inner`, with a reading taken before a line reporting a full disk is passed on."""

        async def seen(stream: OutputStream, line: str) -> None:
            now = time.monotonic()
            if now - self._line_read_at >= LINE_READ_GAP_S and _NO_SPACE_TEXT.search(line):
                self._line_read_at = now
                self.read()
            await inner(stream, line)

        return seen


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


def reports_no_space(run: HarnessRun) -> bool:
    """Whether the run's output (or the error a worker harness's function raised) says
    `No space left on device`, in any case."""
    texts = (run.stderr, run.stdout, run.failure.message if run.failure else "")
    return any(_NO_SPACE_TEXT.search(text) for text in texts)


def disk_full_failure(run: HarnessRun, workdir: Path, history: DiskHistory | None = None) -> RunFailure | None:
    """`disk_verdict` of `run` with the workdir's filesystem read now (at exit, before release) —
    read only for a run that failed on its own terms (a succeeded run pays nothing)."""
    if not _judged(run):
        return None
    return disk_verdict(run, disk_space(workdir), history or DiskHistory())


def _judged(run: HarnessRun) -> bool:
    """Whether `disk_verdict` looks at the disk for `run` at all."""
    if run.spawn_error is not None or run.timed_out or run.oom is True:
        return False
    if run.failure is not None and run.failure.code == DISK_FULL:
        return False
    return run.exit_code not in (0, None) or (run.failure is not None and run.failure.code == "harness_error")


def disk_verdict(run: HarnessRun, now: DiskSpace | None, history: DiskHistory) -> RunFailure | None:
    """The failure a harness run gets for the workdir's disk, None when its own verdict stands.

    Only a run that failed on its own terms (a non-zero exit, or a worker harness's function
    raising) is judged; one that succeeded, timed out, was killed by the out-of-memory killer or
    already failed `disk_full` keeps its verdict. It failed on a full disk — `disk_full`, infra,
    retryable — when, with `now` the reading at its exit and `history` those while it ran:

    - the filesystem is full at exit (`DiskSpace.full`), whatever the harness said;
    - the harness reported `No space left on device` and the filesystem was low (`low_below`) at
      some reading, or its free space shrank to half of the start's or less (`SHRUNK_TO_FRACTION`);
    - the harness reported it and the filesystem cannot be read at exit (best effort).

    A harness that reported it while the disk had room failed on its own (it wrote to another
    filesystem, or just printed the words): its failure stands, its message saying what the disk
    had, so nobody waits for a retry that is not coming.
    """
    if not _judged(run):
        return None
    exited = run.exit_code not in (0, None)
    how = f"exited with {run.exit_code}" if exited else "raised"
    said = reports_no_space(run)
    if now is None:
        return _disk_full("its free space cannot be read", how) if said else None
    if now.full:
        return _disk_full(now.describe(), how)
    if not said:
        return None
    lowest = now.available_bytes if history.lowest_bytes is None else min(history.lowest_bytes, now.available_bytes)
    if lowest < low_below(now.total_bytes):
        return _disk_full(f"{now.mount} had {_size(lowest)} free of {_size(now.total_bytes)} at its lowest", how)
    start = history.start_bytes
    if start is not None and lowest <= start * SHRUNK_TO_FRACTION:
        where = f"{now.mount} went from {_size(start)} to {_size(lowest)} free of {_size(now.total_bytes)}"
        return _disk_full(f"{where} while it ran", how)
    return _room_left(run, now, lowest, how)


def _disk_full(state: str, how: str) -> RunFailure:
    return RunFailure(
        code=DISK_FULL,
        failure_class="infra",
        message=f"the workdir's disk is full ({NO_SPACE}): {state}; the harness {how}",
        retryable=True,
    )


def _room_left(run: HarnessRun, now: DiskSpace, lowest: int, how: str) -> RunFailure:
    """The run's own failure, its message saying why it is not `disk_full`."""
    note = (
        f"the harness reported {NO_SPACE!r} but the workdir's disk had room ({now.describe()} now, "
        f"{_size(lowest)} at its lowest while it ran): not {DISK_FULL}, the harness's own failure "
        f"(a write to another filesystem?)"
    )
    if run.failure is not None:
        failed = run.failure
        message = f"{failed.message}; {note}"
        return RunFailure(
            code=failed.code, failure_class=failed.failure_class, message=message, retryable=failed.retryable
        )
    return RunFailure(code="exit_nonzero", failure_class="agent", message=f"harness {how}; {note}")


def _existing(path: Path) -> Path:
    probe = path
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    return probe


def _available(path: Path) -> tuple[int, int] | None:
    """(available, size) in bytes of the filesystem holding `path` (or its nearest existing
    parent); None when it cannot be read."""
    try:
        stat = os.statvfs(_existing(path))
    except OSError:
        return None
    return stat.f_bavail * stat.f_frsize, stat.f_blocks * stat.f_frsize


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
