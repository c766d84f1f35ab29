"""The dispatcher SIGKILLed mid-batch while its warm workers serve cases: nothing is lost and nothing
is counted twice.

One batch of eight cases on a warm worker harness (the Python SDK), two compute slots. Case c01's
agent waits at a gate file, so one worker holds it unacknowledged; the dispatcher runs with a fault
point (`FAULT_KILL=before_ack:…`, `evalbus_runtime.faults`) that SIGKILLs it right after JetStream
acknowledged c04's `case.executed` and before it acks c04's request. So at the kill one case is
mid-execution on a warm worker and one has its output stored but its input unacknowledged. The
killed dispatcher's workers die with it (the kernel's parent-death signal); a new dispatcher
starts, the gate opens, both messages come back after `ack_wait` and run again on fresh workers —
c04's second `case.executed` is absorbed by `Nats-Msg-Id` deduplication.

Proved: the batch succeeds with every answer right (no case retried); every run exactly once per stage on the CASES
stream and in the event store; every trajectory sealed and intact.
"""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from evalbus.testing.pipeline import eventually, open_pipeline, pid_alive, wait_path
from evalbus_contracts import BatchSpec, CaseSpec, ExactJudge, HarnessSpec, SuiteSpec, batch_run_id
from evalbus_contracts.streams import DISPATCHER_CASES

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

CASE_IDS = tuple(f"c{i:02d}" for i in range(1, 9))
STAGES = ("case.requested", "case.executed", "case.judged", "case.exported")

AGENT = """
import os, time
from pathlib import Path

from evalbus import harness


@harness
def solve(case, ctx):
    number, _, rest = case.input.partition(" ")
    kind, _, path = rest.partition(":")
    if kind == "wait":  # hold the case until the test opens the gate (the agent's own wait, not the test's)
        Path(path + ".started").write_text(str(os.getpid()))
        while not Path(path).exists():
            time.sleep(0.05)
    if kind == "after":  # not before the held case is held: the kill must find it on its worker
        while not Path(path).exists():
            time.sleep(0.05)
    ctx.message("user", case.input)
    return "answer " + number
"""


def read_pid(path: Path) -> int:
    """The pid an agent wrote (sync: a test's read, not I/O on the loop's hot path)."""
    return int(path.read_text())


async def test_dispatcher_killed_mid_batch_with_warm_workers_loses_and_doubles_nothing(
    pg_admin_url: str, tmp_path: Path
) -> None:
    agent = tmp_path / "gated_agent.py"
    agent.write_text(textwrap.dedent(AGENT))
    gate = tmp_path / "gate"
    # c01 waits at the gate; c04, whose output the fault point kills the dispatcher after, runs only
    # once c01 is held (with two slots, c04 could otherwise finish before c01's worker started)
    extra = {"c01": f" wait:{gate}", "c04": f" after:{gate}.started"}
    cases = tuple(
        CaseSpec(id=case_id, input=f"{i}" + extra.get(case_id, ""), expected=f"answer {i}")
        for i, case_id in enumerate(CASE_IDS, start=1)
    )
    spec = BatchSpec(
        suite=SuiteSpec(id="worker-crash", cases=cases),
        harness=HarnessSpec(kind="worker", id="gated", python=f"{agent}:solve", timeout_s=120),
        judges=(ExactJudge(id="exact"),),
    )
    sandboxes = tmp_path / "sandboxes"
    sandboxes.mkdir()
    service_env = {"dispatcher": {"DISPATCHER_SLOTS": "2", "DISPATCHER_WORKDIR_ROOT": str(sandboxes)}}
    async with open_pipeline(pg_admin_url, tmp_path / "pipeline", service_env=service_env) as p:
        try:
            fault = f"before_ack:{DISPATCHER_CASES.durable}:case.requested:evb-*-c04"
            await p.restart("dispatcher", FAULT_KILL=fault)
            batch_id = await p.submit(spec)
            await wait_path(Path(f"{gate}.started"), timeout_s=60)
            worker_pid = read_pid(Path(f"{gate}.started"))
            assert await p.wait_exit("dispatcher", timeout_s=90) == -9
            info = await p.nc.jetstream().consumer_info(DISPATCHER_CASES.stream, DISPATCHER_CASES.durable)
            assert info.num_ack_pending >= 2  # c01 on its worker, c04 done but not acknowledged
            executed = await p.stream_counts(batch_id)
            assert executed[(batch_run_id(batch_id, "c04"), "case.executed")] == 1
            assert executed[(batch_run_id(batch_id, "c01"), "case.executed")] == 0
            # the killed dispatcher's warm workers did not outlive it
            await eventually(lambda: not pid_alive(worker_pid), timeout_s=10, what="the orphaned worker to die")

            await p.start("dispatcher")
            gate.touch()
            view = await p.finalized(batch_id, timeout_s=120)
            await p.quiescent(timeout_s=120)
            runs = await p.runs(batch_id)
            stream, store = await p.stream_counts(batch_id), await p.store_counts(batch_id)
            verified = await p.verify(batch_id)
        except BaseException as e:
            e.add_note(p.diagnostics())
            raise
    assert view.status == "succeeded"
    # every answer right (the exact judge on "answer <n>"), on its first attempt
    assert {c: (r.executed_status, r.verdict, r.attempt) for c, r in runs.items()} == dict.fromkeys(
        CASE_IDS, ("succeeded", "pass", 1)
    )
    expected = {(batch_run_id(batch_id, c), kind): 1 for c in CASE_IDS for kind in STAGES}
    assert {k: v for k, v in stream.items() if k[1] in STAGES} == expected
    assert {k: v for k, v in store.items() if k[1] in STAGES} == expected
    assert verified.ok, verified
