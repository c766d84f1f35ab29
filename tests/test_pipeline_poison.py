"""Poison on the bus, end to end: every message a service cannot use is terminated and copied to
`dlq.<service>` with its reason, by every service that consumes its subject, while a normal batch
keeps flowing through the same five real processes.

Which services consume which subject is read from the contracts' consumer definitions
(`evalbus_contracts.streams.CONSUMERS`), so a consumer added later is covered by the same test.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from evalbus.testing.pipeline import Pipeline, agent_harness, eventually, open_pipeline, task, wait_path
from evalbus_contracts import (
    AnswerMatchGrader,
    BatchRequested,
    BatchSpec,
    CasePlan,
    CaseResult,
    CaseSpec,
    DeadLetter,
    ExactJudge,
    SuiteSpec,
    encode,
    encode_token,
)
from evalbus_contracts.events import CaseJudged
from evalbus_contracts.streams import CONSUMERS
from evalbus_contracts.subjects import subject_matches

pytestmark = pytest.mark.e2e

CASES_SUBJECT_KINDS = (
    "batch.requested",
    "batch.cancelled",
    "batch.finalized",
    "case.requested",
    "case.executed",
    "case.collected",
    "case.judged",
    "case.exported",
    "case.observed",
)
"""Every kind of subject on the CASES stream."""


def consumers_of(subject: str) -> set[str]:
    """The services whose durable consumer on CASES receives `subject` (service = durable prefix)."""
    return {
        c.durable.split("-", 1)[0]
        for c in CONSUMERS
        if c.stream == "CASES" and any(subject_matches(f, subject) for f in c.filter_subjects)
    }


def poison_subject(kind: str, batch_token: str) -> str:
    """A subject of `kind` for a batch of the test's own (case subjects get case `p1`)."""
    return f"{kind}.{batch_token}" if kind.startswith("batch.") else f"{kind}.{batch_token}.p1"


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    """The module's pipeline: one compute slot, so a gated first case keeps the others queued."""
    workdir = tmp_path_factory.mktemp("pipeline-poison")
    async with open_pipeline(pg_admin_url, workdir, service_env={"dispatcher": {"DISPATCHER_SLOTS": "1"}}) as p:
        yield p


@pytest.fixture(autouse=True)
async def _services_up(pipeline: Pipeline) -> None:
    await pipeline.ensure_running()


async def dead_letter_for(pipeline: Pipeline, service: str, subject: str, timeout_s: float = 30.0) -> DeadLetter:
    """Wait for the dead letter `service` writes for a message on `subject`."""
    found: list[DeadLetter] = []

    async def landed() -> bool:
        found[:] = [d for d in await pipeline.dead_letters(service) if d.subject_ == subject]
        return bool(found)

    await eventually(landed, timeout_s=timeout_s, what=f"dlq.{service} to hold {subject}")
    assert len(found) == 1, found
    return found[0]


async def restart_s(pipeline: Pipeline, service: str) -> float:
    """Seconds from killing `service` to its replacement being ready."""
    began = time.monotonic()
    await pipeline.restart(service)
    return time.monotonic() - began


def gated_batch(started: Path, go: Path) -> BatchSpec:
    """A normal batch whose first case is in flight until `go` exists."""
    return BatchSpec(
        suite=SuiteSpec(
            id="poison-neighbour",
            cases=(
                CaseSpec(
                    id="c1",
                    input=task(answer="one", touch=[str(started)], wait_file=str(go)),
                    expected="one",
                    graders=(AnswerMatchGrader(id="answer"),),
                ),
                *(
                    CaseSpec(id=f"c{i}", input=task(answer=a), expected=a, graders=(AnswerMatchGrader(id="answer"),))
                    for i, a in ((2, "two"), (3, "three"))
                ),
            ),
        ),
        harness=agent_harness(),
        judges=(ExactJudge(id="exact"),),
    )


