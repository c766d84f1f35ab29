"""Replicas whose clocks disagree by minutes (libfaketime moves a process's wall clock, its
monotonic clock kept): the dispatcher five minutes behind the gateway, the judge and the exporter
five minutes ahead, the collector five minutes behind. Nothing in the pipeline's delivery may
depend on their clocks agreeing: the batch succeeds with every run exactly once per stage, the
scores are those of the same suite on agreeing clocks, and no duration a user reads is negative
or minutes long."""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import pytest

from evalbus.testing.faketime import skewed
from evalbus.testing.pipeline import Pipeline, agent_harness, open_pipeline, task
from evalbus_contracts import AnswerMatchGrader, BatchSpec, CaseSpec, ExactJudge, LatencyGrader, SuiteSpec, batch_run_id

pytestmark = pytest.mark.e2e

SKEW_S = 300.0
CASES = tuple(f"c{i}" for i in range(1, 7))
STAGES = ("case.requested", "case.executed", "case.judged", "case.exported")


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    workdir = tmp_path_factory.mktemp("clock-skew")
    behind, ahead = skewed(-SKEW_S), skewed(SKEW_S)
    async with open_pipeline(
        pg_admin_url,
        workdir,
        service_env={"dispatcher": behind, "judge": ahead, "exporter": ahead, "collector": behind},
    ) as p:
        yield p


def suite() -> BatchSpec:
    graders = (AnswerMatchGrader(id="answer"), LatencyGrader(id="latency"))
    cases = tuple(
        CaseSpec(id=c, input=task(answer=c, tool_calls=2, sleep_s=0.2), expected=c, graders=graders) for c in CASES
    )
    return BatchSpec(suite=SuiteSpec(id="skew", cases=cases), harness=agent_harness(), judges=(ExactJudge(id="exact"),))


async def test_a_batch_through_replicas_with_skewed_clocks_is_exactly_once_and_scored_as_usual(
    pipeline: Pipeline,
) -> None:
    p = pipeline
    batch = await p.submit(suite())
    view = await p.finalized(batch, timeout_s=120)
    await p.quiescent()
    assert view.status == "succeeded", view
    runs = {batch_run_id(batch, c) for c in CASES}
    want: Counter[tuple[str | None, str]] = Counter({(r, s): 1 for r in runs for s in STAGES})
    kinds = set(STAGES)
    store = Counter({k: n for k, n in (await p.store_counts(batch)).items() if k[1] in kinds})
    assert store == want
    stream = Counter({k: n for k, n in (await p.stream_counts(batch)).items() if k[1] in kinds})
    assert stream == want
    verified = await p.verify(batch)
    assert verified.ok, verified
    assert view.summary is not None
    means = {m.metric: m.mean for m in view.summary.metrics}
    assert means["answer_match"] == 1.0
    assert means["judge:exact"] == 1.0
    latency = means["latency_s"]
    assert latency is not None
    assert 0.0 <= latency < 30.0  # measured on one process's clock: the skew never reaches it
