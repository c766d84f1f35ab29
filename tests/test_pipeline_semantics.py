"""End-to-end semantics of a batch through the five real services (one nats-server, one database
and one compute slot for this module; every test its own batch ids):

- scores come in a deterministic order — graders in grader order (sandbox and observation graders
  interleaved), then judges in selection order — identical across runs, whatever each judge takes;
  and the scorecard does not depend on the order in which cases finish;
- an unregistered judge is `unmeasured: unsupported`, a judge's own error is `unmeasured:
  grader_error`, and neither fails the batch; only an error escaping a judge fails it, with
  `error.phase = "judges"` (provoked by a plugin judge raising `JudgeMachineryError`: no spec can
  break the machinery, the rule judges turn their own errors into scores);
- every failure class: config (command not found, missing secret, harness files that cannot be
  laid out), agent (nonzero exit; timeout → exit 124), infra (a dispatcher whose workdir root is
  not a directory: retried per the batch policy, then reported) — none of them fails the batch;
- cancel: the in-flight case settles, the not-started ones become `cancelled`, the batch ends
  `cancelled`; supersede: the old batch ends `superseded` by the new one, which succeeds.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from pathlib import Path

import pytest

from evalbus.testing.pipeline import (
    Pipeline,
    agent_harness,
    differences,
    eventually,
    open_pipeline,
    task,
    wait_path,
)
from evalbus_api.client import ApiRequestError
from evalbus_api.views import RunView
from evalbus_contracts import (
    AnswerMatchGrader,
    BatchPolicy,
    BatchSpec,
    CaseExecuted,
    CaseRequested,
    CaseSpec,
    CommandGrader,
    CommandHarness,
    ContainsJudge,
    CostGrader,
    Event,
    ExactJudge,
    HarnessSpec,
    JudgeSpec,
    Measured,
    RegisteredJudge,
    Score,
    StepsGrader,
    SuiteSpec,
    TestsPassGrader,
    TextMetricGrader,
    Unmeasured,
    decode_event,
)

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    """The module's pipeline: one compute slot, so "not started yet" is well defined."""
    workdir = tmp_path_factory.mktemp("pipeline-semantics")
    async with open_pipeline(pg_admin_url, workdir, service_env={"dispatcher": {"DISPATCHER_SLOTS": "1"}}) as p:
        yield p


@pytest.fixture(autouse=True)
async def _services_up(pipeline: Pipeline) -> None:
    """Every test starts with all five services running (a test may restart one)."""
    await pipeline.ensure_running()


def plain_cases(*answers: str, start: int = 1) -> tuple[CaseSpec, ...]:
    """Cases `c<start>`, `c<start+1>`... answering `answers` (expected = answer, so each passes)."""
    return tuple(CaseSpec(id=f"c{i}", input=task(answer=a), expected=a) for i, a in enumerate(answers, start=start))


def judge_scores(run: RunView) -> list[Score]:
    """The run's judge scores, in order."""
    return [s for s in run.scores if s.source == "judge"]


def measured_by_metric(run: RunView) -> dict[str, Measured]:
    """The run's measured scores by metric (fails if any score is not measured)."""
    out = {}
    for score in run.scores:
        assert isinstance(score, Measured), score
        out[score.metric] = score
    return out


def requested_attempts(stream: Sequence[tuple[int, Event]], case_id: str) -> list[int]:
    """Attempts of every `case.requested` of a case in the stream, in order."""
    return [ev.attempt for _, ev in stream if isinstance(ev, CaseRequested) and ev.case_id == case_id]


# ---------------------------------------------------------------- score order and judges


ORDER_GRADERS = (
    AnswerMatchGrader(id="answer"),
    TestsPassGrader(id="tests", command="test -f done.txt"),
    StepsGrader(id="steps", max_steps=2),
    CommandGrader(id="lint", command="echo lint-ok", pass_pattern="lint-ok", metric="lint"),
    CostGrader(id="cost"),
    TextMetricGrader(id="number", pattern=r"(\d+)", metric="number"),
)
ORDER_JUDGES: tuple[JudgeSpec, ...] = (
    RegisteredJudge(id="slow", name="delay", params={"max_ms": "120"}),
    ExactJudge(id="exact"),
    RegisteredJudge(id="quick", name="delay", params={"max_ms": "3"}),
    ContainsJudge(id="contains"),
)
EXPECTED_ORDER = [
    ("answer", "answer_match", "grader"),
    ("tests", "tests_pass", "grader"),
    ("steps", "tool_calls", "grader"),
    ("lint", "lint", "grader"),
    ("cost", "cost_usd", "grader"),
    ("number", "number", "grader"),
    ("slow", "judge:slow", "judge"),
    ("exact", "judge:exact", "judge"),
    ("quick", "judge:quick", "judge"),
    ("contains", "judge:contains", "judge"),
]


