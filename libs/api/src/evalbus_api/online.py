"""Response bodies of online evaluation (`/v1/online/suites`, `/v1/online/stats`,
`/v1/online/observations/{trace_id}`): suites, fates, and a suite's rolling scores."""

from __future__ import annotations

from datetime import datetime

import msgspec

from evalbus_contracts import JudgeUsageSummary, OnlineSuiteSpec, Score


class FateView(msgspec.Struct, frozen=True, kw_only=True):
    """One fate of one observation."""

    suite_id: str | None
    """The suite (None: no suite was defined when it arrived)."""
    observation_id: str
    """The observation."""
    fate: str
    """sampled, skipped, dropped, late, dead_lettered or judged."""
    reason: str
    """Why."""
    detail: str | None = None
    """More about the reason."""
    trace_id: str | None = None
    """The trace id, when the observation has one."""
    at: datetime
    """When it was decided."""


class FateCount(msgspec.Struct, frozen=True, kw_only=True):
    """How many observations met one fate for one reason."""

    suite_id: str | None
    fate: str
    reason: str
    count: int


class MetricWindow(msgspec.Struct, frozen=True, kw_only=True):
    """One metric over one rolling window."""

    metric: str
    """The metric (`judge:<id>` for judges)."""
    window: str
    """hour, day or week."""
    count: int
    """Measured scores in the window."""
    mean: float | None
    """Their mean."""
    pass_rate: float | None
    """Passed ÷ scores with a pass/fail (None: none has one)."""


class UsageWindow(msgspec.Struct, frozen=True, kw_only=True):
    """What the suite's model judges cost over one rolling window."""

    window: str
    """hour, day or week."""
    usage: JudgeUsageSummary
    """Calls, tokens and dollars (of the calls whose cost is known)."""


class SeriesPoint(msgspec.Struct, frozen=True, kw_only=True):
    """One metric over one hour of judged observations."""

    metric: str
    hour: datetime
    """Start of the hour (UTC)."""
    count: int
    mean: float | None
    pass_rate: float | None


class JudgedObservation(msgspec.Struct, frozen=True, kw_only=True):
    """A recently judged observation."""

    observation_id: str
    run_id: str
    judged_at: datetime | None
    answer: str | None = None
    scores: list[Score] = msgspec.field(default_factory=list)
    trajectory: str
    """The API path of its stored events."""


class OnlineSuiteView(msgspec.Struct, frozen=True, kw_only=True):
    """An online suite as the API shows it."""

    suite: OnlineSuiteSpec
    """Its definition."""
    applied_by: str
    """Who applied it last."""
    applied_at: datetime
    """When."""


class OnlineSuiteList(msgspec.Struct, frozen=True, kw_only=True):
    """Every online suite."""

    items: list[OnlineSuiteView]


class OnlineSuiteDetail(msgspec.Struct, frozen=True, kw_only=True):
    """One online suite with its rolling scores, fate counts and recent judged observations."""

    suite: OnlineSuiteSpec
    applied_by: str
    applied_at: datetime
    metrics: list[MetricWindow]
    """Per metric and window (hour, day, week): count, mean, pass rate."""
    series: list[SeriesPoint] = msgspec.field(default_factory=list)
    """Per metric and hour of the last 24 hours: count, mean, pass rate (the dashboard's chart)."""
    fates: list[FateCount]
    """Observations per fate and reason."""
    recent: list[JudgedObservation]
    """The most recently judged observations, newest first."""
    judge_usage: list[UsageWindow] = msgspec.field(default_factory=list)
    """What its model judges cost per window (hour, day, week) with a call: calls, tokens, dollars."""


class OnlineStats(msgspec.Struct, frozen=True, kw_only=True):
    """What became of every observation, counted per suite, fate and reason."""

    counts: list[FateCount]


class ObservationAnswer(msgspec.Struct, frozen=True, kw_only=True):
    """Why a trace was (or was not) judged."""

    trace_id: str
    """The trace asked about."""
    status: str
    """`known` (fates follow) or `unknown` (evalbus never received it)."""
    fates: list[FateView]
    """Every fate, per suite, in time order."""


class SuiteDeleted(msgspec.Struct, frozen=True, kw_only=True):
    """A deleted suite."""

    suite_id: str
    deleted: bool = True
