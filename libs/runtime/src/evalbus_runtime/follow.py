"""The newest message of every subject under a filter, as a projection kept in memory: the
dispatcher's cancellations, the collector's online suites, the gateway's suite list.

`follow` reads the last message of each subject (an ordered consumer with `LAST_PER_SUBJECT`),
returns once everything stored at start has been read, and keeps calling `on_message` for every
newer one. `read_last` does the same once and stops.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext
from nats.js.api import DeliverPolicy

log = logging.getLogger("evalbus.follow")

OnMessage = Callable[[Msg], Awaitable[None] | None]


async def follow(
    js: JetStreamContext, stream: str, subject_filter: str, on_message: OnMessage, *, catch_up_s: float = 5.0
) -> Subscription:
    """Call `on_message` for the last message of every subject under `subject_filter`, then for
    every new one; return (with the subscription) once the messages stored at start are read, or
    after `catch_up_s` with a warning."""
    info = await js.stream_info(stream, subjects_filter=subject_filter)
    known = len(info.state.subjects or {})
    read = 0
    caught_up = asyncio.Event()

    async def on_msg(msg: Msg) -> None:
        nonlocal read
        try:
            result = on_message(msg)
            if result is not None:
                await result
        except Exception:
            log.exception("handling %s failed; ignored", msg.subject)
        read += 1
        if read >= known:
            caught_up.set()

    sub = await js.subscribe(
        subject_filter, cb=on_msg, ordered_consumer=True, deliver_policy=DeliverPolicy.LAST_PER_SUBJECT
    )
    if known:
        try:
            await asyncio.wait_for(caught_up.wait(), catch_up_s)
        except TimeoutError:
            log.warning("read %d of %d subjects under %s at start", read, known, subject_filter)
    return sub


async def read_last(js: JetStreamContext, stream: str, subject_filter: str, *, timeout_s: float = 5.0) -> list[Msg]:
    """The last message of every subject under `subject_filter`, in stream order."""
    found: list[Msg] = []
    sub = await follow(js, stream, subject_filter, found.append, catch_up_s=timeout_s)
    await sub.unsubscribe()
    return found
