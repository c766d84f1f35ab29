"""Cancelled batches: which ones (`Cancellations`, from `batch.cancelled.*`) and the short-circuit
(`cancelled_execution`, pure) — a case of a cancelled or superseded batch is not run, but still
gets its `case.executed`, so every case passes every stage."""

from __future__ import annotations

import asyncio
import logging
from typing import Literal

import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

from evalbus_contracts import (
    BatchCancelled,
    CaseExecuted,
    CaseFailure,
    CaseRequested,
    CaseResult,
    CaseTimings,
    DecodeError,
    decode_event,
    subjects,
    utcnow,
)
from evalbus_contracts.streams import CASES
from evalbus_dispatcher.execute import run_id_of

log = logging.getLogger("evalbus.dispatcher")

CancelReason = Literal["cancelled", "superseded"]
"""Why a batch starts no more cases."""


def cancelled_execution(req: CaseRequested, reason: CancelReason, *, detail: str | None = None) -> CaseExecuted:
    """`case.executed` with status `cancelled` for a case that will not run."""
    run_id = run_id_of(req)
    message = detail or f"the batch was {reason} before this case started"
    result = CaseResult(
        case_id=req.case.id,
        run_id=run_id,
        harness=f"{req.harness.id}@{req.harness.version}",
        trial=req.trial,
        failure=CaseFailure(stage="dispatch", failure_class="cancelled", code=reason, message=message),
        timings=CaseTimings(executed_at=utcnow()),
    )
    return CaseExecuted(
        batch_id=req.batch_id,
        case_id=req.case_id or req.case.id,
        run_id=run_id,
        attempt=req.attempt,
        status="cancelled",
        result=result,
        plan=req.plan,
        case=req.case,
    )


class Cancellations:
    """Which batches are cancelled or superseded, from `batch.cancelled.*` (last per batch): followed
    by an ordered consumer, or (`lookup`) read per batch when one of its cases arrives — a lane
    dispatcher's user may not create an unfiltered consumer on CASES, which could re-filter another
    lane's durable consumer."""

    def __init__(self, mode: Literal["follow", "lookup"] = "follow") -> None:
        self._mode = mode
        self._reasons: dict[str, CancelReason] = {}
        self._read = 0

    async def reason(self, js: JetStreamContext, batch_id: str | None) -> CancelReason | None:
        """Why the batch stopped starting cases, or None while it has not."""
        if batch_id is None:
            return None
        known = self._reasons.get(batch_id)
        if known is not None or self._mode == "follow":
            return known
        try:
            raw = await js.get_last_msg(CASES.name, subjects.batch_subject(subjects.BATCH_CANCELLED, batch_id))
        except nats.js.errors.NotFoundError:
            return None
        try:
            event = decode_event(raw.data or b"")
        except DecodeError:
            log.warning("unreadable cancellation of %s ignored", batch_id)
            return None
        if isinstance(event, BatchCancelled):
            self._reasons[batch_id] = event.reason  # a cancellation is final
            return event.reason
        return None

    async def start(self, js: JetStreamContext) -> None:
        """Follow cancellations; return once every cancellation already stored has been read (in
        `lookup` mode: nothing to do)."""
        if self._mode == "lookup":
            return
        info = await js.stream_info("CASES", subjects_filter="batch.cancelled.>")
        known = len(info.state.subjects or {})

        caught_up = asyncio.Event()

        async def on_msg(msg: Msg) -> None:
            try:
                event = decode_event(msg.data)
            except DecodeError:
                log.warning("unreadable cancellation on %s ignored", msg.subject)
            else:
                if isinstance(event, BatchCancelled) and event.batch_id:
                    self._reasons[event.batch_id] = event.reason
            self._read += 1  # one per subject, readable or not
            if self._read >= known:
                caught_up.set()

        await js.subscribe(
            "batch.cancelled.>", cb=on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT
        )
        if known == 0:
            return
        try:
            await asyncio.wait_for(caught_up.wait(), 5.0)
        except TimeoutError:
            log.warning("read %d of %d cancellations at start", self._read, known)
