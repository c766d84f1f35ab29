"""Crash-resume: for each of the dispatcher, the judge, the exporter and the gateway (its
recorder), SIGKILL the service in the windows of the delivery contract, start it again, and
prove each batch ends exactly as an undisturbed run of the same deterministic suite:

1. **mid-message** — the service holds an unacknowledged message whose output is not published
   yet: the batch is held at a rendezvous the test controls (agents waiting for a gate file; a
   judge waiting for one; the OTLP receiver behind a sink holding a request; the recorder blocked
   on its PostgreSQL advisory lock), and the test checks that the target's consumer has messages
   pending acknowledgement when it kills. The redelivery does the work for the first time.
2. **after the PubAck, before the ack** — a deterministic fault point of the chassis
   (`FAULT_KILL=before_ack:…`, `evalbus_runtime.faults`) SIGKILLs the service right after
   JetStream acknowledged its output for case c04 (for the gateway: right after the recorder's
   transaction holding c04's `case.exported` committed) and before it acks the input. The
   redelivery finds that output on the stream (the stage's `settled_by`: the run's
   `case.executed`, `case.judged` or `case.exported`) and acks without doing the work again; a
   stage without it would run again and publish only what the stream lacks
   (`Publisher.publish_missing`), and the gateway's recorder skips a sequence it stored. The
   dispatcher is also killed after its fan-out's PubAcks, before it acks the `batch.requested`;
   that redelivery publishes only the requests the stream lacks (none).
3. **after the PubAck, redelivered past the duplicate window** — the same kills of the dispatcher,
   the judge and the exporter, but before the target starts again CASES' duplicate window is cut to
   1 s and the test waits until it has forgotten the output's `Nats-Msg-Id` (`window_passed`); only
   the redelivery's lookup of its output on the stream keeps every output once. Each faulted case
   also reaches the OTLP sink once: a settled redelivery sends nothing.

What is proved for every batch:
- the same status and the same scorecard (summary and export status; latency metrics excluded,
  being timings) as an undisturbed batch run on the same pipeline just before;
- every run exactly once per stage, in the event store (rows of `events` per run and type, no
  refused duplicates) and on the stream (`case.*` messages per run and type in CASES: a duplicate
  there would mean a publish escaped both the lookup and the `Nats-Msg-Id` window);
- every run's trajectory sealed and intact (`verify_batch`), every case once in the jsonl export.

What breaking deduplication does to it (run by hand on the tree of this change, 2026-12-02): with
`Publisher.stored` made to find nothing (no lookup), 4 of the 14 tests fail — all three
past-the-window variants (the dispatcher's fan-out re-publishes all ten `case.requested`; the
judge's `('…-c04', 'case.judged'): 1` extra, the exporter's `('…-c04', 'case.exported'): 1` extra
on the CASES stream) and the exporter's in-window variant, whose stream duplicate the
`Nats-Msg-Id` window absorbs but whose sink got c04 twice (`assert 2 == 1`). Every mid-message
window still passes, since there the killed replica had published nothing. Earlier, with the
publisher's `Nats-Msg-Id` made unique per publish and before the lookup existed, the in-window
variants failed the same way. The gateway's redelivery is absorbed by the recorder instead (a
sequence already stored is skipped): with that check removed, its after-commit window fails with
the redelivered events refused (`rejections`: `('…-c04', 'case.executed', 'sealed')` and four
more). Before the wait for every consumer to be idle (`Pipeline.quiescent`), the judge and exporter
windows passed even with deduplication broken: the batch finalized before the redelivery came.

The services run with their consumers' own `ack_wait` (healthy replicas send `in_progress` every
quarter of it): a case a killed dispatcher, judge or exporter held is redelivered after 4 s (their
case stages are exclusive: a redelivery whose holder still lives is left to it, `Stage.exclusive`),
what the gateway's recorder held after 10 s. The four targets run concurrently, each on a pipeline
of its own (nats-server, database, five services), and the tests assert on what each scenario
recorded.
"""

from __future__ import annotations

import asyncio
import contextlib
import re
import time
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import msgspec
import pytest
from aiohttp import web

