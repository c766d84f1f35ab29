"""Who may read what: the audience rule every batch and run read shares.

A member sees the batches it submitted and their runs; an admin sees everything. The runs of
online suites (pseudo-batches `online-<suite>`: judged production observations) belong to the
deployment, like the suites: every member reads them. Anything else is answered 404, exactly like
a missing batch or run, so ids cannot be probed.
"""

from __future__ import annotations

from dataclasses import dataclass

from evalbus_api.views import BatchView, RunView
from evalbus_contracts import subjects
from evalbus_gateway.api.errors import ApiError, not_found
from evalbus_gateway.api.reads import find_batch
from evalbus_gateway.api.table import Call
from evalbus_gateway.live.reads import last_on
from evalbus_gateway.store import get_run
from evalbus_gateway.store.projection import ONLINE_BATCH_PREFIX


async def visible_batch(call: Call, batch_id: str) -> BatchView:
    """The batch if the caller may see it; 404 otherwise (missing and not-yours look the same)."""
    view = await find_batch(call.state.pool, call.state.js, batch_id)
    if view is None or not call.user.may_access(view.submitted_by):
        raise not_found("batch", "batch_id", batch_id)
    return view


async def _may_see_batch_of(call: Call, batch_id: str | None) -> bool:
    if call.user.is_admin:
        return True
    if batch_id is None:
        return False
    if batch_id.startswith(ONLINE_BATCH_PREFIX):
        return True
    batch = await find_batch(call.state.pool, call.state.js, batch_id)
    return call.user.may_access(batch.submitted_by if batch is not None else None)


async def visible_run(call: Call, run_id: str) -> RunView:
    """The run if the caller may see its batch; 404 otherwise."""
    run = await get_run(call.state.pool, run_id)
    if run is None or not await _may_see_batch_of(call, run.batch_id):
        raise not_found("run", "run_id", run_id)
    return run


@dataclass(frozen=True, slots=True)
class LiveRun:
    """A run a live read is about: its ids, and its read-model view once recorded."""

    run_id: str
    """The run."""
    batch_id: str | None
    """Its batch (None for a run outside any batch)."""
    case_id: str | None
    """Its case."""
    view: RunView | None
    """The read model's view; None while the recorder has not written the run yet."""


async def visible_live_run(call: Call, run_id: str) -> LiveRun:
    """The run of a live read, if the caller may see it; 404 otherwise.

    A run the recorder has not written yet (it started a few milliseconds ago) is known from its
    marks on the LIVE stream, which carry its batch and case ids.
    """
    view = await get_run(call.state.pool, run_id)
    if view is not None:
        if not await _may_see_batch_of(call, view.batch_id):
            raise not_found("run", "run_id", run_id)
        return LiveRun(run_id=run_id, batch_id=view.batch_id, case_id=view.case_id, view=view)
    mark = await last_on(call.state.js, subjects.live_subject(run_id, "infra"))
    if mark is None or mark.event.run_id != run_id or not await _may_see_batch_of(call, mark.event.batch_id):
        raise not_found("run", "run_id", run_id)
    return LiveRun(run_id=run_id, batch_id=mark.event.batch_id, case_id=mark.event.case_id, view=None)


async def actionable_run(call: Call, run_id: str) -> LiveRun:
    """The run of a live action (exec, terminal, screen), if the caller may act in its sandbox.

    Acting runs commands in the sandbox, so it takes more than seeing the run: the run's creator
    (the submitter of its batch) or an admin. An unknown run is 404, and so is another member's
    (its ids cannot be probed, as for reads); a run the caller sees but did not create — an online
    suite's, which no member created — is 403.
    """
    view = await get_run(call.state.pool, run_id)
    if view is not None:
        run = LiveRun(run_id=run_id, batch_id=view.batch_id, case_id=view.case_id, view=view)
    else:
        mark = await last_on(call.state.js, subjects.live_subject(run_id, "infra"))
        if mark is None or mark.event.run_id != run_id:
            raise not_found("run", "run_id", run_id)
        run = LiveRun(run_id=run_id, batch_id=mark.event.batch_id, case_id=mark.event.case_id, view=None)
    if call.user.is_admin:
        return run
    batch = await find_batch(call.state.pool, call.state.js, run.batch_id) if run.batch_id is not None else None
    if batch is None or batch.submitted_by != call.user.name:
        if not await _may_see_batch_of(call, run.batch_id):  # another member's: as if it did not exist
            raise not_found("run", "run_id", run_id)
        raise ApiError(
            403,
            "forbidden",
            f"only the run's creator or an admin may act in its sandbox; {call.user.name!r} may not",
            "Authorization",
        )
    return run