def order_spec() -> BatchSpec:
    cases = []
    for i in range(1, 5):
        answer = f"answer {i}" if i != 3 else "wrong 3"
        fields = {"answer": answer, "tool_calls": i, "llm_cost": 0.25 * i}
        if i % 2:
            fields["write"] = {"done.txt": "yes"}
        cases.append(CaseSpec(id=f"c{i}", input=task(**fields), expected=f"answer {i}", graders=ORDER_GRADERS))
    return BatchSpec(suite=SuiteSpec(id="order", cases=tuple(cases)), harness=agent_harness(), judges=ORDER_JUDGES)


async def test_scores_come_graders_then_judges_in_selection_order_and_repeat_exactly(pipeline: Pipeline) -> None:
    """Two runs of the same suite: every case's scores in grader order (sandbox and observation
    graders interleaved as declared), then the judges in selection order (a slow judge first), and
    the two runs' scores are identical."""
    first = await pipeline.submit(order_spec())
    second = await pipeline.submit(order_spec())
    for batch_id in (first, second):
        assert (await pipeline.finalized(batch_id)).status == "succeeded"
    runs_1, runs_2 = await pipeline.runs(first), await pipeline.runs(second)
    assert sorted(runs_1) == sorted(runs_2) == ["c1", "c2", "c3", "c4"]
    for case_id, run in runs_1.items():
        assert [(s.grader_id, s.metric, s.source) for s in run.scores] == EXPECTED_ORDER, case_id
        assert all(isinstance(s, Measured) for s in run.scores), run.scores
        assert run.scores == runs_2[case_id].scores, case_id
    # The scores are the real measurements, not placeholders.
    c3 = measured_by_metric(runs_1["c3"])
    assert c3["answer_match"].passed is False
    assert (c3["tool_calls"].value, c3["tool_calls"].passed) == (3, False)
    assert c3["cost_usd"].value == pytest.approx(0.75)
    assert c3["tests_pass"].passed is True
    assert measured_by_metric(runs_1["c2"])["tests_pass"].passed is False


async def test_unregistered_judge_is_unmeasured_unsupported_and_the_batch_succeeds(pipeline: Pipeline) -> None:
    spec = BatchSpec(
        suite=SuiteSpec(id="unregistered", cases=plain_cases("alpha", "beta")),
        harness=agent_harness(),
        judges=(
            ExactJudge(id="exact"),
            RegisteredJudge(id="ghost", name="no-such-judge"),
            ContainsJudge(id="contains"),
        ),
    )
    batch_id = await pipeline.submit(spec)
    view = await pipeline.finalized(batch_id)
    assert view.status == "succeeded"
    assert view.error is None
    for run in (await pipeline.runs(batch_id)).values():
        scores = judge_scores(run)
        assert [s.grader_id for s in scores] == ["exact", "ghost", "contains"]
        ghost = scores[1]
        assert isinstance(ghost, Unmeasured)
        assert ghost.reason == "unsupported"
        assert ghost.retryable is False
        assert run.verdict == "pass"  # an unmeasured judge never decides
    assert view.summary is not None
    ghost_summary = next(m for m in view.summary.metrics if m.metric == "judge:ghost")
    assert ghost_summary.count == 0
    assert ghost_summary.unmeasured == {"unsupported": 2}
    assert view.summary.verdicts.passed == 2


async def test_judge_error_is_an_unmeasured_score_and_the_batch_succeeds(pipeline: Pipeline) -> None:
    spec = BatchSpec(
        suite=SuiteSpec(id="judge-error", cases=plain_cases("alpha", "beta")),
        harness=agent_harness(),
        judges=(RegisteredJudge(id="boom", name="fail"), ExactJudge(id="exact")),
    )
    batch_id = await pipeline.submit(spec)
    view = await pipeline.finalized(batch_id)
    assert view.status == "succeeded"
    assert view.error is None
    assert view.judge_errors == 0
    for run in (await pipeline.runs(batch_id)).values():
        boom, exact = judge_scores(run)
        assert isinstance(boom, Unmeasured)
        assert boom.reason == "grader_error"
        assert "failed on purpose" in (boom.detail or "")
        assert isinstance(exact, Measured)  # the judges after it still ran
        assert exact.passed is True
        assert run.judge_error is None


