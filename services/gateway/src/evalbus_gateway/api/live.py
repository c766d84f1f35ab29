"""The live reads of a run: `GET /v1/runs/{run_id}/logs`, `/logs/stream`, `/trajectory/live` and
`/trajectory/live/stream`, and the `live_trace` deep link of `GET /v1/runs/{run_id}`.

Every answer is read from JetStream when it is asked (the LIVE stream for output and marks, the
CASES stream for whether the run settled) and the event store (who may see the run), so every
gateway replica answers the same. The event streams use LIVE stream sequences as SSE ids, so a
client resumes with `Last-Event-ID` on any replica, missing and repeating nothing:

- a log stream starts with the current tail (the last 64 KiB; the first chunk cut to fit) and a
  trace stream with everything the ring holds, unless resumed; then each new message;
- `: heartbeat` comments on a quiet stream;
- once the run's `case.executed` is on the CASES stream, whatever the LIVE stream holds up to then
  is sent, then `event: end` with `{run_id, status}`, and the stream closes.

The streams of a run on a replica share one subscription of its LIVE subjects and one of its
case's `case.executed` (`live.fanout`): a stream replays from its start on a consumer of its own,
then joins them with no gap and no duplicate; one too far behind is cut (`: lagging`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import nats.errors
from aiohttp import web
from nats.js import JetStreamContext

from evalbus_api.live import LOG_TAIL_BYTES, LiveTraceView, LogTail, RunStatus
from evalbus_api.views import LiveTraceLink, RunView
from evalbus_contracts import encode
from evalbus_gateway.api.access import LiveRun, visible_live_run
from evalbus_gateway.api.reads import requested_on_stream
from evalbus_gateway.api.table import Body, Call, Param, Route
from evalbus_gateway.api.validation import header_seq, path_id
from evalbus_gateway.errors import NotReadyError
from evalbus_gateway.live.fanout import LAGGING, AbortOnLag, Fanout, FeedSpec, Lagged, Watcher, catch_up, replay
from evalbus_gateway.live.reads import (
    Executed,
    ExecutedStatus,
    TailStart,
    executed_feed,
    executed_on_stream,
    last_of,
    last_on,
    live_feed,
    live_subjects,
    locate_tail,
    read_live,
)
from evalbus_gateway.live.views import (
    Stored,
    end_frame,
    live_trace,
    log_frames,
    log_tail,
    recorded_frame,
    trace_frames,
)
from evalbus_gateway.state import GatewayState
from evalbus_gateway.store.queries import get_harness_trace, get_output_tail

log = logging.getLogger("evalbus.gateway.live")

DRAIN_S = 5.0
"""After the run settled, how long a stream waits for the LIVE messages published before it."""
WRITE_BYTES = 64 * 1024
"""Frames of a replay are written in chunks of about this size."""

Render = Callable[[Stored, int], list[bytes]]
"""The SSE frames of one LIVE message, its first `skip` bytes of text left out."""


# ---------------------------------------------------------------- status


async def settled_status(js: JetStreamContext, run: LiveRun) -> ExecutedStatus | None:
    """The run's execution outcome: the read model's, else the CASES stream's (no recording lag)."""
    if run.view is not None and run.view.executed_status is not None:
        return run.view.executed_status
    if run.batch_id is None or run.case_id is None:
        return None
    return await executed_on_stream(js, run.batch_id, run.case_id, run.run_id)


async def run_status(js: JetStreamContext, run: LiveRun) -> RunStatus:
    """`queued` until a dispatcher marked the run, `running` until it settled, then its outcome."""
    settled, mark = await asyncio.gather(settled_status(js, run), last_on(js, live_subjects(run.run_id, "infra")[0]))
    if settled is not None:
        return settled
    return "running" if mark is not None else "queued"


async def live_trace_link(state: GatewayState, view: RunView) -> LiveTraceLink | None:
    """Where the run's trace can be watched on its platform, while it is queued or running."""
    if view.executed_status is not None or view.batch_id is None:
        return None
    trace = await get_harness_trace(state.pool, view.batch_id)
    if trace is None:  # the batch is not recorded yet: its request on the stream says
        requested = await requested_on_stream(state.js, view.batch_id)
        trace = requested.spec.harness.trace if requested is not None else None
    if trace is None or trace.kind == "none":
        return None
    if await executed_on_stream(state.js, view.batch_id, view.case_id, view.run_id) is not None:
        return None
    return LiveTraceLink(kind=trace.kind, endpoint=trace.endpoint or "", run_id=view.run_id)


