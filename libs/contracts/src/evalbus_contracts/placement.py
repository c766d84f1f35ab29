"""Where a run's sandbox is and what it uses: the samples a dispatcher publishes while a harness
runs (`run.<run>.live.placement`), and the status every dispatcher keeps in the `dispatchers`
bucket (its compute slots and the runs holding them), from which any gateway replica answers
"why is my case not running?" the same way."""

from __future__ import annotations

from datetime import datetime
from typing import Literal

import msgspec


class _Data(msgspec.Struct, frozen=True, kw_only=True, omit_defaults=True):
    pass


class PlacementSample(_Data, frozen=True, kw_only=True):
    """What a running (or just exited) harness uses, read by its dispatcher from the backend."""

    at: datetime
    """When the sample was taken (UTC)."""
    state: Literal["running", "exited"] = "running"
    """The harness process is running, or it has exited (the last sample of an execution)."""
    dispatcher: str | None = None
    """Id of the dispatcher replica holding the sandbox."""
    node: str | None = None
    """Node the sandbox runs on."""
    unit: str | None = None
    """Backend unit (`pgid:<n>` on the local backend)."""
    pid: int | None = None
    """Process id of the harness (the leader of its process group)."""
    processes: int = 0
    """Processes alive in the unit when sampled."""
    rss_bytes: int | None = None
    """Resident memory of the unit's processes, bytes (None when it could not be read)."""
    peak_rss_bytes: int | None = None
    """Largest `rss_bytes` sampled so far in this execution."""
    cpu_seconds: float | None = None
    """CPU time (user + system) used by the unit so far, seconds."""
    age_s: float = 0.0
    """Seconds since the harness started."""
    timeout_s: float | None = None
    """The run's time limit (what it asked for)."""
    slots: int = 1
    """Compute slots the sandbox holds (what it asked for)."""
    exit_code: int | None = None
    """Exit code once exited (124 on timeout, 128+n when killed by signal n)."""
    signal: int | None = None
    """Signal that ended the harness, when one did."""
    timed_out: bool = False
    """Killed by the dispatcher because it ran past its time limit."""
    oom: bool | None = None
    """OOM verdict once exited: True when the kernel's out-of-memory killer ended it, False when it
    exited by itself or was killed by something that was not the OOM killer, None when unknown."""


class DispatcherStatus(_Data, frozen=True, kw_only=True):
    """One dispatcher replica as it describes itself, every few seconds, in the `dispatchers`
    bucket (a replica that stopped is deleted; one that died ages out)."""

    dispatcher: str
    """Replica id (`DISPATCHER_ID`, else `<node>-<pid>`)."""
    node: str | None = None
    """Node it runs on."""
    slots: int
    """Compute slots it offers."""
    used: int = 0
    """Slots held now (by accepted runs, until their sandbox is released)."""
    runs: tuple[str, ...] = ()
    """Run ids holding those slots."""
    started_at: datetime
    """When the replica started."""
    updated_at: datetime
    """When this status was written."""
    interval_s: float = 2.0
    """How often the replica writes it: a status older than three intervals is a replica gone."""
    lanes: tuple[str, ...] = ("default",)
    """The lanes whose cases it takes (`DISPATCHER_LANES`); a replica of a release before lanes
    wrote none and serves the default lane."""
