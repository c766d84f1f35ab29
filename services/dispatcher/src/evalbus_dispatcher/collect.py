"""Trace collection in `job` mode: where the platform trace is and who pulls it (pure; the puller
over `evalbus_traces` sources is `trace_puller.PlatformTracePuller`)."""

from __future__ import annotations

from typing import Protocol

from evalbus_contracts import HarnessSpec, TraceEvent, TraceRef


class TracePuller(Protocol):
    """Pulls a run's trace from its platform (implemented over `evalbus_traces` sources).

    Retrying an empty pull is the puller's business; a hard error is raised and becomes a
    retryable `collect` failure that keeps every score already produced.
    """

    async def pull(self, ref: TraceRef) -> list[TraceEvent]:
        """The run's trace events, in order."""
        ...


def trace_ref_for(harness: HarnessSpec, run_id: str) -> TraceRef | None:
    """Where `harness`'s trace of `run_id` lives; None for a harness without a platform trace."""
    spec = harness.trace
    if spec.kind == "none":
        return None
    return TraceRef(
        kind=spec.kind,
        endpoint=spec.endpoint or "",
        run_id=run_id,
        correlate=spec.correlate,
        auth_secret=spec.auth_secret,
        experiment=spec.experiment,
        project=spec.project,
        service=spec.service,
        mapping=dict(spec.mapping),
    )
