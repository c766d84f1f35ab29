"""Online evaluation over HTTP: online suites (`/v1/online/suites`), fate counts
(`/v1/online/stats`) and "why was this trace not judged?" (`/v1/online/observations/{trace_id}`).

Suites are events: applying one publishes `online.suite.applied`, deleting one
`online.suite.deleted`, both on `online.suite.<id>` in CASES, and a read takes the last event of
each suite's subject from the stream — so every gateway replica, and every collector, sees the same
suites. Fates and scores are read from the event store's read models. Admins change suites;
members read everything here (online suites are shared by the deployment, not owned by a member).
"""

from __future__ import annotations

import logging

from aiohttp import web

from evalbus_api.models import ErrorBody
from evalbus_api.online import (
    ObservationAnswer,
    OnlineStats,
    OnlineSuiteDetail,
    OnlineSuiteList,
    OnlineSuiteView,
    SuiteDeleted,
)
from evalbus_api.validation import SpecProblem, judges_problems, suite_id_problem
from evalbus_contracts import (
    DecodeError,
    OnlineSuiteApplied,
    OnlineSuiteDeleted,
    OnlineSuiteSpec,
    decode_event,
    encode,
)
from evalbus_contracts.streams import CASES
from evalbus_contracts.subjects import ONLINE_SUITE, online_suite_subject
from evalbus_gateway.api.errors import ApiError, not_found
from evalbus_gateway.api.table import Body, Call, Link, Param, Route
from evalbus_gateway.api.validation import path_id, query_str, read_json
from evalbus_gateway.store.online import (
    fate_counts,
    observation_fates,
    recent_judged,
    suite_series,
    suite_usage,
    suite_windows,
)
from evalbus_runtime.follow import read_last

log = logging.getLogger("evalbus.gateway.online")

SUITE_BODY_LIMIT = 1024 * 1024
"""Largest online suite definition accepted (bytes)."""


def _json(value: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode(value), content_type="application/json")


async def stored_suites(call: Call) -> dict[str, OnlineSuiteView]:
    """Every defined suite, from the last event on each suite subject."""
    out: dict[str, OnlineSuiteView] = {}
    for msg in await read_last(call.state.js, CASES.name, f"{ONLINE_SUITE}.>"):
        try:
            event = decode_event(msg.data)
        except (DecodeError, ValueError):
            log.warning("unreadable online suite event on %s skipped", msg.subject)
            continue
        if isinstance(event, OnlineSuiteApplied):
            out[event.suite.id] = OnlineSuiteView(suite=event.suite, applied_by=event.by, applied_at=event.ts)
        elif isinstance(event, OnlineSuiteDeleted):
            out.pop(event.suite_id, None)
    return out


async def _stored_suite(call: Call, suite_id: str) -> OnlineSuiteView:
    try:
        raw = await call.state.js.get_last_msg(CASES.name, online_suite_subject(suite_id))
    except Exception:  # nats-py raises NotFoundError (or a server error) for a subject with no message
        raise not_found("online suite", "suite_id", suite_id) from None
    event = decode_event(raw.data or b"")
    if not isinstance(event, OnlineSuiteApplied):
        raise not_found("online suite", "suite_id", suite_id)
    return OnlineSuiteView(suite=event.suite, applied_by=event.by, applied_at=event.ts)


def online_suite_problems(suite: OnlineSuiteSpec) -> list[SpecProblem]:
    """Every rule `suite` breaks, in document order (empty: valid)."""
    problems = [p for p in (suite_id_problem(suite.id, "$.id"),) if p is not None]
    target = suite.target
    if target.service is None and target.agent is None and target.workflow is None and not target.attributes:
        problems.append(SpecProblem("$.target", "name a service, an agent, a workflow or an attribute to match"))
    if not suite.judges:
        problems.append(SpecProblem("$.judges", "an online suite needs at least one judge"))
    problems.extend(judges_problems(suite.judges, "$.judges"))
    return problems


def check_online_suite(suite: OnlineSuiteSpec) -> None:
    """400 naming the first rule `suite` breaks."""
    problems = online_suite_problems(suite)
    if problems:
        first = problems[0]
        more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
        raise ApiError(400, "invalid", first.message + more, first.field)


async def apply_suite(call: Call) -> web.StreamResponse:
    """POST /v1/online/suites."""
    suite = await read_json(call.request, OnlineSuiteSpec, SUITE_BODY_LIMIT)
    check_online_suite(suite)
    event = OnlineSuiteApplied(suite=suite, by=call.user.name)
    await call.state.publisher.publish_event(event)
    log.info("online suite %s applied by %s", suite.id, call.user.name)
    return _json(OnlineSuiteView(suite=suite, applied_by=event.by, applied_at=event.ts), 201)


async def list_suites(call: Call) -> web.StreamResponse:
    """GET /v1/online/suites."""
    suites = await stored_suites(call)
    return _json(OnlineSuiteList(items=[suites[k] for k in sorted(suites)]))


