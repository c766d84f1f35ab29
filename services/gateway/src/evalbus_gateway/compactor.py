"""Stream compaction: a finalized batch's events leave the CASES stream once the event store holds
every one of them.

Why (issue 13's soak): nats-server keeps an entry in memory for every distinct subject a stream
holds, and CASES' subjects are per case (`case.<stage>.<batch>.<case>`): kept for ever, that is
about 1.3 KB of server memory per case, without bound (nats-server grew 1.67 × in 30 minutes while
every service stayed flat). The event store is where events live for ever; the stream is the bus,
and a finished batch needs no bus. So `stream_keep_finalized_s` after a batch's `batch.finalized`,
this gateway task:

1. reads the stream sequences of every message of the batch (`batch.*.<batch>` and
   `case.*.<batch>.>`, headers only, with the SSE's own `live.fanout.replay`);
2. checks the store has handled each of them — recorded in `events` or refused with a reason in
   `rejections` (`store.compaction.unhandled`); if any is missing (the recorder is behind, or a
   message went to the dead-letter queue) nothing is purged and the batch is looked at again later;
3. purges the batch's messages up to the last one it checked (a message published after the check
   is never purged unchecked): its case events and its own `batch.*` events alike. Keeping the
   `batch.*` ones would keep every message block of the stream alive with a few messages in it,
   and nats-server 2.15 holds the record of each message deleted inside a block about as dearly
   as the subject it saved (`bench/nats_compaction.py`: purging only the case events, nats-server
   grew faster than with no purge at all; purging every message, it stays flat);
4. records the compaction (`stream_compactions`): the batch's SSE replay reads its events from the
   store from then on (`api.sse`), and the next round skips it.

Every reader of a finished batch's `batch.*` events looks in the store when the stream has none
(`api.reads.find_batch`, `api.idempotency.original_request`, re-judge). Every step is idempotent:
replicas racing, or a crash between 3 and 4, purge nothing twice that matters and record the first
compaction. Online evaluation's pseudo-batches (`online-<suite>`) are never finalized, so they are
not compacted (see docs/operations.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import time
from typing import TYPE_CHECKING, NamedTuple

import nats.errors
import nats.js.errors
from nats.aio.msg import Msg
from nats.js import JetStreamContext
from prometheus_client import CollectorRegistry, Counter

from evalbus_contracts import subjects
from evalbus_contracts.streams import CASES
from evalbus_gateway.live.fanout import FeedSpec, replay
from evalbus_gateway.store.compaction import Compacted, due_batches, last_recorded_seq, mark_compacted, unhandled
from evalbus_runtime.tasks import cancel_and_wait

if TYPE_CHECKING:
    from evalbus_gateway.store.connections import Database

log = logging.getLogger("evalbus.gateway.compactor")

BATCHES_PER_ROUND = 50
"""Most batches one round looks at (the oldest due first)."""
RETRY_S = 600.0
"""How long a batch with messages the store has not handled is left before it is looked at again
(so a batch with a dead-lettered message does not hold the oldest place in every round)."""


class Held(NamedTuple):
    """A message of a batch the stream holds."""

    seq: int
    subject: str


def _held(msg: Msg) -> Held:
    return Held(int(msg.metadata.sequence.stream), msg.subject)


async def stream_messages(js: JetStreamContext, batch_id: str) -> list[Held]:
    """(stream sequence, subject) of every message of the batch that CASES holds now, in order
    (headers only; a read that stalls gives a prefix, and only what was read is ever purged)."""
    filters = subjects.batch_filter(batch_id)
    firsts: list[int] = []
    for subject in filters:  # where to start, and no wait at all for a batch with nothing left
        with contextlib.suppress(nats.js.errors.NotFoundError):
            firsts.append(int((await js.get_msg(CASES.name, seq=1, subject=subject, next=True)).seq or 0))
    if not firsts:
        return []
    spec = FeedSpec("compaction", CASES.name, tuple(filters), _held)
    return [item async for item in replay(js, spec, after=min(firsts) - 1, before=sys.maxsize, headers_only=True)]


async def compact_batch(js: JetStreamContext, db: Database, batch_id: str) -> Compacted | None:
    """Remove the batch's events from CASES if the store has handled every one of them; what was
    done, or None when some are not handled yet (nothing purged)."""
    held = await stream_messages(js, batch_id)
    seqs = [seq for seq, _ in held]
    missing = await unhandled(db, seqs)
    if missing:
        log.info(
            "%s not compacted: the store has not handled %d of its %d messages (first seq %d)",
            batch_id,
            len(missing),
            len(seqs),
            missing[0],
        )
        return None
    if seqs:
        below = max(seqs) + 1
    else:  # the stream holds none of it (purged by hand, or lost): all the store has is below
        last = await last_recorded_seq(db, batch_id)
        below = last + 1 if last is not None else 0
    if seqs:
        for subject in subjects.batch_filter(batch_id):
            await js.purge_stream(CASES.name, seq=below, subject=subject)
    done = Compacted(batch_id=batch_id, purged_below=below, messages=len(seqs))
    await mark_compacted(db, done)
    return done


class CompactorMetrics:
    """What the compactor did, in the service's registry."""

    def __init__(self, registry: CollectorRegistry | None) -> None:
        self.batches = Counter(
            "evalbus_stream_compactions_total",
            "Finalized batches looked at by stream compaction, by result (compacted, waiting: a message not handled by the store yet)",
            ["result"],
            registry=registry,
        )
        self.messages = Counter(
            "evalbus_stream_compacted_messages_total",
            "Messages (case and batch events) removed from the CASES stream",
            registry=registry,
        )


