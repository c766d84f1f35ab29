"""The consumer loop every service runs: pull only when a slot is free, decode, handle, publish
the outputs with their dedup ids, and ack only after JetStream acknowledged them.

Pulling is callback-driven (own pull requests to `$JS.API.CONSUMER.MSG.NEXT.<stream>.<consumer>`,
messages arriving on one inbox subscription), which the bus notes measured 3–4× faster than
`fetch()`. The loop keeps a credit: it never has more messages requested than it has free slots,
so a replica with no free slot pulls nothing and its work flows to other replicas.

A redelivered message (a replica died between its output's PubAck and its ack, or the handler
asked for a retry) is first checked against the stream: when the stage's `settled_by` output is
stored already, it is acked without running the handler again (no second sink write, no second
LLM judgement, no second run of the agent); otherwise the handler runs and only the outputs not
stored yet are published (`Publisher.publish_missing`). Both hold beyond JetStream's duplicate
window, which is therefore short.

The handler decides delivery: return the output events (ack after they are stored); raise `Retry`
(nak with exponential delay); raise `Poison` (term + copy to `dlq.<service>`). Any other exception
is a retry. A message that fails its last allowed delivery is dead-lettered by the loop; one that
exhausts `max_deliver` without an answer (a worker crashed on it) is dead-lettered from the
JetStream advisory. Long handlers are kept alive with `in_progress`.

A stage whose work must never overlap (`Stage.exclusive`: the dispatcher's agent runs) answers on a
hold subject per message while it handles it, and checks a redelivery there first: a message whose
replica still lives is left to it, so a stalled healthy replica is never joined by a second one, and
the stage's `ack_wait` — how long a dead replica's messages wait — can be short.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription

from evalbus_contracts import DeadLetter, decode_event
from evalbus_contracts.codec import NewerSchemaError
from evalbus_contracts.events import LETTER_CUT_MARK, EventBase, EventKey, stage_output_key
from evalbus_contracts.streams import ConsumerDef, max_deliveries_advisory
from evalbus_runtime.errors import PayloadTooLargeError, Poison, PublishFailedError, Retry
from evalbus_runtime.faults import NO_FAULTS, FaultPoint, Faults
from evalbus_runtime.holds import Holds
from evalbus_runtime.logs import batch_id_var, run_id_var
from evalbus_runtime.metrics import ServiceMetrics
from evalbus_runtime.publisher import Publisher
from evalbus_runtime.slots import SlotPool
from evalbus_runtime.tasks import awaiting_at, cancel_and_wait
from evalbus_runtime.tracing import message_span

log = logging.getLogger("evalbus.consumer")

ACK_WAIT_REFRESH_S = 30.0
"""How often a loop reads its consumer's `ack_wait` back from the server: it touches what it holds
at a quarter of the shorter of that and its own definition's, so a replica of an older release, or
one whose `ACK_WAIT_S` differs, never lets a shorter wait set by another replica run out."""

CANCEL_GRACE_S = 10.0
"""How long `stop` waits for cancelled handlers to end before it gives up on them (and logs where
each one is stuck)."""

Handler = Callable[[Any, "Delivery"], Awaitable[Sequence[EventBase] | None]]
"""A stage: an event and its delivery → the events to publish (None or empty: nothing)."""


@dataclass(frozen=True)
class Stage:
    """A handler bound to a shared durable consumer."""

    consumer: ConsumerDef
    """The consumer it reads."""
    handler: Handler
    """The stage logic."""
    accepts: tuple[type, ...] = ()
    """Event types the handler takes; anything else is poison (empty: any event)."""
    concurrency: int = 16
    """Messages handled at once by this replica."""
    decode: Callable[[bytes], Any] = decode_event
    """Payload decoder (raises on poison)."""
    retry_base_s: float = 0.5
    """First retry delay; doubles per delivery."""
    retry_max_s: float = 30.0
    """Longest retry delay."""
    pull_expires_s: float = 10.0
    """Lifetime of one pull request."""
    settled_by: Callable[[Any], Sequence[EventKey]] = field(default=lambda _event: ())
    """The outputs that, any one of them stored, mean a redelivered input was handled before: the
    loop then acks it without running the handler. Only for an output the handler publishes
    alone (were it published beside others, one could be stored and another not)."""
    pool: SlotPool | None = None
    """Slots shared with other stages of this replica (`slots.py`): a message is handled only once
    it holds one of them as well as one of this stage's `concurrency` (None: `concurrency` alone)."""
    exclusive: bool = False
    """Never handle a message twice at once: while a replica handles one it answers on the message's
    hold subject (`holds.py`), and a redelivery is first checked there — when its
    holder answers, or cannot answer in time (a stopped or starved process), the redelivery is left
    to it (touched with `in_progress`, neither acked nor naked); only nats-server's "no responders"
    (the holder's connection is gone; not believed in the few seconds after this replica
    reconnected, while the holder may be reconnecting too) lets it run. A stall of the holder's
    event loop past `ack_wait` then costs a delivery count, not a second run, which is what makes a
    short `ack_wait` — a short stall after a crash — safe for a stage whose work must not overlap
    (the dispatcher's agent runs). When such counts exhaust `max_deliver` while the holder still
    holds the message, it is watched instead of dead-lettered: no letter once its `settled_by`
    output is stored, a letter when nobody holds it any more without it. Costs a subscription per
    message handled."""