from evalbus.testing.bus import window_passed
from evalbus.testing.judges import waiting_marker
from evalbus.testing.pipeline import (
    Pipeline,
    agent_harness,
    differences,
    eventually,
    open_pipeline,
    pid_alive,
    task,
    wait_path,
    without_metrics,
)
from evalbus.testing.reliability import report, row
from evalbus_api.views import BatchView, RunView
from evalbus_contracts import (
    AnswerMatchGrader,
    BatchSpec,
    CaseExecuted,
    CaseSpec,
    ContainsJudge,
    CostGrader,
    ExactJudge,
    JsonlSink,
    LatencyGrader,
    PlatformSink,
    RegisteredJudge,
    StepsGrader,
    SuiteSpec,
    TestsPassGrader,
    batch_run_id,
)
from evalbus_contracts.streams import (
    CASES,
    DISPATCHER_BATCHES,
    DISPATCHER_CASES,
    EXPORTER_CASES,
    GATEWAY_RECORDER,
    JUDGE_CASES,
    ConsumerDef,
)
from evalbus_gateway.store import BatchVerifyResult
from evalbus_gateway.store.recorder import RECORDER_LOCK
from evalbus_runtime.bus import ensure_stream

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

TARGETS = ("dispatcher", "judge", "exporter", "gateway")
CASE_IDS = tuple(f"c{i:02d}" for i in range(1, 11))
HELD_CASE = "c05"
"""The case each scenario holds at its rendezvous (the dispatcher scenario also holds c06)."""
TIMING_METRICS = ("latency",)
"""Metrics that measure time, so differ between runs: left out of the comparison."""
MEAN_REL_TOL = 1e-9
"""How close two runs' metric means must be (sums of the same floats in another order)."""
STAGE_TYPES = ("case.requested", "case.executed", "case.judged", "case.exported")
FINISH_TIMEOUT_S = 120.0
"""Longest wait for a crashed batch: a redelivery (`ack_wait`), a restart, the rest of the batch."""
FAULT_CASE = "c04"
"""The case whose output a fault point kills the target after (a case no rendezvous holds)."""


# ---------------------------------------------------------------- the suite


@dataclass(frozen=True)
class Gates:
    """The rendezvous files of one batch."""

    root: Path

    @property
    def harness(self) -> Path:
        """Agents of c05 and c06 wait for it."""
        return self.root / "harness.go"

    @property
    def judge(self) -> Path:
        """The `gate` judge waits for it on c05."""
        return self.root / "judge.go"

    def started(self, case_id: str) -> Path:
        """Written by a gated agent when it starts (holds its pid)."""
        return self.root / f"started-{case_id}"


def crash_suite(gates: Gates, otlp_url: str) -> BatchSpec:
    """Ten deterministic cases: right and wrong answers, a failing agent, tool calls and costs,
    sandbox and observation graders, three judges (one a rendezvous), a jsonl and an OTLP sink.
    The gate paths in the inputs only change when things happen, never what is scored."""
    graders = (
        AnswerMatchGrader(id="answer"),
        TestsPassGrader(id="tests", command="test -f done.txt"),
        StepsGrader(id="steps", max_steps=2),
        CostGrader(id="cost"),
        LatencyGrader(id="latency"),
    )
    cases = []
    for i, case_id in enumerate(CASE_IDS, start=1):
        fields: dict[str, Any] = {
            "answer": f"wrong {i}" if i in (3, 7) else f"answer {i}",
            "tool_calls": i % 4,
            "llm_cost": round(0.01 * i, 4),
            "wait_timeout_s": 140,
        }
        if i % 3:
            fields["write"] = {"done.txt": "ok"}
        if i == 9:
            fields["exit"] = 2
        if case_id in (HELD_CASE, "c06"):
            fields["touch"] = [str(gates.started(case_id))]
            fields["wait_file"] = str(gates.harness)
        if case_id == HELD_CASE:
            fields["judge_waits_for"] = str(gates.judge)
        cases.append(CaseSpec(id=case_id, input=task(**fields), expected=f"answer {i}", graders=graders))
    return BatchSpec(
        suite=SuiteSpec(id="crash-resume", cases=tuple(cases)),
        harness=agent_harness(),
        judges=(
            ExactJudge(id="exact"),
            RegisteredJudge(id="gate", name="wait-file", params={"timeout_s": "140"}),
            ContainsJudge(id="contains"),
        ),
        sinks=(JsonlSink(path="crash-{batch}.jsonl"), PlatformSink(platform="otel", endpoint=otlp_url)),
    )


# ---------------------------------------------------------------- an OTLP receiver that can hold a run's export


_RUN_ID = re.compile(r"evb-[A-Za-z0-9]+-c\d\d")