# ---------------------------------------------------------------- snapshots


def _json(value: object) -> web.Response:
    return web.Response(body=encode(value), content_type="application/json")


async def run_logs(call: Call) -> web.StreamResponse:
    """GET /v1/runs/{run_id}/logs."""
    run = await visible_live_run(call, path_id(call.request, "run_id"))
    js = call.state.js
    subject = live_subjects(run.run_id, "log")
    last, status = await asyncio.gather(last_on(js, subject[0]), run_status(js, run))
    if last is None:
        # nothing on the stream: a settled run's output may have left it (the dispatcher purges it
        # `DISPATCHER_LIVE_KEEP_SETTLED_S` after the run settled); the store has its end
        stored = await get_output_tail(call.state.pool, run.run_id)
        if stored is not None:
            return _json(LogTail(run_id=run.run_id, status=status, found=True, text=stored.text, source="store"))
        return _json(LogTail(run_id=run.run_id, status=status, found=False, text=""))
    start = await locate_tail(js, last)
    chunks = await read_live(js, subject, start_seq=start.seq, until_seq=last.seq)
    skip = start.skip if chunks and chunks[0].seq == start.seq else 0
    return _json(log_tail(run.run_id, status, chunks, skip=skip, limit=LOG_TAIL_BYTES))


async def run_live_trace(call: Call) -> web.StreamResponse:
    """GET /v1/runs/{run_id}/trajectory/live."""
    run = await visible_live_run(call, path_id(call.request, "run_id"))
    js = call.state.js
    subject_list = live_subjects(run.run_id, "infra", "trace")
    last, status = await asyncio.gather(last_of(js, subject_list), run_status(js, run))
    messages = [] if last is None else await read_live(js, subject_list, start_seq=None, until_seq=last.seq)
    return _json(live_trace(run.run_id, status, messages))


# ---------------------------------------------------------------- event streams


async def stream_run(
    request: web.Request,
    state: GatewayState,
    run: LiveRun,
    subject_list: list[str],
    *,
    start: TailStart,
    render: Render,
    prelude: bytes = b"",
) -> web.StreamResponse:
    """Serve `subject_list` of the run as SSE from `start` until the run settles (or the client
    leaves), `prelude` (frames) first."""
    streams = state.streams
    if streams.closing():
        raise NotReadyError("the gateway is stopping; reconnect to another replica")
    js, fanout = state.js, state.fanout
    live = live_feed(subject_list)
    executed = None
    if (run.view is None or run.view.executed_status is None) and run.batch_id is not None and run.case_id is not None:
        executed = executed_feed(run.batch_id, run.case_id)
    buffer = state.settings.sse_client_buffer
    abort = AbortOnLag(request.transport)
    watcher: Watcher[Stored | Executed] = Watcher(buffer, on_lag=abort)
    response = web.StreamResponse(
        status=200,
        headers={
            "Content-Type": "text/event-stream; charset=utf-8",
            "Cache-Control": "no-cache",
            "X-Accel-Buffering": "no",
        },
    )
    streams.enter()
    try:
        settled = run.view.executed_status if run.view is not None else None
        if executed is not None:
            # The case's `case.executed` events so far, then each later one through the watcher.
            joined = await fanout.join(js, executed, watcher)
            mine = (e for e in joined.kept if isinstance(e, Executed) and e.run_id == run.run_id)
            settled = next((e.status for e in mine), None)
        await response.prepare(request)
        await response.write(b": evalbus run " + run.run_id.encode("utf-8").replace(b"\n", b" ") + b"\n\n")
        pump = _Pump(response, js, fanout, run, live, watcher, start, render, prelude)
        await pump.serve(settled, state.settings.sse_heartbeat_s)
    except ConnectionResetError:
        pass  # the client left
    except Lagged:
        response.force_close()  # no keep-alive: the client reconnects afresh
        log.info("live stream of %s cut: the client fell %d messages behind", run.run_id, buffer)
        with contextlib.suppress(ConnectionResetError):
            await response.write(LAGGING)
    except nats.errors.Error as e:
        log.info("live stream of %s ended: %s", run.run_id, e)  # the client resumes with Last-Event-ID
    except asyncio.CancelledError:
        if not streams.closing():
            raise
        current = asyncio.current_task()
        if current is not None:
            current.uncancel()  # closed by shutdown: end the response; the client resumes elsewhere
    finally:
        abort.cancel()
        streams.leave()
        await fanout.leave(live, watcher)
        if executed is not None:
            await fanout.leave(executed, watcher)
    return response