async def test_error_escaping_a_judge_fails_the_batch_in_phase_judges(pipeline: Pipeline) -> None:
    """Provoked from outside with a plugin judge raising `JudgeMachineryError` (the one exception
    `run_judge` lets escape); no spec alone can make the machinery fail."""
    spec = BatchSpec(
        suite=SuiteSpec(id="judge-escape", cases=plain_cases("alpha", "beta")),
        harness=agent_harness(),
        judges=(ExactJudge(id="exact"), RegisteredJudge(id="broken", name="escape"), ContainsJudge(id="contains")),
    )
    batch_id = await pipeline.submit(spec)
    view = await pipeline.finalized(batch_id)
    assert view.status == "failed"
    assert view.error is not None
    assert view.error.phase == "judges"
    assert "JudgeMachineryError" in view.error.message
    assert view.judge_errors == 2
    assert view.summary is not None
    assert view.summary.counts.exported == 2  # every case still passed every stage
    for run in (await pipeline.runs(batch_id)).values():
        assert run.judged_status == "judged"
        assert run.exported_status is not None
        assert "JudgeMachineryError" in (run.judge_error or "")
        # Scores before the escape are kept; the judges after it did not run.
        assert [s.grader_id for s in judge_scores(run)] == ["exact"]


def cost_spec(held: str, gate: Path) -> BatchSpec:
    """Three cases costing 0.1, 0.2 and 0.3; case `held` is held at its judge until `gate` exists."""
    cases = []
    for case_id, cost in (("c1", 0.1), ("c2", 0.2), ("c3", 0.3)):
        fields: dict[str, object] = {"answer": case_id, "llm_cost": cost}
        if case_id == held:
            fields["judge_waits_for"] = str(gate)
        cases.append(CaseSpec(id=case_id, input=task(**fields), expected=case_id, graders=(CostGrader(id="cost"),)))
    return BatchSpec(
        suite=SuiteSpec(id="finish-order", cases=tuple(cases)),
        harness=agent_harness(),
        judges=(RegisteredJudge(id="gate", name="wait-file", params={"timeout_s": "60"}),),
    )


async def test_scorecard_does_not_depend_on_the_order_cases_finish(pipeline: Pipeline, tmp_path: Path) -> None:
    """The same suite twice, its cases exported in two orders the test forces: the scorecards must
    be equal. With costs 0.1, 0.2, 0.3 a mean summed in finishing order differs in the last bit:
    (0.1 + 0.2) + 0.3 != (0.2 + 0.3) + 0.1 — so a summary that sums in export order makes the
    "same" batch give two scorecards (and crash-resume, which reorders cases, change it)."""
    summaries = []
    for held in ("c3", "c1"):
        gate = tmp_path / f"{held}.go"
        batch_id = await pipeline.submit(cost_spec(held, gate))
        others = {"c1", "c2", "c3"} - {held}

        async def others_exported(batch_id: str = batch_id, others: set[str] = others) -> bool:
            runs = await pipeline.runs(batch_id)
            return all(c in runs and runs[c].exported_status is not None for c in others)

        await eventually(others_exported, timeout_s=30, what=f"{sorted(others)} exported before {held}")
        gate.touch()
        view = await pipeline.finalized(batch_id)
        assert view.status == "succeeded"
        runs = await pipeline.runs(batch_id)
        exported_at = {c: r.exported_at for c, r in runs.items() if r.exported_at is not None}
        assert max(exported_at, key=exported_at.__getitem__) == held  # the forced order did happen
        assert view.summary is not None
        summaries.append(view.summary)
    assert differences(summaries[0], summaries[1]) == []


# ---------------------------------------------------------------- failure classes


