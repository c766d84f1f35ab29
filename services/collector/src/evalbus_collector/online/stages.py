"""Wiring of online evaluation in the collector: the OTLP receiver, the span-assembly stage
(`collector-spans`), the sampling stage (`collector-observations`) and the suite registry.

    obs.spans.<service>  ──assemble──▶  obs.received.<service>  ──decide──▶  case.observed + online.fate
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Sequence

import msgspec

from evalbus_collector.online.assembly import PendingTrace, TraceAssembler
from evalbus_collector.online.decide import dead_letter_fate, decide
from evalbus_collector.online.observation import observation_of
from evalbus_collector.online.rates import RateCaps, RateCapUnavailableError
from evalbus_collector.online.receiver import OtlpReceiver, ReceiverMetrics
from evalbus_collector.online.suites import SuiteRegistry
from evalbus_collector.settings import CollectorSettings
from evalbus_contracts import DeadLetter, ObservationFate, ObservationReceived, ObservationSpans, encode, utcnow
from evalbus_contracts.events import EventBase
from evalbus_contracts.streams import COLLECTOR_DEAD_LETTERS, COLLECTOR_OBSERVATIONS, COLLECTOR_SPANS
from evalbus_runtime import Delivery, Retry, Service, Stage

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
        self.assembler = TraceAssembler(settle_s=settings.settle_s, max_wait_s=settings.max_wait_s)
        self._metrics = ReceiverMetrics(service.metrics.registry)
        self.receiver: OtlpReceiver | None = None
        self._ticker: asyncio.Task[None] | None = None

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
        self._ticker = asyncio.create_task(self.assembler.run_ticker(), name="trace-assembly")
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
        if self._ticker is not None:
            self._ticker.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._ticker
        await self.suites.stop()

    # ------------------------------------------------------------ stages

    async def on_spans(self, batch: ObservationSpans, delivery: Delivery) -> Sequence[EventBase]:
        """Hold a span batch until its trace is whole; the trace's first batch publishes it."""
        if self.assembler.is_late(batch):
            return self._counted([_late(batch, f"{len(batch.spans)} spans after the trace was assembled")])
        trace, owner = self.assembler.add(batch)
        trace.redelivered |= delivery.num_delivered > 1
        if owner:
            loop = asyncio.get_running_loop()
            trace.published = loop.create_future()
            trace.published.add_done_callback(_retrieve)
        await trace.whole.wait()
        assert trace.published is not None
        if not owner:
            await asyncio.shield(trace.published)
            return []
        try:
            outputs = await self._publish(trace)
        except BaseException as e:
            self.assembler.abandon(trace)
            if not trace.published.done():
                trace.published.set_exception(e if isinstance(e, Exception) else RuntimeError("cancelled"))
            raise
        self.assembler.finish(trace)
        trace.published.set_result(None)
        return self._counted(outputs)

    async def _publish(self, trace: PendingTrace) -> Sequence[EventBase]:
        obs = observation_of(trace.target, trace.trace_id, trace.spans.values(), trace.resource)
        if len(encode(obs)) > self._settings.observation_max_bytes:
            return [
                ObservationFate(
                    observation_id=obs.observation_id,
                    trace_id=obs.trace_id,
                    target=obs.target,
                    fate="dropped",
                    reason="too_large",
                    detail=f"{len(trace.spans)} spans, over {self._settings.observation_max_bytes} bytes",
                )
            ]
        ack = await self._service.publisher.publish_event(obs)
        if ack.duplicate and not trace.redelivered:
            # Assembled before (by another replica, or before a restart) and none of these spans
            # was a redelivery: they came after the trace was judged complete.
            return [
                ObservationFate(
                    observation_id=obs.observation_id,
                    trace_id=obs.trace_id,
                    target=obs.target,
                    fate="late",
                    reason="late_spans",
                    detail=f"{len(trace.spans)} spans after the trace was assembled",
                )
            ]
        return []

    async def on_observation(self, obs: ObservationReceived, _: Delivery) -> Sequence[EventBase]:
        """Decide an observation's fate for every suite; `case.observed` for each that samples it
        (within its rate cap), once the longest delay of the suites that sample it has passed."""
        suites = {s.id: s for s in self.suites.suites}
        decision = decide(obs, suites.values())
        sampled = [suites[o.suite_id] for o in decision.observed if o.suite_id in suites]
        wait = max((s.delay_s for s in sampled), default=0.0) - (utcnow() - obs.ts).total_seconds()
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


def _retrieve(future: asyncio.Future[None]) -> None:
    if not future.cancelled():
        future.exception()
