"""Subject builders. Ids become tokens with the one reversible encoding in `ids`."""

from __future__ import annotations

from evalbus_contracts.ids import encode_token

BATCH_REQUESTED = "batch.requested"
BATCH_CANCELLED = "batch.cancelled"
BATCH_FINALIZED = "batch.finalized"
CASE_REQUESTED = "case.requested"
CASE_EXECUTED = "case.executed"
CASE_COLLECTED = "case.collected"
CASE_JUDGED = "case.judged"
CASE_EXPORTED = "case.exported"
CASE_OBSERVED = "case.observed"
OBS_RECEIVED = "obs.received"
OBS_SPANS = "obs.spans"
ONLINE_SUITE = "online.suite"
ONLINE_FATE = "online.fate"
SUITE_BASELINE = "suite.baseline"


def batch_subject(kind: str, batch_id: str) -> str:
    """`batch.<kind>.<batch>`."""
    return f"{kind}.{encode_token(batch_id)}"


def case_subject(kind: str, batch_id: str, case_id: str) -> str:
    """`case.<stage>.<batch>.<case>`."""
    return f"{kind}.{encode_token(batch_id)}.{encode_token(case_id)}"


DEFAULT_LANE = "default"
"""The lane whose requests carry no lane token (every request written before lanes existed)."""


def case_requested_subject(batch_id: str, case_id: str, lane: str = DEFAULT_LANE) -> str:
    """`case.requested.<batch>.<case>` in the default lane, `case.requested.<batch>.<case>.<lane>`
    in any other: the lane is a last token, so the batch and case stay the third and fourth (every
    `case.*.<batch>.>` filter sees every lane) and a request written before lanes existed is in the
    default lane."""
    base = case_subject(CASE_REQUESTED, batch_id, case_id)
    return base if lane == DEFAULT_LANE else f"{base}.{encode_token(lane)}"


def lane_filter(lane: str) -> str:
    """The requests of one lane (what its dispatchers' consumer takes)."""
    if lane == DEFAULT_LANE:
        return f"{CASE_REQUESTED}.*.*"
    return f"{CASE_REQUESTED}.*.*.{encode_token(lane)}"


def case_requested_filter(batch_id: str, case_id: str) -> str:
    """The requests of one case in whichever lane (`case.requested.<batch>.<case>.*` and, with
    `subject_matches`, the default lane's own subject are its two forms)."""
    return f"{case_subject(CASE_REQUESTED, batch_id, case_id)}.*"


def batch_filter(batch_id: str) -> list[str]:
    """Subjects of every event of one batch (for SSE and replays), requests of every lane included."""
    tok = encode_token(batch_id)
    return [f"batch.*.{tok}", f"case.*.{tok}.>"]


def live_subject(run_id: str, channel: str) -> str:
    """`run.<run>.live.<channel>` with channel `log`, `trace`, `infra` or `placement`."""
    return f"run.{encode_token(run_id)}.live.{channel}"


def live_filter(run_id: str) -> str:
    """Every live subject of one run."""
    return f"run.{encode_token(run_id)}.live.>"


def observation_subject(target: str) -> str:
    """`obs.received.<target>`."""
    return f"{OBS_RECEIVED}.{encode_token(target)}"


def spans_subject(target: str, trace_id: str | None = None) -> str:
    """`obs.spans.<target>.<trace>`: OTLP spans the collector received, waiting to be assembled; the
    trace token lets any collector replica read every span batch of one trace from the stream.
    Without a trace: `obs.spans.<target>`, the subject of collectors before it."""
    if trace_id is None:
        return f"{OBS_SPANS}.{encode_token(target)}"
    return f"{OBS_SPANS}.{encode_token(target)}.{encode_token(trace_id)}"


def online_suite_subject(suite_id: str) -> str:
    """`online.suite.<suite>`: the definitions of one online suite (the last one holds)."""
    return f"{ONLINE_SUITE}.{encode_token(suite_id)}"


def online_fate_subject(observation_id: str) -> str:
    """`online.fate.<observation>`: what became of one observation, per suite."""
    return f"{ONLINE_FATE}.{encode_token(observation_id)}"


def suite_baseline_subject(suite_id: str) -> str:
    """`suite.baseline.<suite>`: the baseline batches of one suite (the last one holds)."""
    return f"{SUITE_BASELINE}.{encode_token(suite_id)}"


def dlq_subject(service: str) -> str:
    """`dlq.<service>`."""
    return f"dlq.{encode_token(service)}"


def hold_subject(stream: str, durable: str, stream_seq: int) -> str:
    """`held.<stream>.<consumer>.<seq>`: while a replica handles a message of an exclusive stage
    (`evalbus_runtime.Stage.exclusive`) it answers requests here, so a replica that gets the message
    redelivered learns that it is still held (an answer, or no answer in time) or held by nobody
    (nats-server's immediate "no responders": the holder's connection is gone)."""
    return f"held.{encode_token(stream)}.{encode_token(durable)}.{stream_seq}"


def control_subject(run_id: str, action: str) -> str:
    """Request/reply subject for actions on a live sandbox (`exec`, `terminal`, `screen`): the
    dispatcher holding the run subscribes to `control_filter(run_id)` while its sandbox lives."""
    return f"ctl.{encode_token(run_id)}.{action}"


def control_filter(run_id: str) -> str:
    """Every action subject of one run."""
    return f"ctl.{encode_token(run_id)}.*"


def terminal_subject(session: str, direction: str) -> str:
    """`term.<session>.in` (keystrokes and resizes, gateway → dispatcher) or `term.<session>.out`
    (output and the end, dispatcher → gateway) of one interactive terminal session."""
    return f"term.{encode_token(session)}.{direction}"


def subject_matches(pattern: str, subject: str) -> bool:
    """NATS subject matching: `*` is one token, `>` the rest (one token or more)."""
    want, have = pattern.split("."), subject.split(".")
    for i, part in enumerate(want):
        if part == ">":
            return len(have) > i
        if i >= len(have) or (part != "*" and part != have[i]):
            return False
    return len(want) == len(have)
