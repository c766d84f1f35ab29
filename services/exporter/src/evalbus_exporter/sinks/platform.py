"""A trace platform as a case sink: `evalbus_traces`' sink for the platform, one case at a time,
with the case's verdict (the authority ladder of `evalbus_grading.verdict`) as a tag."""

from __future__ import annotations

from evalbus_contracts import CaseJudged, SinkOutcome
from evalbus_grading.verdict import decide, objective_metrics_of
from evalbus_traces import ExportContext, TraceSink, judged_case


class PlatformCaseSink:
    """Exports judged cases to one platform through its `TraceSink` (which never raises)."""

    def __init__(self, sink: TraceSink) -> None:
        self._sink = sink
        self.name = sink.name

    async def export(self, judged: CaseJudged) -> SinkOutcome:
        graders = judged.case.graders if judged.case is not None else ()
        verdict = decide(
            judged.result.scores, failure=judged.result.failure, objective_metrics=objective_metrics_of(graders)
        )
        ctx = ExportContext(
            batch_id=judged.batch_id or "",
            suite_id=judged.plan.suite_id,
            harness=judged.result.harness,
            labels=dict(judged.plan.labels),
        )
        outcomes = await self._sink.export(ctx, [judged_case(judged, verdict.outcome)])
        if not outcomes:
            return SinkOutcome(sink=self.name, status="failed", error="the sink returned no outcome")
        return outcomes[0]

    async def close(self) -> None:
        return None
