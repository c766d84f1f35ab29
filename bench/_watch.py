"""`BatchWatch`: arrival times of one batch's events on core NATS subscriptions."""

from __future__ import annotations

import asyncio
import contextlib
import time
from dataclasses import dataclass, field

from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from evalbus_contracts import decode_event, encode_token
from evalbus_contracts.events import EventBase


@dataclass
class BatchWatch:
    """Arrival times (monotonic) of one batch's events, per stage and case token, from core NATS
    subscriptions opened before anything is published; `decode` stages are also decoded."""

    nc: NatsClient
    batch_id: str
    decode: frozenset[str] = frozenset()
    times: dict[str, dict[str, float]] = field(default_factory=dict)
    events: dict[str, list[EventBase]] = field(default_factory=dict)
    _subs: list[Subscription] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> BatchWatch:
        token = encode_token(self.batch_id)
        for subject in (f"case.*.{token}.*", f"batch.*.{token}"):
            self._subs.append(
                await self.nc.subscribe(subject, cb=self._on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
            )
        await self.nc.flush()  # the server has the subscriptions before anything of the batch is sent
        return self

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()

    async def _on_msg(self, msg: Msg) -> None:
        now = time.monotonic()
        parts = msg.subject.split(".")
        stage = f"{parts[0]}.{parts[1]}"
        key = parts[3] if len(parts) > 3 else parts[2]
        self.times.setdefault(stage, {}).setdefault(key, now)
        if stage in self.decode:
            self.events.setdefault(stage, []).append(decode_event(msg.data))
        self._changed.set()

    def count(self, stage: str) -> int:
        """Distinct cases (or batch events) seen at `stage`."""
        return len(self.times.get(stage, {}))

    def last(self, stage: str) -> float:
        """Arrival of the last event of `stage`."""
        return max(self.times[stage].values())

    def first(self, stage: str) -> float:
        """Arrival of the first event of `stage`."""
        return min(self.times[stage].values())

    async def wait_for(self, stage: str, n: int, timeout_s: float) -> None:
        """Until `n` distinct events of `stage` arrived; `TimeoutError` naming the counts otherwise."""
        deadline = time.monotonic() + timeout_s
        while self.count(stage) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                counts = {k: len(v) for k, v in self.times.items()}
                raise TimeoutError(f"{stage}: {self.count(stage)} of {n} after {timeout_s:.0f}s; seen {counts}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))
