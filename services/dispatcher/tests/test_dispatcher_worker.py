"""Warm worker harnesses on the local backend, with real worker processes: the Python SDK served
over the worker protocol (one process for many cases, each in its own workdir with its own run id,
sandbox graders, early release, live log and trace), a worker that crashes, hangs, writes garbage or
is SIGKILLed (each case fails with its own class; the other cases are not affected), recycling, and
the harness spec's rules."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import textwrap
from collections.abc import Callable
from pathlib import Path

import msgspec
import pytest

from evalbus_contracts import (
    CaseExecuted,
    CasePlan,
    CaseRequested,
    CaseSpec,
    CommandGrader,
    HarnessSpec,
    Infra,
    LlmCall,
    Log,
    Measured,
    Message,
    ToolCall,
    ToolResult,
    batch_run_id,
)
from evalbus_contracts.specs import harness_problems
from evalbus_dispatcher import LiveSink, LocalBackend, execute_case
from evalbus_dispatcher.backends.local import REDACTED
from evalbus_dispatcher.retry import should_retry

from .conftest import SECRET_VALUE, LiveRecord

pytestmark = pytest.mark.integration

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"

AGENT = """
import os
from pathlib import Path

from evalbus import Answer, harness


@harness
def solve(case, ctx):
    ctx.message("user", case.input)
    call = ctx.tool_call("calc", {"expr": case.input})
    ctx.tool_result(call, "42")
    ctx.llm_call("tiny", input_tokens=5, output_tokens=1, cost_usd=0.25)
    ctx.log("thinking")
    Path("answer.txt").write_text(os.environ["EVALBUS_RUN_ID"] + "\\n")
    print("working on", case.id, "in", os.getcwd())
    if case.input == "raise":
        raise ValueError("no answer for that")
    return Answer(f"{case.input} -> 42 by {os.getpid()} as {ctx.run_id}")
"""

# A worker written against the documented protocol alone (no SDK): it does what the input says.
RAW_WORKER = r"""
import json, os, signal, sys, time

def send(**message):
    sys.stdout.write(json.dumps(message) + "\n")
    sys.stdout.flush()

send(type="ready", protocol=1)
for line in sys.stdin:
    case = json.loads(line)
    run = case["run_id"]
    send(type="log", run_id=run, text="got " + case["input"])
    print("to stderr " + case["input"], file=sys.stderr, flush=True)
    if case["input"] == "crash":
        os._exit(3)
    if case["input"] == "hang":
        time.sleep(300)
    if case["input"] == "garbage":
        sys.stdout.write("this is not a protocol line\n")
        sys.stdout.flush()
        time.sleep(300)
    if case["input"] == "sigkill":
        os.kill(os.getpid(), signal.SIGKILL)
    send(type="event", run_id=run, event={"kind": "message", "role": "assistant", "text": "ok " + case["input"]})
    send(type="result", run_id=run, answer=f"{os.getpid()}:{case['input']}")
"""


@pytest.fixture
def agent_dir(tmp_path: Path) -> Path:
    folder = tmp_path / "agent"
    folder.mkdir()
    (folder / "wagent.py").write_text(textwrap.dedent(AGENT))
    (folder / "raw_worker.py").write_text(RAW_WORKER)
    return folder


def request(
    batch: str,
    case_id: str,
    harness: HarnessSpec,
    *,
    input: str = "6 x 7",  # noqa: A002
    timeout_s: float | None = None,
    graders: tuple[CommandGrader, ...] = (),
) -> CaseRequested:
    return CaseRequested(
        batch_id=batch,
        case_id=case_id,
        run_id=batch_run_id(batch, case_id, None),
        case=CaseSpec(id=case_id, input=input, timeout_s=timeout_s, graders=graders),
        harness=harness,
        plan=CasePlan(suite_id="suite"),
    )


def sdk_harness(agent_dir: Path, **kw: object) -> HarnessSpec:
    return HarnessSpec(kind="worker", id="w", python="wagent:solve", env={"PYTHONPATH": str(agent_dir)}, **kw)  # type: ignore[arg-type]


def raw_harness(agent_dir: Path, **kw: object) -> HarnessSpec:
    return HarnessSpec(kind="worker", id="raw", command=(sys.executable, str(agent_dir / "raw_worker.py")), **kw)  # type: ignore[arg-type]


def alive(pid: int) -> bool:
    """Whether `pid` runs (a zombie does not)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] not in ("Z", "X")


