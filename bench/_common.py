"""Shared pieces of the pipeline benchmarks (a library; run as a script it does nothing).

- `Infra`: a nats-server of the benchmark's own and, when asked, fresh PostgreSQL databases
  (on the server named by `DATABASE_URL` when set, else on the embedded server).
- `pipeline_stack`: the five services as real processes (`evalbus.testing.stack.ServiceStack`), with
  the repository root on `PYTHONPATH` so the judge can load `bench.plugins`.
- `set_consumer`, `pause`, `resume`: bench-side changes to a durable consumer (a global limit, a
  pause), applied AFTER the services started — every service re-applies the contract's consumer
  definitions when it starts (`Service.start` → `ensure_topology(STREAMS, CONSUMERS)`).
- `CpuMeter`: CPU seconds per process (services, nats-server, embedded PostgreSQL, this one).
- `BatchWatch`: arrival times of one batch's events on core NATS subscriptions.
- `AckPendingProbe`: the peak `num_ack_pending` of a consumer while a run goes on.
- `batch_request`, `sample_events`: a benchmark batch, and a realistic run's four case events.
- `report`: a short table, or one JSON line with `--json`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import os
import statistics
import tempfile
import time
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import msgspec
from nats.aio.client import Client as NatsClient
from nats.aio.msg import Msg
from nats.aio.subscription import Subscription
from nats.js import JetStreamContext

from evalbus.infra.nats import NatsServer, start_nats
from evalbus.infra.postgres import (
    EmbeddedPostgres,
    create_database,
    drop_database,
    embedded_postmaster,
    start_embedded_postgres,
)
from evalbus.testing.stack import ServiceStack
from evalbus_contracts import (
    BatchRequested,
    BatchSpec,
    CaseExecuted,
    CaseExported,
    CaseJudged,
    CasePlan,
    CaseRequested,
    CaseResult,
    CaseSpec,
    CaseTimings,
    CommandHarness,
    ExactJudge,
    JudgeSpec,
    LlmCall,
    Measured,
    Message,
    PromptSnapshot,
    SuiteSpec,
    ToolCall,
    ToolResult,
    batch_run_id,
    decode_event,
    encode_token,
    utcnow,
)
from evalbus_contracts.events import EventBase
from evalbus_contracts.streams import ConsumerDef
from evalbus_runtime.bus import consumer_config

REPO_ROOT = Path(__file__).resolve().parents[1]
"""The repository root (this file is `<root>/bench/_common.py`)."""


# ---------------------------------------------------------------- infrastructure


def quiet_logs() -> None:
    """Keep the runtime's connection warnings (a disconnect when the benchmark closes) off the output."""
    logging.getLogger("evalbus").setLevel(logging.ERROR)


