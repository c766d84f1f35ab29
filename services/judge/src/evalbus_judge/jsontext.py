"""Finding one JSON value in free text: the whole text, a fenced code block, or the outermost
`{…}` span. Models and agents wrap JSON in prose and fences; judges tolerate that, nothing more."""

from __future__ import annotations

import re
from collections.abc import Iterator
from typing import Any

import msgspec

_FENCE = re.compile(r"```[ \t]*(?:json|JSON)?[ \t]*\r?\n?(.*?)```", re.DOTALL)


def _decoded(text: str) -> Iterator[Any]:
    """Every JSON value the candidates of `text` decode to, in preference order."""
    candidates = [text, *(m.group(1) for m in _FENCE.finditer(text))]
    start, end = text.find("{"), text.rfind("}")
    if 0 <= start < end:
        candidates.append(text[start : end + 1])
    for candidate in candidates:
        try:
            yield msgspec.json.decode(candidate.strip())
        except msgspec.DecodeError:
            continue


def find_json(text: str) -> tuple[bool, Any]:
    """`(True, value)` for the first JSON value found in `text`, else `(False, None)`.

    Tried in order: the whole text, each fenced block, the span from the first `{` to the last `}`.
    NaN and Infinity are not JSON and are never accepted.
    """
    for value in _decoded(text):
        return True, value
    return False, None


def find_json_object(text: str) -> dict[str, Any] | None:
    """The first JSON object found in `text` (candidates as in `find_json`), or None."""
    for value in _decoded(text):
        if isinstance(value, dict):
            return value
    return None
