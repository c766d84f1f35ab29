"""A run's large outputs into the `artifacts` bucket, on a real nats-server with a stock 1 MB
`max_payload`: declared files are stored and their events rewritten, declarations that may not be
honoured say why, large logs are stored whole, and an execution that still cannot fit the bus
becomes a failed one instead of a publish that can never succeed."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import msgspec
import pytest
from nats.aio.client import Client as NatsClient

from evalbus.infra.nats import STOCK_MAX_PAYLOAD, NatsServer
from evalbus_contracts import (
    Artifact,
    CaseExecuted,
    CasePlan,
    CaseResult,
    CaseSpec,
    Error,
    Measured,
    Message,
    ObjectRef,
    encode,
)
from evalbus_dispatcher.artifacts import RunObjects, declared_path, is_declaration, too_large
from evalbus_runtime import connect, ensure_topology
from evalbus_runtime.objects import get_object


def test_declared_paths_stay_inside_the_workdir() -> None:
    assert declared_path("out/report.html") == "out/report.html"
    assert declared_path("./out//a.bin") == "out/a.bin"
    for bad in ("", "/etc/passwd", "../x", "out/../../x", "a b.txt", "c:\\x", "ü.txt", "x" * 300):
        assert declared_path(bad) is None, bad


def test_only_an_unstored_artifact_is_a_declaration() -> None:
    assert is_declaration(Artifact(name="a", ref="out/a"))
    assert not is_declaration(Artifact(name="a", ref="artifacts/runs/r/a1/files/a", sha256="0" * 64, size=1))
    assert not is_declaration(Message(role="assistant", text="hi"))


def test_an_execution_too_large_even_offloaded_fails_with_the_reason() -> None:
    scores = tuple(Measured(grader_id=f"g{i}", metric=f"m{i}", value=1.0, detail="d" * 100) for i in range(5))
    result = CaseResult(case_id="c", run_id="r", harness="h@1", scores=scores)
    executed = CaseExecuted(batch_id="b", case_id="c", run_id="r", status="succeeded", result=result, plan=CasePlan())
    failed = too_large(executed, 2_000_000, STOCK_MAX_PAYLOAD)
    assert failed.status == "failed"
    assert failed.result.scores == ()
    assert failed.result.failure is not None
    assert failed.result.failure.code == "result_too_large"
    assert "2000000 bytes" in failed.result.failure.message
    assert str(STOCK_MAX_PAYLOAD) in failed.result.failure.message


@dataclass
class Workdir:
    """A sandbox as the local backend's: its workdir on this machine."""

    workdir: Path


@pytest.fixture
async def stock_bus(stock_nats: NatsServer) -> AsyncIterator[NatsClient]:
    nc = await connect(stock_nats.url, "artifacts-test")
    await ensure_topology(nc.jetstream())
    yield nc
    await nc.close()


