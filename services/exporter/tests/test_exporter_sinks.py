"""The exporter's sinks and aggregation: jsonl idempotence and confinement, status rules, a sink
that raises anyway, per-batch sink cache."""

from __future__ import annotations

import asyncio
from pathlib import Path

import msgspec
import pytest

from evalbus_contracts import (
    CaseJudged,
    CasePlan,
    CaseResult,
    JsonlSink,
    Measured,
    SinkOutcome,
    SinkSpec,
    Unmeasured,
)
from evalbus_exporter.export import SinkCache, export_case, export_status
from evalbus_exporter.sinks.base import CaseSink
from evalbus_exporter.sinks.jsonl import JsonlCaseSink

pytestmark = pytest.mark.unit


def judged(case: str = "c1", batch: str = "b1") -> CaseJudged:
    result = CaseResult(
        case_id=case,
        run_id=f"evb-{batch}-{case}",
        harness="h@1",
        answer="42",
        scores=(
            Measured(grader_id="a", metric="answer_match", value=1.0, passed=True),
            Unmeasured(grader_id="r", metric="judge:r", reason="unsupported", source="judge"),
        ),
    )
    return CaseJudged(
        batch_id=batch, case_id=case, run_id=result.run_id, status="judged", result=result, plan=CasePlan()
    )


async def test_jsonl_writes_one_line_per_case_even_when_redelivered(tmp_path: Path) -> None:
    sink = JsonlCaseSink(JsonlSink(path="{batch}.jsonl"), "b1", tmp_path)
    first = await sink.export(judged("c1"))
    again = await sink.export(judged("c1"))  # a redelivery
    other_replica = JsonlCaseSink(JsonlSink(path="{batch}.jsonl"), "b1", tmp_path)
    third = await other_replica.export(judged("c1"))  # another replica, same file
    await other_replica.export(judged("c2"))
    assert first.status == again.status == third.status == "ok"
    lines = (tmp_path / "b1.jsonl").read_text().splitlines()
    assert len(lines) == 2
    doc = msgspec.json.decode(lines[0])
    assert doc["run_id"] == "evb-b1-c1"
    assert doc["scores"] == {"answer_match": 1.0}  # only measured scores
    assert doc["passed"] == {"answer_match": True}


async def test_jsonl_concurrent_exports_of_the_same_case_write_once(tmp_path: Path) -> None:
    sinks = [JsonlCaseSink(JsonlSink(path="out.jsonl"), "b1", tmp_path) for _ in range(4)]
    await asyncio.gather(*(s.export(judged("c1")) for s in sinks for _ in range(3)))
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("path", ["../escape.jsonl", "/etc/evalbus.jsonl", "a/../../b.jsonl"])
async def test_jsonl_paths_cannot_leave_the_export_folder(tmp_path: Path, path: str) -> None:
    root = tmp_path / "exports"
    outcome = await JsonlCaseSink(JsonlSink(path=path), "b1", root).export(judged())
    assert outcome.status == "failed"
    assert "inside the export folder" in (outcome.error or "")
    assert not (tmp_path / "escape.jsonl").exists()


def test_export_status_rules() -> None:
    ok = SinkOutcome(sink="a", status="ok")
    bad = SinkOutcome(sink="b", status="failed", error="x")
    assert export_status([]) == "skipped"
    assert export_status([ok, ok]) == "exported"
    assert export_status([ok, bad]) == "partial"
    assert export_status([bad, bad]) == "failed"


class Raising:
    name = "raising"

    async def export(self, judged: CaseJudged) -> SinkOutcome:
        raise RuntimeError("boom")

    async def close(self) -> None:
        return None


async def test_a_sink_that_raises_is_a_failed_outcome_not_a_crash(tmp_path: Path) -> None:
    good = JsonlCaseSink(JsonlSink(path="x.jsonl"), "b1", tmp_path)
    exported = await export_case(judged(), [good, Raising()])
    assert exported.status == "partial"
    assert [o.status for o in exported.outcomes] == ["ok", "failed"]
    assert "boom" in (exported.outcomes[1].error or "")
    assert exported.run_id == "evb-b1-c1"


async def test_no_sink_means_skipped() -> None:
    exported = await export_case(judged(), [])
    assert exported.status == "skipped"
    assert exported.outcomes == ()


async def test_sinks_are_built_once_per_batch(tmp_path: Path) -> None:
    built: list[str] = []

    def factory(spec: SinkSpec, batch_id: str) -> CaseSink:
        built.append(batch_id)
        assert isinstance(spec, JsonlSink)
        return JsonlCaseSink(spec, batch_id, tmp_path)

    cache = SinkCache(factory, size=2)
    spec = (JsonlSink(path="{batch}.jsonl"),)
    for batch in ["b1", "b1", "b2", "b1", "b3", "b1"]:
        await cache.for_batch(batch, spec)
    assert built == ["b1", "b2", "b3"]  # b1 stayed cached (most recently used)
    await cache.close()
