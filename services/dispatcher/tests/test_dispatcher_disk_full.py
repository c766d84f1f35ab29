"""A full workdir disk told apart from a harness's own failure: the pure verdict on a run, and the
local backend on a real small tmpfs (mounted here, which needs root — CI runs as root): its own
writes fail `disk_full` (retryable infra, naming the disk) instead of a generic workdir error, a
harness that fills the disk fails `disk_full` instead of `exit_nonzero`, and releasing its
workdir gives the space back so the next case runs."""

from __future__ import annotations

import asyncio
import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from evalbus_contracts import CaseRequested
from evalbus_dispatcher import BackendError, LocalBackend, OutputStream
from evalbus_dispatcher.backends.base import HarnessRun, RunFailure
from evalbus_dispatcher.backends.disk import NO_SPACE, disk_full_failure, disk_space, is_no_space

Script = Callable[[str], tuple[str, ...]]
MakeRequest = Callable[..., CaseRequested]
DISK_BYTES = 4 * 1024 * 1024


async def no_output(stream: OutputStream, line: str) -> None:
    return None


def ran(**fields: object) -> HarnessRun:
    base: dict[str, object] = {"exit_code": 1, "stdout": "", "stderr": ""}
    return HarnessRun(**{**base, **fields})  # type: ignore[arg-type]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("run", "full"),
    [
        (ran(stderr=f"OSError: [Errno 28] {NO_SPACE}: 'out.bin'"), True),
        (ran(stdout=f"write failed: {NO_SPACE}"), True),
        (ran(exit_code=0, failure=RunFailure(code="harness_error", failure_class="agent", message=NO_SPACE)), True),
        (ran(stderr="Traceback: KeyError"), False),  # an agent's own failure, on a disk with room
        (ran(exit_code=0, stderr=NO_SPACE), False),  # it coped: no failure
        (ran(exit_code=124, timed_out=True, stderr=NO_SPACE), False),  # its timeout stands
        (ran(exit_code=137, oom=True, stderr=NO_SPACE), False),  # so does the OOM killer's verdict
        (ran(exit_code=None, spawn_error="cannot start 'x'"), False),
    ],
    ids=["stderr", "stdout", "worker raised", "other failure", "exit 0", "timeout", "oom", "spawn"],
)
def test_the_verdict_on_a_run(tmp_path: Path, run: HarnessRun, full: bool) -> None:
    failure = disk_full_failure(run, tmp_path)
    if not full:
        assert failure is None
        return
    assert failure is not None
    assert (failure.code, failure.failure_class, failure.retryable) == ("disk_full", "infra", True)
    space = disk_space(tmp_path)
    assert space is not None
    assert str(space.mount) in failure.message
    assert NO_SPACE in failure.message


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
