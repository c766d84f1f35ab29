"""Reads of the dispatchers' side of the bus, for a run's placement: the replicas' statuses in the
`dispatchers` bucket, the run's latest request on the CASES stream, and how many requests are ahead
of it in its lane's queue (the shared `dispatcher-cases` consumer, `dispatcher-cases-<lane>` for
another lane). Nothing is kept between
requests, so every gateway replica answers the same."""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from datetime import datetime

import msgspec
import nats.errors
import nats.js.errors
from nats.js import JetStreamContext
from nats.js import api as jsapi

from evalbus_contracts import (
    DEFAULT_LANE,
    CaseRequested,
    DecodeError,
    DispatcherStatus,
    decode,
    decode_event,
    lane_consumer,
    subjects,
)
from evalbus_contracts.streams import CASES, DISPATCHERS, ConsumerDef
from evalbus_gateway.live.reads import READ_TIMEOUT_S
from evalbus_gateway.live.server_clock import parse_time, stream_info_raw

log = logging.getLogger("evalbus.gateway.live")

PROBE_IDLE_S = 5.0
"""How long the server keeps a queue-counting consumer before removing it."""


async def dispatcher_statuses(js: JetStreamContext) -> list[DispatcherStatus]:
    """Every status in the `dispatchers` bucket (stale ones included: the caller decides)."""
    return (await dispatcher_board(js))[0]


async def dispatcher_board(js: JetStreamContext) -> tuple[list[DispatcherStatus], datetime | None]:
    """Every status in the `dispatchers` bucket, and the server's time now.

    The keys come from the bucket's stream info (its subjects), not a key watch, which would need
    consumer grants on the bucket; each value is read back with the time the server stored it,
    which becomes its `updated_at`, and the stream info's own time is the `now` to judge it by. So
    a status's age is the server's to measure: a dispatcher whose clock is minutes off is neither
    taken for gone nor kept alive after it died, and every gateway replica answers the same."""
    prefix = f"$KV.{DISPATCHERS.bucket}."
    stream = f"KV_{DISPATCHERS.bucket}"
    info = await stream_info_raw(js, stream, READ_TIMEOUT_S, subjects_filter=prefix + ">")
    if info is None:
        return [], None  # no bucket yet: no dispatcher ever started
    server_now = parse_time(info.get("ts"))
    out: list[DispatcherStatus] = []
    state = info.get("state")
    subjects = state.get("subjects") if isinstance(state, dict) else None
    for subject in sorted(subjects or {}):
        key = subject.removeprefix(prefix)
        try:
            msg = await js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:
            continue
        if (msg.headers or {}).get("KV-Operation") in ("DEL", "PURGE") or not msg.data:
            continue  # deleted: that replica stopped
        try:
            status = decode(msg.data, DispatcherStatus)
        except DecodeError as e:
            log.warning("unreadable dispatcher status %s left out: %s", key, e)
            continue
        if server_now is not None and msg.time is not None:
            status = msgspec.structs.replace(status, updated_at=min(msg.time, server_now))
        out.append(status)
    return out, server_now


@dataclass(frozen=True, slots=True)
class StoredRequest:
    """A run's latest `case.requested` and its CASES stream sequence."""

    seq: int
    request: CaseRequested


def _request_of(data: bytes, run_id: str) -> CaseRequested | None:
    try:
        event = decode_event(data)
    except DecodeError:
        return None
    return event if isinstance(event, CaseRequested) and event.run_id == run_id else None


async def _lane_subject(js: JetStreamContext, batch_id: str, case_id: str) -> str | None:
    """The lane subject the stream holds the case's requests on, if any (a case's lane is its
    batch's, the same for every trial and attempt)."""
    info = await stream_info_raw(
        js, CASES.name, READ_TIMEOUT_S, subjects_filter=subjects.case_requested_filter(batch_id, case_id)
    )
    state = info.get("state") if info is not None else None
    laned = sorted((state.get("subjects") if isinstance(state, dict) else None) or {})
    return laned[0] if laned else None


async def latest_request(js: JetStreamContext, batch_id: str, case_id: str, run_id: str) -> StoredRequest | None:
    """The run's latest request (its latest attempt) on the CASES stream, in whichever lane; None
    when there is none. The default lane's subject is read first: a request there costs one read."""
    subject = subjects.case_subject(subjects.CASE_REQUESTED, batch_id, case_id)
    try:
        raw = await js.get_last_msg(CASES.name, subject)
    except nats.js.errors.NotFoundError:
        laned = await _lane_subject(js, batch_id, case_id)
        if laned is None:
            return None
        subject = laned
        try:
            raw = await js.get_last_msg(CASES.name, subject)
        except nats.js.errors.NotFoundError:
            return None
    request = _request_of(raw.data or b"", run_id)
    if request is not None:
        return StoredRequest(seq=int(raw.seq or 0), request=request)
    # Another trial of the case was requested last: look through the subject's messages.
    last_seq = int(raw.seq or 0)
    found: StoredRequest | None = None
    sub = await js.subscribe(subject, stream=CASES.name, ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=READ_TIMEOUT_S)
            except nats.errors.TimeoutError:
                return found
            seq = int(msg.metadata.sequence.stream)
            request = _request_of(msg.data, run_id)
            if request is not None:
                found = StoredRequest(seq=seq, request=request)
            if seq >= last_seq:
                return found
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def _pending_from(js: JetStreamContext, seq: int, consumer: ConsumerDef) -> int:
    """Requests on the dispatchers' subjects at or after stream sequence `seq`, counted by an
    ephemeral consumer starting there (the server counts without a message read). It is never
    used again and the server removes it after a few idle seconds: deleting it would need a grant
    on every consumer of CASES, durable ones included."""
    probe = await js.add_consumer(
        consumer.stream,
        jsapi.ConsumerConfig(
            filter_subjects=list(consumer.filter_subjects),
            deliver_policy=jsapi.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=max(1, seq),
            ack_policy=jsapi.AckPolicy.NONE,
            inactive_threshold=PROBE_IDLE_S,
            mem_storage=True,
        ),
    )
    return int(probe.num_pending or 0)


async def requests_ahead(js: JetStreamContext, seq: int, lane: str = DEFAULT_LANE) -> int | None:
    """How many requests the lane's queue will deliver before the one at stream sequence `seq`
    (None when that one was delivered already).

    The queue's undelivered requests are the shared consumer's `num_pending` (every request, before
    any dispatcher created the consumer); those from `seq` on are counted from there: the difference
    is what is ahead.
    """
    consumer = lane_consumer(lane)
    try:
        info = await js.consumer_info(consumer.stream, consumer.durable)
    except nats.js.errors.NotFoundError:
        undelivered = await _pending_from(js, 1, consumer)  # no dispatcher ever served the lane
    else:
        delivered = int(info.delivered.stream_seq or 0) if info.delivered is not None else 0
        if seq <= delivered:
            return None
        undelivered = int(info.num_pending or 0)
    return max(0, undelivered - await _pending_from(js, seq, consumer))
