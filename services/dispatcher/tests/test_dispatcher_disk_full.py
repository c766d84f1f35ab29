"""A full workdir disk told apart from a harness's own failure: the pure verdict on a run (a table
of runs, exit readings and readings while they ran); a harness that only says `No space left on
device` on a disk with room, run end to end on the local backend, failing on its own and not
retried; and the local backend on a real small tmpfs (mounted here, which needs root — CI runs as
root): its own writes fail `disk_full` (retryable infra, naming the disk) instead of a generic
workdir error, a harness that fills the disk fails `disk_full` instead of `exit_nonzero`, a case
beside it that failed on the full disk stays `disk_full` though the space came back before it
exited, and releasing the filler's workdir gives the space back so the next case runs."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from evalbus_contracts import CaseRequested
from evalbus_dispatcher import BackendError, LiveSink, LocalBackend, OutputStream, execute_case, should_retry
from evalbus_dispatcher.backends.base import HarnessRun, RunFailure
from evalbus_dispatcher.backends.disk import (
    NO_SPACE,
    DiskHistory,
    DiskSpace,
    disk_space,
    disk_verdict,
    full_below,
    is_no_space,
    low_below,
)

Script = Callable[[str], tuple[str, ...]]
MakeRequest = Callable[..., CaseRequested]
DISK_BYTES = 4 * 1024 * 1024


async def no_output(stream: OutputStream, line: str) -> None:
    return None


def ran(**fields: object) -> HarnessRun:
    base: dict[str, object] = {"exit_code": 1, "stdout": "", "stderr": ""}
    return HarnessRun(**{**base, **fields})  # type: ignore[arg-type]


MiB, GiB = 1024**2, 1024**3
SAID = f"OSError: [Errno 28] {NO_SPACE}: 'out.bin'"
RAISED = RunFailure(code="harness_error", failure_class="agent", message=f"OSError: {NO_SPACE}")
HOME_FULL = RunFailure(code="disk_full", failure_class="infra", message="starting a worker failed", retryable=True)


def space(available: int, total: int) -> DiskSpace:
    return DiskSpace(mount=Path("/work"), available_bytes=available, total_bytes=total)


ROOM = space(30 * GiB, 100 * GiB)
STEADY = DiskHistory(start_bytes=31 * GiB, lowest_bytes=30 * GiB)
FULL = space(0, 4 * MiB)
Verdict = tuple[str, str, bool] | None
DISK_FULL: Verdict = ("disk_full", "infra", True)


@pytest.mark.unit
@pytest.mark.parametrize(
    ("run", "now", "history", "verdict", "words"),
    [
        (ran(stderr="Traceback: KeyError"), FULL, DiskHistory(), DISK_FULL, "/work has 0 B free of 4.0 MiB"),
        (ran(), space(500 * MiB, 1024 * GiB), STEADY, DISK_FULL, "500.0 MiB free of 1.0 TiB"),
        (ran(stderr=SAID), FULL, DiskHistory(), DISK_FULL, "0 B free"),
        (ran(stdout=f"write failed: {NO_SPACE}"), FULL, DiskHistory(), DISK_FULL, "0 B free"),
        # a neighbour filled the disk, the harness failed on it, the neighbour's space came back
        (ran(stderr=SAID), ROOM, DiskHistory(30 * GiB, 0), DISK_FULL, "/work had 0 B free of 100.0 GiB at its lowest"),
        (ran(stderr=SAID), ROOM, DiskHistory(70 * GiB, 29 * GiB), DISK_FULL, "went from 70.0 GiB to 29.0 GiB free"),
        (ran(stderr="write /work/x: no space left on device"), ROOM, DiskHistory(30 * GiB, GiB), DISK_FULL, "1.0 GiB"),
        (ran(exit_code=0, failure=RAISED), ROOM, DiskHistory(30 * GiB, 0), DISK_FULL, "the harness raised"),
        (ran(stderr=SAID), None, DiskHistory(), DISK_FULL, "its free space cannot be read"),  # best effort
        # it said so, but the workdir's disk had room all along: its own failure, saying why
        (ran(stderr=SAID), ROOM, STEADY, ("exit_nonzero", "agent", False), "/work has 30.0 GiB free of 100.0 GiB"),
        (ran(stderr=SAID), ROOM, DiskHistory(), ("exit_nonzero", "agent", False), "30.0 GiB at its lowest"),
        (ran(exit_code=0, failure=RAISED), ROOM, STEADY, ("harness_error", "agent", False), f"OSError: {NO_SPACE};"),
        (ran(stderr="Traceback: KeyError"), ROOM, DiskHistory(30 * GiB, 0), None, ""),  # silent: the exit counts
        (ran(stderr="Traceback: KeyError"), None, DiskHistory(), None, ""),
        (ran(exit_code=0, stderr=NO_SPACE), FULL, DiskHistory(), None, ""),  # it coped: no failure
        (ran(exit_code=124, timed_out=True, stderr=NO_SPACE), FULL, DiskHistory(), None, ""),  # its timeout stands
        (ran(exit_code=137, oom=True, stderr=NO_SPACE), FULL, DiskHistory(), None, ""),  # so does the OOM killer's
        (ran(exit_code=None, spawn_error="cannot start 'x'"), FULL, DiskHistory(), None, ""),
        (ran(exit_code=None, failure=HOME_FULL), FULL, DiskHistory(), None, ""),  # a worker's home
    ],
    ids=[
        "full, silent",
        "nearly full (0.05%)",
        "full, stderr says so",
        "full, stdout says so",
        "says so, full while it ran",
        "says so, shrank by more than half",
        "says so in lower case (Go), low while it ran",
        "worker raised, full while it ran",
        "says so, unreadable",
        "says so, room",
        "says so, room, never read before",
        "worker raised, room",
        "silent, full while it ran",
        "silent, unreadable",
        "exit 0",
        "timeout",
        "oom",
        "spawn",
        "already disk_full",
    ],
)
def test_the_verdict_on_a_run(
    run: HarnessRun, now: DiskSpace | None, history: DiskHistory, verdict: Verdict, words: str
) -> None:
    failure = disk_verdict(run, now, history)
    if verdict is None:
        assert failure is None, failure
        return
    assert failure is not None
    assert (failure.code, failure.failure_class, failure.retryable) == verdict
    assert words in failure.message, failure.message
    assert NO_SPACE in failure.message, failure.message
    if verdict[0] != "disk_full":
        assert "not disk_full" in failure.message, failure.message


@pytest.mark.unit
def test_the_thresholds_follow_the_size() -> None:
    assert full_below(4 * MiB) == low_below(4 * MiB) == MiB  # a small disk: the last MiB
    assert full_below(1024 * GiB) == int(1024 * GiB * 0.001)
    assert low_below(1024 * GiB) == int(1024 * GiB * 0.02)
    assert space(MiB - 1, 4 * MiB).full
    assert not space(MiB, 4 * MiB).full


@pytest.mark.unit
def test_no_space_is_found_through_the_cause() -> None:
    wrapped = RuntimeError("wrapped")
    wrapped.__cause__ = OSError(28, NO_SPACE)
    assert is_no_space(wrapped)
    assert not is_no_space(OSError(13, "Permission denied"))


@pytest.fixture
def small_disk(tmp_path: Path) -> Iterator[Path]:
    if os.geteuid() != 0:
        pytest.skip("mounting a tmpfs needs root (CI runs as root)")
    where = tmp_path / "small-disk"
    where.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES}", "evalbus-test-disk", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


FILLER = """
import sys
with open("zeros.bin", "wb", buffering=0) as f:
    while True:
        f.write(bytes(65536))
