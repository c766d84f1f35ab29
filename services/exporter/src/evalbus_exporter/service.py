"""Wiring of the exporter: the `exporter-cases` consumer (global export concurrency = its
`max_ack_pending`, default 2) feeding judged cases to their batch's sinks."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import msgspec

from evalbus_contracts import CaseJudged
from evalbus_contracts.events import EventBase
from evalbus_contracts.streams import EXPORTER_CASES
from evalbus_contracts.subjects import CASE_EXPORTED
from evalbus_exporter.export import SinkCache, SinkFactory, export_case, unexportable
from evalbus_exporter.sinks.factory import SinkBuilder
from evalbus_runtime import Delivery, Retry, Service, ServiceSettings, Stage, settled_by_output
from evalbus_runtime.objects import ObjectReadError, ObjectStoreError
from evalbus_runtime.payloads import load_result, unreadable


class ExporterSettings(ServiceSettings):
    """Settings of the exporter (`EXPORTER_<KEY>`, then `<KEY>`)."""

    concurrency: int = 4
    """Cases exported at once by one replica (the global limit is the consumer's max_ack_pending)."""
    global_limit: int = EXPORTER_CASES.max_ack_pending
    """Cases exported at once across ALL replicas (the consumer's max_ack_pending): a sink's limit."""
    export_dir: str | None = None
    """Folder `jsonl` sink paths are resolved in (default: `<state dir>/exports`, else `./exports`)."""

    def export_root(self) -> Path:
        """The folder jsonl files are written under."""
        if self.export_dir:
            return Path(self.export_dir)
        return Path(self.state_dir) / "exports" if self.state_dir else Path("exports")


def build_exporter(service: Service, settings: ExporterSettings, factory: SinkFactory | None = None) -> None:
    """Add the export stage to `service` (sinks from `factory`, by default jsonl and the platforms)."""
    builder = SinkBuilder(settings.export_root())
    cache = SinkCache(factory or builder)

    async def start(_: Service) -> None:
        await builder.start()

    async def handle(event: CaseJudged, _: Delivery) -> Sequence[EventBase]:
        sinks = await cache.for_batch(event.batch_id or "", event.plan.sinks)
        if sinks and event.result.payload is not None:
            try:
                result = await load_result(service.js, event.result)
            except ObjectReadError as e:
                raise Retry(f"the run's payload could not be read yet: {e}") from e
            except ObjectStoreError as e:  # tampered, replaced or gone: no sink gets other bytes
                return [unexportable(event, sinks, unreadable(e))]
            event = msgspec.structs.replace(event, result=result)
        return [await export_case(event, sinks)]

    async def stop(_: Service) -> None:
        await cache.close()
        await builder.close()

    service.on_start(start)
    service.on_stop(stop)
    service.add_stage(
        Stage(
            consumer=msgspec.structs.replace(EXPORTER_CASES, max_ack_pending=settings.global_limit),
            handler=handle,
            accepts=(CaseJudged,),
            concurrency=settings.concurrency,
            settled_by=settled_by_output(CASE_EXPORTED),  # a redelivered case exported already is not sent again
            exclusive=True,  # never two at once: a stalled replica is not joined on its case
        )
    )