async def test_garbage_on_every_consumed_subject_is_dead_lettered_while_a_batch_flows(
    pipeline: Pipeline, tmp_path: Path
) -> None:
    """Garbage on every CASES subject kind (`batch.cancelled` is the next test's, since the
    dispatcher also follows it outside any consumer) lands once in `dlq.<service>` of every
    consumer, with its reason and payload, while a batch is in flight; the batch still finishes."""
    # The subject → consumers table this test relies on (a subject kind nobody consumed is a gap).
    assert {kind: sorted(consumers_of(poison_subject(kind, "b"))) for kind in CASES_SUBJECT_KINDS} == {
        "batch.requested": ["dispatcher", "gateway"],
        "batch.cancelled": ["gateway"],
        "batch.finalized": ["gateway"],
        "case.requested": ["dispatcher", "gateway"],
        "case.executed": ["collector", "gateway", "judge"],
        "case.collected": ["gateway", "judge"],
        "case.judged": ["exporter", "gateway"],
        "case.exported": ["gateway"],
        "case.observed": ["gateway", "judge"],
    }
    started, go = tmp_path / "c1.started", tmp_path / "c1.go"
    batch_id = await pipeline.submit(gated_batch(started, go))
    await wait_path(started)  # the neighbour batch is in flight while the poison arrives

    js = pipeline.nc.jetstream()
    token = f"poison-{uuid.uuid4().hex[:10]}"
    sent: dict[str, bytes] = {}
    for kind in CASES_SUBJECT_KINDS:
        if kind == "batch.cancelled":
            continue
        subject = poison_subject(kind, token)
        sent[subject] = f"not json: {subject} {{".encode()
        await js.publish(subject, sent[subject], headers={"Nats-Msg-Id": f"poison:{subject}"})
    # With its one compute slot held, the dispatcher pulls the poisoned `case.requested` only once
    # the in-flight case is done: let it finish, the poison is in the stream already.
    go.touch()

    for subject, payload in sent.items():
        services = consumers_of(subject)
        assert services, subject
        for service in services:
            letter = await dead_letter_for(pipeline, service, subject)
            assert letter.service == service
            assert letter.reason.startswith("poison: undecodable payload"), letter.reason
            assert letter.payload == payload.decode()
            assert letter.stream == "CASES"
            assert letter.deliveries == 1  # terminated at once, never redelivered

    view = await pipeline.finalized(batch_id)
    assert view.status == "succeeded"
    assert view.summary is not None
    assert view.summary.verdicts.passed == 3
    assert view.summary.counts.exported == 3
    # Nothing of the poison reached the event store.
    assert await pipeline.pool.fetchval("SELECT count(*) FROM events WHERE subject LIKE $1", f"%{token}%") == 0


async def test_event_on_a_subject_that_contradicts_it_is_dead_lettered_not_recorded(pipeline: Pipeline) -> None:
    """A well-formed `case.judged` published on a `case.executed` subject (a misrouted message):
    every consumer of the subject must refuse it. The judge and the collector do; the recorder must
    not store a `case.judged` the subject says is a `case.executed` (it would mark the run judged)."""
    batch_id = f"misrouted-{uuid.uuid4().hex[:10]}"
    run_id = f"evb-{batch_id}-m1"
    event = CaseJudged(
        batch_id=batch_id,
        case_id="m1",
        run_id=run_id,
        status="judged",
        result=CaseResult(case_id="m1", run_id=run_id, harness="h@1"),
        plan=CasePlan(),
    )
    subject = f"case.executed.{encode_token(batch_id)}.m1"
    await pipeline.nc.jetstream().publish(subject, encode(event), headers={"Nats-Msg-Id": f"misrouted:{run_id}"})

    for service in ("collector", "judge"):
        letter = await dead_letter_for(pipeline, service, subject)
        assert "unexpected event type CaseJudged" in letter.reason
    letter = await dead_letter_for(pipeline, "gateway", subject, timeout_s=10.0)
    assert letter.reason.startswith("poison:")
    assert await pipeline.pool.fetchval("SELECT count(*) FROM events WHERE run_id = $1", run_id) == 0


