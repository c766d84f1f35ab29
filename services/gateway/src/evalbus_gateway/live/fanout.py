"""One JetStream subscription per subject set per gateway process, fanned out in memory to every
event stream that follows it.

An event stream (a batch's events, a run's live log or trace) is a *watcher*: a bounded buffer of
items the process's *feed* of those subjects offers it as they arrive. The feed is one ordered
consumer of the subjects from the first watcher's resume point, opened by that watcher and torn
down when the last one leaves; each message is decoded (and, for a batch, framed) once, whatever the
number of watchers, and the feed keeps the latest ones (`RING_ITEMS`, `RING_BYTES`). Nothing else
is held: the feed is a per-process cache of the stream, so every replica answers the same.

Joining is sequence-based, with no gap and no duplicate (`catch_up`). In one step, with no await
in between, the watcher is registered and gets the feed's kept items after its resume point and
the sequence the feed is complete from (`covered`): every later message is offered to it, and
every item at or after `covered` is kept or still to come. Only a resume point before `covered`
(the feed dropped older items, or a client resuming far back) needs a replay of the stream, on a
consumer of its own, from the resume point up to `covered`. So a client joining an open feed
costs no JetStream request at all, and the watcher skips anything at or below what it has sent.

A watcher that falls `limit` items behind while its client does not read (see `Watcher`) is cut:
its buffer is dropped at once, its stream ends with a `: lagging` comment (or, if even that cannot
be written, its connection is aborted), and it resumes with `Last-Event-ID` like any reconnect. It
never holds the feed or the other watchers back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import nats.errors
import nats.js.errors
from aiohttp import web
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from nats.js import api as jsapi

log = logging.getLogger("evalbus.gateway.fanout")

IDLE_HEARTBEAT_S = 5.0
"""JetStream's idle heartbeat on the ordered consumers (how a lost consumer is noticed)."""
READ_TIMEOUT_S = 5.0
"""Longest wait for the next message of a replay (one that aged out meanwhile)."""
LAGGING = b": lagging: this stream fell too far behind and is closed; reconnect with Last-Event-ID\n\n"
"""What a cut stream sends before it closes (a comment: no client-visible event)."""
ABORT_AFTER_S = 1.0
"""How long a cut stream has to write `LAGGING` before its connection is aborted."""
RING_ITEMS = 2048
"""Most items a feed keeps for the watchers that join it…"""
RING_BYTES = 4 * 1024 * 1024
"""…and most bytes (of the messages they came from); the newest item is always kept."""


class Sequenced(Protocol):
    """An item of a feed: it knows its stream sequence."""

    @property
    def seq(self) -> int:
        """Stream sequence of the message it came from."""
        ...


T = TypeVar("T", bound=Sequenced)
T_co = TypeVar("T_co", bound=Sequenced, covariant=True)


class Lagged(Exception):
    """The watcher fell `limit` items behind its feed and was cut."""


class Watcher(Generic[T]):
    """One event stream's bounded buffer of feed items, filled by feeds, emptied by its writer.

    It is cut when `limit` items wait while its client is not taking what was already written
    (a write is pending: the connection is backed up), or when `4 × limit` wait in any case (a
    burst the process has not had the time to write yet is not the client's fault)."""

    def __init__(self, limit: int, *, on_lag: Callable[[], None] | None = None) -> None:
        self._limit = max(1, limit)
        self._items: deque[T] = deque()
        self._waiter: asyncio.Future[None] | None = None
        self._on_lag = on_lag
        self._writing = False
        self.lagged = False
        """Cut for falling behind: nothing is buffered for it any more."""

    def offer(self, item: T) -> None:
        """Buffer `item` (never blocks: a full buffer cuts the watcher instead)."""
        if self.lagged:
            return
        waiting = len(self._items)
        if waiting >= 4 * self._limit or (waiting >= self._limit and self._writing):
            self.lagged = True
            self._items.clear()
            if self._on_lag is not None:
                self._on_lag()
        else:
            self._items.append(item)
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def take(self, timeout_s: float) -> list[T]:
        """Everything buffered, waiting up to `timeout_s` for something (empty: nothing came);
        `Lagged` once cut."""
        if not self._items and not self.lagged:
            loop = asyncio.get_running_loop()
            waiter: asyncio.Future[None] = loop.create_future()
            self._waiter = waiter
            timer = loop.call_later(timeout_s, _wake, waiter)
            try:
                await waiter
            finally:
                timer.cancel()
                self._waiter = None
        if self.lagged:
            raise Lagged
        items = list(self._items)
        self._items.clear()
        return items

    async def write(self, response: web.StreamResponse, data: bytes) -> None:
        """Write `data` to the watcher's client (a write that waits means the client is behind)."""
        self._writing = True
        try:
            await response.write(data)
        finally:
            self._writing = False


