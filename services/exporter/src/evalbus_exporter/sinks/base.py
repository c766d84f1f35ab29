"""The sink port: one judged case in, one outcome out. A sink never raises."""

from __future__ import annotations

from typing import Protocol

from evalbus_contracts import CaseJudged, SinkOutcome


class CaseSink(Protocol):
    """Exports judged cases one at a time."""

    name: str
    """Sink name in outcomes (`jsonl`, `mlflow`...)."""

    async def export(self, judged: CaseJudged) -> SinkOutcome:
        """Export one case; failures are returned as an outcome, never raised."""
        ...

    async def close(self) -> None:
        """Release resources."""
        ...
