"""Build a sink from its spec: `jsonl` here, trace platforms through `evalbus_traces`."""

from __future__ import annotations

from evalbus_contracts import CaseJudged, JsonlSink, PlatformSink, SinkOutcome, SinkSpec
from evalbus_exporter.sinks.base import CaseSink
from evalbus_exporter.sinks.jsonl import JsonlCaseSink


class UnavailableSink:
    """A sink that cannot be built: every case gets a failed outcome naming why."""

    def __init__(self, name: str, reason: str) -> None:
        self.name = name
        self.reason = reason

    async def export(self, judged: CaseJudged) -> SinkOutcome:
        del judged
        return SinkOutcome(sink=self.name, status="failed", error=self.reason)

    async def close(self) -> None:
        return None


def build_case_sink(spec: SinkSpec, batch_id: str) -> CaseSink:
    """The sink for `spec` in batch `batch_id`."""
    if isinstance(spec, JsonlSink):
        return JsonlCaseSink(spec, batch_id)
    assert isinstance(spec, PlatformSink)
    return UnavailableSink(spec.platform, f"{spec.platform} export is not wired in this exporter")
