"""`GET /v1/runs/{run_id}/placement` — "why is my case not running?" — projected (pure) from what
the bus holds: the run's infra marks and its latest placement sample on the LIVE stream, the
dispatchers' statuses in the `dispatchers` bucket, and the dispatchers' queue (the `dispatcher-cases`
consumer). Every replica reads the same, so every replica answers the same.

Phases, from the marks of the run's latest execution:

- `queued`: requested, no dispatcher accepted it yet, and there are dispatchers to take it (the
  reason says how many requests are ahead of it and how busy the slots are);
- `blocked`: it cannot move on by itself: no dispatcher is running, none serves its lane ("no
  dispatcher serves lane gpu"), or an accepted attempt waits out a retry's backoff (the `waiting`
  mark's reason);
- `starting`: a dispatcher accepted it and is provisioning the sandbox or spawning the harness;
- `running`: the harness process exists (or exited while graders use the sandbox);
- `dead`: the sandbox is gone: released (the run finishes without it), settled, or lost with the
  dispatcher that held it (which no longer answers).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from datetime import datetime, timedelta

from msgspec.structs import replace

from evalbus_api.live import Asked, Phase, QueueState, RunPlacement, RunStatus
from evalbus_api.views import LaneWaiting, RunPhase
from evalbus_contracts import DEFAULT_LANE, DispatcherStatus, Infra, PlacementSample

_SETTLED: dict[str, RunPhase] = {
    "requested": "executed",  # settled on the stream before the read model recorded it
    "executed": "executed",
    "collected": "collected",
    "judged": "judged",
    "exported": "exported",
}

LOST_AFTER_S = 15.0
"""An execution whose dispatcher lists it nowhere and that published nothing on the LIVE stream for
this long is lost with its dispatcher."""
STALE_INTERVALS = 3
"""A dispatcher status older than this many of its intervals is a replica gone."""


@dataclass(frozen=True, slots=True)
class MarkSeen:
    """An infra mark as read from the LIVE stream."""

    mark: Infra
    execution: str | None
    attempt: int
    at: datetime
    """When the dispatcher published it."""


@dataclass(frozen=True, slots=True)
class SampleSeen:
    """The latest placement sample as read from the LIVE stream."""

    sample: PlacementSample
    execution: str | None
    attempt: int


@dataclass(frozen=True, slots=True)
class Requested:
    """The run's latest request on the CASES stream, and where the queue stands for it."""

    attempt: int
    asked: Asked
    ahead: int | None
    """Requests ahead of it not delivered yet; None when it was delivered to a dispatcher."""
    lane: str = DEFAULT_LANE
    """The lane it waits in: only dispatchers serving it take it."""


def fresh(statuses: Sequence[DispatcherStatus], now: datetime) -> list[DispatcherStatus]:
    """The statuses of replicas still running (written within three of their intervals)."""
    return [s for s in statuses if now - s.updated_at <= timedelta(seconds=STALE_INTERVALS * max(s.interval_s, 0.1))]


def _slots(statuses: Sequence[DispatcherStatus]) -> str:
    return ", ".join(f"{s.dispatcher}: {s.used}/{s.slots}" for s in sorted(statuses, key=lambda s: s.dispatcher))


def _ahead(n: int | None) -> str:
    if n is None:
        return "handed to a dispatcher that has not accepted it yet"
    return f"{n} ahead of it"


def unserved(lane: str, alive: Sequence[DispatcherStatus], gone: Sequence[DispatcherStatus]) -> str:
    """Why a run of `lane` waits when no live dispatcher serves the lane."""
    seen = ""
    gone_here = [s for s in gone if lane in s.lanes]
    if gone_here:
        last = max(gone_here, key=lambda s: s.updated_at)
        seen = f" (the last one, {last.dispatcher}, was last seen at {last.updated_at.isoformat()})"
    if not alive and lane == DEFAULT_LANE:
        return f"no dispatcher is running: the run waits for one to start{seen}"
    served = sorted({name for s in alive for name in s.lanes})
    others = f"; the {len(alive)} running serve {', '.join(served)}" if alive else ""
    return f"no dispatcher serves lane {lane}: the run waits for one started with DISPATCHER_LANES={lane}{seen}{others}"


def lanes_waiting(lanes: Iterable[str], statuses: Sequence[DispatcherStatus], now: datetime) -> tuple[LaneWaiting, ...]:
    """The lanes among `lanes` that no live dispatcher serves, each with its reason (a batch's view)."""
    alive = fresh(statuses, now)
    gone = [s for s in statuses if s not in alive]
    return tuple(
        LaneWaiting(lane=lane, reason=unserved(lane, alive, gone))
        for lane in sorted(set(lanes))
        if not any(lane in s.lanes for s in alive)
    )


