"""The shape of the recorder's write path (issue 3), against a real PostgreSQL; no timings here
(bench/recorder.py measures them).

- `stored_body_digest` predicts, from a payload, the digest of what jsonb stores: checked against
  the server's own text for thousands of generated documents and the numbers jsonb rewrites.
- Seals chain the digests kept with the events: a body altered after it was recorded no longer
  matches its seal; events stored without a digest are sealed from their bodies.
- A transaction larger than one INSERT slice, with an unstorable message in a later slice, is
  retried and records everything else; the read models equal a rebuild.
- The recorder reads by index only, whatever the statistics and plans of a growing store.
- `Overlap` does its work while a statement is in flight, and leaves the connection usable.
"""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import Iterator
from typing import Any

import asyncpg
import pytest

from evalbus_contracts import (
    BatchPolicy,
    BatchRequested,
    BatchSpec,
    CaseExecuted,
    CaseExported,
    CaseJudged,
    CasePlan,
    CaseRequested,
    CaseResult,
    CaseSpec,
    CommandHarness,
    Event,
    LlmCall,
    Measured,
    Message,
    SuiteSpec,
    TestsPassGrader,
    ToolCall,
    batch_run_id,
    encode,
)
from evalbus_gateway.store import RecordedMessage, migrate, rebuild_read_models, record, verify_batch, verify_run
from evalbus_gateway.store.chain import body_digest, stored_body_digest
from evalbus_gateway.store.overlap import Overlap

pytestmark = pytest.mark.integration

HARNESS = CommandHarness(id="agent", command=("agent",))


async def stored_texts(pool: asyncpg.Pool[asyncpg.Record], documents: list[str]) -> list[str]:
    """What PostgreSQL prints for each document stored as jsonb."""
    rows = await pool.fetch(
        "SELECT u.t::jsonb::text AS stored FROM unnest($1::text[]) WITH ORDINALITY AS u(t, n) ORDER BY u.n",
        documents,
    )
    return [str(r["stored"]) for r in rows]


# ---------------------------------------------------------------- the digest of a body before it is stored

EDGE_NUMBERS = (
    "0", "-0", "0.0", "-0.0", "-0.000", "0e0", "-0e0", "0.0e-3", "-0.0E+5", "1.50", "100.0", "1.5e3", "1.50e1",
    "1E+2", "1e16", "1e22", "-1e16", "1e-7", "1E-07", "2.5E-3", "0.000001", "1e-400", "-1e-400", "5e-324",
    "-5e-324", "1.7976931348623157e308", "9007199254740993", "123456789012345678901234567890",
    "0.1000000000000000055511151231257827021181583404541015625", "12345678901234567890.5", "1e300",
)  # fmt: skip
"""Numbers jsonb stores as `numeric`, printed back differently (or not)."""


def random_number(rng: random.Random) -> str:
    """A JSON number in one of the notations producers write."""
    kind = rng.randrange(7)
    sign = "-" if rng.random() < 0.3 else ""
    if kind == 0:
        return sign + str(rng.randrange(10 ** rng.randrange(1, 25)))
    if kind == 1:
        return repr(rng.uniform(-1e6, 1e6))
    if kind == 2:
        return repr(rng.random() * 10.0 ** rng.randrange(-30, 30))
    if kind == 3:  # trailing zeros, which numeric keeps
        return f"{sign}{rng.randrange(1000)}.{rng.randrange(1000)}{'0' * rng.randrange(4)}"
    if kind == 4:  # an exponent, either case, any sign
        mantissa = f"{rng.randrange(1, 10)}" + (f".{rng.randrange(10**4)}" if rng.random() < 0.5 else "")
        exponent = rng.choice(["e", "E"]) + rng.choice(["", "+", "-"]) + str(rng.randrange(0, 40))
        return sign + mantissa + exponent
    if kind == 5:
        return rng.choice(EDGE_NUMBERS)
    return sign + "0." + "0" * rng.randrange(8) + str(rng.randrange(1, 10**6))


def random_string(rng: random.Random) -> str:
    """A JSON string literal: plain text, escapes, raw and escaped non-ASCII, astral characters."""
    parts = ['"']
    for _ in range(rng.randrange(12)):
        kind = rng.randrange(8)
        if kind == 0:
            parts.append(rng.choice(["\\n", "\\t", '\\"', "\\\\", "\\/", "\\b", "\\f", "\\r"]))
        elif kind == 1:  # an escaped BMP character (no surrogates, no NUL: jsonb refuses them)
            cp = rng.choice([rng.randrange(1, 0x20), rng.randrange(0x20, 0xD800), rng.randrange(0xE000, 0x10000)])
            parts.append(f"\\u{cp:04{rng.choice('xX')}}")
        elif kind == 2:  # an astral character as a surrogate pair
            cp = rng.randrange(0x10000, 0x110000) - 0x10000
            parts.append(f"\\u{0xD800 + (cp >> 10):04x}\\u{0xDC00 + (cp & 0x3FF):04x}")
        elif kind == 3:
            parts.append(rng.choice(["é", "中文", "😀", "\u2028", "\x7f", "ÿ", "\U0001f600x"]))
        else:
            parts.append("".join(rng.choice("abcxyz09 :.,{}[]-eE") for _ in range(rng.randrange(8))))
    parts.append('"')
    return "".join(parts)


