"""An X screen dump (`xwd -root` output) to a PNG, in pure Python (pure: bytes in, bytes out).

XWD is a 100-byte header of 25 big-endian 32-bit fields (xwd writes its header most significant
byte first whatever the machine), the window's name up to `header_size`, `ncolors` 12-byte colour
map entries, then the image exactly as the X server handed it over: `height` rows of
`bytes_per_line` bytes, each pixel `bits_per_pixel` wide in the server's `byte_order`, its
channels where the visual's red/green/blue masks say. Only TrueColor/DirectColor ZPixmaps are
read — what Xvfb (and any X server of this century) gives at depth 15/16/24/32; a palette visual
is refused with a clear error rather than drawn in wrong colours.

The PNG is 8-bit RGB, every row unfiltered, zlib-compressed: the channels are pulled out of the
pixel bytes with slice assignments (no per-pixel Python loop) when each mask is a whole byte, the
common 24/32-bit case; other masks (16-bit 565, say) take a slower per-pixel path. `scale` keeps
every n-th pixel of every n-th row, for a frame too large to send at full size.
"""

from __future__ import annotations

import struct
import zlib
from dataclasses import dataclass
from typing import Literal

HEADER_FIELDS = 25
HEADER_BYTES = HEADER_FIELDS * 4
COLOUR_ENTRY_BYTES = 12
Z_PIXMAP = 2
TRUE_COLOR, DIRECT_COLOR = 4, 5
LSB_FIRST, MSB_FIRST = 0, 1
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class XwdError(ValueError):
    """The data is not an XWD dump this converter reads (the message says why)."""


@dataclass(frozen=True, slots=True)
class XwdImage:
    """A parsed dump: its geometry and layout, and the pixel rows as they were written."""

    width: int
    height: int
    depth: int
    bits_per_pixel: int
    bytes_per_line: int
    byte_order: int
    masks: tuple[int, int, int]
    """Red, green and blue masks of a pixel value."""
    pixels: memoryview
    """`height * bytes_per_line` bytes."""


def parse_xwd(data: bytes) -> XwdImage:
    """The header and pixel rows of an XWD dump; `XwdError` when it is not one this module reads."""
    if len(data) < HEADER_BYTES:
        raise XwdError(f"{len(data)} bytes is too short for an XWD header")
    h = struct.unpack(">25I", data[:HEADER_BYTES])
    header_size, version, pixmap_format, depth, width, height = h[0], h[1], h[2], h[3], h[4], h[5]
    byte_order, bits_per_pixel, bytes_per_line, visual_class = h[7], h[11], h[12], h[13]
    masks = (h[14], h[15], h[16])
    ncolors = h[19]
    if version != 7 or header_size < HEADER_BYTES:
        raise XwdError(f"not an XWD version 7 dump (version {version}, header {header_size} bytes)")
    if pixmap_format != Z_PIXMAP:
        raise XwdError(f"pixmap format {pixmap_format} is not a ZPixmap")
    if visual_class not in (TRUE_COLOR, DIRECT_COLOR):
        raise XwdError(f"visual class {visual_class} is not TrueColor or DirectColor")
    if bits_per_pixel not in (16, 24, 32) or byte_order not in (LSB_FIRST, MSB_FIRST):
        raise XwdError(f"{bits_per_pixel} bits per pixel in byte order {byte_order} is not supported")
    if not all(masks) or width == 0 or height == 0:
        raise XwdError(f"an empty image or colour mask ({width}x{height}, masks {masks})")
    if bytes_per_line < width * bits_per_pixel // 8:
        raise XwdError(f"{bytes_per_line} bytes per line cannot hold {width} pixels")
    start = header_size + ncolors * COLOUR_ENTRY_BYTES
    end = start + height * bytes_per_line
    if len(data) < end:
        raise XwdError(f"the dump is cut short: {len(data)} bytes, {end} expected")
    return XwdImage(
        width=width,
        height=height,
        depth=depth,
        bits_per_pixel=bits_per_pixel,
        bytes_per_line=bytes_per_line,
        byte_order=byte_order,
        masks=masks,
        pixels=memoryview(data)[start:end],
    )


def _byte_index(mask: int, pixel_bytes: int, byte_order: int) -> int | None:
    """Which byte of a pixel a whole-byte mask covers, or None when it is not one whole byte."""
    for i in range(pixel_bytes):
        if mask == 0xFF << (8 * i):
            return i if byte_order == LSB_FIRST else pixel_bytes - 1 - i
    return None


def _planes(image: XwdImage, scale: int) -> tuple[int, int, list[bytes]]:
    """(width, height, [red, green, blue]) of the image kept at every `scale`-th pixel, each plane
    one byte per pixel, row after row."""
    step = image.bits_per_pixel // 8
    used = image.width * step
    rows = [
        image.pixels[y * image.bytes_per_line : y * image.bytes_per_line + used] for y in range(0, image.height, scale)
    ]
    width = len(range(0, image.width, scale))
    indices = [_byte_index(mask, step, image.byte_order) for mask in image.masks]
    if all(i is not None for i in indices):
        stride = step * scale
        planes = []
        for index in indices:
            assert index is not None
            planes.append(b"".join(bytes(row[index::stride]) for row in rows))
        return width, len(rows), planes
    order: Literal["little", "big"] = "little" if image.byte_order == LSB_FIRST else "big"
    shifts = [(mask & -mask).bit_length() - 1 for mask in image.masks]
    tops = [mask >> shift for mask, shift in zip(image.masks, shifts, strict=True)]
    out = [bytearray(), bytearray(), bytearray()]
    for row in rows:
        for x in range(0, used, step * scale):
            value = int.from_bytes(row[x : x + step], order)
            for plane, mask, shift, top in zip(out, image.masks, shifts, tops, strict=True):
                plane.append(((value & mask) >> shift) * 255 // top)
    return width, len(rows), [bytes(p) for p in out]


def _chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def encode_png(width: int, height: int, rgb: bytes | bytearray) -> bytes:
    """An 8-bit RGB PNG of `rgb` (`height` rows of `width * 3` bytes), rows unfiltered."""
    line = width * 3
    if len(rgb) != line * height:
        raise ValueError(f"{len(rgb)} bytes of pixels for a {width}x{height} RGB image")
    raw = b"".join(b"\x00" + bytes(rgb[y * line : (y + 1) * line]) for y in range(height))
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    return PNG_SIGNATURE + _chunk(b"IHDR", header) + _chunk(b"IDAT", zlib.compress(raw, 6)) + _chunk(b"IEND", b"")


def xwd_to_png(data: bytes, scale: int = 1) -> tuple[int, int, bytes]:
    """(width, height, PNG) of an XWD dump, every `scale`-th pixel kept; `XwdError` when unreadable."""
    if scale < 1:
        raise ValueError("scale must be at least 1")
    width, height, (red, green, blue) = _planes(parse_xwd(data), scale)
    rgb = bytearray(width * height * 3)
    rgb[0::3], rgb[1::3], rgb[2::3] = red, green, blue
    return width, height, encode_png(width, height, rgb)
