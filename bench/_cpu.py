"""CPU seconds (and resident memory) per process — services, nats-server, PostgreSQL, this one — from /proc."""

from __future__ import annotations

import os
import time
from collections.abc import Mapping
from pathlib import Path

from bench._infra import Infra

from evalbus.testing.stack import ServiceStack

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # fields from `state` on (the name may hold spaces)


def rss_bytes(pid: int | None) -> int | None:
    """Resident memory of `pid` (VmRSS), None when it is gone."""
    if pid is None:
        return None
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def process_cpu_s(pid: int, *, children: bool = True) -> float:
    """CPU seconds (user + system) of a process, with its waited-for children when asked; 0 if gone."""
    fields = _stat(pid)
    if fields is None:
        return 0.0
    ticks = int(fields[11]) + int(fields[12]) + ((int(fields[13]) + int(fields[14])) if children else 0)
    return ticks / _TICK


def tree_cpu_s(root: int) -> float:
    """CPU seconds of `root` and its live direct children (PostgreSQL: the postmaster and its backends;
    exited backends are in the postmaster's children times)."""
    total = process_cpu_s(root)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and int(fields[1]) == root:
                total += process_cpu_s(int(entry.name))
    return total


def descendants(root: int) -> list[int]:
    """Pids of the live descendants of `root` (children, their children, …)."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None:
                parent[int(entry.name)] = int(fields[1])
    found: list[int] = []
    frontier = {root}
    while frontier:
        frontier = {pid for pid, ppid in parent.items() if ppid in frontier}
        found.extend(frontier)
    return found


HARNESS_OF = "dispatcher"
"""The component whose child processes are the harnesses (measured apart, as `harness`)."""


class CpuMeter:
    """CPU seconds spent by each component of a run between `start()` and `stop()`.

    The dispatcher's harnesses count apart from it, as `harness`: the warm workers alive (their
    own and their children's time) and the harness processes it has already waited for (a
    command harness's, a worker it replaced)."""

    def __init__(self, pids: Mapping[str, int | None]) -> None:
        self._pids = {name: pid for name, pid in pids.items() if pid is not None}
        self._start: dict[str, float] = {}
        self._wall = 0.0
        self.seconds: dict[str, float] = {}
        """CPU seconds per component."""
        self.wall_s = 0.0
        """Wall-clock seconds measured."""

    def _now(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, pid in self._pids.items():
            if name == "postgres":
                out[name] = tree_cpu_s(pid)
            elif name == HARNESS_OF:
                own = process_cpu_s(pid, children=False)
                out[name] = own
                out["harness"] = process_cpu_s(pid) - own + sum(process_cpu_s(p) for p in descendants(pid))
            else:
                out[name] = process_cpu_s(pid)
        times = os.times()
        # this process (the driver) and the children it waited for (the backend-alone harnesses)
        out["bench"] = times.user + times.system + times.children_user + times.children_system
        return out

    def start(self) -> CpuMeter:
        self._start = self._now()
        self._wall = time.monotonic()
        return self

    def stop(self) -> CpuMeter:
        end = self._now()
        self.wall_s = time.monotonic() - self._wall
        self.seconds = {name: end[name] - self._start.get(name, 0.0) for name in end}
        return self

    def per_case_ms(self, cases: int) -> dict[str, float]:
        """CPU milliseconds per case for each component, the total, and the machine's share used."""
        out = {name: 1000 * s / cases for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        out["total"] = sum(out.values())
        return out

    def utilisation(self) -> float:
        """CPU seconds spent per wall second, over the machine's cores (1.0: every core busy)."""
        return sum(self.seconds.values()) / (self.wall_s * (os.cpu_count() or 1)) if self.wall_s else float("nan")


def stack_pids(stack: ServiceStack, infra: Infra) -> dict[str, int | None]:
    """The processes of a run: the services, the nats-server, the embedded PostgreSQL."""
    pids: dict[str, int | None] = {name: sp.process.pid for name, sp in stack.procs.items()}
    pids["nats-server"] = infra.nats.process.pid if infra.nats is not None else None
    pids["postgres"] = infra.postgres_pid()
    return pids