@dataclass
class OtlpReceiver:
    """A loopback OTLP/HTTP traces endpoint (JSON encoding, answers `{}`) that counts exports per
    run id and holds the export of any run in `holds` until it is released."""

    exports: Counter[str] = field(default_factory=Counter)
    held: set[str] = field(default_factory=set)
    holds: dict[str, asyncio.Event] = field(default_factory=dict)
    url: str = ""
    _runner: web.AppRunner | None = None

    async def start(self) -> None:
        app = web.Application()
        app.router.add_post("/v1/traces", self._traces)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://127.0.0.1:{port}"

    async def stop(self) -> None:
        for gate in self.holds.values():
            gate.set()
        if self._runner is not None:
            await self._runner.cleanup()

    async def _traces(self, request: web.Request) -> web.Response:
        body = await request.text()
        for run_id in set(_RUN_ID.findall(body)):
            self.exports[run_id] += 1
            gate = self.holds.get(run_id)
            if gate is not None and not gate.is_set():
                self.held.add(run_id)
                await gate.wait()
        return web.json_response({})


# ---------------------------------------------------------------- one scenario


@dataclass
class BatchFacts:
    """Everything the tests check about one finished batch."""

    batch_id: str
    view: BatchView
    runs: dict[str, RunView]
    store_counts: Counter[tuple[str | None, str]]
    stream_counts: Counter[tuple[str | None, str]]
    rejections: list[tuple[str | None, str, str]]
    verify: BatchVerifyResult
    jsonl_run_ids: list[str]


@dataclass
class FaultWindow:
    """A batch whose target was killed by a fault point after its output's PubAck, before its ack."""

    fault: str
    """The `FAULT_KILL` value the target ran with."""
    past_window: bool
    """Whether the redelivery came after CASES' duplicate window had forgotten the output's id."""
    exit_code: int
    """How the target ended (-9: SIGKILL)."""
    outputs_at_kill: int
    """The output of the faulted message, as stored when the target died (1: it got its PubAck)."""
    ack_pending_at_kill: int
    """Messages of the target's consumer delivered and not acknowledged when it died."""
    recovered_s: float
    """From the target's death until every consumer is idle again: the message it held was
    redelivered (after `ack_wait`) and done again, the batch finalized and all of it recorded."""
    facts: BatchFacts
    otlp_exports: int
    """How many times the OTLP sink received the faulted case (`FAULT_CASE`)."""


@dataclass
class CrashRun:
    """What one scenario recorded."""

    target: str
    undisturbed: BatchFacts | None = None
    crashed: BatchFacts | None = None
    after_ack: list[FaultWindow] = field(default_factory=list)
    ack_pending_at_kill: int = 0
    seconds: float = 0.0
    evidence: dict[str, Any] = field(default_factory=dict)


async def ack_pending(pipeline: Pipeline, consumer: ConsumerDef) -> int:
    """Messages the consumer has delivered and not yet had acknowledged."""
    info = await pipeline.nc.jetstream().consumer_info(consumer.stream, consumer.durable)
    return int(info.num_ack_pending)


async def batch_facts(pipeline: Pipeline, batch_id: str) -> BatchFacts:
    view = await pipeline.finalized(batch_id, timeout_s=FINISH_TIMEOUT_S)
    # A redelivery can come after the batch finalized (its first delivery's output already let the
    # batch finish): a duplicate it published would be missed if we read now.
    await pipeline.quiescent(timeout_s=FINISH_TIMEOUT_S)
    jsonl = pipeline.workdir / "exports" / f"crash-{batch_id}.jsonl"
    lines = jsonl.read_text().splitlines() if jsonl.exists() else []
    return BatchFacts(
        batch_id=batch_id,
        view=view,
        runs=await pipeline.runs(batch_id),
        store_counts=await pipeline.store_counts(batch_id),
        stream_counts=await pipeline.stream_counts(batch_id),
        rejections=await pipeline.rejections(batch_id),
        verify=await pipeline.verify(batch_id),
        jsonl_run_ids=[msgspec.json.decode(line)["run_id"] for line in lines if line.strip()],
    )


def open_gates(root: Path) -> Gates:
    gates = Gates(root)
    root.mkdir(parents=True, exist_ok=True)
    gates.harness.touch()
    gates.judge.touch()
    return gates


Scenario = Callable[[Pipeline, CrashRun, Gates, str, OtlpReceiver], Awaitable[None]]