async def run(req: CaseRequested, backend: LocalBackend, live: LiveSink) -> CaseExecuted:
    return await execute_case(req, backend, live=live, on_release=lambda: None)


def pid_of(executed: CaseExecuted) -> int:
    assert executed.result.answer is not None
    return int(executed.result.answer.split(" by ")[1].split()[0])


async def test_sdk_worker_serves_many_cases_each_in_its_own_workdir(
    backend: LocalBackend, agent_dir: Path, live: LiveSink, live_records: list[LiveRecord]
) -> None:
    grader = CommandGrader(id="own-run", command='grep -qx "$EVALBUS_RUN_ID" answer.txt')
    harness = sdk_harness(agent_dir)
    try:
        first = await run(request("wb1", "c1", harness, graders=(grader,)), backend, live)
        second = await run(request("wb1", "c2", harness, graders=(grader,)), backend, live)
        failing = await run(request("wb1", "c3", harness, input="raise"), backend, live)
        after = await run(request("wb1", "c4", harness), backend, live)
    finally:
        await backend.close()
    for executed in (first, second):
        result = executed.result
        assert executed.status == "succeeded", result.failure
        assert result.answer == f"6 x 7 -> 42 by {pid_of(executed)} as {executed.run_id}"
        # the sandbox grader ran in the case's own workdir and saw its own run id
        assert [(s.grader_id, isinstance(s, Measured) and s.passed) for s in result.scores] == [("own-run", True)]
        kinds = [type(e) for e in result.trace if not isinstance(e, Infra)]
        assert kinds[:5] == [Message, ToolCall, ToolResult, LlmCall, Log]
        assert [e.event for e in result.trace if isinstance(e, Infra)] == [
            "accepted", "started", "placed", "exited", "released",
        ]  # fmt: skip
    # one warm worker served every case; a function that raised failed its case only
    assert pid_of(first) == pid_of(second) == pid_of(after)
    assert failing.status == "failed"
    assert failing.result.failure is not None
    assert (failing.result.failure.failure_class, failing.result.failure.code) == ("agent", "harness_error")
    assert "ValueError: no answer for that" in failing.result.failure.message
    assert "Traceback" in (failing.result.failure.log_tail or "")
    assert after.status == "succeeded"
    assert backend.workers.spawned == 1
    # released: no case workdir is left, the worker's home is gone after close
    assert list((backend.root or Path()).iterdir()) == []
    # live: the printed text in the log (the protocol's lines hidden), the events in the trace
    text = "".join(rec[1][1] for rec in live_records if rec[0] == "log")
    assert "working on c1 in" in text
    assert '"type"' not in text
    assert "EVALBUS_" not in text
    live_kinds = [type(e) for rec in live_records if rec[0] == "trace" for e in rec[1]]
    assert live_kinds.count(ToolCall) == 4


@pytest.mark.parametrize(
    ("fault", "failure_class", "code", "retried"),
    [
        ("crash", "harness", "worker_crashed", False),
        ("hang", "agent", "timeout", False),
        ("garbage", "harness", "worker_protocol", False),
        ("sigkill", "infra", "worker_killed", True),
    ],
)
async def test_a_failing_worker_fails_its_case_only_and_is_replaced(
    backend: LocalBackend, agent_dir: Path, live: LiveSink, fault: str, failure_class: str, code: str, retried: bool
) -> None:
    harness = raw_harness(agent_dir, timeout_s=1.5)
    batch = f"wf-{fault}"
    try:
        warm = await run(request(batch, "before", harness, input="ok"), backend, live)
        # the faulty case and a healthy one at the same time, on the backend's two slots
        faulty, beside = await asyncio.gather(
            run(request(batch, "faulty", harness, input=fault), backend, live),
            run(request(batch, "beside", harness, input="ok"), backend, live),
        )
        after = await run(request(batch, "after", harness, input="ok"), backend, live)
    finally:
        await backend.close()
    for executed in (warm, beside, after):
        assert executed.status == "succeeded", executed.result.failure
        assert executed.result.answer is not None
        assert executed.result.answer.endswith(":ok")
    failure = faulty.result.failure
    assert failure is not None
    assert (failure.failure_class, failure.code) == (failure_class, code), failure.message
    assert should_retry(faulty, 1, 1) is retried
    assert f"got {fault}" in (failure.log_tail or "")  # what it said before it failed is the evidence
    assert f"to stderr {fault}" in (failure.log_tail or "")
    # the faulty worker was replaced: the case after it ran on a live worker, not the dead one
    assert failure.placement is not None
    assert failure.placement.unit is not None
    assert not alive(int(failure.placement.unit.removeprefix("pgid:")))  # gone before its case went on
    assert after.result.answer is not None
    assert after.result.answer.split(":")[0] != failure.placement.unit.removeprefix("pgid:")
    assert backend.workers.spawned >= 2


