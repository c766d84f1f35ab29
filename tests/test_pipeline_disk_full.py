"""The case workdirs' disk full, mid-batch, through the real services.

The dispatcher's workdir root (`DISPATCHER_WORKDIR_ROOT`) is a small tmpfs of the test's own
(mounted in a fixture, unmounted in its teardown; mounting needs root, which CI has — elsewhere the
module is skipped saying so). Two compute slots; every wait is on a file or an event:

1. batch *fill*: `hog` writes zeros in its workdir until the disk is full and holds it there, while
   `w1`, already running beside it, writes a 4 KiB file — which fails. Both cases fail `disk_full`
   (infra, retryable), the message naming the disk (`No space left on device`, the mount point, its
   free space), not an agent's `exit_nonzero`;
2. batch *starved*, submitted while the disk is full: the dispatcher's own writes (each workdir's
   owner mark and input file) fail, so each case fails `disk_full` at the dispatch stage — and the
   dispatcher, the same process throughout, keeps taking cases;
3. the hog lets go: its workdir is released and the space comes back (nothing of any workdir is
   left on the disk), and batch *after* — cases that write a little — succeeds entirely.

Every batch finalizes, every case exactly once per stage in the CASES stream and in the event
store, nothing refused by the recorder, nothing dead-lettered. `retries: 0`, so "once" is exact (a
`disk_full` failure is retryable: with retries, a case would be requested again after its backoff).
"""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import pytest

from evalbus.testing.pipeline import Pipeline, agent_harness, eventually, open_pipeline, task, wait_path
from evalbus.testing.reliability import report, row
from evalbus_api.views import RunView
from evalbus_contracts import AnswerMatchGrader, BatchPolicy, BatchSpec, CaseSpec, SuiteSpec, batch_run_id

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

DISK_BYTES = 16 * 1024 * 1024
"""The small disk's size: the hog fills it in a blink, everything else fits many times over."""
STAGES = ("case.requested", "case.executed", "case.judged", "case.exported")
NO_SPACE = "No space left on device"


