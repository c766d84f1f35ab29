"""Deciding with the results over HTTP: a batch compared with another (`GET /v1/compare`) and a
suite's baseline (`GET|PUT /v1/suites/{suite_id}/baseline`).

The comparison is `evalbus_grading.compare` over the two batches' runs as the `runs` read model
holds them (cancelled runs and runs that never executed are left out), computed in a worker thread
so the event loop keeps serving. Both batches must be visible to the caller (404 otherwise, as for
every batch read) and finalized (409). The answer also carries the candidate's own gates (those its
spec recorded), decided as `evalbus run` decides them, so the dashboard shows the same verdicts.

A baseline is an event: setting one publishes `suite.baseline.set` on `suite.baseline.<suite>` in
CASES (the recorder stores it in the event store like every CASES event), and a read takes the last
event on that subject from the stream — so every replica answers the same at once. Only a batch of
the suite that finalized `succeeded` can be a baseline: a superseded, cancelled or failed batch is
refused (409). Suites are shared by the deployment: any member who can see the batch may set it.
"""

from __future__ import annotations

import asyncio
import logging

import msgspec
from aiohttp import web

from evalbus_api.compare import BaselineRequest, BaselineView, ComparisonView
from evalbus_api.models import ErrorBody
from evalbus_api.validation import MAX_ID_LENGTH
from evalbus_api.views import BatchView
from evalbus_contracts import (
    BatchSummary,
    CaseFailure,
    DecodeError,
    Score,
    SuiteBaselineSet,
    decode,
    decode_event,
    encode,
)
from evalbus_contracts.streams import CASES
from evalbus_contracts.subjects import suite_baseline_subject
from evalbus_gateway.api.errors import ApiError, not_found
from evalbus_gateway.api.reads import finalized_on_stream, find_batch
from evalbus_gateway.api.table import Body, Call, Param, Route
from evalbus_gateway.api.validation import path_id, query_str, read_json
from evalbus_gateway.store.connections import acquire
from evalbus_gateway.store.queries import get_batch_spec
from evalbus_grading.compare import CaseRun, Comparison, compare
from evalbus_grading.gates import GateError, GateResult, NoRegression, decide_regression, decide_threshold, parse_gate

log = logging.getLogger("evalbus.gateway.compare")

BASELINE_BODY_LIMIT = 4096
"""Largest `PUT …/baseline` body (bytes)."""


def _json(value: object, status: int = 200) -> web.Response:
    return web.Response(status=status, body=encode(value), content_type="application/json")


async def current_baseline(call: Call, suite_id: str) -> BaselineView | None:
    """The suite's baseline: the last `suite.baseline.set` on its subject (None when never set)."""
    try:
        raw = await call.state.js.get_last_msg(CASES.name, suite_baseline_subject(suite_id))
    except Exception:  # nats-py raises NotFoundError (or a server error) for a subject with no message
        return None
    try:
        event = decode_event(raw.data or b"")
    except DecodeError:
        log.warning("unreadable baseline event of suite %s ignored", suite_id)
        return None
    if not isinstance(event, SuiteBaselineSet):
        return None
    return BaselineView(suite_id=event.suite_id, batch_id=event.baseline, set_by=event.by, set_at=event.ts)


async def _visible(call: Call, batch_id: str, field: str) -> BatchView:
    """The batch if the caller may see it (404 naming `field` otherwise), with its final status."""
    view = await find_batch(call.state.pool, call.state.js, batch_id)
    if view is None or not call.user.may_access(view.submitted_by):
        raise not_found("batch", field, batch_id)
    if view.finalized_at is None:
        found = await finalized_on_stream(call.state.js, batch_id)
        if found is not None:
            view = msgspec.structs.replace(view, status=found[1].status, finalized_at=found[1].ts)
    return view


def _batch_id(value: str | None, field: str) -> str:
    """A batch id from the query or the body: 1 to `MAX_ID_LENGTH` characters (400 naming `field`)."""
    if value is None or not value.strip() or len(value) > MAX_ID_LENGTH:
        raise ApiError(400, "invalid", f"{field} must be a batch id of 1 to {MAX_ID_LENGTH} characters", field)
    return value


def _finalized(view: BatchView, field: str) -> None:
    if view.finalized_at is None:
        raise ApiError(409, "conflict", f"batch {view.batch_id} is not finalized yet ({view.status})", field)


