"""`evalbus.Client` against the real pipeline, as a script or a notebook uses it: a suite as a
mapping, a file and a `BatchSpec`; waiting, following, results, cancel and re-judge; the errors a
user meets. The calls are made from inside a running event loop (this test's), as from a Jupyter
cell, which the client's own loop thread makes safe."""

from __future__ import annotations

import json
import sys
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from evalbus import Client
from evalbus.client import ApiRequestError, SpecFileError
from evalbus.testing.pipeline import AGENT, Pipeline, agent_harness, open_pipeline, task
from evalbus_api.models import StreamEnd
from evalbus_contracts import AnswerMatchGrader, BatchSpec, CaseSpec, ContainsJudge, SuiteSpec, decode_event

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    async with open_pipeline(pg_admin_url, tmp_path_factory.mktemp("client")) as p:
        yield p


@pytest.fixture
def client(pipeline: Pipeline) -> Iterator[Client]:
    with Client(gateway=pipeline.stack.gateway_url, token=pipeline.stack.admin_token) as c:
        yield c


def mapping(*answers: str, suite_id: str = "client", **extra: object) -> dict[str, object]:
    return {
        "suite": {
            "id": suite_id,
            "cases": [
                {"id": f"c{i}", "input": task(answer=a, **extra), "expected": "yes"} for i, a in enumerate(answers)
            ],
            "graders": [{"kind": "answer-match", "id": "answer"}],
        },
        "harness": {"id": "agent", "command": [sys.executable, str(AGENT)]},
    }


async def test_run_a_suite_given_as_a_mapping_and_read_its_results(client: Client) -> None:
    batch = client.run(mapping("yes", "no", "yes"), timeout_s=120)
    assert batch.status == "succeeded"
    assert batch.summary is not None
    assert batch.summary.verdicts.passed == 2
    runs = client.results(batch.batch_id)
    assert sorted((r.case_id, r.verdict) for r in runs) == [("c0", "pass"), ("c1", "fail"), ("c2", "pass")]
    assert client.batch(batch.batch_id).status == "succeeded"


async def test_a_suite_file_and_a_spec_and_following_the_events(client: Client, tmp_path: Path) -> None:
    path = tmp_path / "suite.json"
    path.write_text(json.dumps(mapping("yes", suite_id="from-file")))
    batch_id = client.submit(path)
    events = list(client.follow(batch_id))
    assert events[-1].event == "end"
    kinds = [e.event for e in events[:-1]]
    assert kinds[0] == "batch.requested"
    assert kinds.count("case.exported") == 1
    assert kinds[-1] == "batch.finalized"
    assert decode_event(events[0].data.encode()).batch_id == batch_id
    decoded = [e.decoded() for e in events]  # every event decodes, `end` included
    assert decoded[-1] == StreamEnd(batch_id=batch_id, status="succeeded")
    assert events[-1].is_end
    assert events[-1].id is None  # `end` carries no sequence: an id belongs to its own event
    assert all(e.id is not None for e in events[:-1])
    spec = BatchSpec(
        suite=SuiteSpec(
            id="as-spec",
            cases=(CaseSpec(id="c", input=task(answer="yes"), expected="yes", graders=(AnswerMatchGrader(id="a"),)),),
        ),
        harness=agent_harness(),
        judges=(ContainsJudge(id="has-yes"),),
    )
    assert client.run(spec, timeout_s=120).status == "succeeded"


async def test_cancel_and_rejudge(client: Client, tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    slow = client.submit(mapping(*(["yes"] * 6), suite_id="slow", wait_file=str(gate), wait_timeout_s=120))
    client.cancel(slow)
    gate.touch()
    assert client.wait(slow, timeout_s=120).status == "cancelled"

    done = client.run(mapping("yes", "no", suite_id="to-rejudge"), timeout_s=120)
    again = client.rejudge(done.batch_id, judges=(ContainsJudge(id="says-no", case_sensitive=False),))
    rejudged = client.wait(again, timeout_s=120)
    assert rejudged.status == "succeeded"
    assert rejudged.summary is not None
    assert {m.metric for m in rejudged.summary.metrics} >= {"judge:says-no"}


async def test_what_a_user_gets_wrong_is_named(client: Client, pipeline: Pipeline) -> None:
    bad = mapping("yes")
    bad["policy"] = {"trails": 3}
    with pytest.raises(SpecFileError, match=r"\$\.policy\.trails.*trials"):
        client.submit(bad)
    with pytest.raises(ApiRequestError) as missing:
        client.batch("no-such-batch")
    assert missing.value.status == 404
    with pytest.raises(ApiRequestError) as refused, Client(gateway=pipeline.stack.gateway_url, token="wrong") as other:
        other.batch("no-such-batch")
    assert refused.value.status == 401
    with pytest.raises(ApiRequestError) as bad_key:
        client.submit(mapping("yes"), idempotency_key="a\nb")
    assert (bad_key.value.status, bad_key.value.field) == (400, "Idempotency-Key")
    with pytest.raises(TimeoutError, match=r"batch b\w+ was not final after 0\.5 s"):
        client.wait(client.submit(mapping("yes", suite_id="slowish", sleep_s=5)), timeout_s=0.5)
