"""Export one judged case to its batch's sinks and say how it went (never raises)."""

from __future__ import annotations

import asyncio
from collections import OrderedDict
from collections.abc import Callable, Sequence

from evalbus_contracts import CaseExported, CaseJudged, SinkOutcome, SinkSpec
from evalbus_exporter.sinks.base import CaseSink

SinkFactory = Callable[[SinkSpec, str], CaseSink]
"""Builds the sink for one spec and batch id."""


def unexportable(judged: CaseJudged, sinks: Sequence[CaseSink], reason: str) -> CaseExported:
    """The `case.exported` of a case whose offloaded payload could not be read as its reference
    pins (tampered with, replaced or gone): no sink is sent other bytes; each is `failed` with
    the reason."""
    outcomes = tuple(
        SinkOutcome(sink=sink.name, status="failed", error=f"the run's payload could not be read: {reason}")
        for sink in sinks
    )
    return CaseExported(
        batch_id=judged.batch_id,
        case_id=judged.case_id,
        run_id=judged.run_id,
        attempt=judged.attempt,
        status=export_status(outcomes),  # type: ignore[arg-type]
        outcomes=outcomes,
    )


def export_status(outcomes: Sequence[SinkOutcome]) -> str:
    """exported (every sink ok), partial, failed (none ok), skipped (no sink)."""
    if not outcomes:
        return "skipped"
    ok = sum(1 for o in outcomes if o.status == "ok")
    if ok == len(outcomes):
        return "exported"
    return "partial" if ok else "failed"


async def export_case(judged: CaseJudged, sinks: Sequence[CaseSink]) -> CaseExported:
    """Run every sink for the case (concurrently), collect outcomes in sink order."""
    outcomes: list[SinkOutcome] = []
    if sinks:
        results = await asyncio.gather(*(_safe(sink, judged) for sink in sinks))
        outcomes.extend(results)
    status = export_status(outcomes)
    return CaseExported(
        batch_id=judged.batch_id,
        case_id=judged.case_id,
        run_id=judged.run_id,
        attempt=judged.attempt,
        status=status,  # type: ignore[arg-type]
        outcomes=tuple(outcomes),
    )


async def _safe(sink: CaseSink, judged: CaseJudged) -> SinkOutcome:
    try:
        return await sink.export(judged)
    except Exception as e:
        return SinkOutcome(sink=sink.name, status="failed", error=f"{type(e).__name__}: {e}")


class SinkCache:
    """Sinks are built once per batch (bounded LRU) from the specs the case event carries."""

    def __init__(self, factory: SinkFactory, size: int = 64) -> None:
        self._factory = factory
        self._size = size
        self._cache: OrderedDict[str, list[CaseSink]] = OrderedDict()

    async def for_batch(self, batch_id: str, specs: Sequence[SinkSpec]) -> list[CaseSink]:
        """The batch's sinks."""
        found = self._cache.get(batch_id)
        if found is not None:
            self._cache.move_to_end(batch_id)
            return found
        sinks = [self._factory(spec, batch_id) for spec in specs]
        self._cache[batch_id] = sinks
        while len(self._cache) > self._size:
            _, old = self._cache.popitem(last=False)
            for sink in old:
                await sink.close()
        return sinks

    async def close(self) -> None:
        """Close every cached sink."""
        for sinks in self._cache.values():
            for sink in sinks:
                await sink.close()
        self._cache.clear()
