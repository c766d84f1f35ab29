"""The rows fault tests give `bench/reliability.py`: each scenario's load, the faults injected,
cases lost and duplicated, the stall, pass/fail — appended to the JSON list in the file
`$EVALBUS_RELIABILITY_REPORT` names (nothing is written when it is unset, as in CI).

    report(row("SIGKILL nats-server mid-batch", load="8 cases", faults=1, lost=0, duplicated=0, stall_s=9.2, passed=True))
"""

from __future__ import annotations

import json
import os
from collections import Counter
from collections.abc import Hashable
from pathlib import Path
from typing import Any, TypeVar

K = TypeVar("K", bound=Hashable)

REPORT_ENV = "EVALBUS_RELIABILITY_REPORT"
"""The file the rows are appended to (a JSON list)."""


def row(
    test: str,
    *,
    load: str,
    faults: int,
    lost: int | None,
    duplicated: int | None,
    passed: bool,
    stall_s: float | None = None,
    resumed_s: float | None = None,
) -> dict[str, Any]:
    """One scenario's row (`lost`/`duplicated` None: the scenario cannot count them)."""
    out: dict[str, Any] = {
        "test": test,
        "load": load,
        "faults": faults,
        "lost": lost,
        "duplicated": duplicated,
        "max_stall_s": None if stall_s is None else round(stall_s, 2),
        "passed": passed,
    }
    if resumed_s is not None:
        out["resumed_s"] = round(resumed_s, 2)
    return out


def report(*rows: dict[str, Any]) -> None:
    """Append `rows` to the report file, when there is one."""
    target = os.environ.get(REPORT_ENV)
    if not target:
        return
    path = Path(target)
    existing = json.loads(path.read_text()) if path.exists() else []
    path.write_text(json.dumps([*existing, *rows], indent=2))


def lost_and_duplicated(want: Counter[K], store: Counter[K], stream: Counter[K] | None = None) -> tuple[int, int]:
    """Events `want`ed but missing from the store; copies beyond `want` in the store and, when
    given, on the stream."""
    lost = sum((want - store).values())
    duplicated = sum((store - want).values()) + (sum((stream - want).values()) if stream is not None else 0)
    return lost, duplicated
