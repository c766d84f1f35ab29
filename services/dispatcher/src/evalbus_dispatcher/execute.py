"""Executing one case on a backend, releasing the sandbox at its last use.

Order: (a long wait in the queue, a retry's backoff or a redelivery: mark `waiting` saying so) → mark
`accepted` → provision → mark `started` → run the harness (mark
`placed` once its process exists, its output teed live, placement samples while it runs, mark
`exited` saying how it ended) → snapshot → compute graders → store the declared artifact files
→ **release** (idempotent, also in `finally`) → `on_release()` → mark `released` → store large
logs → collect the trace (`job` mode) → observation graders → `case.executed`, its answer, trace
and snapshot in the object store when too large for the event (`artifacts.py`).
In `control-plane` mode the observation graders are left to the collector.

A trace pull that fails is a retryable `collect` failure (the sandbox's scores stand, the
observation graders are `unmeasured: missing_evidence`, an `error` trace event says why); a
puller raising `MissingSecretError` pulled nothing, so the observation graders are
`unmeasured: missing_secret` and the case has no failure.

Every failure is data on the result (`CaseFailure`), with its evidence captured when it happens:
the marks so far, the last placement sample and the end of the output (stderr first, 16 KiB), so
they are sealed with the trajectory and outlive the sandbox. `execute_case` raises only when cancelled
(or given a request with neither a run id nor a batch id: `ValueError`, a poison message).
The run's clock (`t`) starts when the dispatcher accepts the case; events the harness prints
are shifted from the harness's clock (seconds since it started) onto it.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from datetime import datetime

from evalbus_contracts import (
    DEFAULT_LANE,
    CaseExecuted,
    CaseFailure,
    CaseRequested,
    CaseResult,
    CaseTimings,
    Error,
    Infra,
    Placement,
    PlacementSample,
    Score,
    Snapshot,
    TraceEvent,
    TraceRef,
    batch_run_id,
    utcnow,
)
from evalbus_contracts.results import FailureClass, FailureStage
from evalbus_dispatcher.artifacts import RunObjects, is_declaration
from evalbus_dispatcher.backends.base import Backend, HarnessRun, SandboxHandle, has_quick_usage
from evalbus_dispatcher.collect import TracePuller, trace_ref_for
from evalbus_dispatcher.errors import BackendError
from evalbus_dispatcher.harness_output import complete_trace, log_tail, parse_stdout
from evalbus_dispatcher.live import LiveSink, LiveTee, shift
from evalbus_dispatcher.placement import SAMPLE_INTERVAL_S, Sampler, exit_message
from evalbus_dispatcher.screen import Declared
from evalbus_grading import Evidence, grade_compute, grade_observations, in_grader_order, partition, unmeasured_scores
from evalbus_runtime.secrets import MissingSecretError

log = logging.getLogger(__name__)

MarkFn = Callable[[str, str], Awaitable[None]]
"""Adds an infra mark (event, message) to the run's trace, live and sealed."""
OnSandbox = Callable[[SandboxHandle, MarkFn, Declared], Awaitable[Callable[[], Awaitable[None]]]]
"""Called with the sandbox once it exists, a way to mark the trace and what the harness declared
for its screen (kept up to date as it declares more); returns what to await right before the
sandbox's release."""

QUEUE_MARK_S = 1.0
"""A run that waited at least this long in the queue before a dispatcher took it gets a `waiting`
mark saying how long (shorter waits are not worth a mark)."""


@dataclass(frozen=True, slots=True)
class Queued:
    """How a request reached the dispatcher: how long after it was stored, on which delivery."""

    waited_s: float
    """Seconds between JetStream storing the request and this dispatcher taking it."""
    delivery: int = 1
    """Delivery number (above 1: an earlier delivery was not acknowledged, or was put back for the
    retry's backoff)."""
    lane: str = DEFAULT_LANE
    """The lane it waited in."""
    attempt: int = 1
    """The request's attempt."""
    backoff_s: float = 0.0
    """A retry's backoff: its first delivery was put back on the bus for that long (no compute slot
    held meanwhile), so that delivery is no sign of a failed dispatcher."""

    def reason(self) -> str | None:
        """The `waiting` mark's words, or None when the wait is not worth a mark."""
        put_back = 1 if self.backoff_s > 0 else 0
        if self.delivery - put_back > 1:
            return (
                f"delivery {self.delivery}: stored {self.waited_s:.1f}s ago; an earlier delivery was not "
                "acknowledged (the dispatcher that held it stopped or failed)"
            )
        if put_back:
            return (
                f"attempt {self.attempt} waited {self.backoff_s:g}s after a retryable failure (stored "
                f"{self.waited_s:.1f}s ago; on the bus meanwhile, no compute slot held)"
            )
        if self.waited_s >= QUEUE_MARK_S:
            if self.lane != DEFAULT_LANE:
                return f"waited {self.waited_s:.1f}s in lane {self.lane}'s queue for a dispatcher serving it"
            return f"waited {self.waited_s:.1f}s in the queue for a compute slot"
        return None


