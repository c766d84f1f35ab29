"""Lanes end to end: the five services as real processes, with a second dispatcher replica that
serves only lane `gpu` (`DISPATCHER_LANES=gpu`) beside the default one.

- A batch mixing both lanes (the harness's default lane, two cases naming `lane: gpu`) runs each
  case only on its lane's dispatcher (the `accepted` mark names the replica), every stage once.
- A batch for lane `nobody` waits visibly: its runs' placement is `blocked` with "no dispatcher
  serves lane nobody"; once a dispatcher serving `nobody` starts, it runs to the end and the wait
  is sealed as a `waiting` mark naming the lane. The batch's view lists the lane while it waits.
- A lane that is not a lane name is refused with a 400 naming the field.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter
from collections.abc import AsyncIterator

import msgspec
import pytest

from evalbus.testing.pipeline import Pipeline, agent_harness, eventually, open_pipeline, task
from evalbus_api.client import ApiRequestError
from evalbus_api.live import RunPlacement
from evalbus_contracts import AnswerMatchGrader, BatchSpec, CaseSpec, SuiteSpec, batch_run_id
from evalbus_dispatcher.execute import QUEUE_MARK_S

pytestmark = pytest.mark.e2e

STAGES = ("case.requested", "case.executed", "case.judged", "case.exported")


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    workdir = tmp_path_factory.mktemp("lanes")
    env = {"DISPATCHER_SLOTS": "2", "DISPATCHER_REPLICA_ID": "d-default", "DISPATCHER_STATUS_INTERVAL_S": "0.5"}
    async with open_pipeline(pg_admin_url, workdir, service_env={"dispatcher": env}) as p:
        await p.start(
            "dispatcher@gpu",
            DISPATCHER_LANES="gpu",
            DISPATCHER_REPLICA_ID="d-gpu",
            DISPATCHER_SLOTS="2",
            DISPATCHER_STATUS_INTERVAL_S="0.5",
        )
        yield p


def case(case_id: str, lane: str | None = None) -> CaseSpec:
    return CaseSpec(
        id=case_id, input=task(answer=case_id), expected=case_id, graders=(AnswerMatchGrader(id="answer"),), lane=lane
    )


def spec(suite: str, cases: tuple[CaseSpec, ...], lane: str = "default") -> BatchSpec:
    harness = msgspec.structs.replace(agent_harness(), lane=lane)
    return BatchSpec(suite=SuiteSpec(id=suite, cases=cases), harness=harness)


async def blocked(p: Pipeline, run_id: str) -> RunPlacement:
    """The run's placement once it reads `blocked` (its request recorded, its queue read)."""
    seen: list[RunPlacement] = []

    async def check() -> bool:
        try:
            seen.append(await p.gw.placement(run_id))
        except ApiRequestError as e:
            if e.status == 404:  # its request is not recorded yet
                return False
            raise
        return seen[-1].phase == "blocked"

    await eventually(check, timeout_s=30, what=f"{run_id} blocked for want of its lane", diagnostics=p.diagnostics)
    return seen[-1]


def accepted_by(placement: RunPlacement) -> list[str]:
    return [m.message for m in placement.events if m.event == "accepted"]


async def test_a_batch_mixing_lanes_runs_each_case_on_its_lanes_dispatcher(pipeline: Pipeline) -> None:
    p = pipeline
    cases = (case("c1"), case("c2"), case("g1", "gpu"), case("g2", "gpu"))
    batch = await p.submit(spec("lanes-mixed", cases))
    assert (await p.gw.get(batch)).waiting == ()  # both lanes are served
    view = await p.finalized(batch)
    assert view.status == "succeeded", p.diagnostics()
    assert view.summary is not None
    assert (view.summary.verdicts.passed, view.summary.verdicts.pass_rate) == (4, 1.0)

    want = {"c1": "d-default", "c2": "d-default", "g1": "d-gpu", "g2": "d-gpu"}
    for case_id, dispatcher in want.items():
        placement = await p.gw.placement(batch_run_id(batch, case_id))
        # (a redelivery on a loaded machine would add a mark, from the same lane's dispatcher)
        assert set(accepted_by(placement)) == {f"accepted by dispatcher {dispatcher}"}, (case_id, placement.events)

    await p.quiescent()
    runs = {batch_run_id(batch, c) for c in want}
    counts = await p.stream_counts(batch)
    stages = Counter({key: n for key, n in counts.items() if key[0] in runs and key[1] in STAGES})
    assert stages == Counter({(r, s): 1 for r in runs for s in STAGES})
    assert await p.rejections(batch) == []


async def test_a_lane_nobody_serves_waits_visibly_then_runs_when_one_starts(pipeline: Pipeline) -> None:
    p = pipeline
    batch = await p.submit(spec("lanes-nobody", (case("n1"), case("n2")), lane="nobody"))
    run = batch_run_id(batch, "n1")

    placement = await blocked(p, run)
    recorded = time.monotonic()  # n1's request was stored before this: its placement is recorded
    assert placement.reason is not None
    assert placement.reason.startswith("no dispatcher serves lane nobody: "), placement.reason
    assert placement.queue is not None
    assert (placement.queue.lane, placement.queue.dispatchers, placement.queue.ahead) == ("nobody", 0, 0)
    behind = await blocked(p, batch_run_id(batch, "n2"))  # the lane's queue is its own: only n1 is ahead
    assert behind.queue is not None
    assert behind.queue.ahead == 1
    view = await p.gw.get(batch)
    assert view.status in ("queued", "running")
    assert [w.lane for w in view.waiting] == ["nobody"]  # the batch's view says it too
    assert view.waiting[0].reason.startswith("no dispatcher serves lane nobody: ")

    # A wait shorter than QUEUE_MARK_S earns no mark; a dispatcher that starts fast could take n1
    # sooner. Not a synchronisation: the wait's length is what the mark is about.
    await asyncio.sleep(max(0.0, recorded + QUEUE_MARK_S + 0.2 - time.monotonic()))
    await p.start("dispatcher@nobody", DISPATCHER_LANES="nobody", DISPATCHER_REPLICA_ID="d-nobody")
    view = await p.finalized(batch)
    assert view.status == "succeeded", p.diagnostics()
    assert view.waiting == ()
    placement = await p.gw.placement(run)
    assert set(accepted_by(placement)) == {"accepted by dispatcher d-nobody"}
    waits = [m.message for m in placement.events if m.event == "waiting"]
    assert any("in lane nobody's queue for a dispatcher serving it" in w for w in waits), waits


@pytest.mark.parametrize(
    ("lanes", "field"),
    [
        ({"harness": "GPU"}, "$.harness.lane"),
        ({"harness": "gpu.eu"}, "$.harness.lane"),
        ({"case": ""}, "$.suite.cases[0].lane"),
        ({"case": "a" * 33}, "$.suite.cases[0].lane"),
    ],
)
async def test_a_lane_that_is_no_lane_name_is_refused_naming_the_field(
    pipeline: Pipeline, lanes: dict[str, str], field: str
) -> None:
    bad = spec("lanes-bad", (case("b1", lanes.get("case")),), lane=lanes.get("harness", "default"))
    with pytest.raises(ApiRequestError) as info:
        await pipeline.submit(bad)
    assert (info.value.status, info.value.field) == (400, field)
    assert "lane" in info.value.message
