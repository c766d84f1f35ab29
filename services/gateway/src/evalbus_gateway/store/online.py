"""Reads of online evaluation: observation fates, fate counts, and a suite's rolling scores.

Fates come from the `online_fates` read model; a suite's scores from the `runs` rows of its
pseudo-batch `online-<suite>` (one per judged observation), windowed on `judged_at`, which is the
`case.judged` event's own timestamp. What its model judges cost is summed from the same scores'
`usage` (a model-only observation skipped over budget has no run and cost nothing).
"""

from __future__ import annotations

from datetime import timedelta
from typing import TYPE_CHECKING

import msgspec

from evalbus_api.online import FateCount, FateView, JudgedObservation, MetricWindow, SeriesPoint, UsageWindow
from evalbus_contracts import JudgeUsageSummary, Score
from evalbus_gateway.store.connections import acquire
from evalbus_gateway.store.projection import ONLINE_BATCH_PREFIX

if TYPE_CHECKING:
    from evalbus_gateway.store.connections import Database

WINDOWS: tuple[tuple[str, timedelta], ...] = (
    ("hour", timedelta(hours=1)),
    ("day", timedelta(days=1)),
    ("week", timedelta(days=7)),
)
"""Rolling windows of a suite's summary: name and length."""


_FATES = """
WITH observations AS (
    SELECT DISTINCT observation_id FROM online_fates WHERE trace_id = $1 OR observation_id = $1
)
SELECT suite_id, observation_id, fate, reason, detail, trace_id, ts
FROM online_fates
WHERE observation_id IN (SELECT observation_id FROM observations)
ORDER BY ts, suite_id, fate
"""

_COUNTS = """
SELECT suite_id, fate, reason, count(*) AS n
FROM online_fates
WHERE ($1::text IS NULL OR suite_id = $1)
GROUP BY suite_id, fate, reason
ORDER BY suite_id, fate, reason
"""

_WINDOWED = """
SELECT s.value->>'metric' AS metric,
       count(*) AS n,
       avg((s.value->>'value')::double precision) AS mean,
       count(*) FILTER (WHERE s.value ? 'pass') AS with_pass,
       count(*) FILTER (WHERE (s.value->>'pass')::boolean) AS passed
FROM runs r, jsonb_array_elements(coalesce(r.scores, '[]'::jsonb)) AS s(value)
WHERE r.batch_id = $1 AND r.judged_at >= now() - $2::interval AND s.value->>'status' = 'measured'
GROUP BY 1
ORDER BY 1
"""

_SERIES = """
SELECT s.value->>'metric' AS metric,
       date_trunc('hour', r.judged_at) AS hour,
       count(*) AS n,
       avg((s.value->>'value')::double precision) AS mean,
       count(*) FILTER (WHERE s.value ? 'pass') AS with_pass,
       count(*) FILTER (WHERE (s.value->>'pass')::boolean) AS passed
FROM runs r, jsonb_array_elements(coalesce(r.scores, '[]'::jsonb)) AS s(value)
WHERE r.batch_id = $1 AND r.judged_at >= now() - $2::interval AND s.value->>'status' = 'measured'
GROUP BY 1, 2
ORDER BY 1, 2
"""

_RECENT = """
SELECT run_id, case_id, judged_at, answer, scores::text AS scores
FROM runs
WHERE batch_id = $1 AND judged_status IS NOT NULL
ORDER BY judged_at DESC NULLS LAST, run_id
LIMIT $2
"""

_USAGE = """
SELECT coalesce(sum(coalesce((u->>'calls')::bigint, 1)), 0) AS calls,
       coalesce(sum((u->>'input_tokens')::bigint), 0) AS input_tokens,
       coalesce(sum((u->>'output_tokens')::bigint), 0) AS output_tokens,
       sum((u->>'cost_usd')::double precision) AS cost_usd,
       coalesce(sum(coalesce((u->>'calls')::bigint, 1)) FILTER (WHERE NOT u ? 'cost_usd'), 0) AS unpriced
FROM runs r, jsonb_array_elements(coalesce(r.scores, '[]'::jsonb)) AS s(value), LATERAL (SELECT s.value->'usage') AS x(u)
WHERE r.batch_id = $1 AND r.judged_at >= now() - $2::interval AND s.value->>'source' = 'judge' AND u IS NOT NULL
"""

