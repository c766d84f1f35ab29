"""A whole pipeline of a test's own, for the cross-service proofs (`tests/test_pipeline_*.py`): a
nats-server, a fresh PostgreSQL database and the five services as real processes
(`ServiceStack`), plus what a test needs to drive and inspect them — a gateway client, a bus
connection to read the CASES and DLQ streams, and a database pool to count stored events and
verify seals.

    async with open_pipeline(pg_admin_url, tmp, service_env={"dispatcher": {"DISPATCHER_SLOTS": "1"}}) as p:
        batch_id = await p.submit(spec)
        view = await p.finalized(batch_id)

The judge loads `evalbus.testing.judges` (`JUDGE_PLUGINS`). Harnesses are the deterministic
`tests/harnesses/pipeline_agent.py` (`agent_harness`, `task`); a harness that asks the gateway
about another run gets its URL in `PIPELINE_GATEWAY_URL` and the admin token through the secret
`pipeline-gateway-token` (`gateway_access`).

Every wait is on an observable condition with a deadline; a timeout names what was awaited and
shows the services' log tails.
"""

from __future__ import annotations

import asyncio
import json
import math
import os
import sys
import time
import typing
from collections import Counter
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import asyncpg
import msgspec
from nats.aio.client import Client as NatsClient

from evalbus.infra.nats import NatsServer, start_nats, start_nats_cluster
from evalbus.infra.postgres import create_database, drop_database
from evalbus.testing.stack import SERVICES, ServiceStack
from evalbus_api.client import GatewayClient
from evalbus_api.views import BatchView, RunView
from evalbus_contracts import (
    BatchSpec,
    BatchSummary,
    CommandHarness,
    DeadLetter,
    Event,
    MetricSummary,
    decode_event,
    encode_token,
)
from evalbus_gateway.database import create_pool
from evalbus_gateway.store import BatchVerifyResult, verify_batch
from evalbus_runtime import connect
from evalbus_runtime.secrets import env_name

REPO_ROOT = Path(__file__).resolve().parents[3]
"""The repository root (this file is `<root>/src/evalbus/testing/pipeline.py`)."""
AGENT = REPO_ROOT / "tests" / "harnesses" / "pipeline_agent.py"
"""The deterministic test agent."""
JUDGE_PLUGINS = "evalbus.testing.judges:register"
"""The judge plugins every pipeline loads."""
GATEWAY_TOKEN_SECRET = "pipeline-gateway-token"  # noqa: S105 - a secret's name, not its value
"""Secret name under which harnesses get the gateway's admin token."""
POLL_S = 0.05
"""How often a wait looks at its condition again."""

if TYPE_CHECKING:
    Pool: TypeAlias = asyncpg.Pool[asyncpg.Record]


# ---------------------------------------------------------------- specs


def task(**fields: Any) -> str:
    """A case input for the test agent (see `tests/harnesses/pipeline_agent.py`)."""
    return json.dumps(fields, sort_keys=True)


def agent_harness(*, harness_id: str = "pipeline-agent", timeout_s: float = 60.0, **kw: Any) -> CommandHarness:
    """The test agent as a command harness (run by this interpreter)."""
    return CommandHarness(id=harness_id, command=(sys.executable, str(AGENT)), timeout_s=timeout_s, **kw)


def gateway_access(gateway_url: str) -> dict[str, Any]:
    """Harness fields giving the agent the gateway's URL and (by secret name) a token."""
    return {
        "env": {"PIPELINE_GATEWAY_URL": gateway_url},
        "secret_env": {"PIPELINE_GATEWAY_TOKEN": GATEWAY_TOKEN_SECRET},
    }


def without_metrics(summary: BatchSummary, prefixes: tuple[str, ...]) -> BatchSummary:
    """`summary` without the metrics whose name starts with one of `prefixes` (timing metrics)."""
    kept: tuple[MetricSummary, ...] = tuple(m for m in summary.metrics if not m.metric.startswith(prefixes))
    return msgspec.structs.replace(summary, metrics=kept)