async def test_config_failures_command_not_found_and_missing_secret(pipeline: Pipeline) -> None:
    not_found = BatchSpec(
        suite=SuiteSpec(id="config-not-found", cases=plain_cases("alpha")),
        harness=CommandHarness(id="ghost-agent", command=("/nonexistent/evalbus-agent",)),
        judges=(ExactJudge(id="exact"),),
    )
    no_secret = BatchSpec(
        suite=SuiteSpec(id="config-no-secret", cases=plain_cases("alpha")),
        harness=agent_harness(secret_env={"API_KEY": "pipeline-secret-that-is-not-set"}),
        judges=(ExactJudge(id="exact"),),
    )
    batches = {name: await pipeline.submit(spec) for name, spec in (("spawn", not_found), ("secret", no_secret))}
    for name, batch_id in batches.items():
        view = await pipeline.finalized(batch_id)
        # its only run never ran: a batch that graded nothing is no success, and says why
        assert view.status == "failed", name
        assert view.error is not None
        assert (view.error.code, view.error.phase) == ("no_run_executed", "dispatch"), name
        assert view.summary is not None
        assert view.summary.counts.failed == 1
        assert view.summary.verdicts.no_verdict == 1
        run = (await pipeline.runs(batch_id))["c1"]
        assert run.executed_status == "failed"
        assert run.failure is not None
        assert run.failure.failure_class == "config", run.failure
        assert run.failure.retryable is False
        assert run.judged_status == "skipped"
        assert run.exported_status is not None
        assert requested_attempts(await pipeline.stream_events(batch_id), "c1") == [1]  # never retried
    spawn = (await pipeline.runs(batches["spawn"]))["c1"].failure
    assert spawn is not None
    assert (spawn.stage, spawn.code) == ("run", "spawn_failed")
    assert "/nonexistent/evalbus-agent" in spawn.message
    secret = (await pipeline.runs(batches["secret"]))["c1"].failure
    assert secret is not None
    assert (secret.stage, secret.code) == ("dispatch", "missing_secret")


async def test_a_worker_that_never_starts_grades_nothing_and_fails_the_batch(pipeline: Pipeline) -> None:
    """An import error in a worker harness is, like a command that cannot be spawned, a run that
    never ran: no grader scores it (here one that would pass), and the batch fails for it."""
    spec = BatchSpec(
        suite=SuiteSpec(
            id="worker-never-started",
            cases=(CaseSpec(id="c1", input="x", graders=(CommandGrader(id="would-pass", command="true"),)),),
        ),
        harness=HarnessSpec(kind="worker", id="broken-worker", python="evalbus_no_such_module:solve"),
        judges=(ExactJudge(id="exact"),),
    )
    batch_id = await pipeline.submit(spec)
    view = await pipeline.finalized(batch_id)
    assert view.status == "failed"
    assert view.error is not None
    assert view.error.code == "no_run_executed"
    run = (await pipeline.runs(batch_id))["c1"]
    assert run.failure is not None
    assert (run.failure.code, run.failure.failure_class) == ("worker_start_failed", "harness")
    assert "evalbus_no_such_module" in (run.failure.log_tail or "")
    assert run.scores == ()
    assert run.judged_status == "skipped"


async def test_agent_failures_nonzero_exit_and_timeout(pipeline: Pipeline) -> None:
    spec = BatchSpec(
        suite=SuiteSpec(
            id="agent-failures",
            cases=(
                CaseSpec(id="ok", input=task(answer="fine"), expected="fine"),
                CaseSpec(id="crash", input=task(stderr="agent crashed: boom", exit=3), expected="x"),
                CaseSpec(id="slow", input=task(sleep_s=60, answer="late"), expected="late", timeout_s=1.0),
            ),
        ),
        harness=agent_harness(),
        judges=(ExactJudge(id="exact"),),
    )
    batch_id = await pipeline.submit(spec)
    view = await pipeline.finalized(batch_id)
    assert view.status == "succeeded"
    runs = await pipeline.runs(batch_id)
    assert runs["ok"].executed_status == "succeeded"
    assert runs["ok"].verdict == "pass"

    crash = runs["crash"]
    assert crash.executed_status == "failed"
    assert crash.failure is not None
    assert (crash.failure.stage, crash.failure.failure_class, crash.failure.code) == ("run", "agent", "exit_nonzero")
    assert "boom" in (crash.failure.log_tail or "")
    slow = runs["slow"]
    assert slow.failure is not None
    assert (slow.failure.stage, slow.failure.failure_class, slow.failure.code) == ("run", "agent", "timeout")
    assert slow.failure.retryable is False
    trajectory = await pipeline.gw.trajectory(slow.run_id)
    executed = [decode_event(bytes(e.body)) for e in trajectory.events if e.type == "case.executed"]
    assert len(executed) == 1
    assert isinstance(executed[0], CaseExecuted)
    assert executed[0].result.exit_code == 124
    stream = await pipeline.stream_events(batch_id)
    for case_id in ("ok", "crash", "slow"):
        assert requested_attempts(stream, case_id) == [1], case_id  # agent failures are not retried
    assert view.summary is not None
    assert view.summary.counts.failed == 2