@dataclass
class _Pump:
    """Writes one run stream: the replay, then the shared feed, then `end` once the run settled
    and what the LIVE stream held up to then was sent."""

    response: web.StreamResponse
    js: JetStreamContext
    fanout: Fanout
    run: LiveRun
    live: FeedSpec[Stored]
    watcher: Watcher[Stored | Executed]
    start: TailStart
    render: Render
    prelude: bytes = b""
    """Frames written before the replay (a settled run's recorded log)."""
    seen: int = 0
    """Last LIVE sequence the client has (or skips)."""

    def frames(self, item: Stored) -> list[bytes]:
        self.seen = item.seq
        return self.render(item, self.start.skip if item.seq == self.start.seq else 0)

    async def drain_point(self) -> int:
        last = await last_of(self.js, self.live.subjects)
        return last.seq if last is not None else 0

    async def serve(self, settled: ExecutedStatus | None, heartbeat_s: float) -> None:
        self.seen = self.start.seq - 1 if self.start.seq is not None else 0
        out: list[bytes] = [self.prelude] if self.prelude else []
        if settled is not None:  # nothing more comes: replay to the end, no feed needed
            async for kept in replay(self.js, self.live, after=self.seen, before=await self.drain_point() + 1):
                out += self.frames(kept)
                out = await self._flush(out, WRITE_BYTES)
            await self.watcher.write(self.response, b"".join(out) + end_frame(self.run.run_id, settled))
            return
        async for caught in catch_up(self.js, self.fanout, self.live, self.watcher, after=self.seen):
            if isinstance(caught, Stored):  # always: the replay reads the LIVE feed's subjects
                out += self.frames(caught)
            out = await self._flush(out, WRITE_BYTES)
        await self._flush(out, 0)
        drain_to: int | None = None
        deadline: float | None = None
        while True:
            if settled is not None and (drain_to is None or self.seen >= drain_to):
                await self.watcher.write(self.response, end_frame(self.run.run_id, settled))
                return
            timeout = heartbeat_s if deadline is None else max(0.0, min(heartbeat_s, deadline - time.monotonic()))
            items = await self.watcher.take(timeout)
            if not items:
                if settled is not None and deadline is not None and time.monotonic() >= deadline:
                    log.info("live stream of %s ends without LIVE messages up to %s", self.run.run_id, drain_to)
                    await self.watcher.write(self.response, end_frame(self.run.run_id, settled))
                    return
                await self.watcher.write(self.response, b": heartbeat\n\n")
                continue
            out = []
            for item in items:
                if isinstance(item, Executed):
                    if settled is None and item.run_id == self.run.run_id:
                        settled = item.status
                        drain_to = await self.drain_point()
                        deadline = time.monotonic() + DRAIN_S
                elif item.seq > self.seen:
                    out += self.frames(item)
            await self._flush(out, 0)

    async def _flush(self, out: list[bytes], at_least: int) -> list[bytes]:
        """Write `out` when it holds at least `at_least` bytes (and something); what is left to write."""
        if out and sum(len(b) for b in out) >= at_least:
            await self.watcher.write(self.response, b"".join(out))
            return []
        return out


def _resume_point(request: web.Request) -> int | None:
    return header_seq(request, "Last-Event-ID")


async def run_logs_stream(call: Call) -> web.StreamResponse:
    """GET /v1/runs/{run_id}/logs/stream (SSE)."""
    request = call.request
    run_id = path_id(request, "run_id")
    last_event_id = _resume_point(request)
    run = await visible_live_run(call, run_id)
    js = call.state.js
    subject = live_subjects(run.run_id, "log")
    last = await last_on(js, subject[0])
    if last_event_id is not None:
        start = TailStart(seq=last_event_id + 1)
    else:
        start = await locate_tail(js, last) if last is not None else TailStart(seq=None)
    prelude = b""
    if last is None:  # nothing of its output on the stream: a settled run's may have left it
        stored = await get_output_tail(call.state.pool, run.run_id)
        prelude = b"" if stored is None else recorded_frame(stored.text, stored.attempt)

    def render(stored: Stored, skip: int) -> list[bytes]:
        return log_frames(stored, skip=skip)

    return await stream_run(request, call.state, run, subject, start=start, render=render, prelude=prelude)


