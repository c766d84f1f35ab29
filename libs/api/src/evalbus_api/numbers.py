"""Whole numbers read from text a client or server sent (headers, cookies, query parameters)."""

from __future__ import annotations


def whole_number(text: str, max_digits: int = 18) -> int | None:
    """`text` as a non-negative integer when it is ASCII digits only, at most `max_digits` of
    them; else None. `str.isdigit` alone takes '²' and '٣', on which `int` raises or reads
    another script's digit, and a very long run of digits is past `int`'s limit."""
    if text.isascii() and text.isdigit() and len(text) <= max_digits:
        return int(text)
    return None