async def get_suite(call: Call) -> web.StreamResponse:
    """GET /v1/online/suites/{suite_id}."""
    suite_id = path_id(call.request, "suite_id")
    view = await _stored_suite(call, suite_id)
    pool = call.state.pool
    return _json(
        OnlineSuiteDetail(
            suite=view.suite,
            applied_by=view.applied_by,
            applied_at=view.applied_at,
            metrics=await suite_windows(pool, suite_id),
            series=await suite_series(pool, suite_id),
            fates=await fate_counts(pool, suite_id),
            recent=await recent_judged(pool, suite_id),
            judge_usage=await suite_usage(pool, suite_id),
        )
    )


async def delete_suite(call: Call) -> web.StreamResponse:
    """DELETE /v1/online/suites/{suite_id}."""
    suite_id = path_id(call.request, "suite_id")
    await _stored_suite(call, suite_id)
    await call.state.publisher.publish_event(OnlineSuiteDeleted(suite_id=suite_id, by=call.user.name))
    log.info("online suite %s deleted by %s", suite_id, call.user.name)
    return _json(SuiteDeleted(suite_id=suite_id))


async def stats(call: Call) -> web.StreamResponse:
    """GET /v1/online/stats."""
    suite = query_str(call.request, "suite")
    return _json(OnlineStats(counts=await fate_counts(call.state.pool, suite)))


async def observation(call: Call) -> web.StreamResponse:
    """GET /v1/online/observations/{trace_id}."""
    trace_id = path_id(call.request, "trace_id")
    fates = await observation_fates(call.state.pool, trace_id)
    return _json(ObservationAnswer(trace_id=trace_id, status="known" if fates else "unknown", fates=fates))


def _suite_links(suite_id: str, *, delete: bool = True) -> tuple[Link, ...]:
    """Where an online suite (its id at the runtime expression `suite_id`) leads: reading, deleting it."""
    read = Link("getOnlineSuite", "getOnlineSuite", {"suite_id": suite_id}, description="The suite")
    if not delete:
        return (read,)
    return (read, Link("deleteOnlineSuite", "deleteOnlineSuite", {"suite_id": suite_id}, description="Delete it"))


_SUITE_ID = Param("suite_id", "path", "The online suite", {"type": "string", "minLength": 1, "maxLength": 256}, True)

ROUTES: tuple[Route, ...] = (
    Route(
        ("POST",),
        "/v1/online/suites",
        "applyOnlineSuite",
        "Define (or replace) an online suite",
        "admin",
        apply_suite,
        description="Publishes `online.suite.applied`: from then on the collectors sample the target's production "
        "traces at `sample_ratio` (by trace id, as OpenTelemetry's TraceIdRatioBased sampler) and the judges score "
        "them. Applying an existing id replaces it. 400 names the offending field.",
        tag="online",
        request=Body("The suite", OnlineSuiteSpec),
        responses={
            201: Body(
                "Applied",
                OnlineSuiteView,
                links=(
                    *_suite_links("$response.body#/suite/id"),
                    Link("listOnlineSuites", "listOnlineSuites", description="Every suite, this one among them"),
                ),
            )
        },
    ),
    Route(
        ("GET",),
        "/v1/online/suites",
        "listOnlineSuites",
        "Every online suite",
        "member",
        list_suites,
        tag="online",
        responses={200: Body("The suites, by id", OnlineSuiteList)},
    ),
    Route(
        ("GET",),
        "/v1/online/suites/{suite_id}",
        "getOnlineSuite",
        "An online suite with its rolling scores, fate counts and recent judged observations",
        "member",
        get_suite,
        tag="online",
        params=(_SUITE_ID,),
        responses={
            200: Body("The suite", OnlineSuiteDetail, links=_suite_links("$request.path.suite_id")[1:]),
            404: Body("No such suite", ErrorBody),
        },
    ),
    Route(
        ("DELETE",),
        "/v1/online/suites/{suite_id}",
        "deleteOnlineSuite",
        "Stop sampling for an online suite",
        "admin",
        delete_suite,
        description="Publishes `online.suite.deleted`; observations already sampled are still judged.",
        tag="online",
        params=(_SUITE_ID,),
        responses={
            200: Body("Deleted", SuiteDeleted, links=_suite_links("$response.body#/suite_id", delete=False)),
            404: Body("No such suite", ErrorBody),
        },
    ),
    Route(
        ("GET",),
        "/v1/online/stats",
        "onlineStats",
        "Observations per suite, fate and reason",
        "member",
        stats,
        tag="online",
        params=(Param("suite", "query", "Only this suite", {"type": "string", "maxLength": 256}),),
        responses={200: Body("The counts", OnlineStats)},
    ),
    Route(
        ("GET",),
        "/v1/online/observations/{trace_id}",
        "getObservationFates",
        "Why was this trace (not) judged?",
        "member",
        observation,
        description="Every fate of the observation with this trace id (or observation id), per suite, with its "
        "reason: sampled, skipped (no_suite, not_target, filtered, not_sampled, over_rate_cap, over_budget), dropped "
        "(invalid_trace_id, too_large), late, dead_lettered, judged. `status: unknown` when evalbus never received it.",
        tag="online",
        params=(Param("trace_id", "path", "Trace id (32 hex) or observation id", {"type": "string"}, True),),
        responses={200: Body("Its fates", ObservationAnswer)},
    ),
)
"""The routes, added to the gateway's table in `api.routes`."""
