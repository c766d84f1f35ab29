"""Retry decisions (pure): only a retryable infrastructure failure runs a case again."""

from __future__ import annotations

import msgspec

from evalbus_contracts import CaseExecuted, CaseRequested, new_event_id, utcnow


def should_retry(executed: CaseExecuted, attempt: int, retries: int) -> bool:
    """Whether to run the case again: a retryable infra failure, and `attempt` ≤ `retries`.

    With `retries = 1` attempt 1 may be retried and attempt 2 may not. A `collect` failure is
    not retried by executing again: its ground-truth scores stand and the trace can be re-pulled.
    """
    failure = executed.result.failure
    return (
        failure is not None
        and failure.failure_class == "infra"
        and failure.retryable
        and failure.stage != "collect"
        and attempt <= retries
    )


def next_attempt(req: CaseRequested) -> CaseRequested:
    """The same run requested again, one attempt later (a new event)."""
    return msgspec.structs.replace(req, attempt=req.attempt + 1, event_id=new_event_id(), ts=utcnow())
