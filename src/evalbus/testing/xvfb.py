"""A real X server for the desktop screen tests: Debian's Xvfb, with `xwd` (the capture tool the
dispatcher runs in the sandbox) and `xsetroot` (to paint something known), found on the machine or
installed with apt when missing and running as root — the same rule as `chromium`: a test that
cannot get them fails, never skips (`.ci/run` installs them up front).

The display number is Xvfb's own choice (`-displayfd`: the first free one, taken with its lock
file), so tests and helpers running side by side never race for one.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest

PACKAGES = {"Xvfb": "xvfb", "xwd": "x11-apps", "xsetroot": "x11-xserver-utils"}
"""Each program the tests need, and the Debian package that has it."""
START_TIMEOUT_S = 30.0


@dataclass(frozen=True, slots=True)
class X11Tools:
    """Where the X programs are."""

    xvfb: str
    xwd: str
    xsetroot: str


def ensure_x11() -> X11Tools:
    """Xvfb, xwd and xsetroot, installed with apt when missing (as root); `pytest.fail` without them."""
    missing = [package for program, package in PACKAGES.items() if shutil.which(program) is None]
    if missing and os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", *missing], check=True, env=env, timeout=900)
    found = {program: shutil.which(program) for program in PACKAGES}
    absent = [PACKAGES[program] for program, path in found.items() if path is None]
    if absent:
        pytest.fail(f"the desktop screen tests need Debian's X tools: apt-get install {' '.join(absent)}")
    return X11Tools(xvfb=str(found["Xvfb"]), xwd=str(found["xwd"]), xsetroot=str(found["xsetroot"]))


def unused_display() -> str:
    """A display name no X server on this machine serves (no socket, no lock file)."""
    for number in range(700, 1000):
        if not Path(f"/tmp/.X11-unix/X{number}").exists() and not Path(f"/tmp/.X{number}-lock").exists():
            return f":{number}"
    raise RuntimeError("every display from :700 to :999 is taken")


def _read_number(fd: int) -> str:
    """What Xvfb writes on its display fd: the number and a newline (EOF if it died first)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 64)
        if not chunk:
            break
        data += chunk
    return data.decode("ascii").strip()


@contextlib.asynccontextmanager
async def running_xvfb(tools: X11Tools, width: int = 320, height: int = 240) -> AsyncIterator[str]:
    """An Xvfb of the test's own at `width`x`height`, 24-bit: its display name (`:N`), while open."""
    read_fd, write_fd = os.pipe()
    try:
        proc = await asyncio.create_subprocess_exec(
            tools.xvfb,
            "-displayfd",
            str(write_fd),
            "-screen",
            "0",
            f"{width}x{height}x24",
            "-noreset",  # a server that resets when its last client leaves would lose what was painted
            "-nolisten",
            "tcp",
            stdout=asyncio.subprocess.DEVNULL,
            stderr=asyncio.subprocess.DEVNULL,
            pass_fds=(write_fd,),
        )
    finally:
        os.close(write_fd)
    try:
        try:
            number = await asyncio.wait_for(asyncio.to_thread(_read_number, read_fd), START_TIMEOUT_S)
        finally:
            os.close(read_fd)
        if not number.isdigit():
            raise RuntimeError(f"Xvfb did not start (exit {proc.returncode}, said {number!r})")
        yield f":{number}"
    finally:
        if proc.returncode is None:
            proc.terminate()
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()


async def paint(tools: X11Tools, display: str, colour: str) -> None:
    """Fill the display's root window with `colour` (`#ff0000`), with xsetroot."""
    proc = await asyncio.create_subprocess_exec(
        tools.xsetroot, "-solid", colour, env={**os.environ, "DISPLAY": display}
    )
    code = await asyncio.wait_for(proc.wait(), 30)
    if code != 0:
        raise RuntimeError(f"xsetroot -solid {colour} on {display} exited {code}")
