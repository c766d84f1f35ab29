"""The HTTP routes of the gateway and their installation on the chassis' aiohttp app.

Reads come from the PostgreSQL read models (the stream only fills in a batch that is not recorded
yet), so every replica answers the same; writes are events published to JetStream
(`batch.requested`, `batch.cancelled`) with their dedup ids. Members see and cancel only the
batches they submitted — another member's batch is answered 404, exactly like a missing one.
"""

from __future__ import annotations

import logging
import secrets
from datetime import datetime
from typing import Any, cast

import msgspec
from aiohttp import web
from aiohttp.typedefs import Handler
from nats.errors import Error as NatsError

from evalbus_api.models import (
    BatchAccepted,
    BatchLinks,
    BatchPage,
    CancelAccepted,
    CancelRequest,
    CasePage,
    ErrorBody,
    Health,
    Me,
    Readiness,
)
from evalbus_api.views import BatchView, RunView, Stage, Trajectory
from evalbus_contracts import BatchCancelled, BatchRequested, BatchSpec, encode, suite_case_count
from evalbus_contracts.streams import SUPERSEDE_KEYS
from evalbus_gateway.api.access import LiveRun, visible_batch, visible_run
from evalbus_gateway.api.actions import ROUTES as ACTION_ROUTES
from evalbus_gateway.api.auth import Principal, authenticate, require_admin
from evalbus_gateway.api.compare import ROUTES as COMPARE_ROUTES
from evalbus_gateway.api.datasets import ROUTES as DATASET_ROUTES
from evalbus_gateway.api.datasets import with_dataset_index
from evalbus_gateway.api.errors import ApiError, error_middleware
from evalbus_gateway.api.idempotency import (
    KEY_REUSED,
    claim_batch,
    idempotency_key,
    key_param,
    keyed_batch_id,
    spec_digest,
)
from evalbus_gateway.api.live import ROUTES as LIVE_ROUTES
from evalbus_gateway.api.live import live_trace_link
from evalbus_gateway.api.mcp import ROUTES as MCP_ROUTES
from evalbus_gateway.api.objects import ROUTES as OBJECT_ROUTES
from evalbus_gateway.api.objects import run_trajectory
from evalbus_gateway.api.online import ROUTES as ONLINE_ROUTES
from evalbus_gateway.api.openapi import build_openapi
from evalbus_gateway.api.placement import ROUTES as PLACEMENT_ROUTES
from evalbus_gateway.api.placement import placement_of, with_lanes_waiting
from evalbus_gateway.api.reads import finalized_on_stream, list_batches
from evalbus_gateway.api.rejudge import ROUTE as REJUDGE_ROUTE
from evalbus_gateway.api.sse import stream_batch_events
from evalbus_gateway.api.supersede import bucket_key, claim_latest, requested_seq
from evalbus_gateway.api.table import Body, Call, Link, Param, Route
from evalbus_gateway.api.validation import (
    check_batch_spec,
    decode_cursor,
    encode_cursor,
    header_seq,
    parse_json,
    path_id,
    query_choice,
    query_int,
    query_str,
    read_body,
    read_json,
)
from evalbus_gateway.live.placement import run_phase
from evalbus_gateway.state import GatewayState
from evalbus_gateway.store import (
    get_batch,
    list_runs,
    open_batches_by_supersede_key,
    rebuild_read_models,
)
from evalbus_gateway.store.queries import RebuildOutcome
from evalbus_gateway.web import ROUTES as WEB_ROUTES

log = logging.getLogger("evalbus.gateway.api")

STAGES = ("requested", "executed", "collected", "judged", "exported")
"""Values of the `stage` filter on a batch's cases."""


# ---------------------------------------------------------------- helpers


def json_response(value: Any, status: int = 200, headers: dict[str, str] | None = None) -> web.Response:
    """A JSON response encoded by msgspec."""
    return web.Response(status=status, body=encode(value), content_type="application/json", headers=headers)


def new_batch_id() -> str:
    """A fresh batch id: `b` + 12 hex digits (short and subject-safe)."""
    return "b" + secrets.token_hex(6)


