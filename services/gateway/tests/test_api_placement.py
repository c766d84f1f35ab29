"""`GET /v1/runs/{run_id}/placement` against a real nats-server (one per test: the queue counts are
the test's own) and PostgreSQL, with two gateway replicas: a queued run's place in the dispatchers'
queue and why it waits, no dispatcher running, a running run's unit and sample, a retry's backoff,
a run lost with its dispatcher, a settled one — the same answer from both replicas, and the run
audience rule."""

from __future__ import annotations

import uuid
from collections.abc import AsyncIterator
from datetime import timedelta

import aiohttp
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.infra.nats import NatsServer
from evalbus.testing.pipeline import eventually
from evalbus_api.live import RunPlacement
from evalbus_contracts import (
    DispatcherStatus,
    Infra,
    InfraMark,
    LivePlacement,
    PlacementSample,
    decode,
    encode,
    utcnow,
)
from evalbus_contracts.streams import DISPATCHERS
from evalbus_gateway.testing import BatchScript, RunningGateway, batch_spec, member, running_gateway
from evalbus_runtime import Publisher, connect, ensure_topology

pytestmark = pytest.mark.integration

ALICE, BOB = "tok-alice", "tok-bob"


@pytest.fixture
async def bus(fresh_nats: NatsServer) -> AsyncIterator[tuple[NatsClient, Publisher]]:
    nc = await connect(fresh_nats.url, "placement-test")
    await ensure_topology(nc.jetstream())
    pub = Publisher(nc)
    await pub.start()
    yield nc, pub
    await pub.stop()
    await nc.close()


@pytest.fixture
async def gateways(
    fresh_nats: NatsServer, database_url: str, bus: tuple[NatsClient, Publisher]
) -> AsyncIterator[tuple[RunningGateway, RunningGateway]]:
    tokens = {ALICE: member("alice"), BOB: member("bob")}
    async with (
        running_gateway(fresh_nats.url, database_url, tokens=tokens) as one,
        running_gateway(fresh_nats.url, database_url, tokens=tokens) as two,
    ):
        yield one, two


async def placement(gw: RunningGateway, run_id: str, token: str = ALICE) -> tuple[int, bytes]:
    async with (
        aiohttp.ClientSession() as http,
        http.get(f"{gw.base_url}/v1/runs/{run_id}/placement", headers={"Authorization": f"Bearer {token}"}) as resp,
    ):
        return resp.status, await resp.read()


AGREE_S = 10.0
"""How long the two replicas may take to have seen the same bus messages (each follows the
dispatchers' statuses on its own watch, so one may be a message behind the other for a moment)."""


async def both(gateways: tuple[RunningGateway, RunningGateway], run_id: str) -> RunPlacement:
    """The placement as both replicas give it, once they agree (within `AGREE_S`)."""
    answers: list[RunPlacement] = []

    async def agree() -> bool:
        answers.clear()
        for gw in gateways:
            code, body = await placement(gw, run_id)
            assert code == 200, body
            answers.append(decode(body, RunPlacement))
        return answers[0] == answers[1]

    await eventually(agree, timeout_s=AGREE_S, what="both gateway replicas to give the same placement",
                     diagnostics=lambda: f"{answers[0]}\n!=\n{answers[1]}")  # fmt: skip
    return answers[0]


async def put_status(
    nc: NatsClient, name: str, slots: int, runs: tuple[str, ...], *, skew_s: float = 0.0, interval_s: float = 2.0
) -> None:
    """Write a dispatcher's status as a replica whose clock is `skew_s` off would (its age is the
    server's to measure, never the writer's clock)."""
    at = utcnow() + timedelta(seconds=skew_s)
    status = DispatcherStatus(
        dispatcher=name,
        node="n1",
        slots=slots,
        used=len(runs),
        runs=runs,
        started_at=at,
        updated_at=at,
        interval_s=interval_s,
    )
    kv = await nc.jetstream().key_value(DISPATCHERS.bucket)
    await kv.put(name, encode(status))


async def recorded(gw: RunningGateway, run_id: str) -> None:
    """Wait until the recorder wrote the run (a moment after its request)."""

    async def found() -> bool:
        async with (
            aiohttp.ClientSession() as http,
            http.get(f"{gw.base_url}/v1/runs/{run_id}", headers={"Authorization": f"Bearer {ALICE}"}) as resp,
        ):
            return resp.status == 200

    await eventually(found, timeout_s=20, what=f"run {run_id} recorded")


def new_script(cases: tuple[str, ...]) -> BatchScript:
    return BatchScript("b" + uuid.uuid4().hex[:12], batch_spec(cases), submitted_by="alice")


