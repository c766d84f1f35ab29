"""Bench-side changes to, and observations of, durable consumers.

`set_consumer`, `pause`, `resume` are applied AFTER the services started — every service
re-applies the contract's consumer definitions when it starts (`Service.start` →
`ensure_topology(STREAMS, CONSUMERS)`). `AckPendingProbe` keeps the peak `num_ack_pending` of a
consumer while a run goes on; `drained` says whether a consumer has nothing left to do.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import msgspec
from nats.js import JetStreamContext

from evalbus_contracts.streams import ConsumerDef
from evalbus_runtime.bus import consumer_config


async def set_consumer(js: JetStreamContext, consumer: ConsumerDef, **changes: Any) -> ConsumerDef:
    """Update a durable consumer in place to `consumer` with `changes` (e.g. `max_ack_pending=8`)."""
    changed = msgspec.structs.replace(consumer, **changes)
    await js.add_consumer(changed.stream, consumer_config(changed))
    return changed


async def consumer_limit(js: JetStreamContext, consumer: ConsumerDef) -> int:
    """The `max_ack_pending` the server holds for `consumer` now."""
    info = await js.consumer_info(consumer.stream, consumer.durable)
    return int(info.config.max_ack_pending or 0)


async def pause(js: JetStreamContext, consumer: ConsumerDef, seconds: float = 3600.0) -> None:
    """Pause deliveries of `consumer` (nats-server ≥ 2.11) for at most `seconds`."""
    until = time.time() + seconds
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(until))
    await js.pause_consumer(consumer.stream, consumer.durable, stamp)


async def resume(js: JetStreamContext, consumer: ConsumerDef) -> None:
    """Resume deliveries of a paused consumer (`consumer` is its current definition).

    nats-server 2.15 does not serve the pull requests that waited through the pause when it is
    resumed: they sit until they expire (the chassis asks for 10 s), so resuming alone delays the
    first delivery by up to that long. A configuration change does serve them, so the consumer's
    `max_ack_pending` is raised by one and put back; the replicas' own slot counts keep the limit.
    """
    await js.resume_consumer(consumer.stream, consumer.durable)
    await set_consumer(js, consumer, max_ack_pending=consumer.max_ack_pending + 1)
    await set_consumer(js, consumer)


class AckPendingProbe:
    """Polls a consumer's `num_ack_pending` while a run goes on; keeps the peak."""

    def __init__(self, js: JetStreamContext, consumer: ConsumerDef, period_s: float = 0.05) -> None:
        self._js = js
        self._consumer = consumer
        self._period = period_s
        self.peak = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AckPendingProbe:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                info = await self._js.consumer_info(self._consumer.stream, self._consumer.durable)
                self.peak = max(self.peak, int(info.num_ack_pending or 0))
            await asyncio.sleep(self._period)


async def drained(js: JetStreamContext, consumer: ConsumerDef) -> bool:
    """Whether `consumer` has nothing pending and nothing unacknowledged."""
    info = await js.consumer_info(consumer.stream, consumer.durable)
    return not info.num_pending and not info.num_ack_pending