def idempotent_batch_id(principal: str, key: str) -> str:
    """The batch id of a submission with an `Idempotency-Key`: the same principal and key give the
    same id (see `api.idempotency` for what a retry with the key gets)."""
    return keyed_batch_id(principal, key)


def links(batch_id: str) -> BatchLinks:
    """Where to follow a batch."""
    base = f"/v1/batches/{batch_id}"
    return BatchLinks(self_=base, cases=f"{base}/cases", events=f"{base}/events", cancel=f"{base}/cancel")


async def _supersede(call: Call, spec: BatchSpec, new_id: str, seq: int | None) -> tuple[str, ...]:
    """Cancel, as superseded by `new_id`, every open batch with the spec's supersede key that the
    caller may cancel (an admin: all of them; a member: its own) and that was requested before it:
    those of the read model, and the caller's latest of the key too recent to be recorded yet
    (`api.supersede`). Requests are ordered by their place on the stream (`seq`, looked up for a
    retry), so an older request — a retry, or one that stalled — never cancels a newer batch; when a
    later submission got there first, `new_id` itself is cancelled as superseded by it (and nothing
    else is)."""
    if spec.supersede_key is None:
        return ()
    state = call.state
    if seq is None:  # a retry: where its batch's request stands
        seq = await requested_seq(state.js, new_id)
    events: list[BatchCancelled] = []
    chosen: list[str] = []
    if seq is not None:
        try:
            kv = await state.js.key_value(SUPERSEDE_KEYS.bucket)
            displaced = await claim_latest(kv, bucket_key(call.user.name, spec.supersede_key), new_id, seq)
        except NatsError:  # the read model still answers for what is recorded; the batch stands
            log.warning(
                "supersede-keys unavailable for batch %s; superseding from the read model", new_id, exc_info=True
            )
            displaced = None
        if displaced is not None and displaced.old == new_id:  # a later submission won: only this one goes
            await state.publisher.publish_events(
                [BatchCancelled(batch_id=new_id, reason="superseded", by=displaced.new, superseded_by=displaced.new)]
            )
            return ()
        if displaced is not None:
            view = await get_batch(state.pool, displaced.old)
            if view is None or view.finalized_at is None:  # not recorded yet, or still open
                chosen.append(displaced.old)
    for batch_id in await open_batches_by_supersede_key(state.pool, spec.supersede_key):
        if batch_id == new_id or batch_id in chosen:
            continue
        if not call.user.is_admin:
            view = await get_batch(state.pool, batch_id)
            if view is None or not call.user.may_access(view.submitted_by):
                continue
        older = await requested_seq(state.js, batch_id)
        if seq is not None and older is not None and older > seq:
            continue  # requested after this one: not this request's to cancel
        chosen.append(batch_id)
    events += [BatchCancelled(batch_id=old, reason="superseded", by=new_id, superseded_by=new_id) for old in chosen]
    await state.publisher.publish_events(events)
    return tuple(chosen)


# ---------------------------------------------------------------- handlers


async def submit_batch(call: Call) -> web.StreamResponse:
    """POST /v1/batches."""
    state = call.state
    spec = await read_json(call.request, BatchSpec, state.settings.max_request_bytes)
    check_batch_spec(spec)
    spec = msgspec.structs.replace(spec, suite=await with_dataset_index(call, spec.suite))
    key = idempotency_key(call.request)
    batch_id = idempotent_batch_id(call.user.name, key) if key else new_batch_id()
    digest = spec_digest(spec) if key else None
    event = BatchRequested(batch_id=batch_id, spec=spec, submitted_by=call.user.name, request_digest=digest)
    size = len(encode(event))
    max_payload = int(getattr(state.nc, "max_payload", 0) or 0)
    if max_payload and size > max_payload:
        raise ApiError(
            413,
            "payload_too_large",
            f"the batch is {size} bytes, more than the bus accepts ({max_payload}): upload the cases "
            "(POST /v1/datasets) and name them in suite.dataset_ref",
            "$.suite.cases",
        )
    if key is None:
        seq: int | None = (await state.publisher.publish_event(event)).seq
        published = True
    else:
        claim = await claim_batch(state, event)
        published, seq = claim.published, claim.seq
    if published:
        log.info("batch %s requested by %s (%d cases)", batch_id, call.user.name, suite_case_count(spec.suite))
    # A retry supersedes again too: its first attempt may have stopped between publishing and that.
    superseded = await _supersede(call, spec, batch_id, seq)
    body = BatchAccepted(batch_id=batch_id, links=links(batch_id), superseded=superseded)
    return json_response(body, status=202, headers={"Location": body.links.self_})


