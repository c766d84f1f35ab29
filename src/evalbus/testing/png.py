"""Reading a PNG's pixels in the tests, with zlib only: 8-bit RGB or RGBA, non-interlaced, every
row filter undone (the frames the live screen sends, whoever encoded them)."""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass

SIGNATURE = b"\x89PNG\r\n\x1a\n"


@dataclass(frozen=True, slots=True)
class Pixels:
    """A decoded image."""

    width: int
    height: int
    rows: tuple[bytes, ...]
    """Each row's RGB bytes (alpha dropped)."""

    def at(self, x: int, y: int) -> tuple[int, int, int]:
        """The RGB of pixel (x, y)."""
        row = self.rows[y]
        return row[3 * x], row[3 * x + 1], row[3 * x + 2]

    def colours(self) -> set[tuple[int, int, int]]:
        """Every distinct colour in the image."""
        return {(row[i], row[i + 1], row[i + 2]) for row in self.rows for i in range(0, len(row), 3)}


def _paeth(a: int, b: int, c: int) -> int:
    p = a + b - c
    pa, pb, pc = abs(p - a), abs(p - b), abs(p - c)
    if pa <= pb and pa <= pc:
        return a
    return b if pb <= pc else c


def decode_png(data: bytes) -> Pixels:
    """The pixels of an 8-bit RGB/RGBA PNG; `ValueError` for anything else."""
    if data[:8] != SIGNATURE:
        raise ValueError("not a PNG")
    pos, idat, width, height, channels = 8, b"", 0, 0, 0
    while pos < len(data):
        (length,) = struct.unpack(">I", data[pos : pos + 4])
        kind, body = data[pos + 4 : pos + 8], data[pos + 8 : pos + 8 + length]
        if zlib.crc32(kind + body) != struct.unpack(">I", data[pos + 8 + length : pos + 12 + length])[0]:
            raise ValueError(f"bad CRC on the {kind!r} chunk")
        if kind == b"IHDR":
            width, height, depth, colour, _, _, interlace = struct.unpack(">IIBBBBB", body)
            if depth != 8 or colour not in (2, 6) or interlace:
                raise ValueError(f"unsupported PNG (depth {depth}, colour type {colour}, interlace {interlace})")
            channels = 3 if colour == 2 else 4
        elif kind == b"IDAT":
            idat += body
        pos += 12 + length
    raw = zlib.decompress(idat)
    stride = width * channels
    if len(raw) != (stride + 1) * height:
        raise ValueError(f"{len(raw)} bytes of image data for {width}x{height}")
    previous = bytearray(stride)
    rows: list[bytes] = []
    for y in range(height):
        method, line = raw[y * (stride + 1)], bytearray(raw[y * (stride + 1) + 1 : (y + 1) * (stride + 1)])
        if method > 4:
            raise ValueError(f"row {y} has filter {method}")
        for i in range(stride if method else 0):
            left = line[i - channels] if i >= channels else 0
            up = previous[i]
            if method == 1:
                predictor = left
            elif method == 2:
                predictor = up
            elif method == 3:
                predictor = (left + up) // 2
            else:
                predictor = _paeth(left, up, previous[i - channels] if i >= channels else 0)
            line[i] = (line[i] + predictor) & 0xFF
        previous = line
        rgb = line if channels == 3 else bytearray(b for i, b in enumerate(line) if i % 4 != 3)
        rows.append(bytes(rgb))
    return Pixels(width=width, height=height, rows=tuple(rows))
