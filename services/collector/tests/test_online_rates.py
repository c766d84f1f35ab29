"""Per-suite rate caps on a real nats-server's key-value store: never more slots than the cap in a
minute, however many takers race for them (two "replicas" here), a fresh count each minute, and
suites counted apart."""

from __future__ import annotations

import asyncio
import uuid

import pytest

from evalbus_collector.online.rates import RateCaps
from evalbus_collector.online.stages import apply_caps
from evalbus_contracts import ObservationFate
from evalbus_runtime import connect

pytestmark = pytest.mark.integration


async def test_racing_replicas_never_take_more_slots_than_the_cap(nats_url: str) -> None:
    a_nc, b_nc = await connect(nats_url, "rates-a"), await connect(nats_url, "rates-b")
    try:
        a, b = RateCaps(), RateCaps()
        await a.start(a_nc.jetstream())
        await b.start(b_nc.jetstream())
        suite = f"s-{uuid.uuid4().hex[:8]}"
        minute = 1_800_000_000.0  # a fixed minute, so the test does not straddle a real one
        taken = await asyncio.gather(*(r.take(suite, 7, now_s=minute) for r in (a, b) for _ in range(20)))
        assert sum(taken) == 7
        assert await a.take(suite, 7, now_s=minute + 30) is False  # the same minute is full
        assert await a.take(suite, 7, now_s=minute + 60) is True  # the next one is not
        assert await b.take(f"{suite}-other", 1, now_s=minute) is True  # suites are counted apart
        assert await b.take(f"{suite}-other", 1, now_s=minute) is False
    finally:
        await a_nc.close()
        await b_nc.close()


@pytest.mark.unit
def test_capped_suites_turn_sampled_into_skipped_over_rate_cap() -> None:
    fates = [
        ObservationFate(observation_id="o", suite_id="capped", fate="sampled", reason="sampled"),
        ObservationFate(observation_id="o", suite_id="free", fate="sampled", reason="sampled"),
        ObservationFate(observation_id="o", suite_id="capped2", fate="skipped", reason="not_sampled"),
    ]
    got = apply_caps(fates, {"capped", "capped2"})
    assert [(f.suite_id, f.fate, f.reason) for f in got] == [
        ("capped", "skipped", "over_rate_cap"),
        ("free", "sampled", "sampled"),
        ("capped2", "skipped", "not_sampled"),
    ]
    assert got[0].msg_id() != fates[0].msg_id()  # a different fate, a different dedup id