class Infra:
    """A nats-server and (optionally) a fresh database, in a temporary folder, for one benchmark."""

    def __init__(self, *, database: bool, prefix: str = "evalbus-bench-") -> None:
        self._want_db = database
        self._tmp = tempfile.TemporaryDirectory(prefix=prefix)
        self.workdir = Path(self._tmp.name)
        self.nats: NatsServer | None = None
        self.database_url = ""
        """URL of the fresh database ("" when none was asked for)."""
        self.database_source = ""
        """`DATABASE_URL` or `embedded`."""
        self._admin_url: str | None = None
        self._embedded: EmbeddedPostgres | None = None
        self._extra: list[NatsServer] = []
        self._databases: list[str] = []

    @property
    def nats_url(self) -> str:
        """Client URL of the benchmark's nats-server."""
        assert self.nats is not None
        return self.nats.url

    def postgres_pid(self) -> int | None:
        """Pid of the embedded PostgreSQL server (None with `DATABASE_URL`: not ours to measure)."""
        if self._embedded is None:
            return None
        master = embedded_postmaster(self._embedded.data_dir)
        return None if master is None else master.pid

    def new_nats(self, name: str) -> NatsServer:
        """Another nats-server of this benchmark (stopped with the rest)."""
        server = start_nats(self.workdir / name)
        self._extra.append(server)
        return server

    async def __aenter__(self) -> Infra:
        try:
            self.nats = start_nats(self.workdir / "nats")
            if self._want_db:
                admin = os.environ.get("DATABASE_URL")
                if admin:
                    self.database_source = "DATABASE_URL"
                else:
                    self._embedded = start_embedded_postgres(self.workdir / "pg")
                    admin = self._embedded.url
                    self.database_source = "embedded"
                self._admin_url = admin
                self.database_url = await self.new_database()
        except BaseException:
            await self.__aexit__(None, None, None)
            raise
        return self

    async def new_database(self) -> str:
        """Another fresh database on the same server (dropped with the rest)."""
        assert self._admin_url is not None
        url = await create_database(self._admin_url, prefix="evalbus_bench")
        self._databases.append(url)
        return url

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        for url in self._databases if self._admin_url else []:
            with contextlib.suppress(Exception):
                await drop_database(self._admin_url or "", url)
        if self._embedded is not None:
            self._embedded.stop()
        for server in [*self._extra, *([self.nats] if self.nats else [])]:
            server.stop()
        self._tmp.cleanup()