def random_value(rng: random.Random, depth: int = 0) -> str:
    """A JSON value with random whitespace, nesting and duplicate keys."""
    space = rng.choice(["", "", " ", "\n  "])
    kind = rng.randrange(7 if depth < 4 else 4)
    if kind == 0:
        return random_number(rng)
    if kind == 1:
        return random_string(rng)
    if kind == 2:
        return rng.choice(["true", "false", "null"])
    if kind == 3:
        return random_number(rng) if rng.random() < 0.5 else random_string(rng)
    if kind == 4:
        return "[" + space + ("," + space).join(random_value(rng, depth + 1) for _ in range(rng.randrange(5))) + "]"
    keys = [random_string(rng) for _ in range(rng.randrange(6))]
    keys += rng.sample(keys, k=min(len(keys), rng.randrange(2)))  # a duplicate key: the last one wins
    members = [f"{key}{space}:{space}{random_value(rng, depth + 1)}" for key in keys]
    return "{" + space + ("," + space).join(members) + space + "}"


def random_document(rng: random.Random) -> str:
    """A JSON object, as payloads are."""
    members = [f'"k{i}":{random_value(rng)}' for i in range(rng.randrange(1, 8))]
    return "{" + ",".join(members) + "}"


async def test_stored_body_digest_predicts_what_postgresql_stores(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    rng = random.Random(20240503)
    documents = [random_document(rng) for _ in range(3000)]
    documents += ['{"n": ' + token + "}" for token in EDGE_NUMBERS]
    stored = await stored_texts(pool, documents)
    unsure = 0
    for document, text in zip(documents, stored, strict=True):
        predicted = stored_body_digest(document)
        if predicted is None:
            unsure += 1
        else:
            assert predicted == body_digest(text), f"{document!r} is stored as {text!r}"
    assert unsure < len(documents) // 20  # the prediction is the rule, reading back the exception
    for token in EDGE_NUMBERS:  # every notation above is predicted, none is only avoided
        assert stored_body_digest('{"n": ' + token + "}") is not None, token


def test_stored_body_digest_is_unsure_rather_than_wrong() -> None:
    for document in (
        '{"n": 1e999}',  # jsonb prints a thousand digits
        '{"n": ' + "9" * 400 + ".5}",  # its double is infinite
        '{"n": ' + "9" * 5000 + "}",  # more digits than Python converts
        "[" * 5000 + "]" * 5000,
        '{"n": 1',
    ):
        assert stored_body_digest(document) is None


# ---------------------------------------------------------------- seals chain the recorded digests


class Pipeline:
    """One batch's events as the pipeline publishes them: a trace and several scores per run, stages
    of successive runs interleaved (stage k of run i comes at i + k * lag), numbered like CASES."""

    def __init__(self, runs: int, *, lag: int = 16, first_seq: int = 1) -> None:
        self.batch_id = f"b{uuid.uuid4().hex[:10]}"
        self.cases = [
            CaseSpec(
                id=f"c{i:04d}",
                input=f"{i} + {i}?",
                expected=str(2 * i),
                graders=(TestsPassGrader(id="t", command="true"),),
            )
            for i in range(runs)
        ]
        self.spec = BatchSpec(suite=SuiteSpec(id="s", cases=tuple(self.cases)), harness=HARNESS, policy=BatchPolicy())
        self.plan = CasePlan(suite_id="s", submitted_by="alice")
        timed: list[tuple[int, int, Event]] = []
        for i, case in enumerate(self.cases):
            for k, event in enumerate(self.run_events(case)):
                timed.append((i + k * lag, k, event))
        timed.sort(key=lambda t: (t[0], t[1]))
        events: list[Event] = [BatchRequested(batch_id=self.batch_id, spec=self.spec, submitted_by="alice")]
        events += [e for _, _, e in timed]
        self.messages = [RecordedMessage(seq, e.subject(), encode(e), e) for seq, e in enumerate(events, first_seq)]

    def run_id(self, case_id: str) -> str:
        return batch_run_id(self.batch_id, case_id)

    def run_events(self, case: CaseSpec) -> list[Event]:
        ids: dict[str, Any] = {"batch_id": self.batch_id, "case_id": case.id, "run_id": self.run_id(case.id)}
        trace = (
            Message(t=0.0, role="user", text=case.input),
            LlmCall(t=0.01, model="m", input_tokens=40, output_tokens=5, cost_usd=0.0012, duration_ms=8.5),
            ToolCall(t=0.02, id="t1", name="calc", args={"x": 1.5e-7, "y": [1, 2.50, -0.0]}),
            Message(t=0.04, role="assistant", text=case.expected or ""),
        )
        scores = (
            Measured(grader_id="t", metric="tests_pass", value=1.0, passed=True),
            Measured(grader_id="c", metric="cost_usd", value=0.0012),
        )
        result = CaseResult(
            case_id=case.id, run_id=ids["run_id"], harness="agent@1", answer=case.expected, trace=trace, scores=scores
        )
        judged = CaseResult(
            case_id=case.id,
            run_id=ids["run_id"],
            harness="agent@1",
            answer=case.expected,
            trace=trace,
            scores=(*scores, Measured(grader_id="j", metric="judge:j", value=0.75, passed=True, source="judge")),
        )
        return [
            CaseRequested(**ids, case=case, harness=HARNESS, plan=self.plan),
            CaseExecuted(**ids, status="succeeded", result=result, plan=self.plan, case=case),
            CaseJudged(**ids, status="judged", result=judged, plan=self.plan, case=case),
            CaseExported(**ids, status="skipped"),
        ]


async def test_each_event_keeps_the_digest_of_its_stored_body(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    p = Pipeline(20)
    out = await record(pool, p.messages)
    assert out.inserted == len(p.messages)
    assert len(out.sealed_runs) == 20
    rows = await pool.fetch("SELECT run_id, body::text AS body, body_sha256 FROM events ORDER BY stream_seq")
    for row in rows:
        if row["run_id"] is None:  # a batch event is never chained
            assert row["body_sha256"] is None
        else:
            assert row["body_sha256"] == body_digest(row["body"])
    assert (await verify_batch(pool, p.batch_id)).ok_count == 20


async def test_a_body_altered_after_it_was_recorded_does_not_match_its_seal(
    pool: asyncpg.Pool[asyncpg.Record],
) -> None:
    """The seal chains what the recorder stored, not what the table holds when the run settles."""
    p = Pipeline(1)
    first, last = p.messages[:-1], p.messages[-1:]  # the run settles with its last event
    await record(pool, first)
    executed = next(m for m in first if m.event.type == "case.executed")
    async with pool.acquire() as conn:  # a superuser rewriting history before the seal
        await conn.execute("ALTER TABLE events DISABLE TRIGGER events_append_only")
        await conn.execute(
            "UPDATE events SET body = jsonb_set(body, '{result,answer}', '\"43\"') WHERE stream_seq = $1",
            executed.stream_seq,
        )
        await conn.execute("ALTER TABLE events ENABLE TRIGGER events_append_only")
    out = await record(pool, last)
    assert out.sealed_runs == (p.run_id("c0000"),)
    result = await verify_run(pool, p.run_id("c0000"))
    assert result.status == "mismatch"
    assert result.first_bad_seq == executed.stream_seq


async def test_events_stored_without_a_digest_are_sealed_from_their_bodies(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    """Rows written before `body_sha256` existed (or whose stored form is not predicted) are
    chained from `body::text`."""
    p = Pipeline(2, lag=1)
    requested, executed, judged = [m for m in p.messages if m.event.run_id == p.run_id("c0000")][:3]
    assert (requested.event.type, executed.event.type, judged.event.type) == (
        "case.requested",
        "case.executed",
        "case.judged",
    )
    async with pool.acquire() as conn:  # as an earlier version of the recorder stored them
        for m in (requested, executed):
            e = m.event
            await conn.execute(
                "INSERT INTO events (stream_seq, subject, type, event_id, batch_id, case_id, run_id, attempt, ts, "
                "body, dedupe_key) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10::jsonb, $11)",
                m.stream_seq,
                m.subject,
                e.type,
                e.event_id,
                e.batch_id,
                e.case_id,
                e.run_id,
                e.attempt,
                e.ts,
                m.data.decode(),
                f"{e.type}:{e.run_id}",
            )
    # a number jsonb keeps as a thousand digits: not predicted, read back
    odd = RecordedMessage(judged.stream_seq, judged.subject, b'{"x_huge":1e999,' + judged.data[1:], judged.event)
    messages = [odd if m is judged else m for m in p.messages]
    out = await record(pool, messages)
    assert out.already_recorded == 2
    assert sorted(out.sealed_runs) == sorted(p.run_id(c.id) for c in p.cases)
    assert await pool.fetchval("SELECT body_sha256 FROM events WHERE stream_seq = $1", judged.stream_seq) is None
    assert (await verify_batch(pool, p.batch_id)).ok_count == 2


async def test_a_large_transaction_with_an_unstorable_message_late_in_it(pool: asyncpg.Pool[asyncpg.Record]) -> None:
    """More events than one INSERT statement takes, one of them refused by PostgreSQL in a later
    statement: the transaction is redone without it, everything else is stored and sealed, and
    the read models equal a rebuild from the stored events."""
    p = Pipeline(150)
    messages = list(p.messages)
    k = next(i for i, m in enumerate(messages) if i > 450 and m.event.type == "case.exported")
    poisoned = messages[k]
    messages[k] = RecordedMessage(
        poisoned.stream_seq, poisoned.subject, b'{"x":1e999999,' + poisoned.data[1:], poisoned.event
    )
    out = await record(pool, messages)
    assert (out.inserted, out.invalid) == (len(messages) - 1, 1)
    assert len(out.sealed_runs) == 149
    assert poisoned.event.run_id not in out.sealed_runs
    assert (await verify_batch(pool, p.batch_id)).ok_count == 149

    models = "SELECT * FROM batches ORDER BY batch_id", "SELECT * FROM runs ORDER BY run_id"
    before = [[dict(r) for r in await pool.fetch(sql)] for sql in models]
    await rebuild_read_models(pool, chunk_size=97)
    after = [[dict(r) for r in await pool.fetch(sql)] for sql in models]
    assert after == before
    assert sum(1 for run in after[1] if run["sealed"]) == 149


async def test_the_recorder_reads_by_index_whatever_the_statistics(database_url: str) -> None:
    """A long-lived connection caches generic plans made while the store was small, and the
    statistics lag behind a growing store; the recorder's lookups still use indexes, so a
    transaction's cost does not grow with the store."""
    conn = await asyncpg.connect(database_url)
    try:
        await migrate(conn)
        await conn.execute("SET plan_cache_mode = force_generic_plan")
        p = Pipeline(400, lag=64)
        head = p.messages[:-40]
        for start in range(0, len(head), 200):
            await record(conn, head[start : start + 200])
        scans = (
            "SELECT relname, seq_scan FROM pg_stat_xact_user_tables "
            "WHERE relname IN ('events', 'seals', 'rejections', 'runs', 'batches')"
        )
        async with conn.transaction():  # the counts of this transaction (and of unflushed earlier ones)
            before = {str(r["relname"]): int(r["seq_scan"]) for r in await conn.fetch(scans)}
            out = await record(conn, p.messages[-40:])
            after = {str(r["relname"]): int(r["seq_scan"]) for r in await conn.fetch(scans)}
        assert out.inserted == 40
        assert out.sealed_runs
        assert after == before
    finally:
        await conn.close()


# ---------------------------------------------------------------- Overlap


def slices(
    done: list[int], n: int, *, fail_at: int | None = None, third: asyncio.Event | None = None
) -> Iterator[None]:
    for i in range(n):
        if i == fail_at:
            raise ValueError("work failed")
        done.append(i)
        if i == 2 and third is not None:
            third.set()
        yield


async def test_overlap_works_while_the_statement_is_in_flight() -> None:
    done: list[int] = []
    third = asyncio.Event()

    async def statement() -> str:
        await third.wait()  # answers only once the work has progressed, which it cannot do itself
        return "answer"

    overlap = Overlap()
    overlap.add(slices(done, 10, third=third))
    assert await asyncio.wait_for(overlap.during(statement()), 5) == "answer"
    assert 3 <= len(done) < 10
    overlap.run_until(lambda: len(done) >= 6)
    assert len(done) == 6
    overlap.finish()
    assert done == list(range(10))
    assert await overlap.during(asyncio.sleep(0, "no work left")) == "no work left"


async def test_overlap_raises_the_works_error_once_the_statement_is_over() -> None:
    done: list[int] = []
    finished = asyncio.Event()

    async def statement() -> None:
        for _ in range(20):
            await asyncio.sleep(0)
        finished.set()

    overlap = Overlap()
    overlap.add(slices(done, 10, fail_at=2))
    with pytest.raises(ValueError, match="work failed"):
        await overlap.during(statement())
    assert finished.is_set()  # the connection would be free for the rollback
    assert done == [0, 1]


async def test_cancelling_overlap_cancels_the_statement() -> None:
    started = asyncio.Event()
    never = asyncio.Event()
    cancelled = asyncio.Event()

    async def statement() -> None:
        started.set()
        try:
            await never.wait()
        except asyncio.CancelledError:
            cancelled.set()
            raise

    def endless() -> Iterator[None]:
        while True:
            yield

    overlap = Overlap()
    overlap.add(endless())
    waiting = asyncio.ensure_future(overlap.during(statement()))
    await asyncio.wait_for(started.wait(), 5)
    waiting.cancel()
    with pytest.raises(asyncio.CancelledError):
        await waiting
    await asyncio.wait_for(cancelled.wait(), 5)