def _wake(waiter: asyncio.Future[None]) -> None:
    if not waiter.done():
        waiter.set_result(None)


@dataclass(frozen=True, slots=True)
class FeedSpec(Generic[T_co]):
    """What a feed follows: `subjects` of `stream`, each message decoded once by `decode` (None:
    not an item). Feeds are shared by `kind`, `stream` and `subjects`."""

    kind: str
    stream: str
    subjects: tuple[str, ...]
    decode: Callable[[Msg], T_co | None] = field(compare=False)

    @property
    def key(self) -> tuple[str, str, tuple[str, ...]]:
        """What identifies the shared feed."""
        return (self.kind, self.stream, self.subjects)


class _Feed(Generic[T]):
    """One ordered consumer of a subject set, keeping its latest items and offering each new one
    to every watcher."""

    def __init__(self, spec: FeedSpec[T], *, ring_items: int, ring_bytes: int) -> None:
        self.spec = spec
        self._ring_items = ring_items
        self._ring_limit = ring_bytes
        self.watchers: dict[Watcher[T], int] = {}
        """Each watcher, and the sequence it joined after (older items are not offered to it)."""
        self.sub: Any = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._last = 0
        self._ring: deque[tuple[T, int]] = deque()
        self._ring_bytes = 0
        self.covered = 1
        """Every item from this sequence on is kept or still to come."""

    async def open(self, js: JetStreamContext, start: int) -> None:
        # From the first watcher's resume point: older messages are nobody's business yet (a
        # reset of the ordered consumer that delivers them again is ignored by `_last`).
        self._last = start - 1
        self.covered = start
        config = jsapi.ConsumerConfig(
            filter_subjects=list(self.spec.subjects),
            deliver_policy=jsapi.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=start,
        )
        self.sub = await js.subscribe(
            self.spec.subjects[0],
            stream=self.spec.stream,
            cb=self._on_msg,
            ordered_consumer=True,
            config=config,
            idle_heartbeat=IDLE_HEARTBEAT_S,
        )

    async def _on_msg(self, msg: Msg) -> None:
        seq = int(msg.metadata.sequence.stream)
        if seq <= self._last:
            return  # a reset of the ordered consumer delivered it again
        self._last = seq
        item = self.spec.decode(msg)
        if item is None:
            return
        self._keep(item, len(msg.data))
        for watcher, after in list(self.watchers.items()):
            if item.seq > after:
                watcher.offer(item)

    def _keep(self, item: T, size: int) -> None:
        self._ring.append((item, size))
        self._ring_bytes += size
        while len(self._ring) > 1 and (len(self._ring) > self._ring_items or self._ring_bytes > self._ring_limit):
            dropped, dropped_size = self._ring.popleft()
            self._ring_bytes -= dropped_size
            self.covered = dropped.seq + 1

    def attach(self, watcher: Watcher[T], after: int) -> list[T]:
        """Register `watcher`; the kept items after `after` (everything later is offered to it)."""
        self.watchers[watcher] = after
        return [item for item, _ in self._ring if item.seq > after]

    async def close(self) -> None:
        if self.sub is not None:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()


@dataclass(frozen=True, slots=True)
class _Joined(Generic[T]):
    kept: list[T]
    """The feed's kept items after the resume point."""
    covered: int
    """The feed holds (or will offer) every item from this sequence on."""


