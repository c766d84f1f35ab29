"""A stalled replica is not joined, a dead one is taken over.

The first test: two judge replicas, the one judging c01 frozen with SIGSTOP
past the case stages' 4 s `ack_wait`. JetStream redelivers c01 to the other replica, whose probe of
the message's hold subject gets no answer from the frozen holder; it leaves the case to it
(`Stage.exclusive`) instead of judging it a second time at once — for a model judge, a second bill.
Resumed, the first replica finishes: c01 is judged by one judge start, once on the stream and in
the store, and the batch scores as it would have.

Without the exclusive stage the other replica starts judging c01 as soon as it is redelivered, and
the test fails waiting for it to leave c01 (tried: `exclusive=False` on the judge's stage).

The second: a dispatcher SIGKILLed while its agent runs, with a second dispatcher already up and
idle — the surviving replica runs the case again once the 4 s ack wait is out (nobody answers on
the hold subject), and the batch ends with the case once per stage. With `EVALBUS_RELIABILITY_REPORT`
set it writes the time from the kill to the new agent's start as a row for `bench/reliability.py`."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from evalbus.testing.judges import waiting_marker
from evalbus.testing.pipeline import agent_harness, eventually, open_pipeline, pid_alive, task
from evalbus.testing.reliability import report, row
from evalbus_contracts import BatchSpec, CaseSpec, ExactJudge, RegisteredJudge, SuiteSpec, batch_run_id

pytestmark = [pytest.mark.e2e]

CASES = ("c01", "c02", "c03")


async def test_a_frozen_judge_replica_keeps_its_case_and_it_is_judged_once(pg_admin_url: str, tmp_path: Path) -> None:
    gate = tmp_path / "judge.go"
    cases = tuple(
        CaseSpec(
            id=c,
            input=task(answer="forty-two", **({"judge_waits_for": str(gate)} if c == "c01" else {})),
            expected="forty-two",
        )
        for c in CASES
    )
    spec = BatchSpec(
        suite=SuiteSpec(id="stalled-judge", cases=cases),
        harness=agent_harness(),
        judges=(ExactJudge(id="exact"), RegisteredJudge(id="gate", name="wait-file", params={"timeout_s": "120"})),
    )
    async with open_pipeline(pg_admin_url, tmp_path / "pipeline") as p:
        await p.start("judge@2")
        batch_id = await p.submit(spec)
        run_id = batch_run_id(batch_id, "c01")
        marker = waiting_marker(gate, run_id)
        await eventually(marker.exists, timeout_s=60, what="a judge replica to start judging c01")
        holder_pid = int(marker.read_text().split()[0])
        names = {p.stack.procs[n].process.pid: n for n in ("judge", "judge@2")}
        holder = names[holder_pid]
        other = next(n for n in names.values() if n != holder)
        os.kill(holder_pid, signal.SIGSTOP)
        try:

            def left_to_the_frozen_holder() -> bool:
                return "did not answer" in p.stack.procs[other].log_path.read_text(errors="replace")

            await eventually(
                left_to_the_frozen_holder, timeout_s=30, what=f"{other} to leave c01 to the frozen {holder}"
            )
        finally:
            os.kill(holder_pid, signal.SIGCONT)
        gate.touch()
        view = await p.finalized(batch_id, timeout_s=60)
        await p.quiescent(timeout_s=60)
        assert view.status == "succeeded"
        assert marker.read_text().split() == [str(holder_pid)]  # one judge start on c01, the holder's
        want = {(batch_run_id(batch_id, c), kind): 1 for c in CASES for kind in ("case.executed", "case.judged")}
        stream = await p.stream_counts(batch_id)
        store = await p.store_counts(batch_id)
        assert {k: stream[k] for k in want} == want
        assert {k: store[k] for k in want} == want
        runs = await p.runs(batch_id)
        assert all(r.verdict == "pass" for r in runs.values()), {c: r.verdict for c, r in runs.items()}


async def test_a_killed_dispatchers_case_runs_again_on_the_surviving_replica(pg_admin_url: str, tmp_path: Path) -> None:
    gate, started = tmp_path / "harness.go", tmp_path / "started-c01"
    spec = BatchSpec(
        suite=SuiteSpec(
            id="surviving-dispatcher",
            cases=(
                CaseSpec(
                    id="c01",
                    input=task(answer="forty-two", touch=[str(started)], wait_file=str(gate), wait_timeout_s=60),
                    expected="forty-two",
                ),
            ),
        ),
        harness=agent_harness(),
        judges=(ExactJudge(id="exact"),),
    )
    service_env = {"dispatcher": {"DISPATCHER_SLOTS": "1"}}
    async with open_pipeline(pg_admin_url, tmp_path / "pipeline", service_env=service_env) as p:
        batch_id = await p.submit(spec)
        await eventually(started.exists, timeout_s=60, what="c01's agent to start on the first dispatcher")
        orphan = int(started.read_text())
        await p.start("dispatcher@2", DISPATCHER_SLOTS="1")  # up and idle: c01 is held by the first
        await p.kill("dispatcher")
        killed_at = time.monotonic()
        try:

            def started_again() -> bool:
                return int(started.read_text()) != orphan

            await eventually(started_again, timeout_s=30, what="c01 to start again on the surviving dispatcher")
            resumed_s = time.monotonic() - killed_at
        finally:
            if pid_alive(orphan):  # the killed dispatcher's agent, if it outlived it
                os.kill(orphan, signal.SIGKILL)
        gate.touch()
        view = await p.finalized(batch_id, timeout_s=60)
        await p.quiescent(timeout_s=60)
        run = batch_run_id(batch_id, "c01")
        want = {(run, kind): 1 for kind in ("case.requested", "case.executed", "case.judged", "case.exported")}
        stream = await p.stream_counts(batch_id)
        store = await p.store_counts(batch_id)
        passed = view.status == "succeeded" and {k: stream[k] for k in want} == want
        report(  # bench/reliability.py's row
            row(
                "SIGKILL dispatcher mid-case, a second replica up: the survivor runs it again",
                load="1 case, 2 dispatchers",
                faults=1,
                lost=sum(max(0, 1 - store[k]) for k in want),
                duplicated=sum(max(0, store[k] - 1) + max(0, stream[k] - 1) for k in want),
                resumed_s=resumed_s,
                passed=passed,
            )
        )
        assert view.status == "succeeded"
        assert {k: stream[k] for k in want} == want
        assert {k: store[k] for k in want} == want
        assert (await p.runs(batch_id))["c01"].verdict == "pass"
