"""A live log's text in chunks: what the dispatcher's live tee and the in-job runner both publish as
`LiveLog` (one implementation, so the two paths cut a run's output the same way). Pure."""

from __future__ import annotations

from collections.abc import Sequence

MAX_LOG_CHUNK_BYTES = 16 * 1024
"""Largest log text (UTF-8 bytes) of one `LiveLog`."""


def utf8_len(text: str) -> int:
    """`text`'s length in UTF-8 bytes (without encoding an ASCII text)."""
    return len(text) if text.isascii() else len(text.encode("utf-8"))


def split_utf8(text: str, limit: int) -> list[str]:
    """`text` in pieces of at most `limit` UTF-8 bytes, never splitting a character."""
    data = text.encode("utf-8")
    if len(data) <= limit:
        return [text]
    pieces: list[str] = []
    start = 0
    while start < len(data):
        end = min(start + limit, len(data))
        while end < len(data) and end > start and (data[end] & 0xC0) == 0x80:  # inside a character
            end -= 1
        if end == start:  # a limit smaller than one character: take the whole character
            end = start + 1
            while end < len(data) and (data[end] & 0xC0) == 0x80:
                end += 1
        pieces.append(data[start:end].decode("utf-8"))
        start = end
    return pieces


def chunks(lines: Sequence[str], limit: int) -> list[str]:
    """Lines joined (each ending in a newline) into chunks of at most `limit` UTF-8 bytes; a line
    longer than that is split across chunks. Concatenated, the chunks are exactly the lines."""
    out: list[str] = []
    current: list[str] = []
    size = 0
    for line in lines:
        for piece in split_utf8(line + "\n", limit):
            n = utf8_len(piece)
            if current and size + n > limit:
                out.append("".join(current))
                current, size = [], 0
            current.append(piece)
            size += n
    if current:
        out.append("".join(current))
    return out