def _queued(
    requested: Requested | None, alive: Sequence[DispatcherStatus], gone: Sequence[DispatcherStatus]
) -> tuple[Phase, str, QueueState]:
    ahead = requested.ahead if requested is not None else 0
    lane = requested.lane if requested is not None else DEFAULT_LANE
    statuses = [s for s in alive if lane in s.lanes]
    slots = sum(s.slots for s in statuses)
    used = sum(min(s.used, s.slots) for s in statuses)
    queue = QueueState(ahead=ahead, lane=lane, dispatchers=len(statuses), slots=slots, used=used)
    prefix = f"attempt {requested.attempt}: " if requested is not None and requested.attempt > 1 else ""
    if not statuses:
        return "blocked", prefix + unserved(lane, alive, gone), queue
    if slots == 0:
        reason = (
            f"{prefix}waiting for room in the cluster: {_ahead(ahead)}; the {len(statuses)} dispatcher(s) serving "
            f"lane {lane} offer no slot now (their cluster has no room for another case)"
        )
    elif used >= slots:
        reason = (
            f"{prefix}waiting for a compute slot: {_ahead(ahead)}; all {slots} slot(s) of "
            f"{len(statuses)} dispatcher(s) are busy ({_slots(statuses)})"
        )
    else:
        reason = (
            f"{prefix}waiting to be taken by a dispatcher: {_ahead(ahead)}; {slots - used} of {slots} slot(s) free "
            f"({_slots(statuses)})"
        )
    return "queued", reason, queue


def project(
    *,
    run_id: str,
    status: RunStatus,
    marks: Sequence[MarkSeen],
    sample: SampleSeen | None,
    requested: Requested | None,
    statuses: Sequence[DispatcherStatus],
    now: datetime,
) -> RunPlacement:
    """The placement of a run from what the bus holds now (`statuses`: every status in the bucket)."""
    alive = fresh(statuses, now)
    gone = [s for s in statuses if s not in alive]
    executions: list[str | None] = []
    for m in marks:
        if m.execution not in executions:
            executions.append(m.execution)
    latest = executions[-1] if executions else None
    current = [m for m in marks if m.execution == latest]
    marked_attempt = current[-1].attempt if current else 0
    own_sample = sample if sample is not None and sample.execution == latest and current else None
    used = own_sample.sample if own_sample is not None else None
    holder = next((s for s in alive if run_id in s.runs), None)
    asked = requested.asked if requested is not None else Asked(timeout_s=used.timeout_s if used else None)
    base = RunPlacement(
        run_id=run_id,
        status=status,
        phase="queued",
        asked=asked,
        restarts=max(0, len(executions) - 1),
        events=tuple(m.mark for m in marks),
    )

    # A newer attempt than any execution marked (or nothing marked at all): in the queue.
    requested_attempt = requested.attempt if requested is not None else 1
    if status in ("queued", "running") and (not current or requested_attempt > marked_attempt):
        phase, reason, queue = _queued(requested, alive, gone)
        return replace(base, phase=phase, reason=reason, attempt=requested_attempt, queue=queue)

    kinds = [m.mark.event for m in current]
    exited = next((m.mark for m in reversed(current) if m.mark.event == "exited"), None)
    placed = replace(
        base,
        attempt=marked_attempt,
        dispatcher=(used.dispatcher if used else None) or (holder.dispatcher if holder else None),
        unit=next((m.mark.unit for m in reversed(current) if m.mark.unit), None) or (used.unit if used else None),
        node=next((m.mark.node for m in reversed(current) if m.mark.node), None) or (used.node if used else None),
        used=used,
        oom=used.oom if used is not None and used.state == "exited" else None,
    )
    if status not in ("queued", "running"):
        if not current:  # purged 2 minutes after it settled, or aged out (or it never ran: a re-judge)
            return replace(placed, phase="dead", reason=f"the run settled ({status}); its live marks are gone")
        if exited is not None:
            return replace(placed, phase="dead", reason=f"the run settled ({status}); the harness {exited.message}")
        return replace(placed, phase="dead", reason=f"the run settled ({status}) without its harness running")
    last = current[-1].mark
    if "released" in kinds:
        reason = "the sandbox was released; the run is finishing without it (trace collection, graders)"
        return replace(placed, phase="dead", reason=reason)
    latest_activity = max([m.at for m in current] + ([used.at] if used is not None else []))
    silent = (now - latest_activity).total_seconds()
    if holder is None and silent > LOST_AFTER_S:
        who = f"dispatcher {placed.dispatcher}" if placed.dispatcher else "the dispatcher that held it"
        reason = (
            f"{who} stopped answering: nothing heard of this execution for {silent:.0f}s; the request is "
            "redelivered to another dispatcher once its ack wait expires"
        )
        return replace(placed, phase="dead", reason=reason)
    if "placed" in kinds:
        return replace(placed, phase="running")
    if last.event == "waiting" and "accepted" in kinds[:-1]:
        return replace(placed, phase="blocked", reason=last.message)
    return replace(placed, phase="starting")


def run_phase(stage: str, executed_status: str | None, placement: RunPlacement | None) -> RunPhase:
    """The run's phase from its read-model `stage` and `executed_status` and, while it has not
    settled, its `placement` (None: nothing on the LIVE stream yet, so it is queued)."""
    settled = executed_status
    if settled is None and placement is not None and placement.status not in ("queued", "running"):
        settled = placement.status  # the stream knows before the read model does
    if settled == "failed":
        return "failed"
    if settled == "cancelled":
        return "cancelled"
    if settled is not None:
        return _SETTLED.get(stage, "executed")
    if placement is None:
        return "queued"
    if placement.phase == "dead":
        released = bool(placement.events) and placement.events[-1].event == "released"
        return "finishing" if released else "lost"
    return placement.phase