async def crash_dispatcher(p: Pipeline, run: CrashRun, gates: Gates, batch_id: str, otlp: OtlpReceiver) -> None:
    """Both compute slots hold an agent (c05, c06) waiting at the harness gate: kill, restart,
    open the gate. The two cases are redelivered to the new dispatcher and run again."""
    gates.judge.touch()
    for case_id in (HELD_CASE, "c06"):
        await wait_path(gates.started(case_id), timeout_s=60)
    orphans = [int(gates.started(c).read_text()) for c in (HELD_CASE, "c06")]
    run.ack_pending_at_kill = await ack_pending(p, DISPATCHER_CASES)
    await p.kill("dispatcher")
    run.evidence["killed_at"] = time.monotonic()
    await p.start("dispatcher")
    run.evidence["restarted_s"] = time.monotonic() - run.evidence["killed_at"]
    # The killed dispatcher's sandboxes: do they outlive it? (Checked by a test of its own.)
    with contextlib.suppress(AssertionError):
        await eventually(lambda: not any(pid_alive(pid) for pid in orphans), timeout_s=5, what="orphans to end")
    run.evidence["orphans_alive_after_restart"] = [pid for pid in orphans if pid_alive(pid)]
    gates.harness.touch()

    def restarted_agents() -> bool:
        """Both held cases started again (their gate files, written atomically, name new agents)."""
        return all(int(gates.started(c).read_text()) not in orphans for c in (HELD_CASE, "c06"))

    await eventually(restarted_agents, timeout_s=60, what="the held cases to start again")
    run.evidence["resumed_s"] = time.monotonic() - run.evidence["killed_at"]


async def crash_judge(p: Pipeline, run: CrashRun, gates: Gates, batch_id: str, otlp: OtlpReceiver) -> None:
    """The `gate` judge holds c05: kill the judge while it waits, restart it, open the gate."""
    gates.harness.touch()
    await wait_path(waiting_marker(gates.judge, batch_run_id(batch_id, HELD_CASE)), timeout_s=60)
    run.ack_pending_at_kill = await ack_pending(p, JUDGE_CASES)
    await p.kill("judge")
    run.evidence["killed_at"] = time.monotonic()
    await p.start("judge")
    gates.judge.touch()


async def crash_exporter(p: Pipeline, run: CrashRun, gates: Gates, batch_id: str, otlp: OtlpReceiver) -> None:
    """The OTLP receiver holds c05's export: kill the exporter while it waits, restart it, release.

    The kill waits until c05 is the only export in flight — every other case's `case.exported` on
    the stream and acknowledged — so that which exports the sink may see twice is known: an export
    killed between its request reaching the sink and its `case.exported` is sent again, and OTLP has
    no read side to find it by (CI saw it once, for a case in the exporter's second slot)."""
    held_run = batch_run_id(batch_id, HELD_CASE)
    others = {batch_run_id(batch_id, c) for c in CASE_IDS if c != HELD_CASE}
    gates.harness.touch()
    gates.judge.touch()
    await eventually(lambda: held_run in otlp.held, timeout_s=60, what=f"the export of {held_run} to be held")

    async def only_the_held_export_in_flight() -> bool:
        counts = await p.stream_counts(batch_id)
        exported = {r for r, kind in counts if kind == "case.exported"}
        return others <= exported and await ack_pending(p, EXPORTER_CASES) == 1

    await eventually(
        only_the_held_export_in_flight, timeout_s=60, what=f"every export but {held_run}'s to be done and acked"
    )
    run.ack_pending_at_kill = await ack_pending(p, EXPORTER_CASES)
    await p.kill("exporter")
    run.evidence["killed_at"] = time.monotonic()
    await p.start("exporter")
    otlp.holds[held_run].set()


async def crash_gateway(p: Pipeline, run: CrashRun, gates: Gates, batch_id: str, otlp: OtlpReceiver) -> None:
    """Once the first cases are recorded, the test takes the recorder's advisory lock, so the
    recorder's next transaction blocks with its messages unacknowledged; the rest of the batch is
    let through, the gateway is killed, the lock released and the gateway started again."""
    gates.judge.touch()

    async def recorded(n: int) -> bool:
        count = await p.pool.fetchval(
            "SELECT count(*) FROM runs WHERE batch_id = $1 AND exported_status IS NOT NULL", batch_id
        )
        return int(count) >= n

    await eventually(lambda: recorded(4), timeout_s=60, what="four cases recorded as exported")
    lock: asyncpg.Connection[asyncpg.Record] = await asyncpg.connect(p.database_url)
    try:
        await lock.execute("SELECT pg_advisory_lock($1)", RECORDER_LOCK)
        gates.harness.touch()  # the rest of the batch now reaches a recorder that cannot commit

        async def exported_on_stream() -> bool:
            counts = await p.stream_counts(batch_id)
            return sum(n for (_, kind), n in counts.items() if kind == "case.exported") == len(CASE_IDS)

        async def recorder_in_flight() -> bool:
            return await ack_pending(p, GATEWAY_RECORDER) > 0

        await eventually(exported_on_stream, timeout_s=60, what="every case.exported on the stream")
        await eventually(recorder_in_flight, timeout_s=30, what="recorder messages in flight")
        run.ack_pending_at_kill = await ack_pending(p, GATEWAY_RECORDER)
        await p.kill("gateway")
        run.evidence["killed_at"] = time.monotonic()
    finally:
        await lock.close()  # ends the session: its advisory lock is released
    await p.start("gateway")