async def run_live_trace_stream(call: Call) -> web.StreamResponse:
    """GET /v1/runs/{run_id}/trajectory/live/stream (SSE)."""
    request = call.request
    run_id = path_id(request, "run_id")
    last_event_id = _resume_point(request)
    run = await visible_live_run(call, run_id)
    start = TailStart(seq=None if last_event_id is None else last_event_id + 1)

    def render(stored: Stored, _skip: int) -> list[bytes]:
        return trace_frames(stored)

    return await stream_run(
        request, call.state, run, live_subjects(run.run_id, "infra", "trace"), start=start, render=render
    )


# ---------------------------------------------------------------- the table

_RUN_ID = Param(
    "run_id", "path", "Run id (`evb-<batch>-<case>[-t<trial>]`)", {"type": "string", "minLength": 1, "maxLength": 256}
)
_LAST_EVENT_ID = Param(
    "Last-Event-ID", "header", "Resume after this LIVE stream sequence", {"type": "integer", "minimum": 0}
)
_SSE = Body("An event stream", content_type="text/event-stream", schema={"type": "string"})

ROUTES: tuple[Route, ...] = (
    Route(
        ("GET",),
        "/v1/runs/{run_id}/logs",
        "getRunLogs",
        "The end of a run's live log (stdout and stderr, last 64 KiB)",
        "member",
        run_logs,
        tag="runs",
        description="Read from the LIVE stream (15 minutes, 2,000 chunks per run; a settled run's output for 2 "
        "minutes after it settled), so every replica answers the same; `last_event_id` is where `/logs/stream` "
        "follows on from. Once a settled run's output has left the stream, the end of it recorded in the event store "
        "(`source: store`, at most 16 KiB). `found` is false when neither holds any output of the run.",
        params=(_RUN_ID,),
        responses={200: Body("The log tail", LogTail)},
    ),
    Route(
        ("GET",),
        "/v1/runs/{run_id}/logs/stream",
        "streamRunLogs",
        "A run's live log as server-sent events",
        "member",
        run_logs_stream,
        tag="runs",
        description="First the current tail (64 KiB), then every chunk as it is written: `event: log`, `id:` the LIVE "
        "stream sequence, `data:` `{stream, text, attempt}`. `Last-Event-ID` resumes exactly after that sequence, on "
        "any replica. `: heartbeat` comments on a quiet stream; once the run settled, `event: end` with "
        "`{run_id, status}` and the stream closes. A settled run whose output has left the stream gets one "
        "`event: log` without `id` (`stream: recorded`, its recorded tail), then `end`, resumed or not.",
        params=(_RUN_ID, _LAST_EVENT_ID),
        responses={200: _SSE},
    ),
    Route(
        ("GET",),
        "/v1/runs/{run_id}/trajectory/live",
        "getRunLiveTrajectory",
        "A run's own trace events before it seals: infra marks and the events its harness printed",
        "member",
        run_live_trace,
        tag="runs",
        description="Dispatch marks (accepted, waiting with the reason, started, released) and the harness's events as "
        "it printed them (each at most 4 KiB; a larger one is left out and counted in an `error` event), from the "
        "LIVE stream: the last 2,000 events of the last 15 minutes, and a settled run's for 2 minutes after it "
        "settled. The sealed `/trajectory` stays the record.",
        params=(_RUN_ID,),
        responses={200: Body("The live trace", LiveTraceView)},
    ),
    Route(
        ("GET",),
        "/v1/runs/{run_id}/trajectory/live/stream",
        "streamRunLiveTrajectory",
        "A run's live trace as server-sent events",
        "member",
        run_live_trace_stream,
        tag="runs",
        description="Everything the ring holds, then each event as it is published: `event: trace`, `id:` the LIVE "
        "stream sequence, `data:` the trace event (`kind` `infra` for a mark). `Last-Event-ID`, heartbeats and "
        "`event: end` as for `/logs/stream`.",
        params=(_RUN_ID, _LAST_EVENT_ID),
        responses={200: _SSE},
    ),
)
"""The live routes, added to the gateway's table in `api.routes`."""