async def list_batches_route(call: Call) -> web.StreamResponse:
    """GET /v1/batches."""
    settings = call.state.settings
    request = call.request
    limit = query_int(request, "limit", default=settings.page_size, low=1, high=settings.max_page_size)
    owner = None if call.user.is_admin else call.user.name
    scope = owner or "*"
    raw_cursor = query_str(request, "cursor")
    after = None
    if raw_cursor is not None:
        created, batch_id = decode_cursor(raw_cursor, "batches", scope, size=2)
        try:
            after = (datetime.fromisoformat(created), batch_id)
        except ValueError:
            raise ApiError(400, "invalid_cursor", "cursor is not one this API returned", "cursor") from None
    views, position = await list_batches(call.state.pool, submitted_by=owner, limit=limit, after=after)
    cursor = encode_cursor("batches", scope, (position[0].isoformat(), position[1])) if position else None
    return json_response(BatchPage(batches=tuple(views), next_cursor=cursor))


async def get_batch_route(call: Call) -> web.StreamResponse:
    """GET /v1/batches/{batch_id}. The read model may lag the stream by a commit: a batch already
    finalized on the stream is shown with its final status, summary and export."""
    batch_id = path_id(call.request, "batch_id")
    view = await visible_batch(call, batch_id)
    if view.finalized_at is None:
        found = await finalized_on_stream(call.state.js, batch_id)
        if found is not None:
            final = found[1]
            view = msgspec.structs.replace(
                view,
                status=final.status,
                summary=final.summary,
                export=final.export,
                error=final.error,
                finalized_at=final.ts,
            )
    if view.finalized_at is None and view.cancel_reason is None:
        view = await with_lanes_waiting(call.state.js, view)
    return json_response(view)


async def batch_cases(call: Call) -> web.StreamResponse:
    """GET /v1/batches/{batch_id}/cases."""
    settings = call.state.settings
    request = call.request
    batch_id = path_id(request, "batch_id")
    limit = query_int(request, "limit", default=settings.page_size, low=1, high=settings.max_page_size)
    stage = query_choice(request, "stage", STAGES)
    raw_cursor = query_str(request, "cursor")
    after = decode_cursor(raw_cursor, "cases", f"{batch_id}/{stage or '*'}", size=1)[0] if raw_cursor else None
    await visible_batch(call, batch_id)
    page = await list_runs(call.state.pool, batch_id, limit=limit, cursor=after, stage=cast("Stage | None", stage))
    cursor = encode_cursor("cases", f"{batch_id}/{stage or '*'}", (page.next_cursor,)) if page.next_cursor else None
    return json_response(CasePage(cases=page.runs, next_cursor=cursor))


async def batch_events(call: Call) -> web.StreamResponse:
    """GET /v1/batches/{batch_id}/events (SSE)."""
    request = call.request
    batch_id = path_id(request, "batch_id")
    last_event_id = header_seq(request, "Last-Event-ID")
    await visible_batch(call, batch_id)
    state = call.state
    return await stream_batch_events(
        request,
        state.js,
        batch_id,
        last_event_id=last_event_id,
        heartbeat_s=state.settings.sse_heartbeat_s,
        streams=state.streams,
        fanout=state.fanout,
        buffer=state.settings.sse_client_buffer,
        db=state.pool,
    )


