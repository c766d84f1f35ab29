"""A retry's backoff is spent on the bus, not in a compute slot: the dispatcher puts the retried
request back with its delay (a `waiting` live mark says why) and runs it when it comes back, so a
replica with one slot runs the next case meanwhile. Real nats-server, the dispatcher service on
the local backend."""

from __future__ import annotations

import uuid
from pathlib import Path

import nats
import pytest
from nats.aio.msg import Msg
from tests.test_deploy_nats_live import running

from evalbus.infra.nats import NatsServer
from evalbus.testing.pipeline import eventually
from evalbus_contracts import (
    CasePlan,
    CaseRequested,
    CaseSpec,
    CommandHarness,
    Infra,
    InfraMark,
    batch_run_id,
    decode_event,
)
from evalbus_contracts.events import CaseExecuted
from evalbus_dispatcher.service import DispatcherSettings, build_dispatcher
from evalbus_runtime import Publisher, Service

pytestmark = [pytest.mark.integration]

BACKOFF_S = 4.0


def request(batch: str, case: str, attempt: int) -> CaseRequested:
    return CaseRequested(
        batch_id=batch,
        case_id=case,
        run_id=batch_run_id(batch, case, None),
        attempt=attempt,
        case=CaseSpec(id=case, input="hi"),
        harness=CommandHarness(id="echo", command=("echo", "done")),
        plan=CasePlan(suite_id="suite", retries=2),
    )


async def test_a_retry_waits_on_the_bus_and_its_slot_runs_another_case_meanwhile(
    fresh_nats: NatsServer, tmp_path: Path
) -> None:
    settings = DispatcherSettings(
        service="dispatcher", nats_url=fresh_nats.url, http_port=0, slots=1, workdir_root=str(tmp_path),
        retry_backoff_s=BACKOFF_S,
    )  # fmt: skip
    service = Service(settings)
    build_dispatcher(service, settings)
    batch = f"bk{uuid.uuid4().hex[:8]}"
    order: list[CaseExecuted] = []
    marks: list[InfraMark] = []

    async def on_executed(msg: Msg) -> None:
        event = decode_event(msg.data)
        assert isinstance(event, CaseExecuted)
        order.append(event)

    async def on_infra(msg: Msg) -> None:
        event = decode_event(msg.data)
        if isinstance(event, InfraMark):
            marks.append(event)

    nc = await nats.connect(fresh_nats.url)
    try:
        async with running(service):
            await nc.subscribe(f"case.executed.{batch}.>", cb=on_executed)
            await nc.subscribe("run.*.live.infra", cb=on_infra)
            publisher = Publisher(nc)
            # the retry first, so the one slot takes it first; the fresh case after it
            await publisher.publish_event(request(batch, "retried", attempt=2))
            await publisher.publish_event(request(batch, "fresh", attempt=1))

            async def both() -> bool:
                return len(order) == 2

            def seen() -> str:
                executed = [(e.case_id, e.attempt, e.status) for e in order]
                live = [(m.case_id, [mark.event for mark in m.marks]) for m in marks]
                return f"executed: {executed}; live marks: {live}"

            await eventually(both, timeout_s=60, what="both cases executed", diagnostics=seen)
            await publisher.stop()
    finally:
        await nc.close()

    # the fresh case ran while the retry waited its backoff (a slot held by the wait: the other way round)
    assert [e.case_id for e in order] == ["fresh", "retried"]
    assert all(e.status == "succeeded" for e in order), [e.result.failure for e in order]
    retried = order[1]
    assert retried.attempt == 2
    waiting = [m for m in retried.result.trace if isinstance(m, Infra) and m.event == "waiting"]
    assert len(waiting) == 1
    assert waiting[0].message.startswith(f"attempt 2 waited {BACKOFF_S:g}s after a retryable failure")
    assert "no compute slot held" in waiting[0].message
    # the live view said so while it waited: the put-back delivery's mark, then the run's own
    live_waiting = [
        mark.message for m in marks if m.run_id == retried.run_id for mark in m.marks if mark.event == "waiting"
    ]
    assert live_waiting[0] == f"attempt 2 waits {BACKOFF_S:g}s after a retryable failure"
    assert len(live_waiting) == 2
