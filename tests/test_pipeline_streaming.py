"""Streaming is proven, not assumed: two rendezvous tests that deadlock (and so fail) under the
two barriers evalbus claims not to have. The five services run as real processes on a nats-server
and a database of this module's own, with ONE compute slot on the dispatcher.

1. Judging does not wait for the batch: case 2's harness blocks until the gateway shows case 1
   judged. Were judging to wait for every case to be executed, case 2 could never finish: it would
   give up at its deadline and fail, and the test asserts it succeeded.
2. The sandbox is not held through judging: case 1's judge blocks until case 2's harness has
   started. With one compute slot, case 2 can start only once case 1 has released its slot; were
   the slot held until case 1 is judged, the judge would reach its deadline and score 0.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from evalbus.testing.pipeline import Pipeline, agent_harness, gateway_access, open_pipeline, task
from evalbus_contracts import (
    BatchSpec,
    CaseExecuted,
    CaseJudged,
    CaseSpec,
    ExactJudge,
    Measured,
    RegisteredJudge,
    SuiteSpec,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    """The module's pipeline: one compute slot, so sandboxes run strictly one at a time."""
    workdir = tmp_path_factory.mktemp("pipeline-streaming")
    async with open_pipeline(pg_admin_url, workdir, service_env={"dispatcher": {"DISPATCHER_SLOTS": "1"}}) as p:
        yield p


async def test_case_is_judged_while_a_later_case_still_executes(pipeline: Pipeline) -> None:
    """Case 2's agent finishes only after case 1 is judged (it asks the gateway): a batch barrier
    before judging would leave it waiting until its deadline, and it would fail."""
    spec = BatchSpec(
        suite=SuiteSpec(
            id="streaming-judge-before-batch",
            cases=(
                CaseSpec(id="c1", input=task(answer="one"), expected="one"),
                CaseSpec(id="c2", input=task(answer="two", wait_judged="c1", wait_timeout_s=30), expected="two"),
            ),
        ),
        harness=agent_harness(**gateway_access(pipeline.stack.gateway_url)),
        judges=(ExactJudge(id="exact"),),
    )
    batch_id = await pipeline.submit(spec)
    view = await pipeline.finalized(batch_id)

    runs = await pipeline.runs(batch_id)
    assert runs["c2"].executed_status == "succeeded", runs["c2"].failure
    assert runs["c2"].answer == "two"
    assert view.status == "succeeded"
    assert view.summary is not None
    assert view.summary.verdicts.passed == 2

    # The stream itself shows the overlap: case 1 was judged before case 2 was executed.
    events = await pipeline.stream_events(batch_id)
    seq = {(type(ev), ev.case_id): s for s, ev in events}
    assert seq[(CaseJudged, "c1")] < seq[(CaseExecuted, "c2")]


async def test_sandbox_is_released_before_the_case_is_judged(pipeline: Pipeline, tmp_path: Path) -> None:
    """Case 1's judge waits until case 2's agent has started; with one compute slot that can only
    happen if case 1's sandbox was released before its judging ended."""
    c2_started = tmp_path / "c2.started"
    spec = BatchSpec(
        suite=SuiteSpec(
            id="streaming-release-before-judge",
            cases=(
                CaseSpec(id="c1", input=task(answer="one", judge_waits_for=str(c2_started)), expected="one"),
                CaseSpec(id="c2", input=task(answer="two", touch=[str(c2_started)]), expected="two"),
            ),
        ),
        harness=agent_harness(),
        judges=(RegisteredJudge(id="rendezvous", name="wait-file", params={"timeout_s": "30"}),),
    )
    batch_id = await pipeline.submit(spec)
    view = await pipeline.finalized(batch_id)
    assert view.status == "succeeded"

    runs = await pipeline.runs(batch_id)
    c1_judge = [s for s in runs["c1"].scores if s.metric == "judge:rendezvous"]
    assert len(c1_judge) == 1
    assert isinstance(c1_judge[0], Measured), c1_judge
    assert c1_judge[0].passed is True, c1_judge[0].detail

    # The timeline from the events: one slot (case 2 started after case 1's release), and case 2
    # started while case 1 was being judged (before its case.judged was built).
    events = {(type(ev), ev.case_id): ev for _, ev in await pipeline.stream_events(batch_id)}
    c1_exec = events[(CaseExecuted, "c1")]
    c2_exec = events[(CaseExecuted, "c2")]
    c1_judged = events[(CaseJudged, "c1")]
    assert isinstance(c1_exec, CaseExecuted)
    assert isinstance(c2_exec, CaseExecuted)
    c1_released_at = c1_exec.result.timings.released_at
    c2_started_at = c2_exec.result.timings.started_at
    assert c1_released_at is not None
    assert c2_started_at is not None
    assert c1_released_at <= c2_started_at < c1_judged.ts
