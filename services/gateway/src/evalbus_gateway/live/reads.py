"""Reads of the LIVE stream (and of the CASES stream's word on whether a run settled).

Nothing here keeps state between requests: every answer is read from JetStream, so every gateway
replica gives the same one. A run's log tail is found without reading its whole ring: each chunk
carries its byte offset in the run's log, and a binary search over stream sequences
(`next_by_subj` lookups) finds the first chunk of the last 64 KiB in a few dozen lookups.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as jsapi

from evalbus_api.live import LOG_TAIL_BYTES
from evalbus_contracts import (
    CaseExecuted,
    DecodeError,
    InfraMark,
    LiveLog,
    LivePlacement,
    LiveTrace,
    decode_event,
    subjects,
)
from evalbus_contracts.streams import CASES, LIVE
from evalbus_gateway.live.fanout import FeedSpec
from evalbus_gateway.live.views import Stored, chunk_end, tail_target

log = logging.getLogger("evalbus.gateway.live")

Channel = Literal["log", "trace", "infra", "placement"]
ExecutedStatus = Literal["succeeded", "failed", "cancelled"]

IDLE_HEARTBEAT_S = 5.0
"""JetStream's idle heartbeat on ordered consumers (how a lost consumer is noticed)."""
READ_TIMEOUT_S = 5.0
"""Longest wait for the next message of a bounded read (a message that aged out meanwhile)."""


def live_subjects(run_id: str, *channels: Channel) -> list[str]:
    """The run's LIVE subjects of `channels`."""
    return [subjects.live_subject(run_id, c) for c in channels]


def _stored(seq: int, data: bytes, subject: str) -> Stored | None:
    try:
        event = decode_event(data)
    except DecodeError as e:
        log.warning("unreadable LIVE message %d on %s left out: %s", seq, subject, e)
        return None
    if not isinstance(event, LiveLog | LiveTrace | InfraMark | LivePlacement):
        return None
    return Stored(seq=seq, event=event)


def stored_message(msg: Msg) -> Stored | None:
    """A message delivered by a consumer of the LIVE stream, decoded (None when it is not a LIVE event)."""
    return _stored(int(msg.metadata.sequence.stream), msg.data, msg.subject)


def live_feed(subject_list: Sequence[str]) -> FeedSpec[Stored]:
    """The shared feed of a run's LIVE subjects (each message decoded once for its streams)."""
    return FeedSpec("live", LIVE.name, tuple(subject_list), stored_message)


async def last_on(js: JetStreamContext, subject: str, stream: str = LIVE.name) -> Stored | None:
    """The last message of `subject` (None when there is none)."""
    try:
        raw = await js.get_last_msg(stream, subject)
    except nats.js.errors.NotFoundError:
        return None
    return _stored(int(raw.seq or 0), raw.data or b"", subject)


async def first_from(js: JetStreamContext, subject: str, seq: int) -> Stored | None:
    """The first message of `subject` at or after stream sequence `seq` (None when there is none)."""
    try:
        raw = await js.get_msg(LIVE.name, seq=seq, subject=subject, next=True)
    except nats.js.errors.NotFoundError:
        return None
    return _stored(int(raw.seq or 0), raw.data or b"", subject)


async def last_of(js: JetStreamContext, subject_list: Sequence[str]) -> Stored | None:
    """The latest message over several subjects."""
    found = [s for s in await asyncio.gather(*(last_on(js, subject) for subject in subject_list)) if s is not None]
    return max(found, key=lambda s: s.seq) if found else None


@dataclass(frozen=True, slots=True)
class TailStart:
    """Where a log tail begins: the stream sequence of its first chunk (None: from the oldest
    chunk kept) and the bytes of that chunk before the tail."""

    seq: int | None
    skip: int = 0