async def test_batch_request_without_batch_id_is_poison_at_once(pipeline: Pipeline) -> None:
    """Valid JSON, invalid request: no batch id to fan out under. Like the judge with a case event
    lacking its ids, the dispatcher must terminate it on the first delivery (poison), not retry it
    to `max_deliver`; and the recorder must not store a batch event that names no batch."""
    marker = uuid.uuid4().hex[:10]
    request = BatchRequested(
        spec=BatchSpec(
            suite=SuiteSpec(id=f"no-batch-{marker}", cases=(CaseSpec(id="x", input="y"),)), harness=agent_harness()
        ),
        submitted_by="pipeline-test",
    )
    subject = f"batch.requested.no-batch-{marker}"
    await pipeline.nc.jetstream().publish(subject, encode(request), headers={"Nats-Msg-Id": f"no-batch:{marker}"})

    letter = await dead_letter_for(pipeline, "dispatcher", subject)
    assert "batch id" in letter.reason
    assert letter.reason.startswith("poison:"), letter.reason
    assert letter.deliveries == 1
    stored = await pipeline.pool.fetchval("SELECT count(*) FROM events WHERE subject = $1", subject)
    assert stored == 0


async def test_garbage_cancellation_neither_stalls_the_dispatcher_nor_loses_cancels(
    pipeline: Pipeline, tmp_path: Path
) -> None:
    """Garbage on `batch.cancelled.*`, which the recorder consumes (dead-letters) and the dispatcher
    follows with its own subscription, outside any consumer: a real cancel published after it must
    still stop a batch, and a dispatcher restarting with the garbage in the stream must be ready as
    quickly as before (the only test of this module storing a garbage cancellation, so the baseline
    restart below sees none)."""
    # The baseline: the slower of two restarts before any garbage cancellation is stored.
    baseline_s = max([await restart_s(pipeline, "dispatcher") for _ in range(2)])

    token = f"poison-cancel-{uuid.uuid4().hex[:10]}"
    subject = f"batch.cancelled.{token}"
    await pipeline.nc.jetstream().publish(subject, b"not json {", headers={"Nats-Msg-Id": f"poison:{subject}"})
    letter = await dead_letter_for(pipeline, "gateway", subject)
    assert letter.reason.startswith("poison: undecodable payload")

    # The running dispatcher still honours a cancel published after the garbage.
    started, go = tmp_path / "c1.started", tmp_path / "c1.go"
    batch_id = await pipeline.submit(gated_batch(started, go))
    await wait_path(started)
    await pipeline.gw.cancel(batch_id)

    async def cancel_recorded() -> bool:
        return (await pipeline.gw.get(batch_id)).cancel_reason == "cancelled"

    await eventually(cancel_recorded, timeout_s=30, what="the cancel to be recorded")
    go.touch()
    view = await pipeline.finalized(batch_id)
    assert view.status == "cancelled"
    runs = await pipeline.runs(batch_id)
    assert [runs[c].executed_status for c in ("c1", "c2", "c3")] == ["succeeded", "cancelled", "cancelled"]

    # Restarts with the garbage stored: as quick as the baseline. A dispatcher the garbage kept
    # from catching up on cancellations would wait out its catch-up timeout (5 s) on every
    # restart, so the quicker of two is compared, against the slower baseline.
    with_garbage_s = min([await restart_s(pipeline, "dispatcher") for _ in range(2)])
    log = pipeline.stack.log_tail("dispatcher", 1000)
    assert with_garbage_s <= 1.5 * baseline_s, (
        f"dispatcher restart took {with_garbage_s:.1f}s with a garbage cancellation stored, "
        f"{baseline_s:.1f}s without:\n{pipeline.stack.log_tail('dispatcher', 5)}"
    )
    assert "cancellations at start" not in log, log  # it caught up, rather than giving up waiting