async def test_max_cases_per_worker_recycles_workers(backend: LocalBackend, agent_dir: Path, live: LiveSink) -> None:
    harness = raw_harness(agent_dir, max_cases_per_worker=2)
    try:
        done = [await run(request("wr", f"c{i}", harness, input="ok"), backend, live) for i in range(5)]
    finally:
        await backend.close()
    pids = [e.result.answer.split(":")[0] for e in done if e.result.answer]
    assert len(pids) == 5
    assert pids[0] == pids[1] != pids[2] == pids[3] != pids[4]
    assert backend.workers.spawned == 3
    assert backend.workers.size == 0


async def test_a_worker_that_cannot_start_fails_its_case_as_its_fault(
    backend: LocalBackend, agent_dir: Path, live: LiveSink
) -> None:
    missing = HarnessSpec(kind="worker", id="w", python="no_such_module:solve", env={"PYTHONPATH": str(agent_dir)})
    absent = HarnessSpec(kind="worker", id="w", command=("/no/such/worker",))
    try:
        checked = (CommandGrader(id="file", command="true"),)  # would pass if it ran
        not_loaded = await run(request("ws", "c1", missing, graders=checked), backend, live)
        not_found = await run(request("ws", "c2", absent), backend, live)
    finally:
        await backend.close()
    assert not_loaded.result.failure is not None
    assert (not_loaded.result.failure.failure_class, not_loaded.result.failure.code) == (
        "harness", "worker_start_failed",
    )  # fmt: skip
    assert "no_such_module" in (not_loaded.result.failure.log_tail or "")
    assert not_loaded.result.failure.never_ran()  # not graded, like a command that cannot spawn
    assert not_loaded.result.scores == ()
    assert not_found.result.failure is not None
    assert (not_found.result.failure.failure_class, not_found.result.failure.code) == ("config", "spawn_failed")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("spec", "problems"),
    [
        (HarnessSpec(id="h", command=("agent",)), []),
        (HarnessSpec(id="h"), ["$.harness.command"]),
        (HarnessSpec(id="h", command=("agent",), python="m:f"), ["$.harness.python"]),
        (HarnessSpec(id="h", command=("agent",), max_cases_per_worker=3), ["$.harness.max_cases_per_worker"]),
        (HarnessSpec(kind="worker", id="h", python="pkg.mod:solve"), []),
        (HarnessSpec(kind="worker", id="h", python="/x/agent.py:solve", max_cases_per_worker=9), []),
        (HarnessSpec(kind="worker", id="h", command=("agent", "--serve")), []),
        (HarnessSpec(kind="worker", id="h"), ["$.harness.command"]),
        (HarnessSpec(kind="worker", id="h", python="solve"), ["$.harness.python"]),
        (HarnessSpec(kind="worker", id="h", python="m:f", command=("x",)), ["$.harness.command"]),
    ],
)
def test_harness_spec_rules(spec: HarnessSpec, problems: list[str]) -> None:
    assert [field for field, _ in harness_problems(spec)] == problems


