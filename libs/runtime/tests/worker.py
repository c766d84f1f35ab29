"""A chassis worker process for the consumer-loop tests: relays `case.requested` → `case.executed`.

Configured by environment: WORKER_CONSUMER (JSON ConsumerDef), WORKER_MARKS (a file that gets one
line per start/end of a message), WORKER_WORK_S (seconds of work per message), WORKER_MODE
(`ok`, `fail` = always raise, `poison-on-input` = Poison when the case input is "poison"),
WORKER_CONCURRENCY, WORKER_SETTLED (set: the stage's `settled_by` is its `case.executed`),
WORKER_EXCLUSIVE (set: the stage is exclusive).
"""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence

import msgspec

from evalbus.testing.bus import executed
from evalbus_contracts import CaseRequested
from evalbus_contracts.events import EventBase
from evalbus_contracts.streams import ConsumerDef
from evalbus_contracts.subjects import CASE_EXECUTED
from evalbus_runtime import (
    Delivery,
    Poison,
    Service,
    ServiceSettings,
    Stage,
    load_settings,
    run_service,
    settled_by_output,
)


def mark(path: str, text: str) -> None:
    with open(path, "a") as f:
        f.write(f"{text} {time.time():.6f} {os.getpid()}\n")


def build(service: Service) -> None:
    consumer = msgspec.json.decode(os.environ["WORKER_CONSUMER"], type=ConsumerDef)
    marks = os.environ["WORKER_MARKS"]
    work_s = float(os.environ.get("WORKER_WORK_S", "0"))
    mode = os.environ.get("WORKER_MODE", "ok")

    async def handle(event: CaseRequested, delivery: Delivery) -> Sequence[EventBase]:
        mark(marks, f"start {event.case_id} {delivery.num_delivered}")
        if mode == "fail":
            raise RuntimeError("always failing")
        if mode == "poison-on-input" and event.case.input == "poison":
            raise Poison("input says poison")
        await asyncio.sleep(work_s)
        mark(marks, f"end {event.case_id} {delivery.num_delivered}")
        return [executed(event)]

    service.add_stage(
        Stage(
            consumer=consumer,
            handler=handle,
            accepts=(CaseRequested,),
            concurrency=int(os.environ.get("WORKER_CONCURRENCY", "4")),
            retry_base_s=0.1,
            settled_by=settled_by_output(CASE_EXECUTED) if os.environ.get("WORKER_SETTLED") else lambda _event: (),
            exclusive=bool(os.environ.get("WORKER_EXCLUSIVE")),
        )
    )


if __name__ == "__main__":
    run_service(load_settings(ServiceSettings, os.environ.get("WORKER_SERVICE", "worker")), build)
