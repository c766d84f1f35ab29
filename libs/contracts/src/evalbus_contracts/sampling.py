"""The online sampling decision (pure): deterministic by trace id, the same decision as
OpenTelemetry's `TraceIdRatioBased` sampler.

OpenTelemetry samples a trace at ratio r when the LOW 64 bits of its trace id are below
`round(r · 2^64)`. Deciding the same way makes the samples nested: an application that traces at
ratio r exports every trace an online suite at r' ≤ r samples (praval compared the whole 128-bit id,
whose high bits dominate, so its sample and the tracer's did not nest). The low bits are the random
part of W3C trace ids even when the high bits start with a timestamp (X-Ray), so samples do not come
in clumps.
"""

from __future__ import annotations

import hashlib
import re

TRACE_ID_LIMIT = (1 << 64) - 1
"""Largest value of the 64 bits the decision reads."""
_TRACE_ID = re.compile(r"[0-9a-f]{32}")


def valid_trace_id(trace_id: str | None) -> bool:
    """Whether `trace_id` is a W3C trace id: 32 lower-case hex digits, not all zero."""
    return trace_id is not None and _TRACE_ID.fullmatch(trace_id) is not None and trace_id != "0" * 32


def ratio_bound(ratio: float) -> int:
    """The bound OpenTelemetry's `TraceIdRatioBased(ratio)` compares against."""
    return round(max(0.0, min(1.0, ratio)) * (TRACE_ID_LIMIT + 1))


def sampled_by_trace_id(trace_id: str, ratio: float) -> bool:
    """Whether a trace is sampled at `ratio` (`trace_id`: a valid 32-hex trace id)."""
    return int(trace_id, 16) & TRACE_ID_LIMIT < ratio_bound(ratio)


def observation_key(observation_id: str) -> str:
    """The sampling key of an observation that has no trace id: the first 32 hex digits of the
    SHA-256 of its observation id (deterministic, so a redelivered observation decides the same)."""
    return hashlib.sha256(observation_id.encode()).hexdigest()[:32]
