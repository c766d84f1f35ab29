"""One JetStream subscription per subject set per gateway process, fanned out in memory to every
event stream that follows it.

An event stream (a batch's events, a run's live log or trace) is a *watcher*: a bounded buffer of
items the process's *feed* of those subjects offers it as they arrive. The feed is one ordered
consumer, opened by the first watcher and torn down when the last one leaves, and each message is
decoded (and, for a batch, framed) once, whatever the number of watchers. Nothing else is held:
the feed is a per-process cache of the stream, so every replica answers the same.

Joining is sequence-based, with no gap and no duplicate (`catch_up`):

1. the watcher replays the stream from its resume point up to the subjects' last message, on an
   ordered consumer of its own (cheap: it ends when it has caught up);
2. it joins the feed, *then* looks up the subjects' last message again and replays up to it. Any
   message stored after that lookup was stored after the join, so the feed offers it; any stored
   before it has a sequence at most the one looked up, so the replay reads it;
3. from then on the watcher reads the feed, skipping what it already has by stream sequence.

A watcher that falls `limit` items behind while its client does not read (see `Watcher`) is cut:
its buffer is dropped at once, its stream ends with a `: lagging` comment (or, if even that cannot be written,
its connection is aborted), and it resumes with `Last-Event-ID` like any reconnect. It never holds
the feed or the other watchers back.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable, Sequence
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
    """One ordered consumer of a subject set, offering each new message to every watcher."""

    def __init__(self, spec: FeedSpec[T]) -> None:
        self.spec = spec
        self.watchers: set[Watcher[T]] = set()
        self.sub: Any = None
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._last = 0

    async def open(self, js: JetStreamContext) -> None:
        # From just after the stream's last message: a reset of the ordered consumer before its
        # first delivery resumes from there, not from the subjects' beginning.
        info = await js.stream_info(self.spec.stream)
        self._last = int(info.state.last_seq)
        config = jsapi.ConsumerConfig(
            filter_subjects=list(self.spec.subjects),
            deliver_policy=jsapi.DeliverPolicy.BY_START_SEQUENCE,
            opt_start_seq=self._last + 1,
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
        for watcher in list(self.watchers):
            watcher.offer(item)

    async def close(self) -> None:
        if self.sub is not None:
            with contextlib.suppress(Exception):
                await self.sub.unsubscribe()


class Fanout:
    """The process's feeds, by subject set (one per `GatewayState`)."""

    def __init__(self, *, on_lagged: Callable[[], None] | None = None) -> None:
        self._feeds: dict[tuple[str, str, tuple[str, ...]], _Feed[Any]] = {}
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

    async def join(self, js: JetStreamContext, spec: FeedSpec[T], watcher: Watcher[T]) -> None:
        """Have `watcher` offered every message of `spec` stored from now on (the feed opened when
        it is the first)."""
        while True:
            feed = self._feeds.get(spec.key)
            if feed is None:
                feed = _Feed(spec)
                self._feeds[spec.key] = feed
                try:
                    await feed.open(js)
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
            feed.watchers.add(watcher)
            return

    async def leave(self, spec: FeedSpec[T], watcher: Watcher[T]) -> None:
        """Forget `watcher`; the feed closes with its last watcher."""
        feed = self._feeds.get(spec.key)
        if feed is None or watcher not in feed.watchers:
            return
        feed.watchers.discard(watcher)
        if watcher.lagged:
            self.lagged += 1
            if self._on_lagged is not None:
                self._on_lagged()
        if not feed.watchers and feed.ready.done():
            del self._feeds[spec.key]
            await feed.close()


# ---------------------------------------------------------------- replay and join


async def last_seq(js: JetStreamContext, stream: str, subject_list: Sequence[str]) -> int:
    """The stream sequence of the last message on any of `subject_list` (wildcards allowed; 0: none)."""

    async def one(subject: str) -> int:
        try:
            raw = await js.get_last_msg(stream, subject)
        except nats.js.errors.NotFoundError:
            return 0
        return int(raw.seq or 0)

    return max(await asyncio.gather(*(one(s) for s in subject_list)), default=0)


async def replay(js: JetStreamContext, spec: FeedSpec[T], *, after: int, until: int) -> AsyncIterator[T]:
    """The items of `spec` stored after sequence `after`, up to (at least) `until`, in order."""
    if until <= after:
        return
    config = jsapi.ConsumerConfig(
        filter_subjects=list(spec.subjects),
        deliver_policy=jsapi.DeliverPolicy.BY_START_SEQUENCE,
        opt_start_seq=after + 1,
    )
    sub = await js.subscribe(
        spec.subjects[0], stream=spec.stream, ordered_consumer=True, config=config, idle_heartbeat=IDLE_HEARTBEAT_S
    )
    try:
        while True:
            try:
                msg = await sub.next_msg(timeout=READ_TIMEOUT_S)
            except nats.errors.TimeoutError:
                log.warning("replay of %s stopped before sequence %d", spec.subjects, until)
                return
            item = spec.decode(msg)
            if item is not None:
                yield item
            meta = msg.metadata
            if int(meta.sequence.stream) >= until or meta.num_pending == 0:
                return
    finally:
        with contextlib.suppress(Exception):
            await sub.unsubscribe()


async def catch_up(
    js: JetStreamContext, fanout: Fanout, spec: FeedSpec[T], watcher: Watcher[T], *, after: int
) -> AsyncIterator[T]:
    """Every item of `spec` after sequence `after` up to the live point, in order and once, with
    `watcher` joined to the feed on the way (see the module's docstring); the watcher then holds
    what follows (items at or below the last one yielded may be in it too: skip them)."""
    seen = after
    async for item in replay(js, spec, after=seen, until=await last_seq(js, spec.stream, spec.subjects)):
        seen = max(seen, item.seq)
        yield item
    await fanout.join(js, spec, watcher)
    async for item in replay(js, spec, after=seen, until=await last_seq(js, spec.stream, spec.subjects)):
        if item.seq > seen:
            seen = item.seq
            yield item


def abort_later(transport: asyncio.BaseTransport | None, delay_s: float = ABORT_AFTER_S) -> Callable[[], None]:
    """An `on_lag` for a watcher: abort `transport` after `delay_s` unless it closed meanwhile
    (a client that reads nothing keeps the writer stuck in a write)."""

    def on_lag() -> None:
        if transport is None:
            return

        def abort() -> None:
            if not transport.is_closing():
                assert isinstance(transport, asyncio.WriteTransport)
                transport.abort()

        asyncio.get_running_loop().call_later(delay_s, abort)

    return on_lag