"""


@pytest.mark.integration
async def test_a_harness_filling_the_disk_then_the_space_back(
    small_disk: Path, script: Script, make_request: MakeRequest
) -> None:
    backend = LocalBackend(slots=2, root=small_disk, environ={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    hog = await backend.provision(make_request(script(FILLER), case_id="hog"))
    filled = await hog.run_harness(no_output)
    assert filled.failure is not None, filled
    assert (filled.failure.code, filled.failure.failure_class, filled.failure.retryable) == ("disk_full", "infra", True)
    assert f"{small_disk} has 0 B free of 4.0 MiB" in filled.failure.message, filled.failure.message

    # the backend's own writes (the owner mark, the input file) on the full disk
    with pytest.raises(BackendError) as refused:
        await backend.provision(make_request(("true",), case_id="starved", input="x" * 10_000))
    assert (refused.value.code, refused.value.failure_class, refused.value.retryable) == ("disk_full", "infra", True)
    assert NO_SPACE in refused.value.message
    assert str(small_disk) in refused.value.message
    assert backend.capacity().used == 1  # the refused case holds no slot

    await hog.release()
    assert await asyncio.to_thread(lambda: list(small_disk.iterdir())) == []
    later = await backend.provision(
        make_request(script("open('out.txt', 'w').write('ok'); print('ok')"), case_id="later")
    )
    try:
        done = await later.run_harness(no_output)
    finally:
        await later.release()
    assert (done.exit_code, done.failure, done.stdout) == (0, None, "ok")


SAYS_NO_SPACE = f"""
import sys
print("OSError: [Errno 28] {NO_SPACE}: '/mnt/scratch/out.bin'", file=sys.stderr, flush=True)
sys.exit(1)
"""


@pytest.mark.integration
async def test_a_harness_saying_no_space_on_a_disk_with_room_fails_on_its_own(
    backend: LocalBackend, sandbox_root: Path, script: Script, make_request: MakeRequest, live: LiveSink
) -> None:
    room = disk_space(sandbox_root)
    assert room is not None
    if room.available_bytes < low_below(room.total_bytes):
        pytest.skip(f"the test's own disk is low ({room.describe()}): it cannot show a disk with room")
    executed = await execute_case(make_request(script(SAYS_NO_SPACE)), backend, live=live, on_release=lambda: None)
    failure = executed.result.failure
    assert failure is not None
    assert (failure.stage, failure.failure_class, failure.code, failure.retryable) == (
        "run",
        "agent",
        "exit_nonzero",
        False,
    ), failure
    assert failure.message.startswith("harness exited with 1; "), failure.message
    assert f"reported {NO_SPACE!r} but the workdir's disk had room ({room.mount} has " in failure.message
    assert "not disk_full" in failure.message, failure.message
    assert NO_SPACE in (failure.log_tail or "")
    assert should_retry(executed, attempt=1, retries=3) is False


def victim(filled: Path, go: Path) -> str:
    """A harness that, once the disk is `filled`, fails a write on it, says so, and exits 1 only
    when told to `go` (by then the space is back)."""
    return f"""