async def compared_runs(call: Call, batch_id: str) -> list[CaseRun]:
    """A batch's runs that executed (not cancelled), as the comparison reads them."""
    async with acquire(call.state.pool) as conn:
        rows = await conn.fetch(
            "SELECT run_id, case_id, trial, answer, verdict, scores::text AS scores, failure::text AS failure "
            "FROM runs WHERE batch_id = $1 AND executed_status IN ('succeeded', 'failed') ORDER BY run_id",
            batch_id,
        )
    runs = []
    for row in rows:
        if row["failure"] is not None and decode(row["failure"], CaseFailure).failure_class == "cancelled":
            continue
        runs.append(
            CaseRun(
                run_id=row["run_id"],
                case_id=row["case_id"],
                trial=row["trial"],
                answer=row["answer"],
                verdict=row["verdict"],
                scores=() if row["scores"] is None else decode(row["scores"], tuple[Score, ...]),
            )
        )
    return runs


async def _against(
    call: Call, candidate: BatchView, named: str | None, compared: Comparison
) -> tuple[Comparison | None, str]:
    """The candidate compared with the base a regression gate names (None: the suite's baseline),
    or None and why not; the comparison already made when that is its base."""
    if named is None:
        baseline = await current_baseline(call, candidate.suite_id) if candidate.suite_id else None
        if baseline is None:
            suite = candidate.suite_id or "?"
            return None, f"suite {suite} has no baseline to compare with (evalbus baseline set {suite} BATCH)"
        named = baseline.batch_id
    if named == compared.base:
        return compared, ""
    try:
        base = await _visible(call, named, "base")
        _finalized(base, "base")
    except ApiError as e:
        return None, f"comparing with {named} failed: {e}"
    base_runs = await compared_runs(call, named)
    candidate_runs = await compared_runs(call, candidate.batch_id)
    return await asyncio.to_thread(compare, named, base_runs, candidate.batch_id, candidate_runs), ""


async def candidate_gates(call: Call, candidate: BatchView, compared: Comparison) -> tuple[GateResult, ...]:
    """Every gate the candidate's spec recorded, decided."""
    spec = await get_batch_spec(call.state.pool, candidate.batch_id)
    if spec is None or not spec.gates:
        return ()
    summary = candidate.summary or BatchSummary()
    bases: dict[str | None, tuple[Comparison | None, str]] = {}
    results = []
    for raw in spec.gates:
        try:
            gate = parse_gate(raw)
        except GateError as e:  # refused at submission; a spec recorded by an older gateway may hold one
            results.append(
                GateResult(
                    gate=raw if isinstance(raw, str) else "no_significant_regression", passed=False, detail=str(e)
                )
            )
            continue
        if isinstance(gate, NoRegression):
            if gate.baseline not in bases:
                bases[gate.baseline] = await _against(call, candidate, gate.baseline, compared)
            results.append(decide_regression(gate, *bases[gate.baseline]))
        else:
            results.append(decide_threshold(gate, summary))
    return tuple(results)


# ---------------------------------------------------------------- handlers


async def compare_batches(call: Call) -> web.StreamResponse:
    """GET /v1/compare?base=…&candidate=…."""
    request = call.request
    candidate_id = _batch_id(query_str(request, "candidate"), "candidate")
    raw_base = query_str(request, "base")
    base_id = None if raw_base is None else _batch_id(raw_base, "base")
    candidate = await _visible(call, candidate_id, "candidate")
    from_baseline = base_id is None
    if base_id is None:
        baseline = await current_baseline(call, candidate.suite_id or "") if candidate.suite_id else None
        if baseline is None:
            raise ApiError(
                404,
                "not_found",
                f"suite {candidate.suite_id!r} has no baseline: name one with ?base=<batch id> "
                "or set it (PUT /v1/suites/{suite_id}/baseline)",
                "base",
            )
        base_id = baseline.batch_id
    base = await _visible(call, base_id, "base")
    _finalized(base, "base")
    _finalized(candidate, "candidate")
    base_runs = await compared_runs(call, base_id)
    candidate_runs = await compared_runs(call, candidate_id)
    comparison = await asyncio.to_thread(compare, base_id, base_runs, candidate_id, candidate_runs)
    comparison = msgspec.structs.replace(
        comparison, base_suite=base.suite_id, candidate_suite=candidate.suite_id, baseline=from_baseline
    )
    gates = await candidate_gates(call, candidate, comparison)
    return _json(ComparisonView(**msgspec.structs.asdict(comparison), gates=gates))