def pipeline_stack(
    infra: Infra,
    name: str,
    *,
    service_env: Mapping[str, Mapping[str, str]] | None = None,
) -> ServiceStack:
    """A `ServiceStack` for one run (own log folder), quiet logs, the repo root on `PYTHONPATH`."""
    workdir = infra.workdir / name
    workdir.mkdir(parents=True, exist_ok=True)
    pythonpath = os.pathsep.join(p for p in (str(REPO_ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return ServiceStack(
        nats_url=infra.nats_url,
        database_url=infra.database_url,
        workdir=workdir,
        env={"PYTHONPATH": pythonpath, "LOG_LEVEL": "WARNING", "LOG_FORMAT": "text"},
        service_env={k: dict(v) for k, v in (service_env or {}).items()},
    )


async def set_consumer(js: JetStreamContext, consumer: ConsumerDef, **changes: Any) -> ConsumerDef:
    """Update a durable consumer in place to `consumer` with `changes` (e.g. `max_ack_pending=8`)."""
    changed = msgspec.structs.replace(consumer, **changes)
    await js.add_consumer(changed.stream, consumer_config(changed))
    return changed


async def consumer_limit(js: JetStreamContext, consumer: ConsumerDef) -> int:
    """The `max_ack_pending` the server holds for `consumer` now."""
    info = await js.consumer_info(consumer.stream, consumer.durable)
    return int(info.config.max_ack_pending or 0)


async def pause(js: JetStreamContext, consumer: ConsumerDef, seconds: float = 3600.0) -> None:
    """Pause deliveries of `consumer` (nats-server ≥ 2.11) for at most `seconds`."""
    until = time.time() + seconds
    stamp = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(until))
    await js.pause_consumer(consumer.stream, consumer.durable, stamp)


async def resume(js: JetStreamContext, consumer: ConsumerDef) -> None:
    """Resume deliveries of a paused consumer (`consumer` is its current definition).

    nats-server 2.15 does not serve the pull requests that waited through the pause when it is
    resumed: they sit until they expire (the chassis asks for 10 s), so resuming alone delays the
    first delivery by up to that long. A configuration change does serve them, so the consumer's
    `max_ack_pending` is raised by one and put back; the replicas' own slot counts keep the limit.
    """
    await js.resume_consumer(consumer.stream, consumer.durable)
    await set_consumer(js, consumer, max_ack_pending=consumer.max_ack_pending + 1)
    await set_consumer(js, consumer)


# ---------------------------------------------------------------- CPU accounting

_TICK = os.sysconf("SC_CLK_TCK")


def _stat(pid: int) -> list[str] | None:
    try:
        raw = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return raw[raw.rindex(")") + 2 :].split()  # fields from `state` on (the name may hold spaces)


def process_cpu_s(pid: int, *, children: bool = True) -> float:
    """CPU seconds (user + system) of a process, with its waited-for children when asked; 0 if gone."""
    fields = _stat(pid)
    if fields is None:
        return 0.0
    ticks = int(fields[11]) + int(fields[12]) + ((int(fields[13]) + int(fields[14])) if children else 0)
    return ticks / _TICK


def tree_cpu_s(root: int) -> float:
    """CPU seconds of `root` and its live direct children (PostgreSQL: the postmaster and its backends;
    exited backends are in the postmaster's children times)."""
    total = process_cpu_s(root)
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            fields = _stat(int(entry.name))
            if fields is not None and int(fields[1]) == root:
                total += process_cpu_s(int(entry.name))
    return total


class CpuMeter:
    """CPU seconds spent by each component of a run between `start()` and `stop()`."""

    def __init__(self, pids: Mapping[str, int | None]) -> None:
        self._pids = {name: pid for name, pid in pids.items() if pid is not None}
        self._start: dict[str, float] = {}
        self._wall = 0.0
        self.seconds: dict[str, float] = {}
        """CPU seconds per component."""
        self.wall_s = 0.0
        """Wall-clock seconds measured."""

    def _now(self) -> dict[str, float]:
        out = {
            name: (tree_cpu_s(pid) if name == "postgres" else process_cpu_s(pid)) for name, pid in self._pids.items()
        }
        times = os.times()
        # this process (the driver) and the children it waited for (the backend-alone harnesses)
        out["bench"] = times.user + times.system + times.children_user + times.children_system
        return out

    def start(self) -> CpuMeter:
        self._start = self._now()
        self._wall = time.monotonic()
        return self

    def stop(self) -> CpuMeter:
        end = self._now()
        self.wall_s = time.monotonic() - self._wall
        self.seconds = {name: end[name] - self._start.get(name, 0.0) for name in end}
        return self

    def per_case_ms(self, cases: int) -> dict[str, float]:
        """CPU milliseconds per case for each component, the total, and the machine's share used."""
        out = {name: 1000 * s / cases for name, s in sorted(self.seconds.items(), key=lambda kv: -kv[1])}
        out["total"] = sum(out.values())
        return out

    def utilisation(self) -> float:
        """CPU seconds spent per wall second, over the machine's cores (1.0: every core busy)."""
        return sum(self.seconds.values()) / (self.wall_s * (os.cpu_count() or 1)) if self.wall_s else float("nan")


def stack_pids(stack: ServiceStack, infra: Infra) -> dict[str, int | None]:
    """The processes of a run: the services, the nats-server, the embedded PostgreSQL."""
    pids: dict[str, int | None] = {name: sp.process.pid for name, sp in stack.procs.items()}
    pids["nats-server"] = infra.nats.process.pid if infra.nats is not None else None
    pids["postgres"] = infra.postgres_pid()
    return pids


# ---------------------------------------------------------------- watching a batch


@dataclass
class BatchWatch:
    """Arrival times (monotonic) of one batch's events, per stage and case token, from core NATS
    subscriptions opened before anything is published; `decode` stages are also decoded."""

    nc: NatsClient
    batch_id: str
    decode: frozenset[str] = frozenset()
    times: dict[str, dict[str, float]] = field(default_factory=dict)
    events: dict[str, list[EventBase]] = field(default_factory=dict)
    _subs: list[Subscription] = field(default_factory=list)
    _changed: asyncio.Event = field(default_factory=asyncio.Event)

    async def start(self) -> BatchWatch:
        token = encode_token(self.batch_id)
        for subject in (f"case.*.{token}.*", f"batch.*.{token}"):
            self._subs.append(
                await self.nc.subscribe(subject, cb=self._on_msg, pending_msgs_limit=-1, pending_bytes_limit=-1)
            )
        return self

    async def stop(self) -> None:
        for sub in self._subs:
            with contextlib.suppress(Exception):
                await sub.unsubscribe()
        self._subs.clear()

    async def _on_msg(self, msg: Msg) -> None:
        now = time.monotonic()
        parts = msg.subject.split(".")
        stage = f"{parts[0]}.{parts[1]}"
        key = parts[3] if len(parts) > 3 else parts[2]
        self.times.setdefault(stage, {}).setdefault(key, now)
        if stage in self.decode:
            self.events.setdefault(stage, []).append(decode_event(msg.data))
        self._changed.set()

    def count(self, stage: str) -> int:
        """Distinct cases (or batch events) seen at `stage`."""
        return len(self.times.get(stage, {}))

    def last(self, stage: str) -> float:
        """Arrival of the last event of `stage`."""
        return max(self.times[stage].values())

    def first(self, stage: str) -> float:
        """Arrival of the first event of `stage`."""
        return min(self.times[stage].values())

    async def wait_for(self, stage: str, n: int, timeout_s: float) -> None:
        """Until `n` distinct events of `stage` arrived; `TimeoutError` naming the counts otherwise."""
        deadline = time.monotonic() + timeout_s
        while self.count(stage) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                counts = {k: len(v) for k, v in self.times.items()}
                raise TimeoutError(f"{stage}: {self.count(stage)} of {n} after {timeout_s:.0f}s; seen {counts}")
            self._changed.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._changed.wait(), min(left, 1.0))


class AckPendingProbe:
    """Polls a consumer's `num_ack_pending` while a run goes on; keeps the peak."""

    def __init__(self, js: JetStreamContext, consumer: ConsumerDef, period_s: float = 0.05) -> None:
        self._js = js
        self._consumer = consumer
        self._period = period_s
        self.peak = 0
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> AckPendingProbe:
        self._task = asyncio.create_task(self._run())
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            with contextlib.suppress(Exception):
                info = await self._js.consumer_info(self._consumer.stream, self._consumer.durable)
                self.peak = max(self.peak, int(info.num_ack_pending or 0))
            await asyncio.sleep(self._period)


async def drained(js: JetStreamContext, consumer: ConsumerDef) -> bool:
    """Whether `consumer` has nothing pending and nothing unacknowledged."""
    info = await js.consumer_info(consumer.stream, consumer.durable)
    return not info.num_pending and not info.num_ack_pending


# ---------------------------------------------------------------- workloads


def case_ids(n_cases: int) -> list[str]:
    """Case ids `c0000…` of a benchmark batch (zero-padded so they sort in order)."""
    width = max(4, len(str(n_cases - 1)))
    return [f"c{i:0{width}d}" for i in range(n_cases)]


def batch_request(
    batch_id: str,
    n_cases: int,
    harness: CommandHarness,
    judges: Sequence[JudgeSpec],
    *,
    expected: str = "4",
) -> BatchRequested:
    """A `batch.requested` of `n_cases` small cases (ids `c0000…`), as the gateway would publish it."""
    cases = tuple(
        CaseSpec(id=case_id, input="What is 2 + 2? Answer with a number only.", expected=expected)
        for case_id in case_ids(n_cases)
    )
    spec = BatchSpec(suite=SuiteSpec(id="bench", cases=cases), harness=harness, judges=tuple(judges))
    return BatchRequested(batch_id=batch_id, spec=spec, submitted_by="bench")


def sample_events(batch_id: str, case_id: str, plan: CasePlan, harness: CommandHarness) -> list[EventBase]:
    """One run's case.requested, case.executed, case.judged and case.exported, shaped like the
    pipeline's own (a short agent trace, grader and judge scores)."""
    run_id = batch_run_id(batch_id, case_id)
    case = CaseSpec(id=case_id, input="What is 2 + 2? Answer with a number only.", expected="4")
    now = utcnow()
    trace = (
        Message(t=0.0, role="user", text=case.input),
        LlmCall(t=0.01, model="bench-model", input_tokens=42, output_tokens=7, cost_usd=0.0012, duration_ms=8.0),
        ToolCall(t=0.02, id="t1", name="calculator", args={"expression": "2+2"}),
        ToolResult(t=0.03, id="t1", output="4"),
        Message(t=0.04, role="assistant", text="4"),
    )
    result = CaseResult(
        case_id=case_id,
        run_id=run_id,
        harness=f"{harness.id}@{harness.version}",
        answer="4",
        exit_code=0,
        trace=trace,
        scores=(Measured(grader_id="am", metric="answer_match", value=1.0, passed=True),),
        snapshot=PromptSnapshot(output="4"),
        timings=CaseTimings(
            queued_at=now, started_at=now, released_at=now, executed_at=now, sandbox_seconds=0.01, harness_seconds=0.01
        ),
    )
    judged = msgspec.structs.replace(
        result,
        scores=(
            *result.scores,
            Measured(grader_id="exact", metric="judge:exact", source="judge", value=1.0, passed=True),
        ),
    )
    return [
        CaseRequested(batch_id=batch_id, case_id=case_id, run_id=run_id, case=case, harness=harness, plan=plan),
        CaseExecuted(
            batch_id=batch_id, case_id=case_id, run_id=run_id, status="succeeded", result=result, plan=plan, case=case
        ),
        CaseJudged(
            batch_id=batch_id, case_id=case_id, run_id=run_id, status="judged", result=judged, plan=plan, case=case
        ),
        CaseExported(batch_id=batch_id, case_id=case_id, run_id=run_id, status="skipped"),
    ]


ZERO_HARNESS = CommandHarness(id="echo", command=("/bin/echo", "4"), timeout_s=60.0)
"""The zero-latency harness: a trivial command (still one process spawn per case)."""
RULE_JUDGE: tuple[JudgeSpec, ...] = (ExactJudge(id="exact"),)
"""The zero-latency judge: an exact-match rule."""


# ---------------------------------------------------------------- numbers and output


def percentile(values: Iterable[float], q: float) -> float:
    """The q-quantile (0..1) by nearest rank; NaN for no values."""
    ordered = sorted(values)
    if not ordered:
        return float("nan")
    return ordered[min(len(ordered) - 1, max(0, int(q * len(ordered) + 0.5) - 1))]


def mean(values: Iterable[float]) -> float:
    """Arithmetic mean; NaN for no values."""
    data = list(values)
    return statistics.fmean(data) if data else float("nan")


def rounded(out: Mapping[str, Any], digits: int = 3) -> dict[str, Any]:
    """`out` with floats rounded (recursively) for printing."""

    def fix(value: Any) -> Any:
        if isinstance(value, float):
            return round(value, digits)
        if isinstance(value, Mapping):
            return {k: fix(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [fix(v) for v in value]
        return value

    return {k: fix(v) for k, v in out.items()}


def report(out: Mapping[str, Any], rows: Sequence[tuple[str, ...]], notes: Sequence[str], as_json: bool) -> None:
    """One JSON line (`--json`), else an aligned table, the notes, then the JSON line."""
    line = msgspec.json.encode(rounded(out)).decode()
    if as_json:
        print(line)
        return
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))] if rows else []
    for r in rows:
        print(
            "  ".join(
                cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(r, widths, strict=True))
            )
        )
    for note in notes:
        print(note)
    print(line)


def fmt(value: float | None, unit: str = "", digits: int = 2) -> str:
    """A number for the table."""
    if value is None or math.isnan(value):
        return "-"
    return f"{value:.{digits}f}{unit}"


@contextlib.asynccontextmanager
async def running(stack: ServiceStack) -> AsyncIterator[ServiceStack]:
    """Stop every service of `stack` on the way out (also on errors)."""
    try:
        yield stack
    finally:
        await asyncio.to_thread(stack.stop)