@pytest.fixture(scope="module")
def small_disk(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A tmpfs of `DISK_BYTES` for the case workdirs; unmounted afterwards."""
    if os.geteuid() != 0:
        pytest.skip("mounting the small tmpfs needs root (CI runs as root)")
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) on this machine")
    where = tmp_path_factory.mktemp("small-disk")
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={DISK_BYTES},mode=0755", "evalbus-small-disk", str(where)],
        capture_output=True,
        text=True,
        check=False,
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.strip()}")
    try:
        yield where
    finally:
        if subprocess.run(["umount", str(where)], capture_output=True, check=False).returncode != 0:
            subprocess.run(["umount", "-l", str(where)], capture_output=True, check=False)


@pytest.fixture(scope="module")
async def pipeline(
    pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory, small_disk: Path
) -> AsyncIterator[Pipeline]:
    dispatcher = {"DISPATCHER_WORKDIR_ROOT": str(small_disk), "DISPATCHER_SLOTS": "2"}
    async with open_pipeline(
        pg_admin_url, tmp_path_factory.mktemp("disk-full"), service_env={"dispatcher": dispatcher}
    ) as p:
        yield p


def spec(suite_id: str, cases: dict[str, str]) -> BatchSpec:
    """A batch of the test agent, `retries: 0`; `cases`: case id → input (each answers its id)."""
    graders = (AnswerMatchGrader(id="answer"),)
    return BatchSpec(
        suite=SuiteSpec(
            id=suite_id,
            cases=tuple(CaseSpec(id=c, input=i, expected=c, graders=graders) for c, i in cases.items()),
        ),
        harness=agent_harness(timeout_s=120),
        policy=BatchPolicy(retries=0),
    )


def free_bytes(path: Path) -> int:
    stat = os.statvfs(path)
    return stat.f_bavail * stat.f_frsize


async def exactly_once(p: Pipeline, batch: str, case_ids: list[str]) -> tuple[int, int]:
    """Assert every case of `batch` once per stage in the stream and the store; (lost, duplicated)."""
    runs = {batch_run_id(batch, c) for c in case_ids}
    want: Counter[tuple[str | None, str]] = Counter({(r, s): 1 for r in runs for s in STAGES})
    kinds = set(STAGES)
    store = Counter({k: n for k, n in (await p.store_counts(batch)).items() if k[1] in kinds})
    stream = Counter({k: n for k, n in (await p.stream_counts(batch)).items() if k[1] in kinds})
    lost = sum((want - store).values()) + sum((want - stream).values())
    duplicated = sum((store - want).values()) + sum((stream - want).values())
    assert store == want, f"event store per (run, type): {store - want} extra, {want - store} missing"
    assert stream == want, f"CASES per (run, type): {stream - want} extra, {want - stream} missing"
    assert await p.rejections(batch) == []
    return lost, duplicated


def assert_disk_full(run: RunView, stage: str, disk: Path) -> None:
    """`run` failed `disk_full` at `stage`, saying so and naming the disk, with no verdict."""
    assert run.executed_status == "failed", run
    failure = run.failure
    assert failure is not None, run
    assert (failure.stage, failure.failure_class, failure.code, failure.retryable) == (
        stage,
        "infra",
        "disk_full",
        True,
    ), failure
    assert NO_SPACE in failure.message, failure.message
    assert str(disk) in failure.message, failure.message  # the disk it means
    assert run.verdict is None  # an infrastructure failure gives no verdict
    if stage == "dispatch":  # nothing ran: nothing to judge or export
        assert (run.judged_status, run.exported_status) == ("skipped", "skipped"), run


async def test_a_full_workdir_disk_fails_its_cases_visibly_and_loses_nothing(
    pipeline: Pipeline, small_disk: Path, tmp_path: Path
) -> None:
    p = pipeline
    dispatcher = p.stack.procs["dispatcher"].process
    started, full, go = tmp_path / "w1-started", tmp_path / "disk-full", tmp_path / "let-go"  # not on the small disk

    # 1. a case fills the disk while another, beside it, writes a little
    filling = spec(
        "disk-fill",
        {
            "hog": task(
                wait_file=str(started),
                fill={"path": "zeros.bin", "then_touch": str(full), "hold_until": str(go)},
                wait_timeout_s=120,
                answer="hog",
            ),
            "w1": task(touch=[str(started)], wait_file=str(full), write={"notes.txt": "x" * 4096}, answer="w1"),
        },
    )
    fill_batch = await p.submit(filling)
    await wait_path(full, timeout_s=60)
    # Full when the hog said so; w1, failing on it at once, may already have been released and its
    # workdir's few blocks freed (the release deletes a small workdir on the loop, in microseconds),
    # which the hog takes back while it holds the disk.
    await eventually(lambda: free_bytes(small_disk) == 0, timeout_s=30, what="the hog to hold the disk full")

    async def w1_executed() -> bool:
        run = (await p.runs(fill_batch)).get("w1")
        return run is not None and run.executed_status is not None

    await eventually(w1_executed, timeout_s=60, what="w1 executed", diagnostics=p.diagnostics)
    w1 = (await p.runs(fill_batch))["w1"]
    assert_disk_full(w1, "run", small_disk)
    assert w1.failure is not None
    assert NO_SPACE in (w1.failure.log_tail or ""), w1.failure  # the harness's own words are kept

    # 2. while it is full (the hog takes back what w1's release freed), a batch whose workdirs
    # cannot even be written
    await eventually(lambda: free_bytes(small_disk) == 0, timeout_s=30, what="the hog to take back w1's space")
    starved_ids = ["v1", "v2", "v3"]
    starved = await p.submit(spec("disk-starved", {c: task(write={"out.txt": c}, answer=c) for c in starved_ids}))
    starved_view = await p.finalized(starved, timeout_s=90)
    assert free_bytes(small_disk) == 0, "the hog still holds the disk"
    # none of its runs got a workdir: the batch graded nothing, so it fails and says why
    assert starved_view.status == "failed", starved_view
    assert starved_view.error is not None
    assert starved_view.error.code == "no_run_executed"
    assert "disk_full" in starved_view.error.message, starved_view.error
    for run in (await p.runs(starved)).values():
        assert_disk_full(run, "dispatch", small_disk)

    # 3. the hog lets go: its workdir is released, the space comes back, later cases succeed
    go.touch()
    let_go_at = time.monotonic()
    fill_view = await p.finalized(fill_batch, timeout_s=90)
    assert fill_view.status == "succeeded", fill_view
    hog = (await p.runs(fill_batch))["hog"]
    assert_disk_full(hog, "run", small_disk)
    assert hog.failure is not None
    assert "free of 16.0 MiB" in hog.failure.message, hog.failure.message  # read before its release
    assert [e.name for e in await asyncio.to_thread(lambda: list(small_disk.iterdir()))] == []
    assert free_bytes(small_disk) > DISK_BYTES - 1024 * 1024

    after_ids = [f"s{i}" for i in range(6)]
    after = await p.submit(spec("disk-after", {c: task(write={"out.txt": c * 1000}, answer=c) for c in after_ids}))
    after_view = await p.finalized(after, timeout_s=90)
    await p.quiescent(timeout_s=60)
    stall_s = time.monotonic() - let_go_at
    assert after_view.status == "succeeded", after_view
    assert after_view.summary is not None
    assert after_view.summary.verdicts.passed == len(after_ids), after_view.summary

    lost = duplicated = 0
    for batch, ids in ((fill_batch, ["hog", "w1"]), (starved, starved_ids), (after, after_ids)):
        batch_lost, batch_duplicated = await exactly_once(p, batch, ids)
        lost, duplicated = lost + batch_lost, duplicated + batch_duplicated
    assert dispatcher.poll() is None, "the dispatcher kept running"
    assert p.stack.procs["dispatcher"].process is dispatcher, "the same dispatcher process throughout"
    assert await p.dead_letters("dispatcher") == []
    report(  # bench/reliability.py's row (stall: the hog lets go → the next batch done, every consumer idle)
        row(
            f"case workdirs' disk full ({DISK_BYTES // (1024 * 1024)} MiB tmpfs): cases failed disk_full",
            load=f"{2 + len(starved_ids) + len(after_ids)} cases in 3 batches",
            faults=2 + len(starved_ids),
            lost=lost,
            duplicated=duplicated,
            stall_s=stall_s,
            passed=True,
        )
    )