def differences(a: Any, b: Any, *, rel_tol: float = 0.0, path: str = "$") -> list[str]:
    """Where two contract values (or plain JSON-like values) differ, as `path: a != b` lines.

    Floats are compared with `rel_tol` (0: exactly); everything else exactly.
    """
    a, b = msgspec.to_builtins(a), msgspec.to_builtins(b)
    if isinstance(a, dict) and isinstance(b, dict):
        out: list[str] = []
        for key in sorted(set(a) | set(b), key=str):
            if key not in a or key not in b:
                out.append(f"{path}.{key}: {a.get(key)!r} != {b.get(key)!r}")
            else:
                out += differences(a[key], b[key], rel_tol=rel_tol, path=f"{path}.{key}")
        return out
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        if len(a) != len(b):
            return [f"{path}: {len(a)} items != {len(b)} items"]
        return [
            d
            for i, (x, y) in enumerate(zip(a, b, strict=True))
            for d in differences(x, y, rel_tol=rel_tol, path=f"{path}[{i}]")
        ]
    if _number(a) and _number(b) and (isinstance(a, float) or isinstance(b, float)):
        return [] if math.isclose(a, b, rel_tol=rel_tol) else [f"{path}: {a!r} != {b!r}"]
    return [] if a == b else [f"{path}: {a!r} != {b!r}"]


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool)


# ---------------------------------------------------------------- waiting


async def eventually(
    check: Callable[[], Awaitable[bool]] | Callable[[], bool],
    *,
    timeout_s: float,
    what: str,
    diagnostics: Callable[[], str] | None = None,
) -> None:
    """Wait until `check()` (sync or async) is true; AssertionError naming `what` at the deadline."""
    deadline = time.monotonic() + timeout_s
    while True:
        result = check()
        if not isinstance(result, bool):
            result = await result
        if result:
            return
        if time.monotonic() > deadline:
            extra = f"\n{diagnostics()}" if diagnostics is not None else ""
            raise AssertionError(f"timed out after {timeout_s:g}s waiting for {what}{extra}")
        await asyncio.sleep(POLL_S)


async def wait_path(path: Path, *, timeout_s: float = 30.0) -> None:
    """Wait until `path` exists."""
    await eventually(path.exists, timeout_s=timeout_s, what=f"{path} to exist")


