"""The two ports of this package: pulling a run's platform trace, and exporting judged cases.

`TraceSource.pull` turns a `TraceRef` into trace events: `[]` means "nothing yet" (flush lag; the
caller retries), a `TraceSourceError` is a hard error (never retried) and `MissingSecretError`
passes through. `TraceSink.export` never raises: every case gets a `SinkOutcome`.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Literal, Protocol

import msgspec

from evalbus_contracts.events import CaseJudged
from evalbus_contracts.results import CaseResult, TraceRef
from evalbus_contracts.scores import Measured
from evalbus_contracts.specs import CaseSpec
from evalbus_contracts.summary import SinkOutcome
from evalbus_contracts.trace import TraceEvent

Verdict = Literal["pass", "fail"]
"""A case verdict as the exporter computed it (the authority ladder lives elsewhere)."""

LLM_JUDGE_KINDS: frozenset[str] = frozenset({"model", "embedding"})
"""Judge kinds whose scores come from a model (platforms label them LLM; the rest CODE)."""


class JudgedCase(msgspec.Struct, frozen=True, kw_only=True):
    """What the exporter knows about one judged run: result (grader and judge scores), case, batch."""

    batch_id: str
    """Batch the run belongs to."""
    result: CaseResult
    """The judged result; judge scores are appended after grader scores."""
    case: CaseSpec | None = None
    """The case (input, expected), when the event carried it."""
    verdict: Verdict | None = None
    """The case verdict, when the caller computed one (exported as a tag / annotation)."""
    judged_at: datetime | None = None
    """When the case was judged (the `case.judged` timestamp; stable across redeliveries)."""
    judge_kinds: dict[str, str] = msgspec.field(default_factory=dict)
    """Judge id → judge kind, to label model judges as LLM judges on the platform."""

    @property
    def run_id(self) -> str:
        """The run id (the correlation key)."""
        return self.result.run_id

    @property
    def case_id(self) -> str:
        """The case id."""
        return self.result.case_id

    def measured(self) -> tuple[Measured, ...]:
        """The scores that are exported: measured ones only, in result order."""
        return tuple(s for s in self.result.scores if isinstance(s, Measured))

    def is_llm_judged(self, score: Measured) -> bool:
        """Whether a score came from a model judge (LLM) rather than code or a rule."""
        return score.source == "judge" and self.judge_kinds.get(score.grader_id) in LLM_JUDGE_KINDS


def judged_case(event: CaseJudged, verdict: Verdict | None = None) -> JudgedCase:
    """The `JudgedCase` of a `case.judged` event (batch id required)."""
    if event.batch_id is None:
        raise ValueError("a case.judged event without a batch id cannot be exported")
    kinds = {j.id: str(type(j).__struct_config__.tag) for j in event.plan.judges}
    return JudgedCase(
        batch_id=event.batch_id,
        result=event.result,
        case=event.case,
        verdict=verdict,
        judged_at=event.ts,
        judge_kinds=kinds,
    )


class ExportContext(msgspec.Struct, frozen=True, kw_only=True):
    """Batch-level facts every exported case carries."""

    batch_id: str
    """Batch id."""
    suite_id: str | None = None
    """Suite id."""
    harness: str | None = None
    """`id@version` of the harness."""
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    """Batch labels (exported as tags/metadata)."""


class TraceSource(Protocol):
    """Pulls one run's trace from a platform."""

    async def pull(self, ref: TraceRef) -> list[TraceEvent]:
        """The run's trace events in time order; `[]` when nothing is there yet.

        Raises `TraceSourceError` (hard error) or `MissingSecretError`.
        """
        ...


class TraceSink(Protocol):
    """Exports judged cases to a platform."""

    name: str
    """Sink name used in outcomes (`mlflow`, `phoenix`...)."""

    async def export(self, ctx: ExportContext, cases: Sequence[JudgedCase]) -> list[SinkOutcome]:
        """One outcome per case, in order; never raises."""
        ...
