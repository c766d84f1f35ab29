"""`POST /v1/batches/{batch_id}/rejudge`: judge a finalized batch again without executing anything.

The gateway mints a new batch id and publishes

1. `batch.requested` for the new batch: the old spec with its judges replaced (by the body's
   `judges`, else the old ones), `submitted_by` the caller and `rejudge_of` the old batch, so the
   dispatcher fans nothing out;
2. one `case.executed` per old run, read from the event store: the old result (trace, grader
   scores, answer, failure) unchanged except its run id (`evb-<new>-<case>[-t<n>]`), the plan's
   judges replaced, `rejudge_of` set. A run whose trace the collector completed
   (`control-plane` collect) is replayed from its `case.collected` result with
   `trace_complete=True`, so the judge takes it directly and the collector pulls nothing.

The judge, the exporter and the recorder then handle the new batch like any other, and it is
finalized when every replayed run is exported. Only a finalized batch can be re-judged (409
otherwise); whoever may see the old batch (its creator, or an admin) may re-judge it. With an
`Idempotency-Key`, a retry gets the same new batch and the key with other judges a 409
(`api.idempotency`).

`rejudge_events` is the pure part: old events in, new events out.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence

import msgspec
from aiohttp import web

from evalbus_api.models import BatchAccepted, BatchLinks, ErrorBody
from evalbus_contracts import (
    BatchRequested,
    BatchSpec,
    CaseCollected,
    CaseExecuted,
    DecodeError,
    JudgeSpec,
    batch_run_id,
    decode_event,
    encode,
    expected_runs,
)
from evalbus_gateway.api.errors import ApiError, not_found
from evalbus_gateway.api.idempotency import (
    claim_batch,
    idempotency_key,
    key_param,
    keyed_batch_id,
    spec_digest,
)
from evalbus_gateway.api.reads import finalized_on_stream, find_batch, requested_on_stream
from evalbus_gateway.api.table import Body, Call, Param, Route
from evalbus_gateway.api.validation import check_batch_spec, parse_json, path_id, read_body
from evalbus_gateway.store import get_batch_spec
from evalbus_gateway.store.connections import snapshot

log = logging.getLogger("evalbus.gateway.api")


class RejudgeRequest(msgspec.Struct, frozen=True, kw_only=True, forbid_unknown_fields=True):
    """Optional body of `POST /v1/batches/{batch_id}/rejudge` (an empty body is the same as `{}`)."""

    judges: tuple[JudgeSpec, ...] | None = None
    """The judges of the new batch, in selection order; absent: the old batch's judges."""


class RejudgeError(ValueError):
    """The stored events of a batch cannot be replayed (a run without its `case.executed`...)."""


def rejudge_spec(spec: BatchSpec, judges: tuple[JudgeSpec, ...] | None) -> BatchSpec:
    """The new batch's spec: the old one with its judges replaced (kept when `judges` is None)."""
    return spec if judges is None else msgspec.structs.replace(spec, judges=judges)


def replayed_case(
    executed: CaseExecuted,
    collected: CaseCollected | None,
    *,
    new_batch_id: str,
    old_batch_id: str,
    judges: tuple[JudgeSpec, ...],
    submitted_by: str,
) -> CaseExecuted:
    """One old run as a `case.executed` of the new batch (see the module docstring)."""
    case_id = executed.case_id or executed.result.case_id
    run_id = batch_run_id(new_batch_id, case_id, executed.result.trial)
    plan = msgspec.structs.replace(executed.plan, judges=judges, submitted_by=submitted_by)
    if executed.trace_complete or collected is None:
        # Complete already; or (collection never recorded) left to the collector to complete again.
        result, complete, deferred = executed.result, executed.trace_complete, executed.deferred_graders
        case = executed.case
    else:
        result, complete, deferred = collected.result, True, ()
        case = collected.case or executed.case
    return CaseExecuted(
        batch_id=new_batch_id,
        case_id=case_id,
        run_id=run_id,
        attempt=executed.attempt,
        status=executed.status,
        result=msgspec.structs.replace(result, run_id=run_id),
        plan=plan,
        case=case,
        trace_complete=complete,
        deferred_graders=deferred,
        rejudge_of=old_batch_id,
        output_tail=executed.output_tail,
    )