async def test_infra_failure_is_retried_per_policy_then_reported(pipeline: Pipeline, tmp_path: Path) -> None:
    """Provoked with a dispatcher whose workdir root is a regular file: provisioning a sandbox
    fails (infra, retryable). `retries = 2` gives three attempts; `retries = 0` one."""
    not_a_dir = tmp_path / "workdir-root-is-a-file"
    not_a_dir.write_text("")
    await pipeline.restart("dispatcher", DISPATCHER_WORKDIR_ROOT=str(not_a_dir), DISPATCHER_RETRY_BACKOFF_S="0.05")
    try:
        retried = await pipeline.submit(
            BatchSpec(
                suite=SuiteSpec(id="infra-retried", cases=plain_cases("alpha")),
                harness=agent_harness(),
                judges=(ExactJudge(id="exact"),),
                policy=BatchPolicy(retries=2),
            )
        )
        once = await pipeline.submit(
            BatchSpec(
                suite=SuiteSpec(id="infra-once", cases=plain_cases("alpha")),
                harness=agent_harness(),
                policy=BatchPolicy(retries=0),
            )
        )
        views = {batch_id: await pipeline.finalized(batch_id) for batch_id in (retried, once)}
    finally:
        await pipeline.restart("dispatcher")
    for batch_id, attempts in ((retried, [1, 2, 3]), (once, [1])):
        assert views[batch_id].status == "failed"  # its only run never got a sandbox
        error = views[batch_id].error
        assert error is not None
        assert error.code == "no_run_executed"
        run = (await pipeline.runs(batch_id))["c1"]
        assert run.executed_status == "failed"
        assert run.failure is not None
        assert (run.failure.stage, run.failure.failure_class, run.failure.code) == (
            "dispatch",
            "infra",
            "workdir_failed",
        )
        assert run.failure.retryable is True
        assert run.judged_status == "skipped"
        assert run.verdict is None  # an infrastructure failure gives no verdict
        stream = await pipeline.stream_events(batch_id)
        assert requested_attempts(stream, "c1") == attempts
        executed = [ev for _, ev in stream if ev.type == "case.executed"]
        assert [ev.attempt for ev in executed] == [attempts[-1]]  # only the last attempt reports


async def test_harness_files_that_cannot_be_laid_out_are_a_config_failure(pipeline: Pipeline) -> None:
    """A spec asking for both a file `notes` and a file `notes/today.txt` can never be laid out:
    the spec is at fault (config), so running it again is pointless (not retryable, one attempt)."""
    spec = BatchSpec(
        suite=SuiteSpec(id="config-files", cases=plain_cases("alpha")),
        harness=agent_harness(files={"notes": "a file", "notes/today.txt": "inside that file"}),
        policy=BatchPolicy(retries=2),
    )
    batch_id = await pipeline.submit(spec)
    view = await pipeline.finalized(batch_id)
    assert view.status == "failed"  # its only run never ran
    assert view.error is not None
    assert view.error.code == "no_run_executed"
    run = (await pipeline.runs(batch_id))["c1"]
    assert run.failure is not None
    assert (run.failure.failure_class, run.failure.retryable) == ("config", False), run.failure
    assert requested_attempts(await pipeline.stream_events(batch_id), "c1") == [1]


# ---------------------------------------------------------------- cancel and supersede


def gated_spec(suite_id: str, started: Path, go: Path, *, supersede_key: str | None = None) -> BatchSpec:
    """Four cases; the first one's agent signals `started` and waits for `go`."""
    first = CaseSpec(id="c1", input=task(answer="one", touch=[str(started)], wait_file=str(go)), expected="one")
    return BatchSpec(
        suite=SuiteSpec(id=suite_id, cases=(first, *plain_cases("two", "three", "four", start=2))),
        harness=agent_harness(),
        judges=(ExactJudge(id="exact"),),
        supersede_key=supersede_key,
    )