class Fanout:
    """The process's feeds, by subject set (one per `GatewayState`)."""

    def __init__(
        self,
        *,
        on_lagged: Callable[[], None] | None = None,
        ring_items: int = RING_ITEMS,
        ring_bytes: int = RING_BYTES,
    ) -> None:
        self._feeds: dict[tuple[str, str, tuple[str, ...]], _Feed[Any]] = {}
        self.ring_items = ring_items
        """Most items a feed opened from now on keeps."""
        self.ring_bytes = ring_bytes
        """Most bytes a feed opened from now on keeps."""
        self._on_lagged = on_lagged
        self.lagged = 0
        """Watchers cut for falling behind, since the process started."""

    @property
    def subscriptions(self) -> int:
        """Feeds open (JetStream subscriptions shared by event streams)."""
        return len(self._feeds)

    @property
    def watchers(self) -> int:
        """Watchers joined to a feed."""
        return sum(len(f.watchers) for f in self._feeds.values())

    async def join(self, js: JetStreamContext, spec: FeedSpec[T], watcher: Watcher[T], *, after: int = 0) -> _Joined[T]:
        """Register `watcher` on the feed of `spec` (opened when it is the first): the items the feed
        kept after `after`, and the sequence from which it is complete (every later message is
        offered to the watcher)."""
        while True:
            feed = self._feeds.get(spec.key)
            if feed is None:
                feed = _Feed(spec, ring_items=self.ring_items, ring_bytes=self.ring_bytes)
                self._feeds[spec.key] = feed
                try:
                    await feed.open(js, after + 1)
                except BaseException:
                    if self._feeds.get(spec.key) is feed:
                        del self._feeds[spec.key]
                    feed.ready.cancel()  # who waits on it opens the feed again
                    raise
                feed.ready.set_result(None)
            elif not feed.ready.done():
                await asyncio.wait({feed.ready})  # another watcher is opening it
            if feed.ready.cancelled() or self._feeds.get(spec.key) is not feed:
                continue  # its opening failed, or its last watcher left meanwhile
            return _Joined(kept=feed.attach(watcher, after), covered=feed.covered)

    async def leave(self, spec: FeedSpec[T], watcher: Watcher[T]) -> None:
        """Forget `watcher`; the feed closes with its last watcher."""
        feed = self._feeds.get(spec.key)
        if feed is None or watcher not in feed.watchers:
            return
        del feed.watchers[watcher]
        if watcher.lagged:
            self.lagged += 1
            if self._on_lagged is not None:
                self._on_lagged()
        if not feed.watchers and feed.ready.done():
            del self._feeds[spec.key]
            await feed.close()


# ---------------------------------------------------------------- replay and join


async def replay(
    js: JetStreamContext, spec: FeedSpec[T], *, after: int, before: int, headers_only: bool = False
) -> AsyncIterator[T]:
    """The items of `spec` stored after sequence `after` and before `before`, in order, read on an
    ordered consumer of the caller's own (`headers_only`: the messages come without their payload).
    A read that stalls `READ_TIMEOUT_S` ends early (logged): what was yielded is a prefix."""
    if before <= after + 1:
        return
    config = jsapi.ConsumerConfig(
        filter_subjects=list(spec.subjects),
        deliver_policy=jsapi.DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=after + 1,
        headers_only=headers_only or None,
    )
    sub = await js.subscribe(
        spec.subjects[0], stream=spec.stream, ordered_consumer=True, config=config, idle_heartbeat=IDLE_HEARTBEAT_S
    )
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=READ_TIMEOUT_S)
            except nats.errors.TimeoutError:
                log.warning("replay of %s stopped before sequence %d", spec.subjects, before)
                return
            meta = msg.metadata
            if int(meta.sequence.stream) >= before:
                return
            item = spec.decode(msg)
            if item is not None:
                yield item
            if meta.num_pending == 0:
                return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def catch_up(
    js: JetStreamContext, fanout: Fanout, spec: FeedSpec[T], watcher: Watcher[T], *, after: int
) -> AsyncIterator[T]:
    """Every item of `spec` after sequence `after` up to what the feed offers `watcher` from now
    on, in order and once (see the module's docstring): `watcher` is joined on the way."""
    joined = await fanout.join(js, spec, watcher, after=after)
    async for item in replay(js, spec, after=after, before=joined.covered):
        yield item
    for item in joined.kept:
        yield item


class AbortOnLag:
    """A watcher's `on_lag`: abort the connection after `delay_s` unless its stream ended meanwhile
    (a client that reads nothing keeps the writer stuck in a write, so the stream cannot end)."""

    def __init__(self, transport: asyncio.BaseTransport | None, delay_s: float = ABORT_AFTER_S) -> None:
        self._transport = transport
        self._delay_s = delay_s
        self._timer: asyncio.TimerHandle | None = None

    def __call__(self) -> None:
        if self._transport is not None and self._timer is None:
            self._timer = asyncio.get_running_loop().call_later(self._delay_s, self._abort)

    def _abort(self) -> None:
        transport = self._transport
        if isinstance(transport, asyncio.WriteTransport) and not transport.is_closing():
            transport.abort()

    def cancel(self) -> None:
        """The stream ended: leave its connection alone."""
        if self._timer is not None:
            self._timer.cancel()
