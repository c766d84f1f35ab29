"""Sandboxes for grader tests: a real shell in the test's directory, and one that breaks."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest

from evalbus_grading import ExecResult, Sandbox


class _ShellSandbox:
    """Runs commands with /bin/sh in a directory, killing the process group on timeout."""

    def __init__(self, workdir: Path, log: list[str]) -> None:
        self.workdir = workdir
        self.log = log

    async def exec(self, command: str, timeout_s: float) -> ExecResult:
        self.log.append(command)
        proc = await asyncio.create_subprocess_exec(
            "/bin/sh",
            "-c",
            command,
            cwd=self.workdir,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        try:
            out, err = await asyncio.wait_for(proc.communicate(), timeout_s)
        except TimeoutError:
            os.killpg(proc.pid, signal.SIGKILL)
            await proc.wait()
            return ExecResult(exit_code=124, stdout="", stderr="", timed_out=True)
        assert proc.returncode is not None
        return ExecResult(exit_code=proc.returncode, stdout=out.decode(), stderr=err.decode())


class _BrokenSandbox:
    """A sandbox whose exec raises (a backend bug or a lost connection)."""

    async def exec(self, command: str, timeout_s: float) -> ExecResult:
        raise ConnectionError("sandbox went away")


@pytest.fixture
def shell_log() -> list[str]:
    """Commands the `shell` sandbox ran, in order."""
    return []


@pytest.fixture
def shell(tmp_path: Path, shell_log: list[str]) -> Sandbox:
    """A real shell sandbox in the test's own directory."""
    return _ShellSandbox(tmp_path, shell_log)


@pytest.fixture
def broken_sandbox() -> Sandbox:
    """A sandbox whose every exec raises."""
    return _BrokenSandbox()
