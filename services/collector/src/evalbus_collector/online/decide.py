"""The online decision (pure): one observation against the online suites → its fate for each suite
and a `case.observed` for each suite that samples it.

For each suite, in this order: the target (service, agent, workflow) must match, then every
attribute filter, then the trace id must be a valid W3C id and fall inside the suite's ratio
(`evalbus_contracts.sampling`, OpenTelemetry's decision). An observation without a trace id is
sampled by the low 64 bits of the SHA-256 of its observation id, so the decision stays
deterministic. With no suite defined the observation still gets a fate: skipped, `no_suite`.
Every output has a deterministic dedup id (suite, observation), so a redelivered or duplicated
observation never yields a second `case.observed` or a second score. A suite's daily budget rides
on its `case.observed` to the judge, which alone knows what its model judges spend.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from evalbus_contracts import (
    CaseObserved,
    CasePlan,
    CaseResult,
    DeadLetter,
    DecodeError,
    ObservationFate,
    ObservationReceived,
    OnlineSuiteSpec,
    OnlineTarget,
    decode_event,
)
from evalbus_contracts.events import Fate, FateReason
from evalbus_contracts.sampling import observation_key, sampled_by_trace_id, valid_trace_id
from evalbus_contracts.trace import Message, TraceEvent

ONLINE_HARNESS = "online@1"
"""The `harness` of an observation's case result: production traffic, no harness ran."""

AGENT_KEYS = ("gen_ai.agent.name", "agent.name")
"""Where an observation's agent name is read from (its metadata)."""
WORKFLOW_KEYS = ("workflow.name", "gen_ai.workflow.name")
"""Where an observation's workflow name is read from (its metadata)."""


@dataclass(frozen=True, slots=True)
class Decision:
    """What one observation yields."""

    fates: tuple[ObservationFate, ...]
    """One per suite (or one `no_suite`)."""
    observed: tuple[CaseObserved, ...]
    """One per suite that sampled it."""


def observed_run_id(suite_id: str, observation_id: str) -> str:
    """The run id of an observation judged for a suite."""
    return f"obs-{suite_id}-{observation_id}"


def _first(metadata: Mapping[str, str], keys: Iterable[str]) -> str | None:
    for key in keys:
        value = metadata.get(key)
        if value:
            return value
    return None


def _target_mismatch(target: OnlineTarget, obs: ObservationReceived) -> tuple[FateReason, str] | None:
    service = obs.metadata.get("service.name") or obs.target
    checks = (
        ("service", target.service, service),
        ("agent", target.agent, _first(obs.metadata, AGENT_KEYS)),
        ("workflow", target.workflow, _first(obs.metadata, WORKFLOW_KEYS)),
    )
    for name, wanted, actual in checks:
        if wanted is not None and wanted != actual:
            return "not_target", f"{name} is {actual!r}, the suite takes {wanted!r}"
    for key, wanted in sorted(target.attributes.items()):
        actual = obs.metadata.get(key)
        if actual != wanted:
            return "filtered", f"{key} is {actual!r}, the suite takes {wanted!r}"
    return None


def conversation(obs: ObservationReceived) -> tuple[TraceEvent, ...]:
    """The observation's trace, with its input as the first user message and its output as the
    last assistant message when the trace does not already carry them (judges read both)."""
    trace = list(obs.trace)
    roles = {e.role for e in trace if isinstance(e, Message)}
    if obs.input and "user" not in roles:
        trace.insert(0, Message(role="user", text=obs.input))
    if obs.output and "assistant" not in roles:
        trace.append(Message(role="assistant", text=obs.output, t=trace[-1].t if trace else 0.0))
    return tuple(trace)


def sampling_key(obs: ObservationReceived) -> str | None:
    """The 32-hex key the ratio decision reads: the trace id, or a digest of the observation id
    when there is no trace id; None when the trace id is malformed."""
    if obs.trace_id is None:
        return observation_key(obs.observation_id)
    return obs.trace_id if valid_trace_id(obs.trace_id) else None


def decide(obs: ObservationReceived, suites: Iterable[OnlineSuiteSpec]) -> Decision:
    """The fates and `case.observed` events of `obs` for `suites`."""
    fates: list[ObservationFate] = []
    observed: list[CaseObserved] = []

    def fate(suite_id: str | None, kind: Fate, reason: FateReason, detail: str | None = None) -> None:
        fates.append(
            ObservationFate(
                observation_id=obs.observation_id,
                suite_id=suite_id,
                trace_id=obs.trace_id,
                target=obs.target,
                fate=kind,
                reason=reason,
                detail=detail,
            )
        )

    key = sampling_key(obs)
    trace = conversation(obs)
    listed = sorted(suites, key=lambda s: s.id)
    if not listed:
        fate(None, "skipped", "no_suite", "no online suite is defined")
    for suite in listed:
        mismatch = _target_mismatch(suite.target, obs)
        if mismatch is not None:
            fate(suite.id, "skipped", mismatch[0], mismatch[1])
            continue
        if key is None:
            fate(suite.id, "dropped", "invalid_trace_id", f"trace id {obs.trace_id!r} is not 32 hex digits")
            continue
        if not sampled_by_trace_id(key, suite.sample_ratio):
            fate(suite.id, "skipped", "not_sampled", f"outside ratio {suite.sample_ratio:g}")
            continue
        fate(suite.id, "sampled", "sampled", f"inside ratio {suite.sample_ratio:g}")
        run_id = observed_run_id(suite.id, obs.observation_id)
        observed.append(
            CaseObserved(
                suite_id=suite.id,
                observation_id=obs.observation_id,
                run_id=run_id,
                result=CaseResult(
                    case_id=obs.observation_id,
                    run_id=run_id,
                    harness=ONLINE_HARNESS,
                    answer=obs.output,
                    trace=trace,
                ),
                plan=CasePlan(judges=suite.judges, suite_id=suite.id),
                expected=obs.expected,
                budget_usd_per_day=suite.budget_usd_per_day,
            )
        )
    return Decision(fates=tuple(fates), observed=tuple(observed))


def dead_letter_fate(letter: DeadLetter) -> ObservationFate | None:
    """The `dead_lettered` fate of an observation a service gave up on (`case.observed` or
    `obs.received` in the letter's payload), or None for any other dead letter."""
    try:
        event = decode_event(letter.payload.encode("utf-8"))
    except (DecodeError, ValueError):
        return None
    reason = letter.reason.split(":", 1)[0]
    detail = f"{letter.service}: {letter.reason}"
    if isinstance(event, CaseObserved):
        return ObservationFate(
            observation_id=event.observation_id,
            suite_id=event.suite_id,
            fate="dead_lettered",
            reason="max_deliver" if reason.startswith("max_deliver") else "poison",
            detail=detail,
        )
    if isinstance(event, ObservationReceived):
        return ObservationFate(
            observation_id=event.observation_id,
            trace_id=event.trace_id,
            target=event.target,
            fate="dead_lettered",
            reason="max_deliver" if reason.startswith("max_deliver") else "poison",
            detail=detail,
        )
    return None
