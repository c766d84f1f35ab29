"""The event store against a real PostgreSQL: migrations, append-only events, dedupe, idempotent
recording, seals and verification, refusals after a seal, completion, rebuild, queries, finalize."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Sequence
from typing import Any

import asyncpg
import pytest

from evalbus_contracts import (
    BatchCancelled,
    BatchPolicy,
    BatchRequested,
    BatchSpec,
    CaseCollected,
    CaseExecuted,
    CaseExported,
    CaseFailure,
    CaseJudged,
    CasePlan,
    CaseRequested,
    CaseResult,
    CaseSpec,
    CommandHarness,
    Event,
    JsonlSink,
    Measured,
    Score,
    SinkOutcome,
    SuiteSpec,
    TestsPassGrader,
    Unmeasured,
    batch_run_id,
    encode,
)
from evalbus_gateway.store import (
    RecordedMessage,
    finalize_batch,
    get_batch,
    get_run,
    get_trajectory,
    list_runs,
    migrate,
    open_batches_by_supersede_key,
    rebuild_read_models,
    record,
    verify_batch,
    verify_run,
)
from evalbus_gateway.store.chain import GENESIS, canonical_bytes, chain
from evalbus_gateway.store.migrate import load_migrations
from evalbus_gateway.store.queries import complete_unfinalized_batches

pytestmark = pytest.mark.integration

HARNESS = CommandHarness(id="echo", command=("echo",))


# ---------------------------------------------------------------- fixtures and event builders


class Stream:
    """Builds a batch's events and numbers them like the CASES stream would."""

    def __init__(
        self,
        cases: Sequence[str] = ("c1", "c2"),
        *,
        trials: int = 1,
        sinks: bool = True,
        supersede_key: str | None = None,
    ) -> None:
        self.batch_id = f"b{uuid.uuid4().hex[:8]}"
        self.spec = BatchSpec(
            suite=SuiteSpec(
                id="suite",
                cases=tuple(
                    CaseSpec(id=c, input=f"task {c}", graders=(TestsPassGrader(id="t", command="true"),)) for c in cases
                ),
            ),
            harness=HARNESS,
            sinks=(JsonlSink(path="/tmp/x.jsonl"),) if sinks else (),
            policy=BatchPolicy(trials=trials),
            supersede_key=supersede_key,
        )
        self.plan = CasePlan(sinks=self.spec.sinks, trials=trials)
        self.seq = 0

    def msg(self, event: Event, seq: int | None = None) -> RecordedMessage:
        if seq is None:
            self.seq += 1
            seq = self.seq
        return RecordedMessage(seq, event.subject(), encode(event), event)

    def run_id(self, case: str, trial: int | None = None) -> str:
        return batch_run_id(self.batch_id, case, trial)

    def requested(self) -> BatchRequested:
        return BatchRequested(batch_id=self.batch_id, spec=self.spec, submitted_by="alice")

    def _ids(self, case: str, trial: int | None) -> dict[str, Any]:
        return {"batch_id": self.batch_id, "case_id": case, "run_id": self.run_id(case, trial)}

    def result(
        self,
        case: str,
        trial: int | None,
        scores: Sequence[Score],
        failure: CaseFailure | None = None,
        answer: str = "42",
    ) -> CaseResult:
        return CaseResult(
            case_id=case,
            run_id=self.run_id(case, trial),
            harness="echo@1",
            trial=trial,
            answer=answer,
            scores=tuple(scores),
            failure=failure,
        )

    def case_requested(self, case: str, trial: int | None = None) -> CaseRequested:
        spec = next(c for c in self.spec.suite.cases if c.id == case)
        return CaseRequested(**self._ids(case, trial), trial=trial, case=spec, harness=HARNESS, plan=self.plan)

    def executed(
        self,
        case: str,
        trial: int | None = None,
        *,
        passed: bool = True,
        status: str = "succeeded",
        failure: CaseFailure | None = None,
    ) -> CaseExecuted:
        scores = (Measured(grader_id="t", metric="tests_pass", value=float(passed), passed=passed),)
        return CaseExecuted(
            **self._ids(case, trial),
            status=status,  # type: ignore[arg-type]
            result=self.result(case, trial, scores, failure),
            plan=self.plan,
        )

    def collected(self, case: str, trial: int | None = None, failure: CaseFailure | None = None) -> CaseCollected:
        scores = (Measured(grader_id="t", metric="tests_pass", value=1.0, passed=True),)
        return CaseCollected(**self._ids(case, trial), result=self.result(case, trial, scores, failure), plan=self.plan)

    def judged(
        self, case: str, trial: int | None = None, *, passed: bool = True, judge_error: str | None = None
    ) -> CaseJudged:
        scores: tuple[Score, ...] = (
            Measured(grader_id="t", metric="tests_pass", value=float(passed), passed=passed),
            Measured(grader_id="j", metric="judge:j", value=0.9, passed=True, source="judge"),
            Unmeasured(grader_id="m", metric="judge:m", reason="unsupported", source="judge"),
        )
        return CaseJudged(
            **self._ids(case, trial),
            status="judged",
            result=self.result(case, trial, scores),
            plan=self.plan,
            judge_error=judge_error,
        )

    def exported(self, case: str, trial: int | None = None, *, status: str = "exported") -> CaseExported:
        outcome = SinkOutcome(
            sink="jsonl",
            status="ok" if status == "exported" else "failed",
            error=None if status == "exported" else "disk full",
        )
        return CaseExported(
            **self._ids(case, trial),
            status=status,  # type: ignore[arg-type]
            outcomes=(outcome,),
        )

    def lifecycle(self, case: str, trial: int | None = None, *, passed: bool = True) -> list[RecordedMessage]:
        return [
            self.msg(self.case_requested(case, trial)),
            self.msg(self.executed(case, trial, passed=passed)),
            self.msg(self.judged(case, trial, passed=passed)),
            self.msg(self.exported(case, trial)),
        ]


