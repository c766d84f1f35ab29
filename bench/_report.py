"""Printing a benchmark's results: an aligned table and notes, then one JSON line (or only the
JSON line with `--json`)."""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import msgspec


def rounded(out: Mapping[str, Any], digits: int = 3) -> dict[str, Any]:
    """`out` with floats rounded (recursively) for printing; Structs (goals) as plain dicts."""

    def fix(value: Any) -> Any:
        if isinstance(value, float):
            return round(value, digits)
        if isinstance(value, Mapping):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [fix(v) for v in value]
        return value

    return {k: fix(v) for k, v in msgspec.to_builtins(out).items()}


def report(out: Mapping[str, Any], rows: Sequence[tuple[str, ...]], notes: Sequence[str], as_json: bool) -> None:
    """One JSON line (`--json`), else an aligned table, the notes, then the JSON line."""
    line = msgspec.json.encode(rounded(out)).decode()
    if as_json:
        print(line)
        return
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))] if rows else []
    for r in rows:
        print(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    for note in notes:
        print(note)
    print(line)


def fmt(value: float | None, unit: str = "", digits: int = 2) -> str:
    """A number for the table."""
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.{digits}f}{unit}"