def settled_by_output(kind: str) -> Callable[[Any], Sequence[EventKey]]:
    """`Stage.settled_by` of a stage whose one output per input is the `kind` event of the same
    batch run (the judge's `case.judged` of a `case.executed`)."""

    def keys(event: Any) -> Sequence[EventKey]:
        key = stage_output_key(kind, event) if isinstance(event, EventBase) else None
        return () if key is None else (key,)

    return keys


@dataclass
class Delivery:
    """One delivery of a message, as the handler sees it."""

    subject: str
    headers: Mapping[str, str]
    num_delivered: int
    stream_seq: int
    _msg: Msg
    _on_release: Callable[[], None]
    _released: bool = False
    stored_ns: int = 0
    """When JetStream stored the message, Unix nanoseconds (0 when the ack subject does not say)."""
    _on_published: list[Callable[[], None]] | None = None
    """Callbacks of `on_published` (None until a handler registers one: most never do)."""

    def on_published(self, callback: Callable[[], None]) -> None:
        """Call `callback` once the handler's outputs are on the stream (every PubAck in; before
        the ack): work that must follow the output, never precede it — the dispatcher schedules
        the purge of a run's live output only once its `case.executed` is stored. Not called when
        the handler returns nothing, fails, or the message is poison; a callback that raises is
        logged and does not fail the message."""
        if self._on_published is None:
            self._on_published = []
        self._on_published.append(callback)

    def _published(self) -> None:
        for callback in self._on_published or ():
            try:
                callback()
            except Exception:
                log.exception("an on_published callback of %s failed", self.subject)

    def release_slot(self) -> None:
        """Give this message's pull slot back now (idempotent): the loop may pull the next one
        while this one finishes work that needs no slot (the dispatcher after compute release)."""
        if not self._released:
            self._released = True
            self._on_release()

    async def in_progress(self) -> None:
        """Tell JetStream the message is still being worked on (the loop also does this itself)."""
        await self._msg.in_progress()


@dataclass
class _Request:
    remaining: int
    deadline: float


def _status(msg: Msg) -> str | None:
    headers = msg.headers
    if headers and not msg.data:
        return headers.get("Status")
    return None