async def execute_case(
    req: CaseRequested,
    backend: Backend,
    *,
    live: LiveSink,
    on_release: Callable[[], None],
    trace_puller: TracePuller | None = None,
    dispatcher: str | None = None,
    queued: Queued | None = None,
    sample_interval_s: float = SAMPLE_INTERVAL_S,
    on_sandbox: OnSandbox | None = None,
    objects: RunObjects | None = None,
) -> CaseExecuted:
    """Run one case × trial and grade it, releasing the sandbox as early as possible.

    `on_release` is called exactly once, right after the sandbox is released (or, when no
    sandbox could be provisioned, right after that failure), so the caller can take the next
    case while this one finishes. `trace_puller` is needed for `job` collect mode with a
    platform trace; without one the collection fails (retryably) and the scores are kept.
    `dispatcher` names the replica in the marks and samples; `queued` says how the request reached
    it (a long wait or a redelivery is marked `waiting`); the harness is sampled every
    `sample_interval_s`. `on_sandbox(handle, mark, declared)` is awaited once the sandbox exists
    (`mark` adds an infra mark to the run's trace, `declared` is what the harness declared for its
    live screen, kept current: its browser's DevTools endpoint (`EVALBUS_CDP_URL` in its environment,
    then `EVALBUS_CDP <url>` lines) and its X display (`EVALBUS_DISPLAY` or `DISPLAY` in its
    environment, then `EVALBUS_DISPLAY :<n>` lines)) and
    returns what to await right before the sandbox is released: the live actions attach and
    detach there. With `objects`, what is too large for the event goes to the `artifacts` bucket
    (`artifacts.py`): declared files before the release, large logs and the result's bulk after.
    """
    execution = _Execution(req, backend, live, on_release, trace_puller)
    execution.dispatcher = dispatcher
    execution.queued = queued
    execution.sample_interval_s = sample_interval_s
    execution.on_sandbox = on_sandbox
    execution.objects = objects
    executed = await execution.run()
    return executed if objects is None else await objects.offload(executed)


def run_id_of(req: CaseRequested) -> str:
    """The request's run id, derived from its batch, case and trial when absent."""
    if req.run_id:
        return req.run_id
    if req.batch_id is None:
        raise ValueError("a case request needs a run id or a batch id")
    return batch_run_id(req.batch_id, req.case.id, req.trial)


def merge_marks(marks: Sequence[Infra], events: Sequence[TraceEvent]) -> tuple[TraceEvent, ...]:
    """Infra marks placed among the events by time; the events keep their own order.

    Each mark goes right before the first event at or after its time (ahead on ties).
    """
    pending = deque(sorted(marks, key=lambda m: m.t))
    out: list[TraceEvent] = []
    for event in events:
        while pending and pending[0].t <= event.t:
            out.append(pending.popleft())
        out.append(event)
    out.extend(pending)
    return tuple(out)


@dataclass
class _InSandbox:
    """What was learned while the sandbox was held."""

    run: HarnessRun | None = None
    answer: str | None = None
    events: list[TraceEvent] = field(default_factory=list)
    t_end: float = 0.0
    snapshot: Snapshot | None = None
    scores: tuple[Score, ...] = ()
    failure: CaseFailure | None = None
    output_tail: str | None = None

    @property
    def harness_ran(self) -> bool:
        run = self.run
        return (
            run is not None and run.spawn_error is None and not (run.failure is not None and run.failure.never_started)
        )