import pathlib, sys, time
def wait(path):
    while not pathlib.Path(path).exists():
        time.sleep(0.01)
wait({str(filled)!r})
try:
    with open("notes.bin", "wb", buffering=0) as f:
        f.write(bytes(65536))
except OSError as e:
    print(f"OSError: {{e}}", file=sys.stderr, flush=True)
wait({str(go)!r})
sys.exit(1)
"""


@pytest.mark.integration
async def test_a_case_failing_on_a_neighbours_full_disk_is_disk_full_after_the_space_came_back(
    small_disk: Path, tmp_path: Path, script: Script, make_request: MakeRequest
) -> None:
    filled, go = tmp_path / "filled", tmp_path / "go"  # not on the small disk
    backend = LocalBackend(slots=2, root=small_disk, environ={"PATH": os.environ.get("PATH", "/usr/bin:/bin")})
    beside = await backend.provision(make_request(script(victim(filled, go)), case_id="beside", timeout_s=60))
    hog = await backend.provision(make_request(script(FILLER), case_id="hog"))
    reported = asyncio.Event()

    async def output(stream: OutputStream, line: str) -> None:
        if NO_SPACE in line:
            reported.set()

    running = asyncio.create_task(beside.run_harness(output))  # its disk read at start: room
    try:
        hogged = await hog.run_harness(no_output)
        assert hogged.failure is not None, hogged
        assert hogged.failure.code == "disk_full", hogged
        filled.touch()
        await asyncio.wait_for(reported.wait(), timeout=30)
        await hog.release()  # the neighbour's space comes back before the failed case exits
        back = disk_space(small_disk)
        assert back is not None
        assert back.available_bytes > DISK_BYTES // 2, back
        go.touch()
        failed = await asyncio.wait_for(running, timeout=30)
    finally:
        go.touch()
        await asyncio.gather(running, return_exceptions=True)
        await beside.release()
        await hog.release()
    assert failed.exit_code == 1, failed
    assert failed.failure is not None, failed
    assert (failed.failure.code, failed.failure.failure_class, failed.failure.retryable) == ("disk_full", "infra", True)
    assert f"{small_disk} had 0 B free of 4.0 MiB at its lowest" in failed.failure.message, failed.failure.message