class ConsumerLoop:
    """Runs one `Stage` against its durable consumer on one connection."""

    def __init__(
        self,
        nc: NatsClient,
        publisher: Publisher,
        stage: Stage,
        *,
        service: str,
        metrics: ServiceMetrics,
        faults: Faults = NO_FAULTS,
    ) -> None:
        self._nc = nc
        self._faults = faults
        self._pub = publisher
        self._stage = stage
        self._service = service
        self._metrics = metrics
        # Labelled metric children are looked up once, not per message.
        self._slots_gauge = metrics.slots_free.labels(stage.consumer.durable)
        self._in_flight_gauge = metrics.in_flight.labels(stage.consumer.durable)
        self._handle_hist = metrics.handle_seconds.labels(stage.consumer.durable)
        self._outcomes = {
            o: metrics.messages.labels(stage.consumer.durable, o)
            for o in ("ack", "ignored", "retry", "poison", "cancelled", "held")
        }
        self._published: dict[str, Any] = {}
        self._consumer = stage.consumer
        self._label = stage.consumer.durable
        self._free = stage.concurrency
        self._pool = stage.pool
        self._waiting: set[asyncio.Task[None]] = set()
        self._requests: dict[str, _Request] = {}
        self._req_ids = 0
        self._inbox = nc.new_inbox()
        self._next_subject = f"$JS.API.CONSUMER.MSG.NEXT.{self._consumer.stream}.{self._consumer.durable}"
        self._sub: Subscription | None = None
        self._adv_sub: Subscription | None = None
        self._tasks: set[asyncio.Task[None]] = set()
        self._refills: set[asyncio.Future[None]] = set()
        """Pull requests being sent (kept: the event loop holds only weak references to tasks)."""
        self._beat: dict[int, tuple[Msg, float]] = {}
        self._watches: dict[asyncio.Task[None], _Exhausted] = {}
        """Exhausted messages a replica still holds (`_watch_exhausted`)."""
        self._ack_wait_s = stage.consumer.ack_wait_s
        """The `ack_wait` held messages are touched against (see `ACK_WAIT_REFRESH_S`)."""
        self._ticker: asyncio.Task[None] | None = None
        self._refill_scheduled = False
        self._holds = Holds(nc, stage.consumer)
        self._stopping = False
        self._idle = asyncio.Event()
        self._idle.set()
        self._slots_gauge.set(self._free)

    # ------------------------------------------------------------ lifecycle

    async def start(self) -> None:
        """Subscribe, listen for exhausted deliveries, and start pulling."""
        self._sub = await self._nc.subscribe(
            f"{self._inbox}.*", cb=self._on_message, pending_msgs_limit=200_000, pending_bytes_limit=-1
        )
        self._adv_sub = await self._nc.subscribe(
            max_deliveries_advisory(self._consumer), queue=f"{self._service}-advisories", cb=self._on_advisory
        )
        await self._follow_ack_wait()
        self._ticker = asyncio.create_task(self._tick(), name=f"tick-{self._label}")
        if self._pool is not None:
            self._pool.on_change(self._schedule_refill)
        self._schedule_refill()

    async def stop(self, timeout_s: float) -> bool:
        """Stop pulling, let in-flight work finish within `timeout_s`; True when it all finished."""
        self._stopping = True
        finished = True
        for task in list(self._waiting):
            task.cancel()  # waiting for a shared slot: back to the stream for another replica
        if self._tasks:
            try:
                await asyncio.wait_for(self._idle.wait(), timeout_s)
            except TimeoutError:
                finished = False
                for task in list(self._tasks):
                    task.cancel()
                # bounded: a handler that ignores its cancellation must not hang the service's stop
                _, stuck = await asyncio.wait(list(self._tasks), timeout=CANCEL_GRACE_S)
                for task in stuck:
                    log.error(
                        "%s: a handler did not stop within %gs of its cancellation; it waits at:\n%s",
                        self._label,
                        CANCEL_GRACE_S,
                        awaiting_at(task),
                    )
        if self._ticker is not None:
            await cancel_and_wait(self._ticker)
        for watch, exhausted in list(self._watches.items()):
            # stopping: no replica of ours will look again, so what is unsettled goes to the DLQ now
            watch.cancel()
            await asyncio.wait({watch}, timeout=CANCEL_GRACE_S)
            if watch.done() and not watch.cancelled():
                continue  # it had settled or dead-lettered it already
            if not await self._exhausted_but_settled(exhausted):
                await self._dead_letter_exhausted(exhausted)
        for sub in (self._sub, self._adv_sub):
            if sub is not None:
                with contextlib.suppress(Exception):
                    await sub.unsubscribe()
        self._sub = self._adv_sub = None
        return finished

    @property
    def in_flight(self) -> int:
        """Messages being handled now."""
        return len(self._tasks)

    def reset_requests(self) -> None:
        """Forget outstanding pull requests (after a reconnect) and pull afresh."""
        self._holds.reconnected()
        self._requests.clear()
        self._schedule_refill()

    # ------------------------------------------------------------ pulling

    def _schedule_refill(self) -> None:
        if not self._refill_scheduled and not self._stopping:
            self._refill_scheduled = True
            asyncio.get_running_loop().call_soon(self._start_refill)

    def _start_refill(self) -> None:
        self._refill_scheduled = False
        task = asyncio.ensure_future(self._refill())
        self._refills.add(task)  # the loop keeps only a weak reference to a task
        task.add_done_callback(self._refills.discard)
        task.add_done_callback(_log_failure)

    async def _refill(self) -> None:
        if self._stopping or self._sub is None or not self._nc.is_connected:
            return
        outstanding = sum(r.remaining for r in self._requests.values())
        free = self._free if self._pool is None else min(self._free, self._pool.available())
        credit = free - outstanding
        if credit <= 0:
            return
        self._req_ids += 1
        rid = str(self._req_ids)
        self._requests[rid] = _Request(remaining=credit, deadline=time.monotonic() + self._stage.pull_expires_s)
        body = b'{"batch":%d,"expires":%d}' % (credit, int(self._stage.pull_expires_s * 1e9))
        try:
            await self._nc.publish(self._next_subject, body, reply=f"{self._inbox}.{rid}")
        except Exception:
            self._requests.pop(rid, None)

    async def _on_message(self, msg: Msg) -> None:
        status = _status(msg)
        if status is not None:
            # Status messages arrive on the request's own inbox: 404 / 408 / 409 end that request.
            if status != "100":
                self._requests.pop(msg.subject.rsplit(".", 1)[-1], None)
                self._schedule_refill()
            return
        # A message carries its stream subject, not the inbox: the server serves waiting requests
        # in order, so it is counted against the oldest one (expiry corrects any drift).
        for rid, req in self._requests.items():
            req.remaining -= 1
            if req.remaining <= 0:
                del self._requests[rid]
            break
        if self._stopping:
            with contextlib.suppress(Exception):
                await msg.nak()
            return
        self._free -= 1
        self._slots_gauge.set(self._free)
        self._idle.clear()
        task = asyncio.create_task(self._handle(msg))
        self._tasks.add(task)
        task.add_done_callback(self._task_done)

    def _task_done(self, task: asyncio.Task[None]) -> None:
        self._tasks.discard(task)
        if not self._tasks:
            self._idle.set()

    def _release(self) -> None:
        self._free += 1
        self._slots_gauge.set(self._free)
        self._schedule_refill()

    def _release_pooled(self, pool: SlotPool) -> None:
        self._release()
        pool.give_back()  # tells every stage sharing it (this one included) to pull again

    async def _follow_ack_wait(self) -> None:
        """Touch held messages against the shorter of the server's `ack_wait` and our own."""
        try:
            info = await self._nc.jetstream().consumer_info(self._consumer.stream, self._consumer.durable)
        except Exception as e:  # best effort: our own definition's stays in force
            log.debug("%s: ack_wait not read back: %s", self._label, e)
            return
        server = float(info.config.ack_wait or 0)
        self._ack_wait_s = min(self._consumer.ack_wait_s, server) if server > 0 else self._consumer.ack_wait_s

    async def _tick(self) -> None:
        refreshed = time.monotonic()
        while True:
            # A held message is touched every quarter of `ack_wait` (at most half a quarter late),
            # so a healthy replica's event loop may stall for more than half of it before a redelivery.
            beat_after = self._ack_wait_s / 4
            await asyncio.sleep(max(0.2, min(1.0, beat_after / 2)))
            now = time.monotonic()
            if now - refreshed >= ACK_WAIT_REFRESH_S:
                refreshed = now
                await self._follow_ack_wait()
            for rid, req in list(self._requests.items()):
                if now > req.deadline + 2.0:
                    self._requests.pop(rid, None)
            for key, (msg, last) in list(self._beat.items()):
                if now - last >= beat_after and key in self._beat:
                    self._beat[key] = (msg, now)
                    with contextlib.suppress(Exception):
                        await msg.in_progress()
            self._schedule_refill()

    # ------------------------------------------------------------ handling

    async def _take_pooled(self, msg: Msg, pool: SlotPool) -> bool:
        """Take a shared slot for `msg`, waiting (kept in progress) when the other stages hold them
        all; False when the wait was cancelled (stopping): the message is back on the stream."""
        if pool.try_take():
            return True
        task = asyncio.current_task()
        assert task is not None
        self._waiting.add(task)
        self._beat[id(msg)] = (msg, time.monotonic())
        try:
            await pool.take()
        except asyncio.CancelledError:
            self._beat.pop(id(msg), None)
            with contextlib.suppress(Exception):
                await msg.nak()
            self._release()
            if not self._stopping:
                raise
            return False
        finally:
            self._waiting.discard(task)
        return True

    async def _handle(self, msg: Msg) -> None:
        num_delivered, stream_seq = _ack_fields(msg.reply)
        if not self._stage.exclusive:
            await self._process(msg, num_delivered, stream_seq)
            return
        hold = await self._claim(msg, num_delivered, stream_seq)
        if hold is None:
            return
        try:
            await self._process(msg, num_delivered, stream_seq)
        finally:
            # only now, after the ack: a redelivery that finds nobody holding it finds the output
            # stored (`_settled`), so it neither runs beside this handler nor after it
            with contextlib.suppress(Exception):
                await hold.unsubscribe()

    async def _claim(self, msg: Msg, num_delivered: int, stream_seq: int) -> Subscription | None:
        """Hold a message of an exclusive stage: its hold subscription, before it waits for any slot;
        None when another replica still holds it (left to it, touched) or the probe could not be
        made (put back with a delay)."""
        try:
            if num_delivered > 1 and await self._holds.held_elsewhere(stream_seq, num_delivered):
                self._outcomes["held"].inc()
                grace = self._holds.grace_left()
                with contextlib.suppress(Exception):
                    if grace > 0:  # maybe nobody holds it: asked again as soon as the grace is over
                        await msg.nak(delay=grace)
                    else:
                        await msg.in_progress()  # its holder's own touches keep it from here on
                self._release()
                return None
            return await self._holds.hold(stream_seq)
        except asyncio.CancelledError:
            with contextlib.suppress(Exception):
                await msg.nak()
            self._release()
            raise
        except Exception as e:
            log.warning(
                "%s: seq %d could not be claimed (%s: %s); put back", self._label, stream_seq, type(e).__name__, e
            )
            self._outcomes["retry"].inc()
            with contextlib.suppress(Exception):
                await msg.nak(delay=self._stage.retry_base_s)
            self._release()
            return None

    async def _process(self, msg: Msg, num_delivered: int, stream_seq: int) -> None:
        pool = self._pool
        if pool is not None and not await self._take_pooled(msg, pool):
            return
        started = time.monotonic()
        self._beat[id(msg)] = (msg, started)
        self._in_flight_gauge.inc()
        headers = msg.headers or {}
        delivery = Delivery(
            subject=msg.subject,
            headers=headers,
            num_delivered=num_delivered,
            stream_seq=stream_seq,
            _msg=msg,
            _on_release=self._release if pool is None else lambda: self._release_pooled(pool),
            stored_ns=stored_ns(msg.reply),
        )
        outcome = "ack"
        try:
            try:
                event = self._stage.decode(msg.data)
            except NewerSchemaError as e:
                raise Poison(str(e)) from e
            except (msgspec.DecodeError, msgspec.ValidationError, ValueError) as e:
                raise Poison(f"undecodable payload: {e}") from e
            if self._stage.accepts and not isinstance(event, self._stage.accepts):
                raise Poison(f"unexpected event type {type(event).__name__} on {self._label}")
            if isinstance(event, EventBase):
                check_subject(event, delivery.subject)
            run_token = run_id_var.set(getattr(event, "run_id", None))
            batch_token = batch_id_var.set(getattr(event, "batch_id", None))
            redelivered = num_delivered > 1
            try:
                with message_span(f"{self._label} process", headers, {"messaging.destination": delivery.subject}):
                    outputs = (
                        None
                        if redelivered and await self._settled(event)
                        else await self._stage.handler(event, delivery)
                    )
                    if self._faults.armed:
                        self._fault("before_publish", event)
                    if outputs:
                        if redelivered:
                            acks = await self._pub.publish_missing(outputs)
                            outputs = [o for o, a in zip(outputs, acks, strict=True) if not a.duplicate]
                        else:
                            await self._pub.publish_events(outputs)
                        for out in outputs:
                            counter = self._published.get(out.type)
                            if counter is None:
                                counter = self._published[out.type] = self._metrics.published.labels(out.type)
                            counter.inc()
                        delivery._published()
            finally:
                run_id_var.reset(run_token)
                batch_id_var.reset(batch_token)
            if not outputs:
                outcome = "ignored"
            if self._faults.armed:
                self._fault("before_ack", event)
            await msg.ack()
        except Poison as p:
            outcome = "poison"
            await self._give_up(msg, delivery, f"poison: {p.reason}")
        except PayloadTooLargeError as e:
            outcome = "poison"
            await self._give_up(msg, delivery, f"too_large: {e}")
        except asyncio.CancelledError:
            outcome = "cancelled"
            with contextlib.suppress(Exception):
                await msg.nak()
            raise
        except Exception as e:
            outcome = "retry"
            reason = e.reason if isinstance(e, Retry) else f"{type(e).__name__}: {e}"
            if not isinstance(e, Retry | PublishFailedError):
                log.warning("handler error on %s (delivery %d): %s", delivery.subject, delivery.num_delivered, reason)
            if delivery.num_delivered >= self._consumer.max_deliver:
                outcome = "poison"
                await self._give_up(msg, delivery, f"max_deliver ({self._consumer.max_deliver}) exhausted: {reason}")
            else:
                delay = e.delay_s if isinstance(e, Retry) and e.delay_s is not None else self._backoff(delivery)
                with contextlib.suppress(Exception):
                    await msg.nak(delay=delay)
        finally:
            self._beat.pop(id(msg), None)
            self._in_flight_gauge.dec()
            self._outcomes[outcome].inc()
            self._handle_hist.observe(time.monotonic() - started)
            delivery.release_slot()

    async def _settled(self, event: Any) -> bool:
        """Whether a redelivered `event` was handled before: one of its stage's `settled_by`
        outputs is stored."""
        for key in self._stage.settled_by(event):
            found = await self._pub.stored(key)
            if found is not None:
                log.info("%s: %s is stored already (seq %d); acking the redelivery", self._label, key[1], found.seq)
                return True
        return False

    def _fault(self, point: FaultPoint, event: Any) -> None:
        self._faults.check(point, self._label, str(getattr(event, "type", "")), getattr(event, "run_id", None))

    def _backoff(self, delivery: Delivery) -> float:
        return float(min(self._stage.retry_base_s * (2 ** (delivery.num_delivered - 1)), self._stage.retry_max_s))

    async def _give_up(self, msg: Msg, delivery: Delivery, reason: str) -> None:
        """Copy to the DLQ, then terminate. If the copy cannot be stored, nak instead: never lose it."""
        letter = DeadLetter(
            service=self._service,
            reason=reason,
            subject_=delivery.subject,
            stream=self._consumer.stream,
            stream_seq=delivery.stream_seq,
            deliveries=delivery.num_delivered,
            payload=_letter_payload(msg.data, self._nc),
            headers=dict(delivery.headers.items()),
        )
        try:
            await self._pub.publish_event(letter)
        except PublishFailedError:
            log.error("could not dead-letter %s seq %d; will retry", delivery.subject, delivery.stream_seq)
            with contextlib.suppress(Exception):
                await msg.nak(delay=self._backoff(delivery))
            return
        self._metrics.dead_letters.labels(self._label, reason.split(":", 1)[0]).inc()
        log.warning("dead-lettered %s seq %d: %s", delivery.subject, delivery.stream_seq, reason)
        with contextlib.suppress(Exception):
            await msg.term()

    async def _exhausted_but_settled(self, exhausted: _Exhausted) -> bool:
        """Whether a message that ran out of deliveries was handled all the same: its stage's
        `settled_by` output is stored (a holder that lost its deliveries while it stalled — each
        one left to it by an exclusive stage — and then finished). Then it needs no dead letter."""
        try:
            event = self._stage.decode(exhausted.data)
            settled = await self._settled(event)
        except Exception:  # undecodable, or the lookup failed: dead-lettered as before
            return False
        if settled:
            log.info(
                "%s: seq %d ran out of deliveries but its output is stored: no dead letter", self._label, exhausted.seq
            )
        return settled

    async def _on_advisory(self, msg: Msg) -> None:
        try:
            doc = msgspec.json.decode(msg.data)
            seq = int(doc["stream_seq"])
            deliveries = int(doc.get("deliveries", 0))
        except (msgspec.DecodeError, KeyError, TypeError, ValueError):
            log.warning("unreadable max-deliveries advisory: %r", msg.data[:200])
            return
        try:
            raw = await self._nc.jetstream().get_msg(self._consumer.stream, seq)
        except Exception as e:
            log.warning("max deliveries for seq %d but it cannot be read: %s", seq, e)
            await self._dead_letter_exhausted(_Exhausted(seq, deliveries))
            return
        exhausted = _Exhausted(seq, deliveries, raw.data or b"", raw.subject or "", dict(raw.headers or {}))
        if await self._exhausted_but_settled(exhausted):
            return
        if self._stage.exclusive and await self._holds.held_elsewhere(seq, deliveries):
            # Its deliveries ran out while a stalled holder kept it (each one left to the holder):
            # watched until it settles; dead-lettered if the holder goes without storing its output.
            log.warning("%s: seq %d ran out of deliveries while a replica still holds it: watched", self._label, seq)
            watch = asyncio.create_task(self._watch_exhausted(exhausted))
            self._watches[watch] = exhausted
            watch.add_done_callback(self._end_watch)
            return
        await self._dead_letter_exhausted(exhausted)

    def _end_watch(self, task: asyncio.Task[None]) -> None:
        self._watches.pop(task, None)

    async def _watch_exhausted(self, exhausted: _Exhausted) -> None:
        """An exhausted message a replica still holds: looked at every `ack_wait` until its output
        is stored (no dead letter) or nobody holds it any more (dead-lettered)."""
        while True:
            await asyncio.sleep(self._ack_wait_s)
            if await self._exhausted_but_settled(exhausted):
                return
            if not await self._holds.held_elsewhere(exhausted.seq, exhausted.deliveries):
                break
        await self._dead_letter_exhausted(exhausted)

    async def _dead_letter_exhausted(self, exhausted: _Exhausted) -> None:
        letter = DeadLetter(
            service=self._service,
            reason=f"max_deliver exhausted: {exhausted.deliveries} deliveries without an answer",
            subject_=exhausted.subject,
            stream=self._consumer.stream,
            stream_seq=exhausted.seq,
            deliveries=exhausted.deliveries,
            payload=_letter_payload(exhausted.data, self._nc),
            headers=exhausted.headers,
        )
        try:
            await self._pub.publish_event(letter)
            self._metrics.dead_letters.labels(self._label, "max_deliver").inc()
        except PublishFailedError:
            log.error("could not dead-letter exhausted seq %d", exhausted.seq)