async def locate_tail(js: JetStreamContext, last: Stored, *, limit: int = LOG_TAIL_BYTES) -> TailStart:
    """The start of the last `limit` bytes of the run's log whose last chunk is `last`.

    Binary search for the first chunk ending past the tail's start offset: a chunk found at or
    after sequence `mid` that ends past it moves the upper bound to `mid`, one that ends before
    it moves the lower bound past itself. Offsets grow along the subject, so this is exact; if a
    dispatcher could not continue them (older messages), the answer is a later chunk and the
    tail only shorter.
    """
    assert isinstance(last.event, LiveLog)
    target = tail_target(last.event, limit)
    if target <= 0:
        return TailStart(seq=None)
    subject = subjects.live_subject(last.event.run_id or "", "log")
    lo, hi, found = 1, last.seq, last
    while lo < hi:
        mid = (lo + hi) // 2
        probe = await first_from(js, subject, mid)
        if probe is None or not isinstance(probe.event, LiveLog):
            lo = mid + 1
        elif chunk_end(probe.event) > target:
            hi, found = mid, probe
        else:
            lo = probe.seq + 1
    assert isinstance(found.event, LiveLog)
    return TailStart(seq=found.seq, skip=max(0, target - found.event.offset))


async def subscribe_live(
    js: JetStreamContext,
    subject_list: Sequence[str],
    *,
    start_seq: int | None,
) -> Any:
    """An ordered consumer on `subject_list` from `start_seq` (None: from the oldest message kept),
    read with `next_msg`."""
    config = jsapi.ConsumerConfig(filter_subjects=list(subject_list))
    if start_seq is not None:
        config.deliver_policy = jsapi.DeliverPolicy.BY_START_SEQUENCE
        config.opt_start_seq = max(1, start_seq)
    return await js.subscribe(
        subject_list[0],
        stream=LIVE.name,
        ordered_consumer=True,
        config=config,
        idle_heartbeat=IDLE_HEARTBEAT_S,
    )


async def read_live(
    js: JetStreamContext, subject_list: Sequence[str], *, start_seq: int | None, until_seq: int
) -> list[Stored]:
    """Every message of `subject_list` from `start_seq` up to `until_seq`, in stream order."""
    out: list[Stored] = []
    sub = await subscribe_live(js, subject_list, start_seq=start_seq)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=READ_TIMEOUT_S)
            except nats.errors.TimeoutError:
                log.warning("read of %s stopped before sequence %d", subject_list, until_seq)
                return out
            seq = int(msg.metadata.sequence.stream)
            stored = stored_message(msg)
            if stored is not None:
                out.append(stored)
            if seq >= until_seq:
                return out
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


def _executed(data: bytes, run_id: str) -> ExecutedStatus | None:
    try:
        event = decode_event(data)
    except DecodeError:
        return None
    if isinstance(event, CaseExecuted) and event.run_id == run_id:
        return event.status
    return None


def executed_subject(batch_id: str, case_id: str) -> str:
    """The CASES subject a run's `case.executed` is published on (shared by the case's trials)."""
    return subjects.case_subject(subjects.CASE_EXECUTED, batch_id, case_id)


async def executed_on_stream(js: JetStreamContext, batch_id: str, case_id: str, run_id: str) -> ExecutedStatus | None:
    """The run's execution outcome as the CASES stream holds it (None while it has none)."""
    subject = executed_subject(batch_id, case_id)
    try:
        raw = await js.get_last_msg(CASES.name, subject)
    except nats.js.errors.NotFoundError:
        return None
    status = _executed(raw.data or b"", run_id)
    if status is not None:
        return status
    # Another trial of the case was executed last: look through the subject's messages.
    sub = await js.subscribe(subject, stream=CASES.name, ordered_consumer=True)
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=READ_TIMEOUT_S)
            except nats.errors.TimeoutError:
                return None
            status = _executed(msg.data, run_id)
            if status is not None:
                return status
            if int(msg.metadata.sequence.stream) >= int(raw.seq or 0):
                return None
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


@dataclass(frozen=True, slots=True)
class Executed:
    """A `case.executed` of one of a case's runs (its trials share the subject)."""

    seq: int
    """CASES stream sequence."""
    run_id: str
    """The run it settles."""
    status: ExecutedStatus
    """Its execution outcome."""


def executed_message(msg: Msg) -> Executed | None:
    """A `case.executed` delivered by a consumer of the CASES stream, decoded."""
    try:
        event = decode_event(msg.data)
    except DecodeError:
        return None
    if not isinstance(event, CaseExecuted) or event.run_id is None:
        return None
    return Executed(seq=int(msg.metadata.sequence.stream), run_id=event.run_id, status=event.status)


def executed_feed(batch_id: str, case_id: str) -> FeedSpec[Executed]:
    """The shared feed of a case's `case.executed` events (for the streams of its runs)."""
    return FeedSpec("executed", CASES.name, (executed_subject(batch_id, case_id),), executed_message)