SCENARIOS: dict[str, Scenario] = {
    "dispatcher": crash_dispatcher,
    "judge": crash_judge,
    "exporter": crash_exporter,
    "gateway": crash_gateway,
}


@dataclass(frozen=True)
class FaultPlan:
    """One after-PubAck kill: the fault spec and how to see that its output was stored."""

    consumer: ConsumerDef
    event_type: str
    run_glob: str
    output: Callable[[Pipeline, str], Awaitable[int]]
    """(pipeline, batch id) → how many copies of the faulted message's output are stored."""

    @property
    def spec(self) -> str:
        return f"before_ack:{self.consumer.durable}:{self.event_type}:{self.run_glob}"


def on_stream(kind: str, case_id: str | None) -> Callable[[Pipeline, str], Awaitable[int]]:
    """Copies of `kind` for `case_id` (every case when None) in the batch's CASES messages."""

    async def count(p: Pipeline, batch_id: str) -> int:
        counts = await p.stream_counts(batch_id)
        runs = {batch_run_id(batch_id, c) for c in CASE_IDS} if case_id is None else {batch_run_id(batch_id, case_id)}
        return sum(n for (run_id, k), n in counts.items() if k == kind and run_id in runs)

    return count


def in_store(kind: str, case_id: str) -> Callable[[Pipeline, str], Awaitable[int]]:
    """Rows of `kind` for `case_id` in the event store."""

    async def count(p: Pipeline, batch_id: str) -> int:
        return (await p.store_counts(batch_id)).get((batch_run_id(batch_id, case_id), kind), 0)

    return count


FAULTS: dict[str, tuple[FaultPlan, ...]] = {
    "dispatcher": (
        FaultPlan(DISPATCHER_BATCHES, "batch.requested", "-", on_stream("case.requested", None)),
        FaultPlan(DISPATCHER_CASES, "case.requested", f"evb-*-{FAULT_CASE}", on_stream("case.executed", FAULT_CASE)),
    ),
    "judge": (FaultPlan(JUDGE_CASES, "*", f"evb-*-{FAULT_CASE}", on_stream("case.judged", FAULT_CASE)),),
    "exporter": (FaultPlan(EXPORTER_CASES, "*", f"evb-*-{FAULT_CASE}", on_stream("case.exported", FAULT_CASE)),),
    "gateway": (
        FaultPlan(GATEWAY_RECORDER, "case.exported", f"evb-*-{FAULT_CASE}", in_store("case.exported", FAULT_CASE)),
    ),
}
"""Per target, its after-PubAck kills (one batch each); a fan-out counts as the dispatcher's output of
every case."""
PAST_WINDOW_TARGETS = ("dispatcher", "judge", "exporter")
"""Targets whose after-PubAck kills also run with the redelivery after the duplicate window: the ones
that publish an output. (The gateway's recorder publishes nothing; it skips a sequence it stored.)"""


def fault_windows(target: str) -> list[tuple[FaultPlan, bool]]:
    """The target's after-PubAck batches: each plan inside the duplicate window, then past it."""
    passes = (False, True) if target in PAST_WINDOW_TARGETS else (False,)
    return [(plan, past) for past in passes for plan in FAULTS[target]]


SHORT_WINDOW_S = 1.0
"""CASES' duplicate window while a past-the-window redelivery waits for the target to come back."""