def pid_alive(pid: int) -> bool:
    """Whether process `pid` exists (an agent or worker a killed service left behind); a zombie
    counts as existing."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


# ---------------------------------------------------------------- what the stream holds


@dataclass(frozen=True, slots=True)
class StoredMessage:
    """One message of a stream."""

    seq: int
    """Stream sequence."""
    subject: str
    """Subject."""
    data: bytes
    """Payload."""

    def event(self) -> Event:
        """The payload as a contract event."""
        return decode_event(self.data)


async def read_stream(nc: NatsClient, stream: str, subjects: tuple[str, ...]) -> list[StoredMessage]:
    """Every message of `stream` on `subjects` stored now, in stream order (ordered consumers,
    bounded by the stream's own per-subject counts)."""
    js = nc.jetstream()
    out: dict[int, StoredMessage] = {}
    for subject in subjects:
        info = await js.stream_info(stream, subjects_filter=subject)
        total = sum((info.state.subjects or {}).values())
        if total == 0:
            continue
        sub = await js.subscribe(subject, stream=stream, ordered_consumer=True)
        try:
            for _ in range(total):
                msg = await sub.next_msg(timeout=10)
                seq = msg.metadata.sequence.stream
                out[seq] = StoredMessage(seq=seq, subject=msg.subject, data=bytes(msg.data))
        finally:
            await sub.unsubscribe()
    return [out[seq] for seq in sorted(out)]


def batch_subjects(batch_id: str) -> tuple[str, ...]:
    """The CASES subjects of one batch."""
    token = encode_token(batch_id)
    return (f"batch.*.{token}", f"case.*.{token}.>")


Counts: TypeAlias = Counter[tuple[str | None, str]]
"""`(run id, event type)` → copies (run id None for batch events)."""

STAGE_TYPES = ("case.requested", "case.executed", "case.judged", "case.exported")
"""The event types every run of a batch has exactly once."""


def once_each(
    runs: typing.Iterable[str], *, stages: tuple[str, ...] = STAGE_TYPES, batch_events: bool = True
) -> Counts:
    """What a batch's counts must be: every run once per stage (and `batch.requested` and
    `batch.finalized` once when `batch_events`)."""
    want: Counts = Counter({(r, s): 1 for r in runs for s in stages})
    if batch_events:
        want[(None, "batch.requested")] = 1
        want[(None, "batch.finalized")] = 1
    return want


def count_problems(where: str, got: Counts, want: Counts, *, show: int = 8) -> str | None:
    """None when `got` has exactly the keys of `want` with their counts (other event types and runs
    outside `want` ignored); else one short paragraph: copies missing and extra per event type, and
    the first few offending keys — readable where a diff of thousands of lines is not."""
    kinds = {k for _, k in want}
    runs = {r for r, _ in want}
    seen: Counts = Counter({(r if r in runs else None, k): n for (r, k), n in got.items() if k in kinds})
    missing, extra = want - seen, seen - want
    if not missing and not extra:
        return None

    def per_kind(c: Counts) -> str:
        totals: Counter[str] = Counter(dict.fromkeys(sorted(kinds), 0))
        for (_, k), n in c.items():
            totals[k] += n
        return ", ".join(f"{k} {n}" for k, n in totals.items() if n)

    def first(c: Counts) -> str:
        keys = sorted(c, key=lambda key: (str(key[0]), key[1]))
        more = f" (+{len(keys) - show} more)" if len(keys) > show else ""
        return ", ".join(f"{r}:{k}×{c[(r, k)]}" for r, k in keys[:show]) + more

    parts = [f"{where}: {sum(seen.values())} copies of {len(want)} expected"]
    if missing:
        parts.append(f"missing [{per_kind(missing)}]: {first(missing)}")
    if extra:
        parts.append(f"extra [{per_kind(extra)}]: {first(extra)}")
    return "; ".join(parts)


# ---------------------------------------------------------------- the pipeline


@dataclass
class Pipeline:
    """A running pipeline of one test (or one test module)."""

    nats: NatsServer
    database_url: str
    stack: ServiceStack
    nc: NatsClient
    pool: Pool
    gw: GatewayClient
    workdir: Path
    cluster: list[NatsServer] = field(default_factory=list)
    """Every node when the pipeline runs on a NATS cluster (`nats` is the first)."""

    # ------------------------------------------------------------ services

    def diagnostics(self, lines: int = 30) -> str:
        """The log tail of every service, for a failure message."""
        parts = []
        for name in self.stack.procs:
            try:
                parts.append(f"--- {name} ---\n{self.stack.log_tail(name, lines)}")
            except OSError as e:
                parts.append(f"--- {name} --- (no log: {e})")
        return "\n".join(parts)

    async def kill(self, name: str) -> None:
        """SIGKILL service `name` and wait for it to exit."""
        await asyncio.to_thread(self.stack.kill, name)

    async def wait_exit(self, name: str, *, timeout_s: float = 60.0) -> int:
        """Wait until service `name` exits by itself (a fault point killed it); its return code."""
        process = self.stack.procs[name].process
        await eventually(
            lambda: process.poll() is not None,
            timeout_s=timeout_s,
            what=f"{name} to exit",
            diagnostics=self.diagnostics,
        )
        return int(process.returncode)

    async def start(self, name: str, **env: str) -> None:
        """Start service `name` (with extra environment) and wait until it is ready."""
        start = typing.cast("Callable[..., object]", self.stack.start)  # `**env` is not `wait`
        await asyncio.to_thread(lambda: start(name, **env))

    async def restart(self, name: str, **env: str) -> None:
        """SIGKILL service `name` if it runs, start it again (with extra environment), wait for ready."""
        await self.kill(name)
        await self.start(name, **env)

    async def ensure_running(self) -> None:
        """Start again (with the stack's own environment) any service that is not running."""
        for name in SERVICES:
            proc = self.stack.procs.get(name)
            if proc is None or proc.process.poll() is not None:
                await self.start(name)

    # ------------------------------------------------------------ batches

    async def submit(self, spec: BatchSpec) -> str:
        """Submit `spec` through the gateway; its batch id."""
        return (await self.gw.submit(spec)).batch_id

    async def finalized(self, batch_id: str, *, timeout_s: float = 90.0) -> BatchView:
        """The batch once its `batch.finalized` is RECORDED (the event store and the read model hold
        it, not only the stream, which `GET /v1/batches/{id}` also consults), as the API shows it."""

        async def recorded() -> bool:
            found = await self.pool.fetchval(
                "SELECT finalized_at IS NOT NULL FROM batches WHERE batch_id = $1", batch_id
            )
            return bool(found)

        await eventually(
            recorded, timeout_s=timeout_s, what=f"batch {batch_id} to be finalized", diagnostics=self.diagnostics
        )
        view = await self.gw.get(batch_id)
        assert view.finalized_at is not None
        return view

    async def quiescent(self, *, timeout_s: float = 60.0) -> None:
        """Wait until every consumer of CASES has delivered and had acknowledged everything: no
        redelivery is still to come (a message a killed replica held comes back only after its
        `ack_wait`, possibly after its batch finalized) and the recorder has stored it all."""

        async def idle() -> bool:
            infos = await self.nc.jetstream().consumers_info("CASES")
            return all(info.num_ack_pending == 0 and info.num_pending == 0 for info in infos)

        await eventually(
            idle, timeout_s=timeout_s, what="every CASES consumer to be idle", diagnostics=self.diagnostics
        )

    async def runs(self, batch_id: str) -> dict[str, RunView]:
        """The batch's runs by case id (trials would collide: for batches without trials)."""
        return {run.case_id: run for run in await self.gw.all_cases(batch_id)}

    async def stream(self, batch_id: str) -> list[StoredMessage]:
        """Every CASES message of the batch, in stream order."""
        return await read_stream(self.nc, "CASES", batch_subjects(batch_id))

    async def stream_events(self, batch_id: str) -> list[tuple[int, Event]]:
        """Every CASES event of the batch as `(stream seq, event)`, in stream order."""
        return [(m.seq, m.event()) for m in await self.stream(batch_id)]

    async def stream_counts(self, batch_id: str) -> Counter[tuple[str | None, str]]:
        """`(run id, event type)` → messages stored in CASES for the batch (run id None for batch events)."""
        return Counter((ev.run_id, ev.type) for _, ev in await self.stream_events(batch_id))

    async def store_counts(self, batch_id: str) -> Counter[tuple[str | None, str]]:
        """`(run id, event type)` → rows in the event store's `events` table for the batch."""
        rows = await self.pool.fetch(
            "SELECT run_id, type, count(*) AS n FROM events WHERE batch_id = $1 GROUP BY run_id, type", batch_id
        )
        return Counter({(r["run_id"], str(r["type"])): int(r["n"]) for r in rows})

    async def once_per_stage_problems(self, batch_id: str, want: Counts) -> list[str]:
        """How the batch's CASES messages and event-store rows differ from `want` (see
        `once_each`); empty when both hold exactly that."""
        problems = [
            count_problems("event store", await self.store_counts(batch_id), want),
            count_problems("CASES stream", await self.stream_counts(batch_id), want),
        ]
        return [p for p in problems if p]

    async def rejections(self, batch_id: str) -> list[tuple[str | None, str, str]]:
        """`(run id, type, reason)` of every message of the batch the recorder refused."""
        rows = await self.pool.fetch(
            "SELECT run_id, type, reason FROM rejections WHERE batch_id = $1 ORDER BY stream_seq", batch_id
        )
        return [(r["run_id"], str(r["type"]), str(r["reason"])) for r in rows]

    async def verify(self, batch_id: str) -> BatchVerifyResult:
        """Recompute every seal of the batch (what `evalbus verify` does)."""
        return await verify_batch(self.pool, batch_id)

    async def dead_letters(self, service: str) -> list[DeadLetter]:
        """Every dead letter of `service` stored so far."""
        out: list[DeadLetter] = []
        for message in await read_stream(self.nc, "DLQ", (f"dlq.{encode_token(service)}",)):
            event = message.event()
            assert isinstance(event, DeadLetter)
            out.append(event)
        return out


@asynccontextmanager
async def open_pipeline(
    pg_admin_url: str,
    workdir: Path,
    *,
    env: Mapping[str, str] | None = None,
    service_env: Mapping[str, Mapping[str, str]] | None = None,
    cluster: int = 0,
) -> AsyncIterator[Pipeline]:
    """Start a nats-server, a fresh database and the five services (all ready); stop them on exit.

    `cluster`: run on a JetStream cluster of that many nodes instead (loopback, every node routing
    to every other; the services get every node's URL and `STREAM_REPLICAS` = the node count).

    `env` goes to every service, `service_env` to one service each (after the defaults: judge
    plugins, text logs; the dispatcher gets the gateway token secret for harnesses; the gateway
    keeps finalized batches on CASES for an hour, so stream counts see every message).
    """
    await asyncio.to_thread(workdir.mkdir, parents=True, exist_ok=True)
    nodes = start_nats_cluster(workdir / "nats", cluster) if cluster else [start_nats(workdir / "nats")]
    nats = nodes[0]
    nats_url = ",".join(node.url for node in nodes)
    database_url = ""
    stack: ServiceStack | None = None
    nc: NatsClient | None = None
    pool: Pool | None = None
    gw: GatewayClient | None = None
    try:
        database_url = await create_database(pg_admin_url, "evalbus_pipeline")
        replicas = {"STREAM_REPLICAS": str(cluster)} if cluster else {}
        stack = ServiceStack(
            nats_url=nats_url,
            database_url=database_url,
            workdir=workdir,
            env={"JUDGE_PLUGINS": JUDGE_PLUGINS, "LOG_FORMAT": "text", **replicas, **(env or {})},
        )
        per_service = {name: dict(values) for name, values in (service_env or {}).items()}
        dispatcher = per_service.setdefault("dispatcher", {})
        dispatcher.setdefault(env_name(GATEWAY_TOKEN_SECRET), stack.admin_token)
        # A finalized batch stays on CASES for an hour, not a minute: the tests count its messages on
        # the stream (a duplicate shows there first) after waits that can outlast the default.
        per_service.setdefault("gateway", {}).setdefault("GATEWAY_STREAM_KEEP_FINALIZED_S", "3600")
        stack.service_env = per_service
        await asyncio.to_thread(stack.start_all)
        nc = await connect(nats_url, "pipeline-test")
        pool = await create_pool(database_url, min_size=1, max_size=4)
        gw = GatewayClient(stack.gateway_url, stack.admin_token)
        yield Pipeline(
            nats=nats,
            database_url=database_url,
            stack=stack,
            nc=nc,
            pool=pool,
            gw=gw,
            workdir=workdir,
            cluster=nodes if cluster else [],
        )
    finally:
        if gw is not None:
            await gw.close()
        if pool is not None:
            await pool.close()
        if nc is not None:
            await nc.close()
        if stack is not None:
            await asyncio.to_thread(stack.stop)
        if database_url:
            await drop_database(pg_admin_url, database_url)
        for node in nodes:
            node.stop()