async def cancel_batch(call: Call) -> web.StreamResponse:
    """POST /v1/batches/{batch_id}/cancel."""
    state = call.state
    request = call.request
    batch_id = path_id(request, "batch_id")
    body = await read_body(request, state.settings.max_request_bytes)
    if body.strip():
        parse_json(body, CancelRequest)
    view = await visible_batch(call, batch_id)
    finalized = await finalized_on_stream(state.js, batch_id)
    if finalized is not None or view.finalized_at is not None:
        status = finalized[1].status if finalized is not None else view.status
        raise ApiError(409, "conflict", f"batch {batch_id} is already finalized ({status})", "batch_id")
    if view.cancel_reason is not None:
        return json_response(CancelAccepted(batch_id=batch_id, reason=view.cancel_reason), status=202)
    await state.publisher.publish_event(BatchCancelled(batch_id=batch_id, reason="cancelled", by=call.user.name))
    log.info("batch %s cancelled by %s", batch_id, call.user.name)
    return json_response(CancelAccepted(batch_id=batch_id), status=202)


async def get_run_route(call: Call) -> web.StreamResponse:
    """GET /v1/runs/{run_id}; with its `phase` (its placement's while it has not settled) and, while
    it is queued or running and its harness exports to a trace platform, `live_trace`."""
    view = await visible_run(call, path_id(call.request, "run_id"))
    placement = None
    if view.executed_status is None:
        live = LiveRun(run_id=view.run_id, batch_id=view.batch_id, case_id=view.case_id, view=view)
        placement = await placement_of(call.state.js, live)
    link = await live_trace_link(call.state, view)
    phase = run_phase(view.stage, view.executed_status, placement)
    return json_response(msgspec.structs.replace(view, live_trace=link, phase=phase))


async def me(call: Call) -> web.StreamResponse:
    """GET /v1/me."""
    return json_response(Me(principal=call.user.name, role=call.user.role))


async def rebuild(call: Call) -> web.StreamResponse:
    """POST /v1/admin/read-models/rebuild."""
    body = (await read_body(call.request, call.state.settings.max_request_bytes)).strip()
    if body not in (b"", b"{}"):
        raise ApiError(400, "invalid", "this request takes no body (or an empty object)", "$")
    outcome = await rebuild_read_models(call.state.pool)
    log.info("read models rebuilt by %s: %d events", call.user.name, outcome.events)
    return json_response(outcome)


async def openapi_document(call: Call) -> web.StreamResponse:
    """GET /openapi.json."""
    return web.Response(body=call.state.openapi, content_type="application/json")


# ---------------------------------------------------------------- the table

_ID = {"type": "string", "minLength": 1, "maxLength": 256}
_BATCH_ID = Param("batch_id", "path", "Batch id", _ID, required=True)
_RUN_ID = Param("run_id", "path", "Run id (`evb-<batch>-<case>[-t<trial>]`)", _ID, required=True)


def _limit(default_doc: str) -> Param:
    return Param("limit", "query", f"Page size ({default_doc})", {"type": "integer", "minimum": 1})


_CURSOR = Param("cursor", "query", "`next_cursor` of the previous page", {"type": "string"})


def _batch_links(batch_id: str) -> tuple[Link, ...]:
    """Where a batch (its id at the runtime expression `batch_id`) leads: itself, its runs, cancelling it."""
    return (
        Link("getBatch", "getBatch", {"batch_id": batch_id}, description="The batch"),
        Link("listBatchCases", "listBatchCases", {"batch_id": batch_id}, description="Its runs"),
        Link("cancelBatch", "cancelBatch", {"batch_id": batch_id}, description="Cancel it"),
    )


def _run_links(run_id: str) -> tuple[Link, ...]:
    """Where a run (its id at the runtime expression `run_id`) leads: itself, its trajectory, its logs."""
    return (
        Link("getRun", "getRun", {"run_id": run_id}, description="The run"),
        Link("getRunTrajectory", "getRunTrajectory", {"run_id": run_id}, description="Its recorded events"),
        Link("getRunLogs", "getRunLogs", {"run_id": run_id}, description="Its log tail"),
    )