_SCORES = msgspec.json.Decoder(list[Score])


async def observation_fates(db: Database, trace_id: str) -> list[FateView]:
    """Every fate of the observations with this trace id (or observation id), in time order."""
    async with acquire(db) as conn:
        rows = await conn.fetch(_FATES, trace_id)
    return [
        FateView(
            suite_id=r["suite_id"] or None,
            observation_id=r["observation_id"],
            fate=r["fate"],
            reason=r["reason"],
            detail=r["detail"],
            trace_id=r["trace_id"],
            at=r["ts"],
        )
        for r in rows
    ]


async def fate_counts(db: Database, suite_id: str | None = None) -> list[FateCount]:
    """Observations per (suite, fate, reason), for one suite or all."""
    async with acquire(db) as conn:
        rows = await conn.fetch(_COUNTS, suite_id)
    return [
        FateCount(suite_id=r["suite_id"] or None, fate=r["fate"], reason=r["reason"], count=int(r["n"])) for r in rows
    ]


async def suite_windows(db: Database, suite_id: str) -> list[MetricWindow]:
    """Per metric and rolling window: count, mean and pass rate of the suite's judged observations."""
    batch_id = ONLINE_BATCH_PREFIX + suite_id
    out: list[MetricWindow] = []
    async with acquire(db) as conn:
        for window, interval in WINDOWS:
            for r in await conn.fetch(_WINDOWED, batch_id, interval):
                with_pass = int(r["with_pass"])
                out.append(
                    MetricWindow(
                        metric=r["metric"],
                        window=window,
                        count=int(r["n"]),
                        mean=None if r["mean"] is None else float(r["mean"]),
                        pass_rate=int(r["passed"]) / with_pass if with_pass else None,
                    )
                )
    return out


async def suite_usage(db: Database, suite_id: str) -> list[UsageWindow]:
    """Per rolling window with a model-judge call: the suite's judge calls, tokens and cost."""
    out: list[UsageWindow] = []
    async with acquire(db) as conn:
        for window, interval in WINDOWS:
            r = await conn.fetchrow(_USAGE, ONLINE_BATCH_PREFIX + suite_id, interval)
            if r is None or not r["calls"]:
                continue
            usage = JudgeUsageSummary(
                calls=int(r["calls"]),
                input_tokens=int(r["input_tokens"]),
                output_tokens=int(r["output_tokens"]),
                cost_usd=None if r["cost_usd"] is None else float(r["cost_usd"]),
                unpriced_calls=int(r["unpriced"]),
            )
            out.append(UsageWindow(window=window, usage=usage))
    return out


async def suite_series(db: Database, suite_id: str, hours: int = 24) -> list[SeriesPoint]:
    """Per metric and hour of the last `hours`: count, mean and pass rate (hours without a judged
    observation are absent)."""
    async with acquire(db) as conn:
        rows = await conn.fetch(_SERIES, ONLINE_BATCH_PREFIX + suite_id, timedelta(hours=hours))
    out: list[SeriesPoint] = []
    for r in rows:
        with_pass = int(r["with_pass"])
        out.append(
            SeriesPoint(
                metric=r["metric"],
                hour=r["hour"],
                count=int(r["n"]),
                mean=None if r["mean"] is None else float(r["mean"]),
                pass_rate=int(r["passed"]) / with_pass if with_pass else None,
            )
        )
    return out


async def recent_judged(db: Database, suite_id: str, limit: int = 20) -> list[JudgedObservation]:
    """The suite's most recently judged observations."""
    async with acquire(db) as conn:
        rows = await conn.fetch(_RECENT, ONLINE_BATCH_PREFIX + suite_id, limit)
    return [
        JudgedObservation(
            observation_id=r["case_id"],
            run_id=r["run_id"],
            judged_at=r["judged_at"],
            answer=r["answer"],
            scores=_SCORES.decode(r["scores"]) if r["scores"] else [],
            trajectory=f"/v1/runs/{r['run_id']}/trajectory",
        )
        for r in rows
    ]