async def test_the_example_worker_suite_runs_on_warm_workers(backend: LocalBackend, live: LiveSink) -> None:
    from evalbus.cli.suite_file import load_suite

    spec = load_suite(EXAMPLES / "worker.yaml")
    assert spec.harness.python == f"{EXAMPLES / 'worker_agent.py'}:solve"
    try:
        done = [
            await execute_case(
                CaseRequested(
                    batch_id="wx",
                    case_id=case.id,
                    run_id=batch_run_id("wx", case.id, None),
                    case=case,
                    harness=spec.harness,
                    plan=CasePlan(suite_id=spec.suite.id),
                ),
                backend,
                live=live,
                on_release=lambda: None,
            )
            for case in spec.suite.cases
        ]
    finally:
        await backend.close()
    assert [e.result.answer for e in done] == [c.expected for c in spec.suite.cases] == ["42", "42", "20"]
    for executed in done:
        assert executed.status == "succeeded", executed.result.failure
        scores = {s.grader_id: s for s in executed.result.scores}
        assert all(isinstance(s, Measured) and s.passed for s in scores.values()), scores
    assert backend.workers.spawned == 1


ASYNC_AGENT = """
import asyncio, os, sys

from evalbus.harness import Case, Context


async def solve(case: Case, ctx: Context):  # plain (undecorated) and async
    await asyncio.sleep(0)
    ctx.message("assistant", "thinking about " + str(case.json()["q"]))
    print("printed", os.environ["EVALBUS_RUN_ID"], os.getcwd())
    print("to stderr", file=sys.stderr)
    os.write(1, b"raw fd 1 bytes\\n")  # not the protocol's: sent to stderr
    return None if case.json()["q"] == "none" else case.json()["q"] * 2
"""