@dataclass(frozen=True, slots=True)
class _Exhausted:
    """A message that ran out of deliveries, as its dead letter carries it (empty when it could not
    be read back)."""

    seq: int
    deliveries: int
    data: bytes = b""
    subject: str = ""
    headers: dict[str, str] = field(default_factory=dict)


_LETTER_ROOM = 16 * 1024
"""Bytes of a dead letter kept for its reason, headers and envelope."""


def _letter_payload(data: bytes, nc: NatsClient) -> str:
    """The message as a dead letter carries it: whole, or its head when the letter would not fit the
    server's `max_payload` (the stream still holds the original at its sequence)."""
    limit = int(getattr(nc, "max_payload", 0) or 0)
    text = data.decode("utf-8", errors="replace")
    if not limit or len(data) * 2 + _LETTER_ROOM <= limit:  # JSON escaping may double it
        return text
    keep = max(0, (limit - _LETTER_ROOM) // 2)
    return text[:keep] + f"... [{len(data) - keep}{LETTER_CUT_MARK}"


def _ack_fields(reply: str) -> tuple[int, int]:
    """Delivery count and stream sequence from a JetStream ack subject, without building nats-py's
    full metadata (timestamps and all) per message:
    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` (v1), or with a domain and
    an account hash after `$JS.ACK` (v2)."""
    tokens = reply.split(".")
    if len(tokens) == 9:
        return int(tokens[4]), int(tokens[5])
    return int(tokens[6]), int(tokens[7])


def stored_ns(reply: str) -> int:
    """When the message was stored (Unix ns), from its JetStream ack subject (0 when unreadable)."""
    tokens = reply.split(".")
    try:
        return int(tokens[7] if len(tokens) == 9 else tokens[9])
    except (IndexError, ValueError):
        return 0


def check_subject(event: EventBase, subject: str) -> None:
    """Poison an event whose own subject contradicts the one it arrived on (a `case.judged` on a
    `case.executed` subject, a batch event without its batch id): stages route on subjects."""
    try:
        expected = event.subject()
    except ValueError as e:
        raise Poison(f"{event.type} without the ids its subject needs: {e}") from e
    if expected != subject:
        raise Poison(f"{event.type} belongs on {expected}, arrived on {subject}")


def _log_failure(task: asyncio.Future[None]) -> None:
    if not task.cancelled() and task.exception() is not None:
        log.warning("pull refill failed: %s", task.exception())
