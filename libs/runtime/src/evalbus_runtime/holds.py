"""Who holds a message of an exclusive stage (`Stage.exclusive`).

While a replica handles such a message it subscribes to the message's hold subject
(`subjects.hold_subject`: `held.<stream>.<consumer>.<seq>`) and answers every request there. A
replica that gets the message redelivered asks first: an answer, or none in time, means a replica
still holds it (a stopped or starved process cannot answer, yet holds it); nats-server's immediate
"no responders" means nobody does — the holder's connection is gone. Only that answer lets a
redelivery run, and not right after this replica reconnected, when the holder may be reconnecting
too.
"""

from __future__ import annotations

import contextlib
import logging
import time

import nats.errors
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from evalbus_contracts.streams import ConsumerDef
from evalbus_contracts.subjects import hold_subject

log = logging.getLogger("evalbus.consumer")

HOLD_PROBE_TIMEOUT_S = 1.0
"""How long a probe waits for the holder to answer."""
RECONNECT_GRACE_S = 2.0
"""After this replica reconnected, how long "no responders" on a hold subject is not believed: a
restarted nats-server's clients come back one by one (each tries every 0.5 s), and a holder not
back yet has no subscription for a moment — its message is put back until the grace is over and
asked about again then."""


class Holds:
    """The hold subjects of one consumer, on one connection."""

    def __init__(self, nc: NatsClient, consumer: ConsumerDef) -> None:
        self._nc = nc
        self._consumer = consumer
        self._label = consumer.durable
        self._reconnected_at = -RECONNECT_GRACE_S

    def reconnected(self) -> None:
        """This replica's connection came back (its grace starts)."""
        self._reconnected_at = time.monotonic()

    def grace_left(self) -> float:
        """Seconds of `RECONNECT_GRACE_S` left since this replica last reconnected (0: none)."""
        return max(0.0, RECONNECT_GRACE_S - (time.monotonic() - self._reconnected_at))

    async def hold(self, stream_seq: int) -> Subscription:
        """Answer on the hold subject of `stream_seq` until the subscription is removed."""
        return await self._nc.subscribe(self._subject(stream_seq), cb=_answer)

    async def held_elsewhere(self, stream_seq: int, num_delivered: int) -> bool:
        """Whether a replica still holds the message at `stream_seq`: its hold subject answers, or
        nobody answers within `HOLD_PROBE_TIMEOUT_S`; False only on "no responders", and not within
        `RECONNECT_GRACE_S` of this replica's reconnecting. A probe that cannot be sent raises."""
        try:
            await self._nc.request(self._subject(stream_seq), b"", timeout=HOLD_PROBE_TIMEOUT_S)
        except nats.errors.NoRespondersError:
            grace = self.grace_left()
            if grace > 0:
                log.warning(
                    "%s: seq %d (delivery %d) has no holder, but this replica reconnected only now and its "
                    "holder may not be back yet: asked again in %.1fs",
                    self._label,
                    stream_seq,
                    num_delivered,
                    grace,
                )
                return True
            return False
        except nats.errors.TimeoutError:
            log.warning(
                "%s: seq %d (delivery %d) is held by a replica that did not answer within %gs: left to it",
                self._label,
                stream_seq,
                num_delivered,
                HOLD_PROBE_TIMEOUT_S,
            )
            return True
        log.info(
            "%s: seq %d (delivery %d) is still held by a replica: left to it", self._label, stream_seq, num_delivered
        )
        return True

    def _subject(self, stream_seq: int) -> str:
        return hold_subject(self._consumer.stream, self._consumer.durable, stream_seq)


async def _answer(msg: Msg) -> None:
    """A probe of a message this replica holds: yes (any answer will do)."""
    with contextlib.suppress(Exception):
        await msg.respond(b"")