async def fault_window(
    p: Pipeline, target: str, plan: FaultPlan, spec: BatchSpec, otlp: OtlpReceiver, *, past_window: bool
) -> FaultWindow:
    """Restart `target` with `plan`'s fault point armed, submit `spec`, wait for the target to kill
    itself, start it again unarmed, and collect the batch. `past_window`: before the start, shorten
    CASES' duplicate window and wait until it has forgotten the output's `Nats-Msg-Id`, so only the
    redelivery's lookup of its output on the stream (`Stage.settled_by`, `publish_missing`) stands
    between it and a duplicate; the window is set back once the target is up."""
    await p.restart(target, FAULT_KILL=plan.spec)
    batch_id = await p.submit(spec)
    exit_code = await p.wait_exit(target, timeout_s=90)
    died = time.monotonic()
    outputs = await plan.output(p, batch_id)
    pending = await ack_pending(p, plan.consumer)
    js = p.nc.jetstream()
    if past_window:
        await ensure_stream(js, msgspec.structs.replace(CASES, duplicate_window_s=SHORT_WINDOW_S))
        await window_passed(p.nc)  # the output's id, older than the probe's, is forgotten too
    await p.start(target)
    if past_window:
        await ensure_stream(js, CASES)
    facts = await batch_facts(p, batch_id)
    return FaultWindow(
        fault=plan.spec,
        past_window=past_window,
        exit_code=exit_code,
        outputs_at_kill=outputs,
        ack_pending_at_kill=pending,
        recovered_s=time.monotonic() - died,
        facts=facts,
        otlp_exports=otlp.exports[batch_run_id(batch_id, FAULT_CASE)],
    )


async def run_scenario(target: str, pg_admin_url: str, root: Path, otlp: OtlpReceiver) -> CrashRun:
    """An undisturbed batch, then the same suite with `target` killed mid-message."""
    run = CrashRun(target=target)
    began = time.monotonic()
    sandboxes = root / "sandboxes"
    sandboxes.mkdir(parents=True)
    service_env = {"dispatcher": {"DISPATCHER_SLOTS": "2", "DISPATCHER_WORKDIR_ROOT": str(sandboxes)}}
    async with open_pipeline(pg_admin_url, root / "pipeline", service_env=service_env) as p:
        try:
            quiet = await p.submit(crash_suite(open_gates(root / "gates-undisturbed"), otlp.url))
            run.undisturbed = await batch_facts(p, quiet)

            gates = Gates(root / "gates-crashed")
            gates.root.mkdir()
            spec = crash_suite(gates, otlp.url)
            batch_id = await p.submit(spec)
            if target == "exporter":
                otlp.holds[batch_run_id(batch_id, HELD_CASE)] = asyncio.Event()
            await SCENARIOS[target](p, run, gates, batch_id, otlp)
            run.crashed = await batch_facts(p, batch_id)
            run.evidence["recovered_s"] = time.monotonic() - run.evidence.get("killed_at", time.monotonic())
            run.evidence["sandboxes_left"] = sorted(d.name for d in sandboxes.iterdir())
            run.evidence["otlp_exports"] = {r: n for r, n in otlp.exports.items() if batch_id in r}
            stream = await p.stream_events(batch_id)
            run.evidence["executed_attempts"] = {
                ev.case_id: ev.attempt for _, ev in stream if isinstance(ev, CaseExecuted)
            }
            for i, (plan, past_window) in enumerate(fault_windows(target)):
                spec_after = crash_suite(open_gates(root / f"gates-after-ack-{i}"), otlp.url)
                run.after_ack.append(await fault_window(p, target, plan, spec_after, otlp, past_window=past_window))
        except BaseException as e:
            e.add_note(f"scenario {target}:\n{p.diagnostics()}")
            raise
    run.seconds = time.monotonic() - began
    return run