async def test_cancel_settles_the_in_flight_case_and_cancels_the_rest(pipeline: Pipeline, tmp_path: Path) -> None:
    started, go = tmp_path / "c1.started", tmp_path / "c1.go"
    batch_id = await pipeline.submit(gated_spec("cancel", started, go))
    await wait_path(started)  # c1 holds the only compute slot; c2..c4 are queued
    accepted = await pipeline.gw.cancel(batch_id)
    assert accepted.batch_id == batch_id

    async def cancel_recorded() -> bool:
        return (await pipeline.gw.get(batch_id)).cancel_reason == "cancelled"

    await eventually(cancel_recorded, timeout_s=30, what="the cancel to be recorded")
    go.touch()  # the in-flight case may now finish
    view = await pipeline.finalized(batch_id)

    assert view.status == "cancelled"
    runs = await pipeline.runs(batch_id)
    assert runs["c1"].executed_status == "succeeded"  # settled, not killed
    assert runs["c1"].judged_status == "judged"
    assert runs["c1"].verdict == "pass"
    for case_id in ("c2", "c3", "c4"):
        run = runs[case_id]
        assert run.executed_status == "cancelled", case_id
        assert run.failure is not None
        assert (run.failure.failure_class, run.failure.code) == ("cancelled", "cancelled")
        assert run.exported_status is not None  # every case still passes every stage
    assert view.summary is not None
    assert view.summary.counts.cancelled == 3
    assert view.summary.counts.exported == 4
    assert view.summary.verdicts.passed == 1
    finals = [ev for _, ev in await pipeline.stream_events(batch_id) if ev.type == "batch.finalized"]
    assert len(finals) == 1
    with pytest.raises(ApiRequestError) as err:
        await pipeline.gw.cancel(batch_id)
    assert err.value.status == 409


async def test_supersede_ends_the_old_batch_superseded(pipeline: Pipeline, tmp_path: Path) -> None:
    started, go = tmp_path / "c1.started", tmp_path / "c1.go"
    key = f"supersede-{tmp_path.name}"
    old = await pipeline.submit(gated_spec("supersede-old", started, go, supersede_key=key))
    await wait_path(started)
    accepted = await pipeline.gw.submit(
        BatchSpec(
            suite=SuiteSpec(id="supersede-new", cases=plain_cases("one", "two")),
            harness=agent_harness(),
            judges=(ExactJudge(id="exact"),),
            supersede_key=key,
        )
    )
    assert accepted.superseded == (old,)

    async def supersede_recorded() -> bool:
        return (await pipeline.gw.get(old)).cancel_reason == "superseded"

    await eventually(supersede_recorded, timeout_s=30, what="the supersede to be recorded")
    go.touch()
    old_view = await pipeline.finalized(old)
    new_view = await pipeline.finalized(accepted.batch_id)

    assert old_view.status == "superseded"
    assert old_view.superseded_by == accepted.batch_id
    old_runs = await pipeline.runs(old)
    assert old_runs["c1"].executed_status == "succeeded"
    for case_id in ("c2", "c3", "c4"):
        assert old_runs[case_id].executed_status == "cancelled", case_id
        failure = old_runs[case_id].failure
        assert failure is not None
        assert failure.code == "superseded"
    assert new_view.status == "succeeded"
    assert new_view.summary is not None
    assert new_view.summary.verdicts.passed == 2


# ---------------------------------------------------------------- live view


async def test_a_run_streams_its_output_marks_and_trace_to_the_live_stream(pipeline: Pipeline) -> None:
    """While it runs, a case's stderr, its trace events and its infra marks go to `run.<run>.live.*`
    (best effort, without acks); the sealed trace in `case.executed` stays the record."""
    from evalbus.testing.pipeline import read_stream
    from evalbus_contracts import InfraMark, LiveLog, LiveTrace, ToolCall
    from evalbus_contracts.subjects import live_filter

    spec = BatchSpec(
        suite=SuiteSpec(
            id="live",
            cases=(CaseSpec(id="c1", input=task(answer="7", stderr="thinking hard\n", tool_calls=2), expected="7"),),
        ),
        harness=agent_harness(),
    )
    batch_id = await pipeline.submit(spec)
    await pipeline.finalized(batch_id)
    run_id = f"evb-{batch_id}-c1"

    async def live() -> list[Event]:
        return [m.event() for m in await read_stream(pipeline.nc, "LIVE", (live_filter(run_id),))]

    events: list[Event] = []

    async def marks_arrived() -> bool:
        events[:] = await live()
        return {m.event for e in events if isinstance(e, InfraMark) for m in e.marks} >= {
            "accepted",
            "started",
            "released",
        }

    await eventually(marks_arrived, timeout_s=15, what="the live marks of the run")
    logs = "".join(e.text for e in events if isinstance(e, LiveLog) and e.stream == "stderr")
    assert "thinking hard" in logs
    assert "EVALBUS_EVENT" not in "".join(e.text for e in events if isinstance(e, LiveLog))
    traced = [ev for e in events if isinstance(e, LiveTrace) for ev in e.events]
    assert sum(isinstance(ev, ToolCall) for ev in traced) == 2
    assert all(e.run_id == run_id for e in events)