def rejudge_events(
    *,
    old_batch_id: str,
    new_batch_id: str,
    spec: BatchSpec,
    judges: tuple[JudgeSpec, ...] | None,
    submitted_by: str,
    stored: Sequence[CaseExecuted | CaseCollected],
) -> tuple[BatchRequested, list[CaseExecuted]]:
    """`batch.requested` of the new batch and one `case.executed` per old run, from the old
    batch's stored `case.executed` / `case.collected` events (pure). Raises `RejudgeError` when
    the stored runs are not exactly the runs the old spec expects."""
    new_spec = rejudge_spec(spec, judges)
    requested = BatchRequested(batch_id=new_batch_id, spec=new_spec, submitted_by=submitted_by, rejudge_of=old_batch_id)
    executed: dict[str, CaseExecuted] = {}
    collected: dict[str, CaseCollected] = {}
    for event in stored:
        run_id = event.run_id or event.result.run_id
        if isinstance(event, CaseExecuted):
            executed.setdefault(run_id, event)
        else:
            collected.setdefault(run_id, event)
    expected = expected_runs(spec)
    if len(executed) != expected:
        raise RejudgeError(f"the event store holds {len(executed)} executed runs of the {expected} the batch has")
    cases = [
        replayed_case(
            executed[run_id],
            collected.get(run_id),
            new_batch_id=new_batch_id,
            old_batch_id=old_batch_id,
            judges=new_spec.judges,
            submitted_by=submitted_by,
        )
        for run_id in sorted(executed)
    ]
    return requested, cases


# ---------------------------------------------------------------- I/O


async def stored_runs(call: Call, batch_id: str) -> list[CaseExecuted | CaseCollected]:
    """The batch's recorded `case.executed` and `case.collected` events (one of each per run, the
    store's unique key), in stream order."""
    async with snapshot(call.state.pool) as conn:
        rows = await conn.fetch(
            "SELECT body::text AS body FROM events WHERE batch_id = $1 "
            "AND type IN ('case.executed', 'case.collected') ORDER BY stream_seq",
            batch_id,
        )
    out: list[CaseExecuted | CaseCollected] = []
    for row in rows:
        try:
            event = decode_event(str(row["body"]).encode("utf-8"))
        except DecodeError as e:
            raise RejudgeError(f"a stored event of batch {batch_id} cannot be decoded: {e}") from e
        if isinstance(event, CaseExecuted | CaseCollected):
            out.append(event)
    return out


def _new_batch_id(call: Call, old_batch_id: str, key: str | None) -> str:
    """A fresh id; with an `Idempotency-Key`, the same one for the same caller, batch and key."""
    if key is None:
        return "b" + secrets.token_hex(6)
    return keyed_batch_id(call.user.name, "rejudge", old_batch_id, key)


async def _publish(call: Call, requested: BatchRequested, cases: list[CaseExecuted], keyed: bool) -> bool:
    """Publish the new batch; whether this request created it (False for a keyed retry).

    Without a key the id is fresh and everything goes out at once. With one, `batch.requested`
    claims the id first (`claim_batch`: a retry or the 409 of a reused key), and only then are the
    runs published — so a request that lost the id publishes none of its own runs into another
    request's batch. A retry completes a first attempt that stopped after its claim: it publishes the
    runs the stream does not hold yet (`Publisher.publish_missing`, one read per run), which needs
    no clock — a replica's clock minutes off once made "still inside the duplicate window" a guess."""
    publisher = call.state.publisher
    if not keyed:
        await publisher.publish_events([requested, *cases])
        return True
    claim = await claim_batch(call.state, requested)
    if claim.published:
        await publisher.publish_events(cases)
    else:
        await publisher.publish_missing(cases)
    return claim.published


