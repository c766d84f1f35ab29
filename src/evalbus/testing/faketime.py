"""Skewed clocks for a service process: Debian's libfaketime, preloaded into the process, moves
its wall clock (`time.time`, `datetime.now`) by a fixed offset and leaves its monotonic clock alone
(`FAKETIME_DONT_FAKE_MONOTONIC`), as a replica whose NTP is off would see it. Installed with apt
when missing and running as root (`.ci/run` installs it up front); a test that cannot get it fails,
never skips."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import pytest

LIBRARY_CANDIDATES = (
    "/usr/lib/x86_64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/aarch64-linux-gnu/faketime/libfaketimeMT.so.1",
    "/usr/lib/faketime/libfaketimeMT.so.1",
)


def _found() -> str | None:
    return next((p for p in LIBRARY_CANDIDATES if Path(p).exists()), None)


def ensure_faketime() -> str:
    """The path of libfaketime (multi-threaded), installed with apt when missing (as root);
    `pytest.fail` without it."""
    found = _found()
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "faketime"], check=True, env=env, timeout=600)
        found = _found()
    if not found:
        pytest.fail("Debian's libfaketime is needed for the clock-skew tests: apt-get install faketime")
    return found


def skewed(offset_s: float) -> dict[str, str]:
    """Environment that starts a process with its wall clock `offset_s` seconds off (monotonic kept)."""
    sign = "+" if offset_s >= 0 else "-"
    return {
        "LD_PRELOAD": ensure_faketime(),
        "FAKETIME": f"{sign}{abs(offset_s):g}s",
        "FAKETIME_DONT_FAKE_MONOTONIC": "1",
        "FAKETIME_NO_CACHE": "1",
    }