ROUTES: tuple[Route, ...] = (
    Route(
        ("POST",),
        "/v1/batches",
        "submitBatch",
        "Submit a batch",
        "member",
        submit_batch,
        description="Validates the spec and publishes `batch.requested`. With a `supersede_key`, every open batch "
        "with the same key (yours; any, for an admin) is cancelled as superseded by the new one. An "
        "`Idempotency-Key` header makes a retried submission return the same batch id, publishing nothing "
        "new; the same key with a different spec is a 409 `idempotency_key_reused`.",
        params=(key_param("Same key, same principal → same batch id"),),
        request=Body("The batch", BatchSpec),
        responses={
            202: Body(
                "Accepted: published as `batch.requested`",
                BatchAccepted,
                links=_batch_links("$response.body#/batch_id"),
            ),
            409: KEY_REUSED,
        },
    ),
    Route(
        ("GET",),
        "/v1/batches",
        "listBatches",
        "List batches, newest first",
        "member",
        list_batches_route,
        description="A member sees the batches it submitted; an admin sees all.",
        params=(_limit("default 100"), _CURSOR),
        responses={200: Body("A page of batches", BatchPage)},
    ),
    Route(
        ("GET",),
        "/v1/batches/{batch_id}",
        "getBatch",
        "A batch: status, per-stage counts, summary, export status, error",
        "member",
        get_batch_route,
        params=(_BATCH_ID,),
        responses={200: Body("The batch", BatchView, links=_batch_links("$response.body#/batch_id")[1:])},
    ),
    Route(
        ("GET",),
        "/v1/batches/{batch_id}/cases",
        "listBatchCases",
        "A batch's runs with per-stage status, scores and verdict",
        "member",
        batch_cases,
        params=(
            _BATCH_ID,
            _limit("default 100"),
            _CURSOR,
            Param("stage", "query", "Only runs whose furthest stage is this one", {"enum": list(STAGES)}),
        ),
        responses={
            200: Body(
                "A page of runs, by run id",
                CasePage,
                links=(
                    *_run_links("$response.body#/cases/0/run_id"),
                    Link(
                        "nextPage",
                        "listBatchCases",
                        {"batch_id": "$request.path.batch_id", "cursor": "$response.body#/next_cursor"},
                        description="The next page",
                    ),
                ),
            )
        },
    ),
    Route(
        ("GET",),
        "/v1/batches/{batch_id}/events",
        "streamBatchEvents",
        "The batch's events as server-sent events",
        "member",
        batch_events,
        description="`id:` is the CASES stream sequence and `event:` the event type; `data:` is the event JSON. "
        "`Last-Event-ID` resumes exactly after that sequence. A `: heartbeat` comment is sent on a quiet "
        "stream; after `batch.finalized` comes `event: end` with `{batch_id, status}` and the stream closes.",
        params=(
            _BATCH_ID,
            Param("Last-Event-ID", "header", "Resume after this stream sequence", {"type": "integer", "minimum": 0}),
        ),
        responses={200: Body("An event stream", content_type="text/event-stream", schema={"type": "string"})},
    ),
    Route(
        ("POST",),
        "/v1/batches/{batch_id}/cancel",
        "cancelBatch",
        "Cancel a batch",
        "member",
        cancel_batch,
        description="Publishes `batch.cancelled`: no new case starts, in-flight cases settle, and the batch ends "
        "`cancelled` with a partial summary. 409 when it is already finalized.",
        params=(_BATCH_ID,),
        request=Body("Optional, empty object", CancelRequest),
        request_required=False,
        responses={
            202: Body("Cancelling", CancelAccepted),
            409: Body("Already finalized (`error.field` = `batch_id`)", ErrorBody),
        },
    ),
    REJUDGE_ROUTE,
    Route(
        ("GET",),
        "/v1/runs/{run_id}",
        "getRun",
        "A run (one case × trial of a batch)",
        "member",
        get_run_route,
        tag="runs",
        description="The read model's run, with its `phase`: while it has not settled, its placement phase "
        "projected from the LIVE stream as `GET /v1/runs/{run_id}/placement` does (`queued`, `blocked`, `starting`, "
        "`running`; `finishing` once its sandbox is released, `lost` with its dispatcher); then its furthest stage "
        "recorded (`executed`, `collected`, `judged`, `exported`), or `failed` / `cancelled`.",
        params=(_RUN_ID,),
        responses={200: Body("The run", RunView)},
    ),
    Route(
        ("GET",),
        "/v1/runs/{run_id}/trajectory",
        "getRunTrajectory",
        "A run's recorded events in stream order, and its seal once settled",
        "member",
        run_trajectory,
        tag="runs",
        params=(_RUN_ID,),
        description="A result that was too large for the bus is stored with its answer, trace or snapshot in "
        "the `artifacts` bucket; the read fills them back in from the object after checking its digest (the "
        "event's `loaded` names them) and answers `409 tampered` when the object is not the one the events pin.",
        responses={200: Body("The trajectory", Trajectory)},
    ),
    *OBJECT_ROUTES,
    *LIVE_ROUTES,
    *COMPARE_ROUTES,
    *DATASET_ROUTES,
    *PLACEMENT_ROUTES,
    *ACTION_ROUTES,
    *ONLINE_ROUTES,
    *WEB_ROUTES,
    *MCP_ROUTES,
    Route(
        ("GET",),
        "/v1/me",
        "whoAmI",
        "The principal and role of the bearer token",
        "member",
        me,
        tag="auth",
        responses={200: Body("Who you are", Me)},
    ),
    Route(
        ("POST",),
        "/v1/admin/read-models/rebuild",
        "rebuildReadModels",
        "Rebuild the read models from the event store",
        "admin",
        rebuild,
        tag="admin",
        responses={200: Body("What was replayed", RebuildOutcome)},
    ),
    Route(
        ("GET",),
        "/openapi.json",
        "getOpenApi",
        "This document",
        "public",
        openapi_document,
        tag="meta",
        responses={200: Body("OpenAPI 3.1", schema={"type": "object"})},
    ),
    Route(
        ("GET", "HEAD"),
        "/healthz",
        "health",
        "Liveness",
        "public",
        tag="meta",
        responses={200: Body("Up", Health)},
    ),
    Route(
        ("GET", "HEAD"),
        "/readyz",
        "readiness",
        "Readiness: connected to the bus and started",
        "public",
        tag="meta",
        responses={200: Body("Ready", Readiness), 503: Body("Not ready", Readiness)},
    ),
    Route(
        ("GET", "HEAD"),
        "/metrics",
        "metrics",
        "Prometheus metrics",
        "public",
        tag="meta",
        responses={200: Body("Prometheus text format", content_type="text/plain", schema={"type": "string"})},
    ),
)
"""Every route of the gateway's app (the last three are the chassis' own)."""