@pytest.fixture(scope="module")
async def crash_runs(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[dict[str, Any]]:
    """The four scenarios, run at once; target → its `CrashRun` (or the exception it raised)."""
    otlp = OtlpReceiver()
    await otlp.start()
    root = tmp_path_factory.mktemp("pipeline-crash")
    try:
        results = await asyncio.gather(
            *(run_scenario(t, pg_admin_url, root / t, otlp) for t in TARGETS), return_exceptions=True
        )
        outcomes = dict(zip(TARGETS, results, strict=True))
        report(*reliability_rows(outcomes))
        yield outcomes
    finally:
        await otlp.stop()


def lost_and_duplicated(facts: BatchFacts) -> tuple[int, int]:
    """Stage events missing from the store, and copies beyond one (stream, store, refused)."""
    runs = {batch_run_id(facts.batch_id, c) for c in CASE_IDS}
    want: Counter[tuple[str | None, str]] = Counter({(r, kind): 1 for r in runs for kind in STAGE_TYPES})
    store = Counter({k: n for k, n in facts.store_counts.items() if k[0] in runs})
    stream = Counter({k: n for k, n in facts.stream_counts.items() if k[0] in runs})
    lost = sum((want - store).values())
    duplicated = sum((store - want).values()) + sum((stream - want).values()) + len(facts.rejections)
    return lost, duplicated


WINDOW_NOTE = {False: "", True: ", redelivered past the duplicate window"}


def reliability_rows(outcomes: dict[str, Any]) -> list[dict[str, Any]]:
    """One row per window of every scenario (or its error)."""
    rows: list[dict[str, Any]] = []
    for target, run in outcomes.items():
        if not isinstance(run, CrashRun):
            rows.append({"test": f"SIGKILL {target}", "error": f"{type(run).__name__}: {run}"})
            continue
        windows: list[tuple[str, BatchFacts | None, float | None]] = [
            ("mid-message (output not published)", run.crashed, run.evidence.get("recovered_s")),
            *(
                (
                    f"after PubAck, before ack ({w.fault.split(':')[1]}){WINDOW_NOTE[w.past_window]}",
                    w.facts,
                    w.recovered_s,
                )
                for w in run.after_ack
            ),
        ]
        for window, facts, stall in windows:
            if facts is None:
                continue
            lost, duplicated = lost_and_duplicated(facts)
            rows.append(
                row(
                    f"SIGKILL {target}: {window}",
                    load=f"{len(CASE_IDS)} cases, 4 stages",
                    faults=1,
                    lost=lost,
                    duplicated=duplicated,
                    stall_s=stall,
                    passed=lost == 0 and duplicated == 0 and facts.view.status == "succeeded",
                )
            )
            if facts is run.crashed and "resumed_s" in run.evidence:
                # kill → the orphaned cases' agents started again (the dispatcher's scenario)
                rows[-1]["resumed_s"] = round(run.evidence["resumed_s"], 2)
                rows[-1]["restarted_s"] = round(run.evidence["restarted_s"], 2)
    return rows


def outcome(crash_runs: dict[str, Any], target: str) -> CrashRun:
    result = crash_runs[target]
    if isinstance(result, BaseException):
        raise result
    assert isinstance(result, CrashRun)
    return result


# ---------------------------------------------------------------- the proofs


def assert_exactly_once(facts: BatchFacts) -> None:
    runs = {batch_run_id(facts.batch_id, c) for c in CASE_IDS}
    want: Counter[tuple[str | None, str]] = Counter({(r, kind): 1 for r in runs for kind in STAGE_TYPES})
    want[(None, "batch.requested")] = 1
    want[(None, "batch.finalized")] = 1
    store = Counter({(r if r in runs else None, k): n for (r, k), n in facts.store_counts.items()})
    assert store == want, f"event store rows per (run, type) differ: {store - want} extra, {want - store} missing"
    assert facts.stream_counts == want, (
        f"CASES messages per (run, type) differ: {facts.stream_counts - want} extra, "
        f"{want - facts.stream_counts} missing"
    )
    assert facts.rejections == []
    assert facts.verify.ok, facts.verify
    assert facts.verify.ok_count == len(CASE_IDS)
    assert sorted(facts.jsonl_run_ids) == sorted(runs)  # each case once in the jsonl export


def assert_same_scorecard(crashed: BatchFacts, undisturbed: BatchFacts) -> None:
    """Same status, summary (timing metrics aside; means to 1e-9 relative, since a mean sums in
    the order cases finished — see `test_scorecard_does_not_depend_on_the_order_cases_finish`),
    export status, and per case the same verdict, stage outcomes and scores."""
    assert crashed.view.status == undisturbed.view.status == "succeeded"
    assert crashed.view.summary is not None
    assert undisturbed.view.summary is not None
    summary_diff = differences(
        without_metrics(crashed.view.summary, TIMING_METRICS),
        without_metrics(undisturbed.view.summary, TIMING_METRICS),
        rel_tol=MEAN_REL_TOL,
    )
    assert summary_diff == [], "summaries differ"
    assert differences(crashed.view.export, undisturbed.view.export) == [], "export summaries differ"
    for case_id in CASE_IDS:
        a, b = crashed.runs[case_id], undisturbed.runs[case_id]
        outcome_a = (a.verdict, a.executed_status, a.judged_status, a.exported_status)
        outcome_b = (b.verdict, b.executed_status, b.judged_status, b.exported_status)
        assert outcome_a == outcome_b, case_id
        scores_a = [s for s in a.scores if not s.metric.startswith(TIMING_METRICS)]
        scores_b = [s for s in b.scores if not s.metric.startswith(TIMING_METRICS)]
        assert differences(scores_a, scores_b) == [], case_id


def test_undisturbed_runs_agree_and_score_as_designed(crash_runs: dict[str, Any]) -> None:
    """The reference: four undisturbed runs of the suite (one per pipeline) give one scorecard,
    which is the one the suite was built for."""
    facts = [outcome(crash_runs, t).undisturbed for t in TARGETS]
    assert all(f is not None for f in facts)
    first = facts[0]
    assert first is not None
    for other in facts[1:]:
        assert other is not None
        assert_same_scorecard(other, first)
        assert_exactly_once(other)
    assert_exactly_once(first)
    summary = first.view.summary
    assert summary is not None
    assert summary.counts.executed == summary.counts.judged == summary.counts.exported == 10
    assert summary.counts.failed == 1  # c09's agent exits 2
    # c03, c07 wrong; c09 failed at run, so the ladder gives it no verdict.
    assert (summary.verdicts.passed, summary.verdicts.failed, summary.verdicts.no_verdict) == (7, 2, 1)
    assert first.view.export is not None
    assert first.view.export.status == "succeeded"


@pytest.mark.parametrize("target", TARGETS)
def test_batch_survives_sigkill_of_service_mid_message(crash_runs: dict[str, Any], target: str) -> None:
    run = outcome(crash_runs, target)
    assert run.ack_pending_at_kill > 0, f"{target} held no unacknowledged message when it was killed"
    assert run.crashed is not None
    assert run.undisturbed is not None
    assert_exactly_once(run.crashed)
    assert_same_scorecard(run.crashed, run.undisturbed)
    assert all(attempt == 1 for attempt in run.evidence["executed_attempts"].values()), run.evidence


@pytest.mark.parametrize("target", TARGETS)
def test_batch_survives_sigkill_of_service_after_its_output_was_acknowledged(
    crash_runs: dict[str, Any], target: str
) -> None:
    """The window a duplicate is born in: the target died by its fault point with its output
    stored and its input unacknowledged; the redelivery did the work again, and still every case is
    once per stage, in the stream and in the store, with the undisturbed scorecard."""
    run = outcome(crash_runs, target)
    assert run.undisturbed is not None
    windows = [w for w in run.after_ack if not w.past_window]
    assert [w.fault for w in windows] == [plan.spec for plan in FAULTS[target]]
    for window in windows:
        assert_fault_window(window, run.undisturbed)


@pytest.mark.parametrize("target", PAST_WINDOW_TARGETS)
def test_a_redelivery_after_the_duplicate_window_still_publishes_each_output_once(
    crash_runs: dict[str, Any], target: str
) -> None:
    """The same kills, with the redelivery held back until CASES' duplicate window had forgotten the
    output's `Nats-Msg-Id`: only the lookup of the output on the stream keeps it once (and the
    exporter's redelivery, finding its `case.exported`, sends nothing to the OTLP sink)."""
    run = outcome(crash_runs, target)
    assert run.undisturbed is not None
    windows = [w for w in run.after_ack if w.past_window]
    assert [w.fault for w in windows] == [plan.spec for plan in FAULTS[target]]
    for window in windows:
        assert_fault_window(window, run.undisturbed)


def assert_fault_window(window: FaultWindow, undisturbed: BatchFacts) -> None:
    assert window.exit_code == -9, window.fault
    expected_outputs = len(CASE_IDS) if window.fault.startswith("before_ack:dispatcher-batches") else 1
    assert window.outputs_at_kill == expected_outputs, window.fault
    assert window.ack_pending_at_kill > 0, window.fault
    assert_exactly_once(window.facts)
    assert_same_scorecard(window.facts, undisturbed)
    assert window.otlp_exports == 1, window.fault  # a settled redelivery sends nothing to the sink


def test_exporter_crash_resends_only_the_held_case(crash_runs: dict[str, Any]) -> None:
    """The held export is sent again by the restarted exporter (OTLP has no read side, so a
    re-send is expected); no other case is exported twice."""
    run = outcome(crash_runs, "exporter")
    assert run.crashed is not None
    exports = run.evidence["otlp_exports"]
    held = batch_run_id(run.crashed.batch_id, HELD_CASE)
    assert exports[held] == 2
    assert all(n == 1 for r, n in exports.items() if r != held), exports


def test_killed_dispatcher_leaves_no_sandbox_behind(crash_runs: dict[str, Any]) -> None:
    """The sandboxes a SIGKILLed dispatcher held (agent process groups in their own sessions, and
    their workdirs) must not outlive it: once a dispatcher is back and the batch is over, no
    orphaned agent runs on and no workdir is left under the workdir root."""
    run = outcome(crash_runs, "dispatcher")
    leaks = {
        "agent pids still running after the restart": run.evidence["orphans_alive_after_restart"],
        "workdirs left after the batch": run.evidence["sandboxes_left"],
    }
    assert leaks == {key: [] for key in leaks}