async def rejudge_batch(call: Call) -> web.StreamResponse:
    """POST /v1/batches/{batch_id}/rejudge."""
    state = call.state
    request = call.request
    old_id = path_id(request, "batch_id")
    body = await read_body(request, state.settings.max_request_bytes)
    wanted = parse_json(body, RejudgeRequest) if body.strip() else RejudgeRequest()
    if wanted.judges is not None and not wanted.judges:
        raise ApiError(400, "invalid", "no judges: leave `judges` out to judge again with the batch's own", "$.judges")
    view = await find_batch(state.pool, state.js, old_id)
    if view is None or not call.user.may_access(view.submitted_by):
        raise not_found("batch", "batch_id", old_id)
    if view.finalized_at is None and await finalized_on_stream(state.js, old_id) is None:
        raise ApiError(409, "conflict", f"batch {old_id} is not finalized yet ({view.status})", "batch_id")
    spec = await get_batch_spec(state.pool, old_id)
    if spec is None:
        requested = await requested_on_stream(state.js, old_id)
        if requested is None:
            raise ApiError(409, "conflict", f"batch {old_id} has no recorded spec to re-judge", "batch_id")
        spec = requested.spec
    check_batch_spec(rejudge_spec(spec, wanted.judges))
    key = idempotency_key(request)
    new_id = _new_batch_id(call, old_id, key)
    try:
        requested_event, cases = rejudge_events(
            old_batch_id=old_id,
            new_batch_id=new_id,
            spec=spec,
            judges=wanted.judges,
            submitted_by=call.user.name,
            stored=await stored_runs(call, old_id),
        )
    except RejudgeError as e:
        raise ApiError(409, "conflict", f"batch {old_id} cannot be re-judged: {e}", "batch_id") from None
    if key is not None:
        requested_event = msgspec.structs.replace(requested_event, request_digest=spec_digest(requested_event.spec))
    if await _publish(call, requested_event, cases, keyed=key is not None):
        log.info("batch %s re-judges %s for %s (%d runs)", new_id, old_id, call.user.name, len(cases))
    base = f"/v1/batches/{new_id}"
    accepted = BatchAccepted(
        batch_id=new_id,
        links=BatchLinks(self_=base, cases=f"{base}/cases", events=f"{base}/events", cancel=f"{base}/cancel"),
    )
    return web.Response(status=202, body=encode(accepted), content_type="application/json", headers={"Location": base})


ROUTE = Route(
    ("POST",),
    "/v1/batches/{batch_id}/rejudge",
    "rejudgeBatch",
    "Judge a finalized batch again, without executing anything",
    "member",
    rejudge_batch,
    description="Creates a new batch (`batch.requested` with `rejudge_of`) whose runs are the old batch's "
    "`case.executed` events replayed from the event store with new run ids; the dispatcher executes nothing. "
    "`judges` replaces the old judges (default: the same). The new batch is judged, exported and finalized like "
    "any other. Allowed to the old batch's creator and admins; 409 while the old batch is not finalized. An "
    "`Idempotency-Key` header makes a retried request return the same new batch; the same key with other "
    "judges is a 409 `idempotency_key_reused`.",
    params=(
        Param("batch_id", "path", "The batch to re-judge", {"type": "string", "minLength": 1, "maxLength": 256}, True),
        key_param("Same key, same principal, same batch → same new batch id"),
    ),
    request=Body("Optional: the judges of the new batch", RejudgeRequest),
    request_required=False,
    responses={
        202: Body("Accepted: the new batch was published", BatchAccepted),
        409: Body(
            "The batch is not finalized, or its runs cannot be replayed (`error.field` = `batch_id`); or the "
            "`Idempotency-Key` was used with other judges (`error.field` = `Idempotency-Key`)",
            ErrorBody,
        ),
    },
)
"""The route, added to the gateway's table in `api.routes`."""
