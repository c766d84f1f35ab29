"""A model judge's provider misbehaving while a batch runs through the real services (the judge
pointed at a local OpenAI-compatible server, `evalbus.testing.chat_server`: a provider cannot run
here, so it is tested at the protocol level, with the documented bodies and headers).

- **Flaky**: the provider answers 429 with `Retry-After`, then 500, then hangs past the judge's
  timeout, a few requests each, before it recovers. Every case is judged once, on a real verdict:
  the judge waited, retried and got through, and the provider saw every fault.
- **Down**: every request hangs for longer than the judge's retries last. The batch still ends,
  every case once per stage, each judge score `unmeasured` with the reason `grader_timeout` in the
  scorecard — visible, not a zero and not a lost case.

With `EVALBUS_RELIABILITY_REPORT` set each writes its row for `bench/reliability.py`.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import AsyncIterator

import pytest

from evalbus.testing.chat_server import ChatCompletionsServer, Reply, error_body, judge_env, serving
from evalbus.testing.pipeline import Pipeline, agent_harness, eventually, open_pipeline, task
from evalbus.testing.reliability import lost_and_duplicated, report, row
from evalbus_contracts import BatchSpec, CaseSpec, Measured, ModelJudge, SuiteSpec, Unmeasured, batch_run_id

pytestmark = [pytest.mark.e2e]

API_KEY = "sk-provider-faults"  # noqa: S105 - the scripted provider's test key
STAGES = ("case.requested", "case.executed", "case.judged", "case.exported")
FLAKY = (
    *[Reply(status=429, headers={"Retry-After": "1"}, body=error_body("Rate limit reached", "requests"))] * 3,
    *[Reply(status=500, body=error_body("The server had an error", "server_error"))] * 3,
    *[Reply(hang=True)] * 2,
)
"""What the provider answers the flaky batch's first requests, in order; then verdicts."""


@pytest.fixture(scope="module")
async def provider() -> AsyncIterator[ChatCompletionsServer]:
    async with serving(api_key=API_KEY) as server:
        yield server


@pytest.fixture(scope="module")
async def pipeline(
    pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory, provider: ChatCompletionsServer
) -> AsyncIterator[Pipeline]:
    judge = judge_env(provider)
    async with open_pipeline(pg_admin_url, tmp_path_factory.mktemp("provider"), service_env={"judge": judge}) as p:
        yield p


def suite(tag: str, cases: int, judge: ModelJudge) -> BatchSpec:
    return BatchSpec(
        suite=SuiteSpec(
            id=f"provider-{tag}",
            cases=tuple(CaseSpec(id=f"c{i:02d}", input=task(answer=f"a{i}"), expected=f"a{i}") for i in range(cases)),
        ),
        harness=agent_harness(),
        judges=(judge,),
    )


async def exactly_once(p: Pipeline, batch: str, cases: int) -> tuple[int, int, bool]:
    runs = {batch_run_id(batch, f"c{i:02d}") for i in range(cases)}
    want: Counter[tuple[str | None, str]] = Counter({(r, s): 1 for r in runs for s in STAGES})
    store = Counter({k: n for k, n in (await p.store_counts(batch)).items() if k[1] in STAGES})
    stream = Counter({k: n for k, n in (await p.stream_counts(batch)).items() if k[1] in STAGES})
    lost, duplicated = lost_and_duplicated(want, store, stream)
    return lost, duplicated, store == want and stream == want


async def test_a_provider_answering_429_500_and_hanging_is_waited_out_and_every_case_judged_once(
    pipeline: Pipeline, provider: ChatCompletionsServer
) -> None:
    p = pipeline
    before, abandoned = Counter(provider.statuses), len(provider.abandoned)
    provider.push(*FLAKY)
    # enough retries for one case to meet every fault: which case meets which is the arrival order's
    judge = ModelJudge(id="rubric", rubric="Is the answer right?", timeout_s=2.0, max_retries=len(FLAKY))
    batch = await p.submit(suite("flaky", 10, judge))
    view = await p.finalized(batch, timeout_s=120)
    await p.quiescent()
    lost, duplicated, once = await exactly_once(p, batch, 10)
    answered = provider.statuses - before
    runs = await p.runs(batch)
    report(
        row(
            "judge provider: 429 + Retry-After ×3, 500 ×3, 2 requests hanging past the timeout",
            load="10 cases, a model judge",
            faults=len(FLAKY),
            lost=lost,
            duplicated=duplicated,
            passed=view.status == "succeeded" and once,
        )
    )
    assert view.status == "succeeded", view
    assert once, (lost, duplicated)
    assert not provider.script, "every scripted fault was answered"
    assert answered[429] >= 3, answered
    assert answered[500] >= 3, answered
    await eventually(  # the server notices a client that hung up when its connection closes
        lambda: len(provider.abandoned) - abandoned >= 2, timeout_s=30, what="the judge giving up on the hangs"
    )
    scores = {c: [s for s in r.scores if s.metric == "judge:rubric"] for c, r in runs.items()}
    assert all(len(s) == 1 for s in scores.values()), scores
    measured = {c: s[0].value for c, s in scores.items() if isinstance(s[0], Measured)}
    assert measured == dict.fromkeys(scores, 1.0), scores
    assert await p.dead_letters("judge") == []


async def test_a_provider_hanging_longer_than_the_retries_ends_each_score_unmeasured_and_visible(
    pipeline: Pipeline, provider: ChatCompletionsServer
) -> None:
    p = pipeline
    provider.outage = Reply(hang=True)
    try:
        judge = ModelJudge(id="rubric", rubric="Is the answer right?", timeout_s=1.0, max_retries=1)
        batch = await p.submit(suite("down", 3, judge))
        view = await p.finalized(batch, timeout_s=120)
    finally:
        provider.outage = None
    await p.quiescent()
    lost, duplicated, once = await exactly_once(p, batch, 3)
    report(
        row(
            "judge provider hanging on every request past the judge's retries",
            load="3 cases, a model judge",
            faults=3,
            lost=lost,
            duplicated=duplicated,
            passed=view.status == "succeeded" and once,
        )
    )
    assert view.status == "succeeded", view
    assert once, (lost, duplicated)
    runs = await p.runs(batch)
    scores = {c: [s for s in r.scores if s.metric == "judge:rubric"] for c, r in runs.items()}
    assert {c: [s.reason if isinstance(s, Unmeasured) else s for s in found] for c, found in scores.items()} == {
        c: ["grader_timeout"] for c in scores
    }
    assert view.summary is not None
    rubric = next(m for m in view.summary.metrics if m.metric == "judge:rubric")
    assert (rubric.count, dict(rubric.unmeasured)) == (0, {"grader_timeout": 3}), rubric
