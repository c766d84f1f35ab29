"""Debian's headless Chromium for the tests that need a real browser (the dashboard, the live
screen): found on the machine or installed with apt when missing and running as root; a test that
cannot get it fails, never skips (`.ci/run` installs it up front), and reading a frame's first
pixel needs no imaging library."""

from __future__ import annotations

import os
import shutil
import struct
import subprocess
import zlib

import pytest


def ensure_chromium() -> str:
    """The `chromium` executable, installed with apt when missing (as root); `pytest.fail` without it."""
    found = shutil.which("chromium")
    if found:
        return found
    if os.geteuid() == 0 and shutil.which("apt-get"):
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        subprocess.run(["apt-get", "update", "-qq"], check=True, env=env, timeout=600)
        subprocess.run(["apt-get", "install", "-y", "-qq", "chromium"], check=True, env=env, timeout=900)
        found = shutil.which("chromium")
    if not found:
        pytest.fail("Debian's chromium is needed for the browser tests: apt-get install chromium")
    return found


def png_size_and_first_pixel(data: bytes) -> tuple[int, int, tuple[int, int, int]]:
    """(width, height, RGB of the top-left pixel) of an 8-bit RGB or RGBA PNG.

    The first pixel of the first row is its raw bytes whatever the row's filter: every PNG filter
    predicts it from neighbours that do not exist, which count as zero.
    """
    if data[:8] != b"\x89PNG\r\n\x1a\n":
        raise ValueError("not a PNG")
    pos, idat, width, height, colour = 8, b"", 0, 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind = data[pos + 4 : pos + 8]
        body = data[pos + 8 : pos + 8 + length]
        if kind == b"IHDR":
            width, height, depth, colour = struct.unpack(">IIBB", body[:10])
            if depth != 8 or colour not in (2, 6):
                raise ValueError(f"unsupported PNG (depth {depth}, colour type {colour})")
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    r, g, b = raw[1], raw[2], raw[3]
    return width, height, (r, g, b)
