"""`Publisher.stored` and `publish_missing` against a real nats-server: an event's stored copy is
found by its subject and `Nats-Msg-Id`, also where several runs share the subject (a case's
trials) and when the one looked for is not the subject's last message."""

from __future__ import annotations

import uuid

import pytest
from nats.aio.client import Client as NatsClient

from evalbus_contracts import CaseExecuted, CasePlan, CaseResult
from evalbus_contracts.events import stage_output_key
from evalbus_contracts.subjects import CASE_EXECUTED, CASE_JUDGED
from evalbus_runtime import PubAck, Publisher

pytestmark = [pytest.mark.integration]


def executed(batch: str, case: str, trial: int) -> CaseExecuted:
    run = f"evb-{batch}-{case}-t{trial}"
    return CaseExecuted(
        batch_id=batch,
        case_id=case,
        run_id=run,
        status="succeeded",
        result=CaseResult(case_id=case, run_id=run, harness="h@1", answer="ok"),
        plan=CasePlan(),
    )


async def test_a_stored_event_is_found_among_the_runs_sharing_its_subject(bus: tuple[NatsClient, Publisher]) -> None:
    _, pub = bus
    batch = f"b{uuid.uuid4().hex[:8]}"
    trials = [executed(batch, "c1", t) for t in (1, 2, 3)]
    acks = await pub.publish_events(trials[:2])
    assert len({t.subject() for t in trials}) == 1  # the trials share one subject

    found = [await pub.stored((t.subject(), t.msg_id())) for t in trials[:2]]
    assert found == [PubAck("CASES", acks[0].seq, True), PubAck("CASES", acks[1].seq, True)]  # the first: not last
    assert await pub.stored((trials[2].subject(), trials[2].msg_id())) is None  # same subject, not stored
    assert await pub.stored(("case.executed.nobatch.nocase", "case.executed:evb-nobatch-nocase")) is None
    assert await pub.stored(("not.a.stream.subject", "x")) is None

    # Only the missing one is published; the stored ones come back as they are.
    again = await pub.publish_missing(trials)
    assert [(a.seq, a.duplicate) for a in again[:2]] == [(acks[0].seq, True), (acks[1].seq, True)]
    assert not again[2].duplicate
    assert await pub.stored((trials[2].subject(), trials[2].msg_id())) is not None


@pytest.mark.unit
def test_a_stage_output_key_names_the_same_run_on_the_next_stage() -> None:
    event = executed("b1", "c1", 2)
    assert stage_output_key(CASE_JUDGED, event) == ("case.judged.b1.c1", "case.judged:evb-b1-c1-t2")
    assert stage_output_key(CASE_EXECUTED, event) == (event.subject(), event.msg_id())