async def table(pool: asyncpg.Pool[asyncpg.Record], sql: str) -> list[dict[str, Any]]:
    async with pool.acquire() as conn:
        return [dict(r) for r in await conn.fetch(sql)]


async def read_models(pool: asyncpg.Pool[asyncpg.Record]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    return (
        await table(pool, "SELECT * FROM batches ORDER BY batch_id"),
        await table(pool, "SELECT * FROM runs ORDER BY run_id"),
    )


# ---------------------------------------------------------------- migrations and append-only


async def test_migrate_concurrent_replicas_apply_once(database_url: str) -> None:
    conns = [await asyncpg.connect(database_url) for _ in range(5)]
    try:
        applied = await asyncio.gather(*(migrate(c) for c in conns))
        versions = [m.version for m in load_migrations()]
        assert sorted(v for a in applied for v in a) == versions  # each version applied by exactly one
        assert await migrate(conns[0]) == []
        rows = await conns[0].fetch("SELECT version FROM schema_migrations ORDER BY version")
        assert [r["version"] for r in rows] == versions
    finally:
        for c in conns:
            await c.close()


async def test_events_are_append_only(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    s = Stream(cases=("c1",))
    await record(pool, [s.msg(s.requested()), *s.lifecycle("c1")])
    async with pool.acquire() as conn:
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
            await conn.execute("UPDATE events SET subject = 'x' WHERE stream_seq = 1")
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
            await conn.execute("DELETE FROM events WHERE stream_seq = 1")
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
            await conn.execute("TRUNCATE events")
        with pytest.raises(asyncpg.InsufficientPrivilegeError, match="append-only"):
            await conn.execute("UPDATE seals SET head_hash = 'x'")
        assert await conn.fetchval("SELECT count(*) FROM events") == 5


# ---------------------------------------------------------------- dedupe and idempotency


async def test_dedupe_by_sequence_and_by_key(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    s = Stream(cases=("c1",))
    first = s.msg(s.executed("c1", passed=True))
    out = await record(pool, [s.msg(s.requested()), first])
    assert out.inserted == 2

    again = await record(pool, [first])  # same sequence: a redelivery
    assert (again.inserted, again.already_recorded, again.duplicates) == (0, 1, 0)

    second = s.msg(s.executed("c1", passed=False))  # same dedupe key, new sequence: a second emission
    dup = await record(pool, [second])
    assert (dup.inserted, dup.duplicates) == (0, 1)
    rejected = await table(pool, "SELECT stream_seq, reason, detail FROM rejections")
    assert rejected == [
        {"stream_seq": second.stream_seq, "reason": "duplicate", "detail": f"case.executed:{s.run_id('c1')}"}
    ]
    run = await get_run(pool, s.run_id("c1"))
    assert run is not None
    assert run.verdict == "pass"

    # the same key twice inside one call: the lower sequence wins
    s2 = Stream(cases=("c9",))
    a, b = s2.msg(s2.executed("c9", passed=False)), s2.msg(s2.executed("c9", passed=True))
    a, b = RecordedMessage(1000 + a.stream_seq, *a[1:]), RecordedMessage(1000 + b.stream_seq, *b[1:])
    out2 = await record(pool, [b, a])
    assert (out2.inserted, out2.duplicates) == (1, 1)
    run2 = await get_run(pool, s2.run_id("c9"))
    assert run2 is not None
    assert run2.verdict == "fail"


async def test_recording_the_same_messages_twice_changes_nothing(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    s = Stream()
    messages = [s.msg(s.requested()), *s.lifecycle("c1"), *s.lifecycle("c2", passed=False)]
    late = s.msg(s.collected("c1"))  # after c1's seal: refused
    dup = s.msg(s.executed("c2"))  # second case.executed of c2 after its seal: refused as sealed
    messages += [late, dup]
    first = await record(pool, messages)
    assert first.inserted == 9
    assert first.rejected_sealed == 2

    tables = "events", "batches", "runs", "seals", "rejections"
    before = {t: await table(pool, f"SELECT * FROM {t}") for t in tables}
    second = await record(pool, messages)
    assert second.inserted == 0
    assert second.already_recorded == len(messages)
    assert second.duplicates == second.rejected_sealed == 0
    assert second.sealed_runs == ()
    after = {t: await table(pool, f"SELECT * FROM {t}") for t in tables}
    assert after == before


# ---------------------------------------------------------------- seals and verification


async def test_seal_verifies_and_detects_tampering(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    s = Stream(cases=("c1", "c2"))
    out = await record(pool, [s.msg(s.requested()), *s.lifecycle("c1"), *s.lifecycle("c2")])
    assert sorted(out.sealed_runs) == sorted([s.run_id("c1"), s.run_id("c2")])

    run_id = s.run_id("c1")
    async with pool.acquire() as conn:
        seal = await conn.fetchrow("SELECT * FROM seals WHERE run_id = $1", run_id)
        bodies = await conn.fetch(
            "SELECT stream_seq, body::text AS b FROM events WHERE run_id = $1 ORDER BY stream_seq", run_id
        )
    assert seal is not None
    # the documented definition, recomputed independently of the store's code path
    import hashlib
    import json

    h = GENESIS
    for row in bodies:
        canon = json.dumps(json.loads(row["b"]), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
        h = hashlib.sha256((h + hashlib.sha256(canon.encode()).hexdigest()).encode()).hexdigest()
    assert seal["head_hash"] == h
    assert (seal["event_count"], seal["first_seq"], seal["last_seq"]) == (4, 2, 5)

    ok = await verify_run(pool, run_id)
    assert ok.ok
    assert ok.computed_head == ok.sealed_head == h
    assert (await verify_batch(pool, s.batch_id)).ok

    judged_seq = bodies[2]["stream_seq"]
    async with pool.acquire() as conn:  # a superuser bypassing the trigger to forge a score
        await conn.execute("ALTER TABLE events DISABLE TRIGGER events_append_only")
        await conn.execute(
            "UPDATE events SET body = jsonb_set(body, '{result,answer}', '\"43\"') WHERE stream_seq = $1",
            judged_seq,
        )
        await conn.execute("ALTER TABLE events ENABLE TRIGGER events_append_only")
    bad = await verify_run(pool, run_id)
    assert bad.status == "mismatch"
    assert bad.first_bad_seq == judged_seq
    batch = await verify_batch(pool, s.batch_id)
    assert not batch.ok
    assert (batch.mismatched, batch.ok_count) == (1, 1)

    async with pool.acquire() as conn:  # an event deleted from the chain
        await conn.execute("ALTER TABLE events DISABLE TRIGGER events_append_only")
        await conn.execute("DELETE FROM events WHERE stream_seq = $1", bodies[1]["stream_seq"])
        await conn.execute("ALTER TABLE events ENABLE TRIGGER events_append_only")
    gone = await verify_run(pool, run_id)
    assert gone.status == "mismatch"
    assert gone.first_bad_seq == bodies[1]["stream_seq"]


async def test_unsealed_run_verifies_as_not_sealed(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    s = Stream(cases=("c1",))
    await record(pool, [s.msg(s.requested()), s.msg(s.case_requested("c1")), s.msg(s.executed("c1"))])
    result = await verify_run(pool, s.run_id("c1"))
    assert result.status == "not_sealed"
    assert result.event_count == 2
    assert (await verify_run(pool, "nope")).status == "not_sealed"
    async with pool.acquire() as conn, conn.transaction():  # a caller's own transaction is reused
        assert (await verify_run(conn, s.run_id("c1"))).event_count == 2
    assert not (await verify_batch(pool, s.batch_id)).ok


def test_canonical_bytes_sorted_compact_and_number_stable() -> None:
    assert canonical_bytes('{"b": 1, "a": {"d": [1, 2.50], "c": "é"}}') == '{"a":{"c":"é","d":[1,2.5]},"b":1}'.encode()
    assert canonical_bytes('{"x": 0.0000001}') == canonical_bytes('{"x": 1e-07}')
    assert chain(["{}"]) != chain(['{"a":1}'])
    assert len(chain(["{}", "{}"])) == 2


async def test_events_after_seal_are_rejected_and_counted(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    s = Stream(cases=("c1",))
    head = [s.msg(s.requested()), s.msg(s.case_requested("c1")), s.msg(s.executed("c1")), s.msg(s.judged("c1"))]
    exported = s.msg(s.exported("c1"))
    late_in_same_call = s.msg(s.collected("c1"))
    out = await record(pool, [late_in_same_call, exported, *head])  # order of the call does not matter
    assert out.rejected_sealed == 1
    assert out.sealed_runs == (s.run_id("c1"),)
    late = s.msg(s.collected("c1"), seq=99)
    out2 = await record(pool, [late])
    assert (out2.inserted, out2.rejected_sealed) == (0, 1)
    rows = await table(pool, "SELECT stream_seq, reason, run_id FROM rejections ORDER BY stream_seq")
    assert rows == [
        {"stream_seq": late_in_same_call.stream_seq, "reason": "sealed", "run_id": s.run_id("c1")},
        {"stream_seq": 99, "reason": "sealed", "run_id": s.run_id("c1")},
    ]
    assert (await verify_run(pool, s.run_id("c1"))).ok
    run = await get_run(pool, s.run_id("c1"))
    assert run is not None
    assert run.sealed
    assert not run.collected


async def test_body_jsonb_cannot_hold_is_refused_not_wedged(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    s = Stream(cases=("c1",))
    good = s.msg(s.requested())
    poisoned = s.msg(s.case_requested("c1"))
    raw = b'{"huge":1e999999,' + poisoned.data[1:]  # an unknown field msgspec skips, numeric overflow
    nul = s.msg(s.executed("c1"))
    nul_raw = nul.data.replace(b'"answer":"42"', b'"answer":"4\\u00002"')
    out = await record(
        pool,
        [
            good,
            RecordedMessage(poisoned.stream_seq, poisoned.subject, raw, poisoned.event),
            RecordedMessage(nul.stream_seq, nul.subject, nul_raw, nul.event),
        ],
    )
    assert (out.inserted, out.invalid) == (2, 1)
    rows = await table(pool, "SELECT reason FROM rejections")
    assert rows == [{"reason": "invalid"}]
    run = await get_run(pool, s.run_id("c1"))
    assert run is not None
    assert run.answer == "4\ufffd2"


# ---------------------------------------------------------------- read models, completion, rebuild


async def test_read_models_and_completion(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    s = Stream(cases=("c1", "c2", "c1"), trials=1)  # a repeated case id counts once
    out = await record(pool, [s.msg(s.requested())])
    batch = await get_batch(pool, s.batch_id)
    assert batch is not None
    assert (batch.status, batch.total_runs, batch.suite_id) == ("queued", 2, "suite")
    assert out.complete_batches == ()

    c1 = s.lifecycle("c1")
    out = await record(pool, c1)
    assert out.complete_batches == ()
    batch = await get_batch(pool, s.batch_id)
    assert batch is not None
    assert batch.status == "running"
    assert (batch.counts.requested, batch.counts.executed, batch.counts.judged, batch.counts.exported) == (1, 1, 1, 1)

    c2 = s.lifecycle("c2", passed=False)
    out = await record(pool, c2[:3])
    assert out.complete_batches == ()
    out = await record(pool, c2[3:])
    assert out.complete_batches == (s.batch_id,)
    # a redelivery of the last message (crash before ack) reports it again until it is finalized
    assert (await record(pool, c2[3:])).complete_batches == (s.batch_id,)
    assert await complete_unfinalized_batches(pool) == [s.batch_id]

    event = await finalize_batch(pool, s.batch_id)
    assert event.batch_id == s.batch_id
    assert event.status == "succeeded"
    assert event.summary.verdicts.passed == 1
    assert event.summary.verdicts.failed == 1
    assert event.export.status == "succeeded"
    assert event.export.exported == 2
    out = await record(pool, [s.msg(event)])
    assert out.inserted == 1
    assert out.complete_batches == ()
    batch = await get_batch(pool, s.batch_id)
    assert batch is not None
    assert batch.status == "succeeded"
    assert batch.summary == event.summary
    assert batch.finalized_at is not None
    assert batch.export == event.export
    assert await complete_unfinalized_batches(pool) == []

    run = await get_run(pool, s.run_id("c2"))
    assert run is not None
    assert (run.stage, run.verdict, run.verdict_rung, run.sealed) == ("exported", "fail", "ground_truth", True)
    assert [sc.metric for sc in run.scores] == ["tests_pass", "judge:j", "judge:m"]


async def test_cancel_and_judge_error_finalize(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    s = Stream(cases=("c1",), supersede_key="pr-7")
    t = Stream(cases=("c1",), supersede_key="pr-7")
    await record(pool, [s.msg(s.requested()), t.msg(t.requested(), seq=50)])
    assert set(await open_batches_by_supersede_key(pool, "pr-7")) == {s.batch_id, t.batch_id}
    cancel = BatchCancelled(batch_id=s.batch_id, reason="superseded", by="bot", superseded_by=t.batch_id)
    await record(pool, [s.msg(cancel)])
    assert await open_batches_by_supersede_key(pool, "pr-7") == [t.batch_id]
    batch = await get_batch(pool, s.batch_id)
    assert batch is not None
    assert batch.status == "queued"
    assert batch.cancel_reason == "superseded"
    assert (await finalize_batch(pool, s.batch_id)).status == "superseded"

    msgs = [
        t.msg(t.case_requested("c1"), seq=51),
        t.msg(t.executed("c1"), seq=52),
        t.msg(t.judged("c1", judge_error="boom"), seq=53),
        t.msg(t.exported("c1", status="failed"), seq=54),
    ]
    assert (await record(pool, msgs)).complete_batches == (t.batch_id,)
    final = await finalize_batch(pool, t.batch_id)
    assert final.status == "failed"
    assert final.error is not None
    assert final.error.phase == "judges"
    assert final.export.status == "failed"
    assert final.export.message == "disk full"


async def test_rebuild_reproduces_read_models(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    s = Stream(cases=("c1", "c2", "c3"), trials=2)
    failure = CaseFailure(stage="run", failure_class="infra", code="spawn_failed", message="no")
    msgs = [s.msg(s.requested())]
    msgs += s.lifecycle("c1", 1) + s.lifecycle("c1", 2, passed=False) + s.lifecycle("c2", 1)
    msgs += [
        s.msg(s.case_requested("c2", 2)),
        s.msg(s.executed("c2", 2, status="failed", failure=failure)),
        s.msg(s.collected("c2", 2, failure)),
    ]
    msgs += [s.msg(s.case_requested("c3", 1)), s.msg(s.executed("c3", 1, status="cancelled"))]
    msgs += [s.msg(BatchCancelled(batch_id=s.batch_id, reason="cancelled", by="alice"))]
    other = Stream(cases=("x",))
    other.seq = 1000
    msgs += [other.msg(other.requested()), *other.lifecycle("x")]
    for i in range(0, len(msgs), 3):  # recorded in small calls
        await record(pool, msgs[i : i + 3])
    final = await finalize_batch(pool, other.batch_id)
    await record(pool, [other.msg(final)])

    before = await read_models(pool)
    outcome = await rebuild_read_models(pool, chunk_size=5)
    assert outcome.events == len(msgs) + 1
    assert outcome.undecodable == 0
    after = await read_models(pool)
    assert after == before
    assert len(after[0]) == 2
    assert len(after[1]) == 6
    run = await get_run(pool, s.run_id("c2", 2))
    assert run is not None
    assert run.stage == "collected"
    assert run.executed_status == "failed"
    assert run.verdict is None
    assert run.failure == failure


async def test_list_runs_trajectory_and_pages(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    s = Stream(cases=tuple(f"c{i}" for i in range(5)))
    msgs = [s.msg(s.requested())]
    for i in range(5):
        msgs += s.lifecycle(f"c{i}") if i < 3 else [s.msg(s.case_requested(f"c{i}")), s.msg(s.executed(f"c{i}"))]
    await record(pool, msgs)

    page1 = await list_runs(pool, s.batch_id, limit=2)
    page2 = await list_runs(pool, s.batch_id, limit=2, cursor=page1.next_cursor)
    page3 = await list_runs(pool, s.batch_id, limit=2, cursor=page2.next_cursor)
    ids = [r.run_id for p in (page1, page2, page3) for r in p.runs]
    assert ids == sorted(s.run_id(f"c{i}") for i in range(5))
    assert page3.next_cursor is None
    executed = await list_runs(pool, s.batch_id, stage="executed")
    assert [r.case_id for r in executed.runs] == ["c3", "c4"]
    assert all(r.verdict == "pass" and r.scores for r in executed.runs)

    traj = await get_trajectory(pool, s.run_id("c0"))
    assert traj is not None
    assert traj.seal is not None
    assert [e.type for e in traj.events] == ["case.requested", "case.executed", "case.judged", "case.exported"]
    assert traj.seal.event_count == 4
    assert traj.seal.last_seq == traj.events[-1].stream_seq
    open_traj = await get_trajectory(pool, s.run_id("c4"))
    assert open_traj is not None
    assert open_traj.seal is None
    assert len(open_traj.events) == 2
    assert await get_trajectory(pool, "unknown") is None
    assert await get_batch(pool, "unknown") is None


async def test_recorder_batches_many_events(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    cases = tuple(f"c{i}" for i in range(300))
    s = Stream(cases=cases)
    msgs = [s.msg(s.requested())]
    for c in cases:
        msgs += s.lifecycle(c)
    out = await record(pool, msgs)
    assert out.inserted == len(msgs)
    assert len(out.sealed_runs) == 300
    assert out.complete_batches == (s.batch_id,)
    assert (await verify_batch(pool, s.batch_id)).ok_count == 300


async def test_replicas_recording_the_same_stream_concurrently(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    s = Stream(cases=tuple(f"c{i}" for i in range(20)))
    msgs = [s.msg(s.requested())]
    for i in range(20):
        msgs += s.lifecycle(f"c{i}")
    chunks_a = [msgs[i : i + 7] for i in range(0, len(msgs), 7)]
    chunks_b = [msgs[i : i + 11] for i in range(0, len(msgs), 11)]

    async def replica(chunks: list[list[RecordedMessage]]) -> list[str]:
        complete: list[str] = []
        for chunk in chunks:
            complete += (await record(pool, chunk)).complete_batches
        return complete

    done_a, done_b = await asyncio.gather(replica(chunks_a), replica(chunks_b))
    assert s.batch_id in done_a or s.batch_id in done_b
    assert await table(pool, "SELECT count(*) AS n FROM events") == [{"n": len(msgs)}]
    assert await table(pool, "SELECT count(*) AS n FROM rejections") == [{"n": 0}]
    batch = await get_batch(pool, s.batch_id)
    assert batch is not None
    assert batch.counts.exported == 20
    assert batch.counts.requested == 20
    assert (await verify_batch(pool, s.batch_id)).ok_count == 20


async def test_a_run_recorded_out_of_order_seals_only_when_every_stage_is_in(
    pool: asyncpg.Pool[asyncpg.Record],
) -> None:
    """Replicas may record out of stream order: `case.exported` first must not refuse the judged
    event that comes after it; the seal waits for the whole trajectory."""
    s = Stream(cases=("c1",))
    requested, executed, judged, exported = s.lifecycle("c1")
    first = await record(pool, [s.msg(s.requested()), requested, executed, exported])
    assert first.sealed_runs == ()
    assert first.rejected_sealed == 0
    second = await record(pool, [judged])
    assert second.inserted == 1
    assert len(second.sealed_runs) == 1
    run_id = second.sealed_runs[0]
    assert (await verify_run(pool, run_id)).status == "ok"
    late = await record(pool, [s.msg(s.collected("c1"))])
    assert late.rejected_sealed == 1


async def test_a_batch_is_complete_only_when_every_run_is_sealed_not_merely_exported(
    pool: asyncpg.Pool[asyncpg.Record],
) -> None:
    """A replica died holding c2's `case.executed`; the rest of c2 flowed past it and was recorded
    first. Every run is exported, but c2's results are not all in: finalizing now would aggregate
    without them (seen in the crash test's after-commit window: `counts.executed: 9 != 10`). The
    batch is complete, and its aggregate whole, once c2's executed event is recorded."""
    s = Stream(cases=("c1", "c2"))
    await record(pool, [s.msg(s.requested()), *s.lifecycle("c1")])
    requested, executed, judged, exported = s.lifecycle("c2")
    early = await record(pool, [requested, judged, exported])
    assert early.complete_batches == ()
    assert await complete_unfinalized_batches(pool) == []
    late = await record(pool, [executed])
    assert late.complete_batches == (s.batch_id,)
    event = await finalize_batch(pool, s.batch_id)
    assert event.summary.counts.executed == 2
    assert event.summary.verdicts.verdicted == 2


async def test_a_run_whose_case_requested_comes_last_seals_with_it_not_without(
    pool: asyncpg.Pool[asyncpg.Record],
) -> None:
    """The recorder replica holding c1's `case.requested` died with it uncommitted; the run's other
    stages were recorded by other replicas. Sealing then refused the requested event as `sealed`
    when it came back after `ack_wait`, and the store lost it (seen in the scale-out test: 4,001 of
    4,002 rows). The seal waits for it, and chains it."""
    s = Stream(cases=("c1",))
    requested, executed, judged, exported = s.lifecycle("c1")
    early = await record(pool, [s.msg(s.requested()), executed, judged, exported])
    assert early.sealed_runs == ()
    assert early.complete_batches == ()
    late = await record(pool, [requested])
    assert late.inserted == 1
    assert late.rejected_sealed == 0
    assert len(late.sealed_runs) == 1
    assert late.complete_batches == (s.batch_id,)
    verified = await verify_run(pool, late.sealed_runs[0])
    assert verified.status == "ok"
    rows = await table(pool, "SELECT event_count FROM seals")
    assert rows == [{"event_count": 4}]