class _Execution:
    """The state of one `execute_case` call."""

    def __init__(
        self,
        req: CaseRequested,
        backend: Backend,
        live: LiveSink,
        on_release: Callable[[], None],
        puller: TracePuller | None,
    ) -> None:
        self._req = req
        self._backend = backend
        self._live = live
        self._on_release = on_release
        self._puller = puller
        self._run_id = run_id_of(req)
        self._t0 = time.monotonic()
        self._accepted_at = utcnow()
        self._marks: list[Infra] = []
        self._notes: list[TraceEvent] = []
        self._unit: str | None = None
        self._node: str | None = None
        self._provisioned_mono: float | None = None
        self._released_mono: float | None = None
        self._started_at: datetime | None = None
        self._released_at: datetime | None = None
        self._release_signalled = False
        self._sandbox_released = False
        self._tee: LiveTee | None = None
        self._sample: PlacementSample | None = None
        self._detach: Callable[[], Awaitable[None]] | None = None
        self.dispatcher: str | None = None
        self.queued: Queued | None = None
        self.sample_interval_s = SAMPLE_INTERVAL_S
        self.on_sandbox: OnSandbox | None = None
        self.declared = Declared.from_env(req.harness.env)
        """What the harness declared for its screen, as last declared."""
        self.objects: RunObjects | None = None

    def _t(self) -> float:
        return time.monotonic() - self._t0

    async def run(self) -> CaseExecuted:
        try:
            return await self._run()
        finally:
            self._signal_release()  # exactly once, whatever happened (cancellation included)

    async def _run(self) -> CaseExecuted:
        async with LiveTee(self._live) as tee:
            self._tee = tee

            def browser(url: str) -> None:
                self.declared.cdp = url

            def display(name: str) -> None:
                self.declared.display = name

            tee.on_cdp, tee.on_display = browser, display
            # How long it waited before this dispatcher took it comes first: that wait came first.
            queue_reason = self.queued.reason() if self.queued is not None else None
            if queue_reason is not None:
                await self._mark(tee, "waiting", queue_reason)
            who = f"dispatcher {self.dispatcher}" if self.dispatcher else "a dispatcher"
            await self._mark(tee, "accepted", f"accepted by {who}")
            self._provisioned_mono = time.monotonic()
            try:
                handle = await self._backend.provision(self._req)
            except BackendError as e:
                self._signal_release()
                failure = self._failure(e.stage, e.failure_class, e.code, e.message, retryable=e.retryable)
                return self._build(_InSandbox(failure=failure))
            except Exception as e:
                log.exception("provisioning failed")
                self._signal_release()
                message = f"{type(e).__name__}: {e}"
                failure = self._failure("dispatch", "infra", "provision_failed", message, retryable=True)
                return self._build(_InSandbox(failure=failure))
            try:
                if self.on_sandbox is not None:

                    async def mark(event: str, message: str) -> None:
                        await self._mark(tee, event, message)

                    self._detach = await self.on_sandbox(handle, mark, self.declared)
                held = await self._in_sandbox(handle, tee)
            except Exception as e:
                log.exception("executing the case failed")
                message = f"{type(e).__name__}: {e}"
                held = _InSandbox(failure=self._failure("run", "infra", "dispatcher_error", message, retryable=True))
            finally:
                await self._release(handle, tee)
            return self._build(await self._after_release(held))

    async def _in_sandbox(self, handle: SandboxHandle, tee: LiveTee) -> _InSandbox:
        req = self._req
        self._unit, self._node = handle.unit, handle.node
        self._started_at = utcnow()
        started_t = self._t()
        await self._mark(tee, "started", "harness starting", t=started_t)
        tee.t_offset = started_t
        timeout_s = req.case.timeout_s or req.harness.timeout_s
        sampler = Sampler(
            handle.usage,
            tee.sample,
            dispatcher=self.dispatcher,
            node=self._node,
            timeout_s=timeout_s,
            interval_s=self.sample_interval_s,
            quick=handle.quick_usage if has_quick_usage(handle) else None,
        )

        async def spawned(pid: int) -> None:
            self._unit = handle.unit or f"pid:{pid}"
            self._node = handle.node or self._node  # a cluster backend knows it once the unit is placed
            where = f" on {self._node}" if self._node else ""
            what = f"worker {pid} took the case" if req.harness.kind == "worker" else f"process group {pid} started"
            await self._mark(tee, "placed", f"{what}{where}")
            await sampler.start(pid)

        ran: HarnessRun | None = None
        try:
            ran = await handle.run_harness(tee.on_output, spawned)
        finally:
            self._sample = await sampler.finish(ran)
        run = ran
        self._unit = handle.unit or self._unit
        self._node = handle.node or self._node
        held = _InSandbox(run=run, t_end=started_t + run.duration_s)
        if run.spawn_error is not None:
            held.failure = self._failure("run", "config", "spawn_failed", run.spawn_error)
            return held
        if run.failure is not None and run.failure.never_started:  # nothing of the agent ran: nothing to grade
            failed, tail = run.failure, log_tail(run.stdout, run.stderr)
            held.output_tail = tail
            held.failure = self._failure(
                "run", failed.failure_class, failed.code, failed.message, retryable=failed.retryable, log_tail=tail
            )
            return held
        await self._mark(tee, "exited", exit_message(run, self._sample, timeout_s))
        output = parse_stdout(run.stdout)
        held.answer = output.answer
        held.events = [shift(e, started_t) for e in output.events]
        if output.invalid_lines:
            held.events.append(
                Error(message=f"{output.invalid_lines} torn or invalid EVALBUS_* line(s) skipped", t=held.t_end)
            )
        tail = held.output_tail = log_tail(run.stdout, run.stderr)
        if run.timed_out:
            held.failure = self._failure(
                "run", "agent", "timeout", f"harness ran past {timeout_s:g}s and was killed (exit 124)", log_tail=tail
            )
        elif run.oom is True:
            held.failure = self._failure(
                "run", "agent", "oom", f"harness was killed by the out-of-memory killer (exit {run.exit_code})",
                log_tail=tail,
            )  # fmt: skip
        elif run.failure is not None:
            failed = run.failure
            held.failure = self._failure(
                "run", failed.failure_class, failed.code, failed.message, retryable=failed.retryable, log_tail=tail
            )
        elif run.exit_code != 0:
            held.failure = self._failure(
                "run", "agent", "exit_nonzero", f"harness exited with {run.exit_code}", log_tail=tail
            )
        try:
            held.snapshot = await handle.snapshot(output.answer)
        except Exception as e:
            self._notes.append(Error(message=f"snapshot failed: {type(e).__name__}: {e}", t=self._t()))
        held.scores = await grade_compute(req.case.graders, handle)
        if self.objects is not None and any(is_declaration(e) for e in held.events):
            held.events = await self.objects.store_declared(
                held.events, handle, run_id=self._run_id, attempt=req.attempt, t=self._t()
            )
        return held

    async def _release(self, handle: SandboxHandle, tee: LiveTee) -> None:
        if self._sandbox_released:
            return
        self._sandbox_released = True
        if self._detach is not None:
            detach, self._detach = self._detach, None
            try:
                await detach()
            except Exception:
                log.warning("detaching the live actions failed", exc_info=True)
        try:
            await handle.release()
        except Exception as e:
            log.warning("sandbox release failed", exc_info=True)
            self._notes.append(Error(message=f"sandbox release failed: {type(e).__name__}: {e}", t=self._t()))
        self._signal_release()
        await self._mark(tee, "released", "compute slot released")

    def _signal_release(self) -> None:
        if self._release_signalled:
            return
        self._release_signalled = True
        self._released_mono = time.monotonic()
        self._released_at = utcnow()
        try:
            self._on_release()
        except Exception:
            log.exception("on_release callback failed")

    async def _after_release(self, held: _InSandbox) -> _InSandbox:
        """Trace collection and observation graders, with the sandbox already gone."""
        if not held.harness_ran or held.run is None:
            return held
        if self.objects is not None:
            logs = await self.objects.store_logs(
                held.run.stdout, held.run.stderr, run_id=self._run_id, attempt=self._req.attempt, t=held.t_end
            )
            self._notes.extend(logs)
        harness = self._req.harness
        _, observation = partition(self._req.case.graders)
        kind = harness.trace.kind
        answer = held.answer or ""
        if kind == "none":
            held.events = list(
                complete_trace(held.events, answer=answer, trace_kind=kind, stderr=held.run.stderr, t_end=held.t_end)
            )
            held.scores += grade_observations(observation, self._evidence(held))
            return held
        if harness.trace.collect == "control-plane":
            return held  # the collector completes the trace and grades what is deferred
        ref = trace_ref_for(harness, self._run_id)
        assert ref is not None
        try:
            pulled = await self._pull(ref)
        except MissingSecretError as e:
            # Nothing was pulled (never unauthenticated): a visible non-measurement, not a failure.
            self._notes.append(Error(message=f"trace not collected from {ref.kind}: {e}", t=self._t()))
            held.events = list(complete_trace(held.events, answer=answer, trace_kind=kind, stderr="", t_end=held.t_end))
            held.scores += unmeasured_scores(observation, "missing_secret", str(e))
            return held
        except Exception as e:
            message = f"trace pull from {ref.kind} failed: {type(e).__name__}: {e}"
            log.warning("%s", message)
            collect_failure = self._failure("collect", "infra", "collect_failed", message, retryable=True)
            if held.failure is None:
                held.failure = collect_failure
            # the trace itself says why its platform events are missing
            self._notes.append(Error(message=message, t=self._t()))
            held.events = list(complete_trace(held.events, answer=answer, trace_kind=kind, stderr="", t_end=held.t_end))
            held.scores += unmeasured_scores(
                observation, "missing_evidence", "the trace could not be pulled", retryable=True
            )
            return held
        if not pulled:
            self._notes.append(Error(message=f"the {ref.kind} trace pull returned no events", t=self._t()))
        # Platform spans are timed from the trace's first span; put them on the run's clock, from
        # the moment the harness started, like the events it printed.
        started_t = held.t_end - held.run.duration_s
        on_run_clock = [shift(e, started_t) for e in pulled]
        held.events = list(
            complete_trace([*held.events, *on_run_clock], answer=answer, trace_kind=kind, stderr="", t_end=held.t_end)
        )
        held.scores += grade_observations(observation, self._evidence(held))
        return held

    async def _pull(self, ref: TraceRef) -> list[TraceEvent]:
        if self._puller is None:
            raise BackendError("no trace puller is configured for job-mode collection", code="collect_failed")
        return await self._puller.pull(ref)

    def _evidence(self, held: _InSandbox) -> Evidence:
        return Evidence(answer=held.answer, trace=self._trace(held), expected=self._req.case.expected)

    def _trace(self, held: _InSandbox) -> tuple[TraceEvent, ...]:
        return merge_marks(self._marks, [*held.events, *sorted(self._notes, key=lambda e: e.t)])

    async def _mark(self, tee: LiveTee, event: str, message: str, *, t: float | None = None) -> None:
        at = self._t() if t is None else t
        mark = Infra(scope="placement", event=event, message=message, unit=self._unit, node=self._node, t=at)
        self._marks.append(mark)
        await tee.mark(mark)

    def _failure(
        self,
        stage: FailureStage,
        failure_class: FailureClass,
        code: str,
        message: str,
        *,
        retryable: bool = False,
        log_tail: str | None = None,
    ) -> CaseFailure:
        if log_tail is None and self._tee is not None:
            log_tail = self._tee.recent_tail()  # what was seen of the output when it failed
        return CaseFailure(
            stage=stage,
            failure_class=failure_class,
            code=code,
            message=message,
            retryable=retryable,
            placement=Placement(
                unit=self._unit,
                node=self._node,
                events=tuple(self._marks),
                dispatcher=self.dispatcher,
                resources=self._sample,
            ),
            log_tail=log_tail,
        )

    def _build(self, held: _InSandbox) -> CaseExecuted:
        req = self._req
        harness = req.harness
        ran = held.harness_ran
        control_plane = ran and harness.trace.kind != "none" and harness.trace.collect == "control-plane"
        _, observation = partition(req.case.graders)
        run = held.run
        provisioned, released = self._provisioned_mono, self._released_mono
        timings = CaseTimings(
            queued_at=self._accepted_at,
            started_at=self._started_at,
            released_at=self._released_at,
            executed_at=utcnow(),
            sandbox_seconds=(released - provisioned) if provisioned is not None and released is not None else 0.0,
            harness_seconds=run.duration_s if run is not None else 0.0,
        )
        result = CaseResult(
            case_id=req.case.id,
            run_id=self._run_id,
            harness=f"{harness.id}@{harness.version}",
            trial=req.trial,
            answer=held.answer,
            exit_code=run.exit_code if run is not None else None,
            trace=self._trace(held),
            scores=in_grader_order(req.case.graders, held.scores),
            snapshot=held.snapshot,
            failure=held.failure,
            trace_ref=trace_ref_for(harness, self._run_id) if ran else None,
            timings=timings,
        )
        return CaseExecuted(
            batch_id=req.batch_id,
            case_id=req.case_id or req.case.id,
            run_id=self._run_id,
            attempt=req.attempt,
            status="failed" if held.failure is not None else "succeeded",
            result=result,
            plan=req.plan,
            case=req.case,
            trace_complete=not control_plane,
            deferred_graders=tuple(g.id for g in observation) if control_plane else (),
            output_tail=None if held.failure is not None and held.failure.log_tail else held.output_tail,
        )
