"""An upgrade to lanes on a real nats-server: the dispatchers' queue as the release before lanes
left it — `dispatcher-cases` created the old way (`$JS.API.CONSUMER.DURABLE.CREATE`, filter
`case.requested.>`) with a request of that release waiting in it (its payload as first written,
`tests/fixtures/events/case.requested.v1.json`: no lane anywhere) — is taken over by a dispatcher of
this release: the consumer keeps its place and narrows to the default lane (`case.requested.*.*`),
and the old request runs, in the default lane."""

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import nats
import nats.js.errors
import pytest
from nats.js import api as jsapi

from evalbus.infra.nats import NatsServer
from evalbus.testing.pipeline import eventually
from evalbus_contracts import STREAMS, CaseExecuted, CaseRequested, decode_event, subjects
from evalbus_contracts.streams import DISPATCHER_CASES
from evalbus_dispatcher.service import DispatcherSettings, build_dispatcher
from evalbus_runtime import Service, ensure_topology

pytestmark = pytest.mark.integration

FIXTURE = Path(__file__).parent / "fixtures" / "events" / "case.requested.v1.json"


@contextlib.asynccontextmanager
async def running(service: Service) -> AsyncIterator[Service]:
    await service.start()
    try:
        yield service
    finally:
        await service.stop()


async def test_the_queue_of_the_release_before_lanes_is_taken_over_with_its_requests(
    fresh_nats: NatsServer, tmp_path: Path
) -> None:
    nats_url = fresh_nats.url
    nc = await nats.connect(nats_url)
    try:
        js = nc.jetstream()
        await ensure_topology(js, STREAMS, ())
        old_config = jsapi.ConsumerConfig(
            durable_name=DISPATCHER_CASES.durable,
            filter_subject="case.requested.>",
            ack_policy=jsapi.AckPolicy.EXPLICIT,
            deliver_policy=jsapi.DeliverPolicy.ALL,
            ack_wait=10.0,
            max_deliver=5,
            max_ack_pending=1000,
            max_waiting=4096,
        )
        await js.add_consumer("CASES", old_config)  # no name: the legacy durable create

        doc = json.loads(FIXTURE.read_bytes())
        batch = f"bup{uuid.uuid4().hex[:8]}"
        doc |= {"batch_id": batch, "run_id": f"evb-{batch}-c1", "event_id": uuid.uuid4().hex}
        doc["harness"]["command"] = ["cat"]  # the fixture's agent path was the capturing machine's
        assert "lane" not in doc["harness"]
        assert "lane" not in doc["case"]
        old = subjects.case_subject(subjects.CASE_REQUESTED, batch, "c1")
        await js.publish(old, json.dumps(doc).encode(), headers={"Nats-Msg-Id": f"case.requested:{doc['run_id']}"})
        pending = await js.consumer_info("CASES", DISPATCHER_CASES.durable)
        assert pending.num_pending >= 1

        settings = DispatcherSettings(
            service="dispatcher", nats_url=nats_url, slots=1, workdir_root=str(tmp_path), replica_id="d-new"
        )
        service = Service(settings)
        build_dispatcher(service, settings)
        async with running(service):
            info = await js.consumer_info("CASES", DISPATCHER_CASES.durable)
            assert info.config.filter_subject == "case.requested.*.*"

            executed: list[CaseExecuted] = []

            async def ran() -> bool:
                try:
                    raw = await js.get_last_msg("CASES", subjects.case_subject(subjects.CASE_EXECUTED, batch, "c1"))
                except nats.js.errors.NotFoundError:
                    return False
                event = decode_event(raw.data or b"")
                assert isinstance(event, CaseExecuted)
                executed.append(event)
                return True

            await eventually(ran, timeout_s=60, what="the old request executed by the new dispatcher")
        request = decode_event(json.dumps(doc).encode())
        assert isinstance(request, CaseRequested)
        assert (request.lane, request.subject()) == ("default", old)
        assert executed[0].run_id == doc["run_id"]
        assert executed[0].status == "succeeded", executed[0].result.failure
    finally:
        await nc.close()
