"""What a local sandbox uses, read from `/proc` (a real process group of this machine), the memory
cgroup's OOM-kill count (files laid out as cgroup v1 and v2 lay them out), and the OOM verdict."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
from pathlib import Path

import pytest

from evalbus_dispatcher.backends.procfs import (
    group_alive,
    group_usage,
    members_usage,
    oom_kills,
    oom_verdict,
    tree_usage,
)

pytestmark = pytest.mark.unit


async def test_group_usage_sums_the_processes_of_a_real_group() -> None:
    # A leader that starts a child, both holding memory, both in one new process group.
    child = "import time; b = b'y' * (40 * 2**20); print('child up', flush=True); time.sleep(60)"
    code = (
        "import subprocess, sys, time; b = b'x' * (40 * 2**20); "
        f"subprocess.Popen([sys.executable, '-c', {child!r}]); print('up', flush=True); time.sleep(60)"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, start_new_session=True
    )
    try:
        assert proc.stdout is not None
        assert await proc.stdout.readline() == b"up\n"
        assert await proc.stdout.readline() == b"child up\n"
        usage = group_usage(proc.pid)
        assert usage is not None
        assert usage.processes == 2
        assert usage.rss_bytes > 80 * 2**20  # both processes' 40 MiB, summed
        assert usage.cpu_seconds > 0.0
        # the same read from the leader's process tree alone
        tree = tree_usage(proc.pid)
        assert tree is not None
        assert tree.processes == 2
        assert tree.rss_bytes > 80 * 2**20
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        await proc.wait()
    assert tree_usage(proc.pid) is None  # the leader is gone: only a scan of every process can tell
    assert group_usage(2**22 + 7) is None  # no such group


async def test_members_left_by_a_dead_leader_are_read_from_the_trees_they_were_reparented_to() -> None:
    # The leader starts a member of its group holding memory, says its pid, and exits: the member
    # lives on under another parent (a subreaper's child, in the dispatcher), outside the leader's tree.
    child = "import time; b = b'y' * (40 * 2**20); print('child up', flush=True); time.sleep(60)"
    code = (
        "import subprocess, sys; "
        f"p = subprocess.Popen([sys.executable, '-c', {child!r}], stdout=sys.stdout); print(p.pid, flush=True)"
    )
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", code, stdout=asyncio.subprocess.PIPE, start_new_session=True
    )
    assert proc.stdout is not None
    member = int(await proc.stdout.readline())
    assert await proc.stdout.readline() == b"child up\n"
    await proc.wait()  # the leader is gone and reaped
    try:
        assert tree_usage(proc.pid) is None
        usage = members_usage(proc.pid, [os.getpid(), member])  # a root outside the group is passed over
        assert usage is not None
        assert usage.processes == 1
        assert usage.rss_bytes > 40 * 2**20
        scanned = group_usage(proc.pid)  # the scan of every process agrees
        assert scanned is not None
        assert scanned.processes == 1
    finally:
        os.killpg(proc.pid, signal.SIGKILL)


async def test_a_group_is_alive_until_its_last_process_is_reaped() -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-c", "import time; time.sleep(60)", start_new_session=True
    )
    assert group_alive(proc.pid)
    proc.kill()
    await proc.wait()  # reaped here: nothing of the group is left
    assert not group_alive(proc.pid)


def test_oom_kills_read_from_cgroup_v1_and_v2(tmp_path: Path) -> None:
    proc = tmp_path / "proc"
    (proc / "self").mkdir(parents=True)
    root = tmp_path / "cgroup"
    (proc / "self" / "cgroup").write_text("4:memory:/box/one\n0::/\n")
    (root / "memory" / "box" / "one").mkdir(parents=True)
    (root / "memory" / "box" / "one" / "memory.oom_control").write_text("oom_kill_disable 0\nunder_oom 0\noom_kill 3\n")
    assert oom_kills(proc, root) == 3

    (proc / "self" / "cgroup").write_text("0::/system.slice/evalbus\n")
    (root / "system.slice" / "evalbus").mkdir(parents=True)
    (root / "system.slice" / "evalbus" / "memory.events").write_text("low 0\nhigh 0\nmax 2\noom 2\noom_kill 1\n")
    assert oom_kills(proc, root) == 1

    (proc / "self" / "cgroup").write_text("")
    assert oom_kills(proc, root) is None


def test_the_oom_verdict() -> None:
    kill = int(signal.SIGKILL)
    assert oom_verdict(None, timed_out=False, before=0, after=5) is False  # exited by itself
    assert oom_verdict(kill, timed_out=True, before=0, after=1) is False  # our own timeout kill
    assert oom_verdict(int(signal.SIGSEGV), timed_out=False, before=0, after=1) is False
    assert oom_verdict(kill, timed_out=False, before=2, after=3) is True
    assert oom_verdict(kill, timed_out=False, before=2, after=2) is False
    assert oom_verdict(kill, timed_out=False, before=None, after=None) is None
