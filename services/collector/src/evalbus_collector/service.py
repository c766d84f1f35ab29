"""Wiring of the collector (`CollectorSettings` is re-exported here for entry points and tests): `case.executed` events whose trace is deferred (`control-plane` collect)
are completed by pulling the platform trace and published as `case.collected`, which the judge
consumes; complete cases are acknowledged and ignored. Online evaluation (the OTLP/HTTP receiver,
trace assembly and sampling) is wired by `evalbus_collector.online.stages`."""

from __future__ import annotations

from collections.abc import Sequence

import aiohttp
import msgspec

from evalbus_collector.complete import complete
from evalbus_collector.online.stages import OnlineIngest
from evalbus_collector.settings import CollectorSettings
from evalbus_contracts import CaseCollected, CaseExecuted
from evalbus_contracts.events import EventBase
from evalbus_contracts.streams import COLLECTOR_CASES
from evalbus_contracts.subjects import CASE_COLLECTED
from evalbus_runtime import Delivery, Retry, SecretStore, Service, Stage, settled_by_output
from evalbus_runtime.objects import ObjectReadError, ObjectStoreError
from evalbus_runtime.payloads import COLLECTED_FILE, load_result, offload_result, unreadable
from evalbus_traces import build_source, collect_trace


def build_collector(service: Service, settings: CollectorSettings, secrets: SecretStore | None = None) -> OnlineIngest:
    """Add the collection stage and the online-evaluation stages to `service`."""
    store = secrets or SecretStore()
    session: aiohttp.ClientSession | None = None

    async def start(_: Service) -> None:
        nonlocal session
        session = aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=30))

    async def stop(_: Service) -> None:
        if session is not None:
            await session.close()

    async def handle(event: CaseExecuted, delivery: Delivery) -> Sequence[EventBase]:
        if event.trace_complete:
            return []
        if event.result.payload is not None:
            try:
                event = msgspec.structs.replace(event, result=await load_result(service.js, event.result))
            except ObjectReadError as e:
                raise Retry(f"the run's payload could not be read yet: {e}") from e
            except ObjectStoreError as e:  # the judge reads the same reference and fails visibly
                return [complete(event, None, degraded=f"the run's payload could not be read: {unreadable(e)}")]
        return [await _offloaded(await _collect(event, delivery))]

    async def _offloaded(collected: CaseCollected) -> CaseCollected:
        result = await offload_result(
            service.js,
            collected.result,
            attempt=collected.attempt,
            inline_max=settings.payload_inline_max_bytes,
            file=COLLECTED_FILE,
        )
        return collected if result is collected.result else msgspec.structs.replace(collected, result=result)

    async def _collect(event: CaseExecuted, delivery: Delivery) -> CaseCollected:
        ref = event.result.trace_ref
        if ref is None:
            return complete(event, None, degraded="no trace reference to collect from")
        assert session is not None
        outcome = await collect_trace(build_source(ref, store, session), ref, delay_s=settings.empty_pull_delay_s)
        if outcome.status == "unavailable":
            if delivery.num_delivered <= settings.unavailable_retries:
                raise Retry(
                    f"trace endpoint unavailable: {outcome.error}", settings.retry_delay_s * delivery.num_delivered
                )
            return complete(event, outcome, degraded=f"trace unavailable at {ref.endpoint}: {outcome.error}")
        return complete(event, outcome)

    service.on_start(start)
    service.on_stop(stop)
    service.add_stage(
        Stage(
            consumer=COLLECTOR_CASES,
            handler=handle,
            accepts=(CaseExecuted,),
            concurrency=settings.concurrency,
            settled_by=settled_by_output(CASE_COLLECTED),
            exclusive=True,  # never two at once: a stalled replica is not joined on its case
        )
    )
    online = OnlineIngest(service, settings)
    online.wire()
    return online


__all__ = ["CollectorSettings", "build_collector"]