# ---------------------------------------------------------------- installation


def _bind(route: Route, state: GatewayState) -> Handler:
    handler = route.handler
    assert handler is not None

    async def endpoint(request: web.Request) -> web.StreamResponse:
        principal: Principal | None = None
        if route.access != "public":
            principal = authenticate(request, state.tokens)
            if route.access == "admin":
                require_admin(principal)
        call = Call(request=request, state=state, principal=principal)
        if principal is not None and not principal.is_admin and route.is_event_stream:
            # The handler serves the whole stream, so the slot is held for as long as it is open.
            with state.stream_slots.hold(principal.name, state.settings.sse_max_per_principal):
                return await handler(call)
        return await handler(call)

    endpoint.__name__ = route.operation_id
    return endpoint


def install_api(app: web.Application, state: GatewayState, routes: tuple[Route, ...] = ROUTES) -> None:
    """Add the error middleware and every route with a handler to `app` (before it starts), and
    generate the OpenAPI document from the same table."""
    app.middlewares.append(error_middleware)
    for route in routes:
        if route.handler is None:
            continue
        endpoint = _bind(route, state)
        for method in route.methods:
            app.router.add_route(method, route.path, endpoint)
        if "GET" in route.methods and not route.is_event_stream:
            app.router.add_route("HEAD", route.path, endpoint)  # HTTP: a GET resource answers HEAD (no body)
    state.openapi = encode(build_openapi(routes))
