"""What observation-only graders read: the final answer, the trace and the expected answer.

A view, not a contract: the dispatcher builds it from what the harness produced, the collector
from a `CaseResult` completed with a pulled trace.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from evalbus_contracts import CaseResult, Message, TraceEvent


@dataclass(frozen=True, slots=True)
class Evidence:
    """The observations of one run, as graders see them."""

    answer: str | None
    """The final answer (None when the run produced none)."""
    trace: Sequence[TraceEvent]
    """The trace, in order (infra marks included; graders that must ignore them do)."""
    expected: str | None = None
    """The case's expected answer."""

    @classmethod
    def of(cls, result: CaseResult, expected: str | None) -> Evidence:
        """The evidence held by a case result."""
        return cls(answer=result.answer, trace=result.trace, expected=expected)

    def final_answer(self) -> str | None:
        """The answer, falling back to the last assistant message of the trace."""
        if self.answer is not None:
            return self.answer
        for event in reversed(self.trace):
            if isinstance(event, Message) and event.role == "assistant":
                return event.text
        return None
