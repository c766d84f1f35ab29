"""The placement projection (pure): which phase a run is in and the reason, from its marks, its
latest sample, its request's place in the queue and the dispatchers' statuses."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest

from evalbus_api.live import Asked, RunPlacement, RunStatus
from evalbus_contracts import DispatcherStatus, Infra, PlacementSample
from evalbus_gateway.live.placement import MarkSeen, Requested, SampleSeen, project, run_phase

pytestmark = pytest.mark.unit

RUN = "evb-b1-c1"
NOW = datetime(2026, 12, 1, 12, 0, 0, tzinfo=UTC)


def status(name: str, slots: int, runs: tuple[str, ...] = (), *, age_s: float = 0.5) -> DispatcherStatus:
    at = NOW - timedelta(seconds=age_s)
    return DispatcherStatus(
        dispatcher=name, slots=slots, used=len(runs), runs=runs, started_at=at, updated_at=at, interval_s=2.0
    )


def marks(*events: str, execution: str = "x1", attempt: int = 1, age_s: float = 0.1) -> list[MarkSeen]:
    return [
        MarkSeen(
            mark=Infra(scope="placement", event=e, message=f"{e} message", unit="pgid:42" if e == "placed" else None),
            execution=execution,
            attempt=attempt,
            at=NOW - timedelta(seconds=age_s),
        )
        for e in events
    ]


def sample(state: str = "running", execution: str = "x1", **kw: object) -> SampleSeen:
    fields: dict[str, object] = {
        "at": NOW - timedelta(seconds=0.2),
        "dispatcher": "d-1",
        "node": "n1",
        "unit": "pgid:42",
        "pid": 42,
        "processes": 2,
        "rss_bytes": 10_000_000,
        "cpu_seconds": 0.5,
        "age_s": 3.0,
        "timeout_s": 60.0,
        "state": state,
        **kw,
    }
    return SampleSeen(sample=PlacementSample(**fields), execution=execution, attempt=1)  # type: ignore[arg-type]


def place(
    *,
    status_: RunStatus = "running",
    seen: list[MarkSeen] | None = None,
    latest: SampleSeen | None = None,
    requested: Requested | None = None,
    statuses: list[DispatcherStatus] | None = None,
) -> RunPlacement:
    return project(
        run_id=RUN,
        status=status_,
        marks=seen or [],
        sample=latest,
        requested=requested,
        statuses=statuses or [],
        now=NOW,
    )


def test_queued_behind_busy_slots_says_how_many_are_ahead() -> None:
    view = place(
        status_="queued",
        requested=Requested(attempt=1, asked=Asked(timeout_s=30.0), ahead=3),
        statuses=[status("d-1", 2, ("evb-b1-a", "evb-b1-b")), status("d-2", 1, ("evb-b1-c",))],
    )
    assert view.phase == "queued"
    assert view.reason == (
        "waiting for a compute slot: 3 ahead of it; all 3 slot(s) of 2 dispatcher(s) are busy (d-1: 2/2, d-2: 1/1)"
    )
    assert view.queue is not None
    assert (view.queue.ahead, view.queue.dispatchers, view.queue.slots, view.queue.used) == (3, 2, 3, 3)
    assert view.asked == Asked(timeout_s=30.0)
    assert view.used is None


def test_queued_while_the_dispatchers_cluster_has_no_room_says_so() -> None:
    view = place(
        status_="queued",
        requested=Requested(attempt=1, asked=Asked(), ahead=0),
        statuses=[status("d-k8s", 0, ())],
    )
    assert view.phase == "queued"
    assert view.reason == (
        "waiting for room in the cluster: 0 ahead of it; the 1 dispatcher(s) serving lane default offer no slot now "
        "(their cluster has no room for another case)"
    )


def test_queued_with_free_slots_and_a_retry_attempt() -> None:
    view = place(
        status_="running",
        seen=marks("accepted", "started", "placed", "exited", "released"),
        requested=Requested(attempt=2, asked=Asked(), ahead=0),
        statuses=[status("d-1", 2, ("evb-b1-a",))],
    )
    assert view.phase == "queued"
    assert view.attempt == 2
    assert (
        view.reason == "attempt 2: waiting to be taken by a dispatcher: 0 ahead of it; 1 of 2 slot(s) free (d-1: 1/2)"
    )
    assert view.restarts == 0
    assert [e.event for e in view.events] == ["accepted", "started", "placed", "exited", "released"]


def test_no_dispatcher_running_is_blocked_naming_the_last_one_seen() -> None:
    view = place(status_="queued", requested=Requested(attempt=1, asked=Asked(), ahead=0))
    assert (view.phase, view.reason) == ("blocked", "no dispatcher is running: the run waits for one to start")
    stale = status("d-old", 4, age_s=30.0)
    view = place(status_="queued", requested=Requested(attempt=1, asked=Asked(), ahead=5), statuses=[stale])
    assert view.phase == "blocked"
    assert view.reason is not None
    assert "the last one, d-old, was last seen at" in view.reason


def test_accepted_is_starting_and_a_backoff_is_blocked_with_its_reason() -> None:
    holder = [status("d-1", 1, (RUN,))]
    assert place(seen=marks("accepted"), statuses=holder).phase == "starting"
    assert place(seen=marks("waiting", "accepted"), statuses=holder).phase == "starting"  # a queue wait, before
    assert place(seen=marks("accepted", "started"), statuses=holder).phase == "starting"
    blocked = place(seen=marks("accepted", "waiting"), statuses=holder)
    assert (blocked.phase, blocked.reason) == ("blocked", "waiting message")


def test_running_carries_the_sample_unit_and_node() -> None:
    view = place(seen=marks("accepted", "started", "placed"), latest=sample(), statuses=[status("d-1", 1, (RUN,))])
    assert view.phase == "running"
    assert (view.dispatcher, view.unit, view.node) == ("d-1", "pgid:42", "n1")
    assert view.used is not None
    assert (view.used.pid, view.used.rss_bytes, view.used.cpu_seconds, view.used.age_s) == (42, 10_000_000, 0.5, 3.0)
    assert view.oom is None  # not exited
    assert view.reason is None


def test_a_sample_of_an_older_execution_is_not_shown() -> None:
    seen = marks("accepted", "released", execution="x0") + marks("accepted", execution="x1")
    view = place(seen=seen, latest=sample(execution="x0"), statuses=[status("d-1", 1, (RUN,))])
    assert view.used is None
    assert view.restarts == 1
    assert view.phase == "starting"


def test_released_and_settled_are_dead_with_why() -> None:
    exited = sample(state="exited", exit_code=3, oom=False)
    released = place(seen=marks("accepted", "started", "placed", "exited", "released"), latest=exited)
    assert released.phase == "dead"
    assert released.reason == "the sandbox was released; the run is finishing without it (trace collection, graders)"
    assert released.oom is False
    settled = place(status_="failed", seen=marks("accepted", "started", "placed", "exited", "released"), latest=exited)
    assert (settled.phase, settled.reason) == ("dead", "the run settled (failed); the harness exited message")
    never = place(status_="failed", seen=marks("accepted"))
    assert (never.phase, never.reason) == ("dead", "the run settled (failed) without its harness running")


def test_an_execution_its_dispatcher_no_longer_answers_for_is_dead() -> None:
    old = marks("accepted", "started", "placed", age_s=40.0)
    stale_sample = sample(at=NOW - timedelta(seconds=39))
    view = place(seen=old, latest=stale_sample, statuses=[status("d-2", 1)])
    assert view.phase == "dead"
    assert view.reason is not None
    assert view.reason.startswith("dispatcher d-1 stopped answering: nothing heard of this execution for 39s")
    # Listed by a live dispatcher, the same silence is just a quiet run.
    assert place(seen=old, latest=stale_sample, statuses=[status("d-1", 1, (RUN,))]).phase == "running"


def test_the_run_phase_is_the_placement_until_it_settles_then_the_stage() -> None:
    held = place(seen=marks("accepted", "started", "placed"), latest=sample(), statuses=[status("d-1", 1, (RUN,))])
    assert run_phase("requested", None, None) == "queued"  # nothing on the LIVE stream yet
    assert run_phase("requested", None, place(status_="queued", statuses=[status("d-1", 1)])) == "queued"
    assert run_phase("requested", None, place(seen=marks("accepted", "started"))) == "starting"
    assert run_phase("requested", None, place(seen=marks("accepted", "waiting"))) == "blocked"
    assert run_phase("requested", None, held) == "running"
    released = place(seen=marks("accepted", "started", "placed", "exited", "released"), latest=sample("exited"))
    assert run_phase("requested", None, released) == "finishing"
    lost = place(seen=marks("accepted", "started", "placed", age_s=60), statuses=[])
    assert lost.phase == "dead"
    assert run_phase("requested", None, lost) == "lost"
    # settled on the stream before the read model recorded it
    assert run_phase("requested", None, place(status_="succeeded", seen=marks("accepted"))) == "executed"
    assert run_phase("requested", None, place(status_="failed", seen=marks("accepted"))) == "failed"
    # settled in the read model: the furthest stage, or the execution's failure
    assert run_phase("exported", "succeeded", None) == "exported"
    assert run_phase("judged", "succeeded", None) == "judged"
    assert run_phase("exported", "failed", None) == "failed"
    assert run_phase("exported", "cancelled", None) == "cancelled"