@pytest.mark.unit
def test_the_sdk_speaks_the_protocol_on_its_own(tmp_path: Path) -> None:
    import json
    import subprocess

    (tmp_path / "async_agent.py").write_text(textwrap.dedent(ASYNC_AGENT))
    work = tmp_path / "work"
    work.mkdir()

    def case(run: str, q: object) -> str:
        message = {"type": "case", "run_id": run, "case_id": run, "input": json.dumps({"q": q}), "workdir": str(work),
                   "input_file": "/dev/null", "timeout_s": 5, "env": {"EVALBUS_RUN_ID": run}}  # fmt: skip
        return json.dumps(message) + "\n"

    done = subprocess.run(
        [sys.executable, "-m", "evalbus.harness", f"{tmp_path / 'async_agent.py'}:solve"],
        input=case("r1", 21) + case("r2", "none"),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    lines = [json.loads(line) for line in done.stdout.splitlines()]
    assert lines[0] == {"type": "ready"}
    assert [(m["type"], m["run_id"]) for m in lines[1:5]] == [
        ("event", "r1"),
        ("log", "r1"),
        ("log", "r1"),
        ("result", "r1"),
    ]
    assert lines[1]["event"]["text"] == "thinking about 21"
    assert lines[2] == {"type": "log", "run_id": "r1", "text": f"printed r1 {work}"}
    assert lines[3] == {"type": "log", "run_id": "r1", "stream": "stderr", "text": "to stderr"}
    assert lines[4] == {"type": "result", "run_id": "r1", "answer": "42"}
    assert lines[-1] == {"type": "result", "run_id": "r2"}  # None: no answer, the command fallbacks apply
    assert "raw fd 1 bytes" in done.stderr


async def test_a_workers_secrets_are_redacted_from_what_it_says(
    backend: LocalBackend, agent_dir: Path, live: LiveSink, live_records: list[LiveRecord]
) -> None:
    (agent_dir / "leaky.py").write_text(
        textwrap.dedent(
            """
            import os, sys
            from evalbus import harness

            @harness
            def solve(case, ctx):
                key = os.environ["API_KEY"]
                ctx.message("assistant", "the key is " + key)
                print("printing", key)
                print("stderr", key, file=sys.stderr)
                return "answer with " + key
            """
        )
    )
    harness = HarnessSpec(
        kind="worker", id="leaky", python=f"{agent_dir / 'leaky.py'}:solve", secret_env={"API_KEY": "api-key"}
    )
    try:
        executed = await run(request("wsec", "c1", harness), backend, live)
    finally:
        await backend.close()
    assert executed.status == "succeeded", executed.result.failure
    assert executed.result.answer == f"answer with {REDACTED}"
    everything = msgspec.json.encode(executed).decode() + repr(live_records)
    assert SECRET_VALUE not in everything
    assert everything.count(REDACTED) >= 4  # the answer, the message, the printed line, stderr


async def test_an_idle_worker_that_dies_leaves_the_pool(backend: LocalBackend, agent_dir: Path, live: LiveSink) -> None:
    harness = raw_harness(agent_dir)
    try:
        first = await run(request("wi", "c1", harness, input="ok"), backend, live)
        assert first.result.answer is not None
        pid = int(first.result.answer.split(":")[0])
        assert backend.workers.idle_pids() == [pid]
        os.kill(pid, signal.SIGKILL)  # killed while it waits for a case
        await wait_until(lambda: backend.workers.size == 0)
        second = await run(request("wi", "c2", harness, input="ok"), backend, live)
    finally:
        await backend.close()
    assert second.status == "succeeded", second.result.failure
    assert second.result.answer is not None
    assert int(second.result.answer.split(":")[0]) != pid
    assert backend.workers.spawned == 2


async def wait_until(condition: Callable[[], bool], deadline_s: float = 10.0) -> None:
    """Poll a condition until it holds (the pool notices a death on its own)."""
    end = asyncio.get_running_loop().time() + deadline_s
    while not condition():
        assert asyncio.get_running_loop().time() < end, "condition not met in time"
        await asyncio.sleep(0.02)


async def test_a_worker_serves_one_batch_so_the_next_batch_runs_the_edited_agent(
    backend: LocalBackend, agent_dir: Path, live: LiveSink
) -> None:
    """A user fixes their agent and runs the suite again: the new batch gets fresh workers that
    import the edited file, not the warm ones of the last batch still holding the old code (the
    same harness spec, argv and environment). Within a batch a worker is reused."""
    harness = raw_harness(agent_dir)
    try:
        first = [await run(request("wb1", f"c{i}", harness, input="ok"), backend, live) for i in range(2)]
        source = agent_dir / "raw_worker.py"
        source.write_text(source.read_text().replace('answer=f"{os.getpid()}:', 'answer=f"{os.getpid()}:edited '))
        second = [await run(request("wb2", f"c{i}", harness, input="ok"), backend, live) for i in range(2)]
    finally:
        await backend.close()
    answers = [e.result.answer or "" for e in (*first, *second)]
    pids = [a.split(":")[0] for a in answers]
    assert pids[0] == pids[1], answers  # reused within a batch
    assert pids[2] == pids[3], answers
    assert pids[1] != pids[2], answers  # not across batches
    assert [a.split(":", 1)[1] for a in answers] == ["ok", "ok", "edited ok", "edited ok"]
    assert backend.workers.spawned == 2


async def test_an_idle_worker_is_retired_after_its_idle_time_and_the_oldest_idle_makes_room(
    make_backend: Callable[..., LocalBackend], agent_dir: Path, live: LiveSink
) -> None:
    """Workers of ended batches do not stay: every slot full of idle workers, a new batch's case
    retires the one idle longest; an idle worker exits on its own after `worker_idle_s`."""
    backend = make_backend(worker_idle_s=3.0)
    harness = raw_harness(agent_dir)

    def pid(e: CaseExecuted) -> int:
        assert e.result.answer is not None, e.result.failure
        return int(e.result.answer.split(":")[0])

    try:
        a = pid(await run(request("wa", "c1", harness, input="ok"), backend, live))
        b = pid(await run(request("wb", "c1", harness, input="ok"), backend, live))
        assert sorted(backend.workers.idle_pids()) == sorted([a, b])
        c = pid(await run(request("wc", "c1", harness, input="ok"), backend, live))
        assert sorted(backend.workers.idle_pids()) == sorted([b, c])
        await wait_until(lambda: not alive(a))  # the oldest idle one made room
        await wait_until(lambda: backend.workers.size == 0, deadline_s=30.0)  # then all go idle-timed
        await wait_until(lambda: not alive(b) and not alive(c))
    finally:
        await backend.close()
    assert backend.workers.spawned == 3