@pytest.mark.integration
async def test_declared_files_are_stored_and_their_events_rewritten(stock_bus: NatsClient, tmp_path: Path) -> None:
    js = stock_bus.jetstream()
    run_id = f"evb-{uuid.uuid4().hex[:8]}-c1"
    work = tmp_path / "work"
    (work / "out").mkdir(parents=True)
    data = bytes(range(256)) * (3 * STOCK_MAX_PAYLOAD // 256)
    (work / "out" / "big.bin").write_bytes(data)
    (tmp_path / "secret.txt").write_text("outside")
    (work / "link.txt").symlink_to(tmp_path / "secret.txt")
    events = [
        Artifact(name="big", ref="out/big.bin", media_type="application/octet-stream", t=1.0),
        Artifact(name="gone", ref="out/missing.bin", t=2.0),
        Artifact(name="escape", ref="../secret.txt", t=3.0),
        Artifact(name="link", ref="link.txt", t=4.0),
    ]
    objects = RunObjects(js)
    out = await objects.store_declared(events, Workdir(work), run_id=run_id, attempt=2, t=5.0)
    stored = out[0]
    assert isinstance(stored, Artifact)
    assert stored.ref == f"artifacts/runs/{run_id}/a2/files/out/big.bin"
    assert stored.sha256 is not None
    assert (stored.size, stored.sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert stored.media_type == "application/octet-stream"
    ref = ObjectRef(bucket="artifacts", name=stored.ref.partition("/")[2], size=len(data), sha256=stored.sha256)
    assert await get_object(js, ref) == data
    errors = [e.message for e in out if isinstance(e, Error)]
    assert len(errors) == 3
    assert "no such file" in errors[0]
    assert "stay inside the workdir" in errors[1]
    assert "inside the workdir" in errors[2]
    assert [e for e in out if isinstance(e, Artifact) and e.sha256 is None] == events[1:]

    elsewhere = await objects.store_declared(events[:1], object(), run_id=run_id, attempt=1, t=0.0)
    assert isinstance(elsewhere[1], Error)
    assert "no files the dispatcher can read" in elsewhere[1].message


@pytest.mark.integration
async def test_logs_over_the_threshold_are_stored_whole(stock_bus: NatsClient) -> None:
    js = stock_bus.jetstream()
    run_id = f"evb-{uuid.uuid4().hex[:8]}-c1"
    objects = RunObjects(js, inline_max=1000)
    stdout = 'EVALBUS_RESULT {"answer": "x"}\n' + "line\n" * 500
    logs = await objects.store_logs(stdout, "short", run_id=run_id, attempt=1, t=9.0)
    [log] = logs
    assert (log.name, log.role, log.t) == ("stdout.log", "stdout", 9.0)
    assert log.sha256 is not None
    assert log.size is not None
    ref = ObjectRef(bucket="artifacts", name=log.ref.partition("/")[2], size=log.size, sha256=log.sha256)
    assert (await get_object(js, ref)).decode() == "line\n" * 500  # control lines removed


@pytest.mark.integration
async def test_offload_keeps_a_large_execution_under_the_bus_limit(stock_bus: NatsClient) -> None:
    js = stock_bus.jetstream()
    run_id = f"evb-{uuid.uuid4().hex[:8]}-c1"
    result = CaseResult(case_id="c1", run_id=run_id, harness="h@1", answer="z" * (2 * STOCK_MAX_PAYLOAD))
    executed = CaseExecuted(
        batch_id="b",
        case_id="c1",
        run_id=run_id,
        status="succeeded",
        result=result,
        plan=CasePlan(),
        case=CaseSpec(id="c1", input="q"),
    )
    objects = RunObjects(js, max_event_bytes=STOCK_MAX_PAYLOAD)
    out = await objects.offload(executed)
    assert out.status == "succeeded"
    assert out.result.payload is not None
    assert out.result.offloaded == ("answer",)
    assert len(encode(out)) < 4096
    small = msgspec.structs.replace(executed, result=msgspec.structs.replace(result, answer="ok"))
    assert await objects.offload(small) is small


async def test_the_end_of_the_output_is_dropped_before_a_result_is_lost(stock_bus: NatsClient) -> None:
    """`output_tail` (for the log view) never makes an execution too large: an event that fits
    without it loses it, one that fits with it keeps it."""
    result = CaseResult(case_id="c1", run_id="r1", harness="h@1", answer="ok")
    executed = CaseExecuted(
        batch_id="b",
        case_id="c1",
        run_id="r1",
        status="succeeded",
        result=result,
        plan=CasePlan(),
        output_tail="x" * 9000,
    )
    limit = len(encode(executed)) + 8 * 1024 - 100  # headroom included: just too large with the tail
    out = await RunObjects(stock_bus.jetstream(), max_event_bytes=limit).offload(executed)
    assert (out.status, out.output_tail, out.result.answer) == ("succeeded", None, "ok")
    roomy = RunObjects(stock_bus.jetstream(), max_event_bytes=limit + 200)
    assert await roomy.offload(executed) is executed
