"""Wiring of online evaluation in the collector: the OTLP receiver, the span-assembly stage
(`collector-spans`), the sampling stage (`collector-observations`) and the suite registry.

    obs.spans.<service>.<trace>  ──assemble──▶  obs.received.<service>  ──decide──▶  case.observed + online.fate
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Sequence

import msgspec

from evalbus_collector.online.assembly import NS, Cut, PendingTrace, StoredBatch, TraceAssembler
from evalbus_collector.online.decide import dead_letter_fate, decide
from evalbus_collector.online.observation import observation_of
from evalbus_collector.online.rates import RateCaps, RateCapUnavailableError
from evalbus_collector.online.receiver import OtlpReceiver, ReceiverMetrics
from evalbus_collector.online.suites import SuiteRegistry
from evalbus_collector.online.trace_store import BusClock, TraceStore, TraceStoreUnavailableError
from evalbus_collector.settings import CollectorSettings
from evalbus_contracts import DeadLetter, ObservationFate, ObservationReceived, ObservationSpans, encode, utcnow
from evalbus_contracts.events import EventBase
from evalbus_contracts.streams import COLLECTOR_DEAD_LETTERS, COLLECTOR_OBSERVATIONS, COLLECTOR_SPANS
from evalbus_runtime import Delivery, Retry, Service, Stage
from evalbus_runtime.tasks import cancel_and_wait

log = logging.getLogger("evalbus.collector.online")


def _late(batch: ObservationSpans, detail: str) -> ObservationFate:
    return ObservationFate(
        observation_id=batch.trace_id,
        trace_id=batch.trace_id,
        target=batch.target,
        fate="late",
        reason="late_spans",
        detail=detail,
    )


class OnlineIngest:
    """The collector's online stages and their resources."""

    def __init__(self, service: Service, settings: CollectorSettings) -> None:
        self._service = service
        self._settings = settings
        self.suites = SuiteRegistry()
        self.rates = RateCaps()
        self.clock = BusClock()
        self.traces = TraceStore()
        self.assembler = TraceAssembler(
            settle_s=settings.settle_s, max_wait_s=settings.max_wait_s, clock=self.clock.now_ns
        )
        self._metrics = ReceiverMetrics(service.metrics.registry)
        self.receiver: OtlpReceiver | None = None
        self._tasks: list[asyncio.Task[None]] = []

    def wire(self) -> None:
        """Add the stages and the start / stop hooks to the service."""
        service = self._service
        service.on_start(self._start)
        service.on_stop(self._stop)
        service.add_stage(
            Stage(
                consumer=COLLECTOR_SPANS,
                handler=self.on_spans,
                accepts=(ObservationSpans,),
                concurrency=self._settings.spans_concurrency,
            )
        )
        service.add_stage(
            Stage(
                consumer=COLLECTOR_OBSERVATIONS,
                handler=self.on_observation,
                accepts=(ObservationReceived,),
                concurrency=self._settings.observations_concurrency,
            )
        )

        service.add_stage(
            Stage(consumer=COLLECTOR_DEAD_LETTERS, handler=self.on_dead_letter, accepts=(DeadLetter,), concurrency=16)
        )

    async def _start(self, service: Service) -> None:
        await self.rates.start(service.js, service.settings.stream_replicas)
        await self.suites.start(service.js)
        await self.traces.start(service.nc, service.js, service.settings.stream_replicas)
        try:
            await self.clock.calibrate(service.nc)
        except Exception as e:  # the local clock meanwhile; calibrated again every 30 s
            log.warning("bus clock not calibrated: %s", e)
        self._tasks = [
            asyncio.create_task(self.assembler.run_ticker(), name="trace-assembly"),
            asyncio.create_task(self.clock.run(service.nc), name="bus-clock"),
        ]
        s = self._settings
        if s.otlp_port >= 0:
            self.receiver = OtlpReceiver(
                service.publisher,
                host=s.otlp_host,
                port=s.otlp_port,
                max_body_bytes=s.otlp_max_body_bytes,
                max_in_flight=s.otlp_max_in_flight,
                metrics=self._metrics,
            )
            await self.receiver.start()

    async def _stop(self, _: Service) -> None:
        if self.receiver is not None:
            await self.receiver.stop()
        for task in self._tasks:
            await cancel_and_wait(task)
        await self.suites.stop()

    # ------------------------------------------------------------ stages

    async def on_spans(self, batch: ObservationSpans, delivery: Delivery) -> Sequence[EventBase]:
        """Hold a span batch until its trace is whole; the trace's first batch here decides it (from
        the stream's view of the trace, `assembly`) and every batch is acknowledged after that."""
        stored = StoredBatch(
            seq=delivery.stream_seq,
            stored_ns=delivery.stored_ns // 1000 * 1000 if delivery.stored_ns else self.clock.now_ns(),
            batch=batch,
        )
        known = self.assembler.assembled(batch)
        if known is not None:
            return self._late_if_after(stored, known)
        trace, owner = self.assembler.add(stored, delivery.subject)
        if not owner:
            assert trace.outcome is not None
            return self._late_if_after(stored, await asyncio.shield(trace.outcome))
        trace.outcome = asyncio.get_running_loop().create_future()
        trace.outcome.add_done_callback(_retrieve)
        try:
            outputs: Sequence[EventBase] = ()
            decided: int | None = None
            while decided is None:
                await trace.wake.wait()
                trace.wake.clear()
                decided, outputs = await self._settle(trace)
            last_seq = decided
        except BaseException as e:
            self.assembler.abandon(trace)
            if not trace.outcome.done():
                trace.outcome.set_exception(e if isinstance(e, Exception) else RuntimeError("cancelled"))
            if isinstance(e, TraceStoreUnavailableError):
                raise Retry(str(e)) from e
            raise
        self.assembler.finish(trace, last_seq)
        trace.outcome.set_result(last_seq)
        return [*self._counted(outputs), *self._late_if_after(stored, last_seq)]

    def _late_if_after(self, stored: StoredBatch, last_seq: int) -> list[EventBase]:
        """Nothing for a batch the trace's observation includes; `late` for one after it."""
        if stored.seq <= last_seq:
            return []
        return self._counted([_late(stored.batch, f"{len(stored.batch.spans)} spans after the trace was assembled")])

    async def _settle(self, trace: PendingTrace) -> tuple[int | None, Sequence[EventBase]]:
        """Look at `trace` in the stream: None (look again later, rescheduled), or the last stream
        sequence of its stored observation and the events to publish with it."""
        # `now` before the read: a batch the read misses was stored after it, so after `now`; if
        # the trace is due by `now`, that batch is late by the cut's own rule, on every replica.
        now = self.clock.now_ns()
        batches = list(trace.local.values())
        if trace.trace_subject and await self.traces.count(trace.subject) != len(trace.local):
            batches += await self.traces.batches(trace.subject)  # batches held elsewhere (or gone)
        view = self.assembler.cut(batches)
        if now < view.due_ns:
            if not view.root_ended:
                # what is left of a trace another replica assembled (its batches acknowledged)?
                standing = await self.traces.assembled(trace.target, trace.trace_id)
                if standing is not None:
                    return standing, ()
            self.assembler.schedule(trace, view)
            return None, ()
        outputs, stored = await self._publish(trace, view)
        if stored:
            return await self.traces.record(trace.target, trace.trace_id, view.last_seq), outputs
        standing = await self.traces.assembled(trace.target, trace.trace_id)
        if standing is None:  # assembled before the record was written (a replica died between)
            standing = await self.traces.record(trace.target, trace.trace_id, view.last_seq)
        return standing, outputs

    async def _publish(self, trace: PendingTrace, view: Cut) -> tuple[Sequence[EventBase], bool]:
        """Publish the observation of `view`'s included batches: the events to publish with it and
        whether this publish stored it (False: stored before, by this or another replica)."""
        obs = observation_of(trace.target, trace.trace_id, view.spans(), view.resource())
        if len(encode(obs)) > self._settings.observation_max_bytes:
            return [
                ObservationFate(
                    observation_id=obs.observation_id,
                    trace_id=obs.trace_id,
                    target=obs.target,
                    fate="dropped",
                    reason="too_large",
                    detail=f"{len(view.spans())} spans, over {self._settings.observation_max_bytes} bytes",
                )
            ], True
        ack = await self._service.publisher.publish_event(obs)
        return (), not ack.duplicate

    async def on_observation(self, obs: ObservationReceived, delivery: Delivery) -> Sequence[EventBase]:
        """Decide an observation's fate for every suite; `case.observed` for each that samples it
        (within its rate cap), once the longest delay of the suites that sample it has passed."""
        suites = {s.id: s for s in self.suites.suites}
        decision = decide(obs, suites.values())
        sampled = [suites[o.suite_id] for o in decision.observed if o.suite_id in suites]
        wait = max((s.delay_s for s in sampled), default=0.0) - self._age_s(obs, delivery)
        if wait > 0:
            raise Retry(f"online suite delay: deciding in {wait:.1f} s", delay_s=wait)
        capped: set[str] = set()
        for suite in sampled:
            if suite.rate_per_min is None:
                continue
            try:
                if not await self.rates.take(suite.id, suite.rate_per_min):
                    capped.add(suite.id)
            except RateCapUnavailableError as e:
                raise Retry(f"rate counter unavailable: {e}") from e
        fates = self._counted(apply_caps(decision.fates, capped))
        return [*fates, *(o for o in decision.observed if o.suite_id not in capped)]

    def _age_s(self, obs: ObservationReceived, delivery: Delivery) -> float:
        """How long ago the observation was stored on the bus, by JetStream's clock (the sender's
        clock, which `obs.ts` is, may be anything); by `obs.ts` only when the delivery does not say."""
        if delivery.stored_ns:
            return (self.clock.now_ns() - delivery.stored_ns) / NS
        return (utcnow() - obs.ts).total_seconds()

    async def on_dead_letter(self, letter: DeadLetter, _: Delivery) -> Sequence[EventBase]:
        """An observation some service gave up on gets the fate `dead_lettered`; other letters are
        only acknowledged (they stay in the DLQ for `evalbus dlq`)."""
        fate = dead_letter_fate(letter)
        return [] if fate is None else self._counted([fate])

    def _counted(self, events: Sequence[EventBase]) -> list[EventBase]:
        """`events`, their fates counted in the service's metrics."""
        for event in events:
            if isinstance(event, ObservationFate):
                self._metrics.fates.labels(event.suite_id or "-", event.fate, event.reason).inc()
        return list(events)


def apply_caps(fates: Sequence[ObservationFate], capped: set[str]) -> list[ObservationFate]:
    """The fates with `sampled` turned into `skipped: over_rate_cap` for the capped suites."""
    return [
        msgspec.structs.replace(f, fate="skipped", reason="over_rate_cap", detail="the suite's rate_per_min is reached")
        if f.suite_id in capped and f.fate == "sampled"
        else f
        for f in fates
    ]


def _retrieve(future: asyncio.Future[int]) -> None:
    if not future.cancelled():
        future.exception()
