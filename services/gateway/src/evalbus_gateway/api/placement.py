"""`GET /v1/runs/{run_id}/placement`: where a run's sandbox is and why ("why is my case not
running?"), projected when asked from the LIVE stream (the run's marks and latest sample), the
`dispatchers` bucket and the dispatchers' queue on the CASES stream, so every replica answers the
same. A run read: `runs:read` and the run-audience rule (404 for a run the caller may not see)."""

from __future__ import annotations

import asyncio

import msgspec
from aiohttp import web
from nats.js import JetStreamContext

from evalbus_api.live import Asked, RunPlacement
from evalbus_api.views import BatchView
from evalbus_contracts import InfraMark, LivePlacement, encode, lane_problem, utcnow
from evalbus_gateway.api.access import LiveRun, visible_live_run
from evalbus_gateway.api.live import run_status
from evalbus_gateway.api.reads import requested_on_stream
from evalbus_gateway.api.table import Body, Call, Param, Route
from evalbus_gateway.api.validation import path_id
from evalbus_gateway.live.dispatchers import dispatcher_board, latest_request, requests_ahead
from evalbus_gateway.live.placement import MarkSeen, Requested, SampleSeen, lanes_waiting, project
from evalbus_gateway.live.reads import last_on, live_subjects, read_live


async def _marks(js: JetStreamContext, run_id: str) -> list[MarkSeen]:
    subject = live_subjects(run_id, "infra")
    last = await last_on(js, subject[0])
    if last is None:
        return []
    out: list[MarkSeen] = []
    for stored in await read_live(js, subject, start_seq=None, until_seq=last.seq):
        event = stored.event
        if isinstance(event, InfraMark):
            out.extend(
                MarkSeen(mark=mark, execution=event.execution, attempt=event.attempt, at=event.ts)
                for mark in event.marks
            )
    return out


async def _sample(js: JetStreamContext, run_id: str) -> SampleSeen | None:
    last = await last_on(js, live_subjects(run_id, "placement")[0])
    if last is None or not isinstance(last.event, LivePlacement):
        return None
    event = last.event
    return SampleSeen(sample=event.sample, execution=event.execution, attempt=event.attempt)


async def _requested(js: JetStreamContext, run: LiveRun) -> Requested | None:
    if run.batch_id is None or run.case_id is None:
        return None
    stored = await latest_request(js, run.batch_id, run.case_id, run.run_id)
    if stored is None:
        return None
    req = stored.request
    # a request whose lane is no lane name (published around the gateway) has no queue to count
    ahead = await requests_ahead(js, stored.seq, req.lane) if lane_problem(req.lane) is None else None
    return Requested(
        attempt=req.attempt,
        asked=Asked(timeout_s=req.case.timeout_s or req.harness.timeout_s),
        ahead=ahead,
        lane=req.lane,
    )


async def placement_of(js: JetStreamContext, run: LiveRun) -> RunPlacement:
    """The run's placement, projected from what the bus holds now."""
    status, marks, sample, requested, (statuses, server_now) = await asyncio.gather(
        run_status(js, run),
        _marks(js, run.run_id),
        _sample(js, run.run_id),
        _requested(js, run),
        dispatcher_board(js),
    )
    return project(
        run_id=run.run_id,
        status=status,
        marks=marks,
        sample=sample,
        requested=requested,
        statuses=statuses,
        now=server_now or utcnow(),  # the dispatchers' freshness is judged on the server's clock
    )


async def run_placement(call: Call) -> web.StreamResponse:
    """GET /v1/runs/{run_id}/placement."""
    run = await visible_live_run(call, path_id(call.request, "run_id"))
    view = await placement_of(call.state.js, run)
    return web.Response(body=encode(view), content_type="application/json")


async def with_lanes_waiting(js: JetStreamContext, view: BatchView) -> BatchView:
    """`view` with the lanes of its cases no running dispatcher serves (while some case has not
    executed): the harness's lane and the inline cases' own."""
    if view.total_runs is not None and view.counts.executed >= view.total_runs:
        return view
    requested = await requested_on_stream(js, view.batch_id)
    if requested is None or requested.rejudge_of is not None:
        return view
    spec = requested.spec
    lanes = {spec.harness.lane} | {c.lane for c in spec.suite.cases if c.lane}
    statuses, server_now = await dispatcher_board(js)
    waiting = lanes_waiting(lanes, statuses, server_now or utcnow())
    return msgspec.structs.replace(view, waiting=waiting) if waiting else view


_RUN_ID = Param(
    "run_id", "path", "Run id (`evb-<batch>-<case>[-t<trial>]`)", {"type": "string", "minLength": 1, "maxLength": 256}
)

ROUTES: tuple[Route, ...] = (
    Route(
        ("GET",),
        "/v1/runs/{run_id}/placement",
        "getRunPlacement",
        "Where a run's sandbox is and why: queued, blocked, starting, running or dead",
        "member",
        run_placement,
        tag="runs",
        description="`phase` with the `reason` while queued or blocked (how many requests are ahead of it in its "
        "lane, how busy the lane's dispatchers' slots are, a retry's backoff, no dispatcher running, no dispatcher "
        "serving its lane) or dead (released, settled, lost with "
        "its dispatcher); the dispatcher, unit and node; what it asked for and what it uses (the latest resource "
        "sample: pid, processes, resident memory, CPU seconds, age); restarts; the OOM verdict; and every infra mark "
        "(the backend's event feed). Read from the LIVE stream, the `dispatchers` bucket and the dispatchers' queue, "
        "so every replica answers the same.",
        params=(_RUN_ID,),
        responses={200: Body("The placement", RunPlacement)},
    ),
)
"""The placement route, added to the gateway's table in `api.routes`."""
