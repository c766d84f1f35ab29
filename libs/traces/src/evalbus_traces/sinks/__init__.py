"""Trace sinks, one module per platform: each exports judged cases and reports per-case outcomes.

`export_each` is the shared isolation contract: cases are exported one after another (the
exporter bounds concurrency across cases), and whatever one case raises becomes that case's
`failed` outcome — a sink never throws.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable, Sequence

from evalbus_contracts.summary import SinkOutcome
from evalbus_traces.ports import JudgedCase

ERROR_CAP = 500
"""Longest error text kept on an outcome."""


async def export_each(
    sink: str, cases: Sequence[JudgedCase], one: Callable[[JudgedCase], Awaitable[SinkOutcome]]
) -> list[SinkOutcome]:
    """`one(case)` for every case, in order; an exception becomes that case's failed outcome."""
    outcomes: list[SinkOutcome] = []
    for case in cases:
        try:
            outcomes.append(await one(case))
        except Exception as e:
            outcomes.append(SinkOutcome(sink=sink, status="failed", error=f"{type(e).__name__}: {e}"[:ERROR_CAP]))
    return outcomes