async def get_baseline(call: Call) -> web.StreamResponse:
    """GET /v1/suites/{suite_id}/baseline."""
    suite_id = path_id(call.request, "suite_id")
    baseline = await current_baseline(call, suite_id)
    if baseline is None:
        raise not_found("baseline of suite", "suite_id", suite_id)
    return _json(baseline)


async def set_baseline(call: Call) -> web.StreamResponse:
    """PUT /v1/suites/{suite_id}/baseline."""
    suite_id = path_id(call.request, "suite_id")
    body = await read_json(call.request, BaselineRequest, BASELINE_BODY_LIMIT)
    _batch_id(body.batch_id, "$.batch_id")
    view = await _visible(call, body.batch_id, "$.batch_id")
    if view.suite_id != suite_id:
        raise ApiError(
            409, "conflict", f"batch {view.batch_id} is of suite {view.suite_id!r}, not {suite_id!r}", "$.batch_id"
        )
    _finalized(view, "$.batch_id")
    if view.status != "succeeded":
        raise ApiError(
            409,
            "conflict",
            f"batch {view.batch_id} finalized {view.status}: only a batch that succeeded can be a baseline",
            "$.batch_id",
        )
    event = SuiteBaselineSet(suite_id=suite_id, baseline=view.batch_id, by=call.user.name)
    await call.state.publisher.publish_event(event)
    log.info("baseline of suite %s set to %s by %s", suite_id, view.batch_id, call.user.name)
    return _json(BaselineView(suite_id=suite_id, batch_id=view.batch_id, set_by=event.by, set_at=event.ts))


# ---------------------------------------------------------------- the table

_ID = {"type": "string", "minLength": 1, "maxLength": 256}
_SUITE_ID = Param("suite_id", "path", "Suite id", _ID, required=True)

ROUTES: tuple[Route, ...] = (
    Route(
        ("GET",),
        "/v1/compare",
        "compareBatches",
        "A candidate batch against a base batch: per-metric deltas, paired tests, regressed cases",
        "member",
        compare_batches,
        description="Cases are matched by case id (trials pooled per case). Per metric (and `verdicts`): base and "
        "candidate values over the cases both measured, the delta with a paired-bootstrap 95 % interval, the "
        "p-value of a paired test (exact McNemar for pass/fail pairs, Wilcoxon signed-rank otherwise), a "
        "Benjamini–Hochberg q-value across the metrics and `significant` (q < 0.05); the cases by what became of "
        "their verdicts, each with both batches' runs. Without `base`, the candidate suite's baseline. 404 when "
        "a batch is unknown or not the caller's (or there is no baseline), 409 when one is not finalized. `gates`: the "
        "candidate's own gates, decided as `evalbus run` decides them.",
        tag="compare",
        params=(
            Param("candidate", "query", "The candidate batch", _ID, required=True),
            Param("base", "query", "The base batch (default: the candidate suite's baseline)", _ID),
        ),
        responses={
            200: Body("The comparison", ComparisonView),
            404: Body("Unknown batch, or no baseline (`error.field` names which)", ErrorBody),
            409: Body("A batch is not finalized", ErrorBody),
        },
    ),
    Route(
        ("GET",),
        "/v1/suites/{suite_id}/baseline",
        "getSuiteBaseline",
        "A suite's baseline batch",
        "member",
        get_baseline,
        tag="compare",
        params=(_SUITE_ID,),
        responses={200: Body("The baseline", BaselineView), 404: Body("No baseline set", ErrorBody)},
    ),
    Route(
        ("PUT",),
        "/v1/suites/{suite_id}/baseline",
        "setSuiteBaseline",
        "Make a batch its suite's baseline",
        "member",
        set_baseline,
        description="Publishes `suite.baseline.set`; comparisons and regression gates of the suite then default to "
        "this batch. The batch must be the caller's to see (404), of this suite and finalized `succeeded` (409: a "
        "superseded, cancelled or failed batch is never a baseline).",
        tag="compare",
        params=(_SUITE_ID,),
        request=Body("The batch", BaselineRequest),
        responses={200: Body("The new baseline", BaselineView), 409: Body("Not a possible baseline", ErrorBody)},
    ),
)
"""The compare and baseline routes."""