class Compactor:
    """The gateway's compaction loop: every `interval_s`, the batches finalized more than
    `keep_s` ago and not compacted yet (`compact_batch` each)."""

    def __init__(
        self,
        js: JetStreamContext,
        db: Database,
        *,
        keep_s: float,
        interval_s: float,
        registry: CollectorRegistry | None = None,
    ) -> None:
        self._js = js
        self._db = db
        self._keep_s = keep_s
        self._interval_s = interval_s
        self._metrics = CompactorMetrics(registry)
        self._task: asyncio.Task[None] | None = None
        self._retry_at: dict[str, float] = {}
        """Batches with messages the store has not handled, and when to look at them again."""

    def start(self) -> None:
        """Run the loop in the background."""
        if self._task is None:
            self._task = asyncio.create_task(self._loop(), name="stream-compactor")

    async def stop(self) -> None:
        """End the loop (a round under way is abandoned; the next start resumes it)."""
        if self._task is not None:
            await cancel_and_wait(self._task)
            self._task = None

    async def run_once(self) -> bool:
        """One round: compact every due batch that can be; whether it was full (it looked at as
        many batches as a round holds, so more may be due)."""
        now = time.monotonic()
        self._retry_at = {b: at for b, at in self._retry_at.items() if at > now}
        due = await due_batches(self._db, self._keep_s, BATCHES_PER_ROUND, skip=list(self._retry_at))
        for batch_id in due:
            result = await compact_batch(self._js, self._db, batch_id)
            if result is None:
                self._retry_at[batch_id] = now + RETRY_S
                self._metrics.batches.labels("waiting").inc()
                continue
            self._metrics.batches.labels("compacted").inc()
            self._metrics.messages.inc(result.messages)
            log.debug("%s compacted: %d messages left the stream", batch_id, result.messages)
        return len(due) == BATCHES_PER_ROUND

    async def _loop(self) -> None:
        while True:
            full = False
            try:
                full = await self.run_once()
            except (OSError, TimeoutError, nats.errors.Error) as e:
                log.warning("stream compaction round failed (retried next round): %s: %s", type(e).__name__, e)
            except Exception:
                log.exception("stream compaction round failed (retried next round)")
            # A full round (a backlog: the first start after an upgrade, a recorder that caught
            # up) goes straight on to the next one.
            await asyncio.sleep(0 if full else self._interval_s)