async def test_a_queued_run_says_how_many_are_ahead_and_why_it_waits(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher]
) -> None:
    nc, pub = bus
    script = new_script(("c1", "c2", "c3"))
    await pub.publish_event(script.requested())
    for case_id in script.case_ids:
        await pub.publish_event(script.case_requested(case_id))
    run_id = script.run_id("c3")
    for case_id in script.case_ids:
        await recorded(gateways[0], script.run_id(case_id))

    # Nobody to take it: blocked.
    view = await both(gateways, run_id)
    assert (view.status, view.phase) == ("queued", "blocked")
    assert view.reason == "no dispatcher is running: the run waits for one to start"
    assert view.queue is not None
    assert view.queue.ahead == 2

    # A dispatcher whose only slot is busy: queued behind the two requests before it.
    await put_status(nc, "d-1", 1, ("evb-other-x",))
    view = await both(gateways, run_id)
    assert view.phase == "queued"
    assert (
        view.reason == "waiting for a compute slot: 2 ahead of it; all 1 slot(s) of 1 dispatcher(s) are busy (d-1: 1/1)"
    )
    assert view.asked.timeout_s == script.spec.harness.timeout_s
    first = await both(gateways, script.run_id("c1"))
    assert first.queue is not None
    assert first.queue.ahead == 0

    # Its clock ten minutes behind or ahead changes nothing: freshness is the server's to measure.
    for skew_s in (-600.0, 600.0):
        await put_status(nc, "d-1", 1, ("evb-other-x",), skew_s=skew_s)
        view = await both(gateways, run_id)
        assert view.phase == "queued", (skew_s, view.reason)

    # The dispatcher is gone (no status written for three of its intervals, by the server's
    # clock): blocked again, naming when it was last seen.
    await put_status(nc, "d-1", 1, ("evb-other-x",), interval_s=0.1)

    async def blocked() -> bool:
        return (await both(gateways, run_id)).phase == "blocked"

    await eventually(blocked, timeout_s=10, what="the silent dispatcher taken for gone")
    view = await both(gateways, run_id)
    assert view.reason is not None
    assert "the last one, d-1, was last seen at" in view.reason

    # Another member may not see it; an unknown run is 404 too.
    assert (await placement(gateways[0], run_id, BOB))[0] == 404
    assert (await placement(gateways[0], "evb-nope-c1"))[0] == 404


async def test_a_running_run_shows_its_unit_and_sample_then_dead_once_released(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher]
) -> None:
    nc, pub = bus
    script = new_script(("c1",))
    await pub.publish_event(script.requested())
    await pub.publish_event(script.case_requested("c1"))
    run_id = script.run_id("c1")
    ids = {"batch_id": script.batch_id, "case_id": "c1", "run_id": run_id, "execution": "e1"}
    await put_status(nc, "d-1", 2, (run_id,))

    async def mark(seq: int, event: str, message: str = "", unit: str | None = None, **kw: object) -> None:
        infra = Infra(scope="placement", event=event, message=message or event, unit=unit, node="n1")
        await pub.publish_event(InfraMark(mark=infra, seq=seq, **ids, **kw))  # type: ignore[arg-type]

    await mark(1, "accepted", "accepted by dispatcher d-1")
    assert (await both(gateways, run_id)).phase == "starting"
    await mark(2, "waiting", "attempt 1 waits 1s after a retryable failure")
    blocked = await both(gateways, run_id)
    assert (blocked.status, blocked.phase, blocked.reason) == (
        "running",
        "blocked",
        "attempt 1 waits 1s after a retryable failure",
    )
    await mark(3, "started")
    await mark(4, "placed", "process group 4242 started on n1", unit="pgid:4242")
    sample = PlacementSample(
        at=utcnow(), dispatcher="d-1", node="n1", unit="pgid:4242", pid=4242, processes=3, rss_bytes=52_428_800,
        peak_rss_bytes=52_428_800, cpu_seconds=1.25, age_s=4.5, timeout_s=60.0,
    )  # fmt: skip
    await pub.publish_event(LivePlacement(sample=sample, seq=1, **ids))  # type: ignore[arg-type]
    running = await both(gateways, run_id)
    assert (running.phase, running.reason, running.dispatcher, running.unit, running.node) == (
        "running",
        None,
        "d-1",
        "pgid:4242",
        "n1",
    )
    assert running.used == sample
    assert [e.event for e in running.events] == ["accepted", "waiting", "started", "placed"]

    await mark(5, "exited", "exited with 0 after 4.50s")
    exited = msgspec_replace(sample, state="exited", exit_code=0, oom=False)
    await pub.publish_event(LivePlacement(sample=exited, seq=2, **ids))  # type: ignore[arg-type]
    await mark(6, "released")
    dead = await both(gateways, run_id)
    assert (dead.phase, dead.oom, dead.used) == ("dead", False, exited)
    assert dead.reason == "the sandbox was released; the run is finishing without it (trace collection, graders)"

    await pub.publish_event(script.executed("c1"))
    settled = await both(gateways, run_id)
    assert (settled.status, settled.phase) == ("succeeded", "dead")
    assert settled.reason == "the run settled (succeeded); the harness exited with 0 after 4.50s"


async def test_a_run_whose_dispatcher_stopped_answering_is_dead(
    gateways: tuple[RunningGateway, RunningGateway], bus: tuple[NatsClient, Publisher]
) -> None:
    nc, pub = bus
    script = new_script(("c1",))
    await pub.publish_event(script.requested())
    await pub.publish_event(script.case_requested("c1"))
    run_id = script.run_id("c1")
    long_ago = utcnow() - timedelta(seconds=90)
    ids = {"batch_id": script.batch_id, "case_id": "c1", "run_id": run_id, "execution": "e1", "ts": long_ago}
    # a run's first marks go out in one message (the dispatcher's hold): the unit is in `more`
    first, *more = (
        Infra(scope="placement", event=event, message=event, unit="pgid:7" if event == "placed" else None)
        for event in ("accepted", "started", "placed")
    )
    await pub.publish_event(InfraMark(mark=first, more=tuple(more), seq=1, **ids))  # type: ignore[arg-type]
    await put_status(nc, "d-2", 1, ())  # alive, but not holding it
    view = await both(gateways, run_id)
    assert view.phase == "dead"
    assert view.reason is not None
    assert view.reason.startswith("the dispatcher that held it stopped answering: nothing heard of this execution for")
    assert view.unit == "pgid:7"


def msgspec_replace(sample: PlacementSample, **changes: object) -> PlacementSample:
    import msgspec

    return msgspec.structs.replace(sample, **changes)
