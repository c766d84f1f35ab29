"""The Nomad backend: a batch job per case attempt, through python-nomad.

The job's one task runs the in-job runner (docs/backends.md) with the job spec in `EVALBUS_JOB`;
`harness.compute` gives its image (`docker` driver), CPU (cores × `cpu_mhz_per_core` MHz), memory,
GPUs (a `nvidia/gpu` device), `${meta.<key>}` constraints and, for `network: none`, a group
network in mode `none` (and the `docker` driver's `network_mode = "none"`); each `secret_env`
entry becomes a template reading a Nomad Variable by name (`<variables_prefix>/<name>`, item
`value`) into the task's environment — no value in the job; so does the runner's NATS password when
it publishes the live view itself (`runner_nats`). The run id is in the job's `Meta`.

While the allocation comes up the sandbox polls the job's evaluations and allocations and marks the
run's trace: `submitted`; `waiting` with `blocked: <the blocked evaluation's exhausted dimensions and
filtered constraints>`; `scheduled` (allocation, node); and every task event with Nomad's own
timestamp. A task that cannot start (`Driver Failure`, a template whose variable is missing) fails
the run at once, with that evidence in the marks. The stdout log is read by offset through the
client fs/logs API while the task runs; out of memory is the `Terminated` event's `oom_killed`.
Release deregisters the job with `purge=true`. Exec and the terminal use the alloc exec WebSocket.
A declared file is read from the ended allocation's directory (kept until it is garbage-collected;
the release comes after) through the client filesystem API: `fs/stat` (a file, its size; links
followed), `fs/ls` of its folder (the entry itself is no link), `fs/cat` for one block, `fs/readat`
by offset and limit for a larger file.
"""

from __future__ import annotations

import asyncio
import base64
import json
import logging
import math
import re
import secrets as token
import shlex
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any
from urllib.parse import quote, urlencode

import aiohttp
import msgspec
import nomad  # type: ignore[import-untyped]
import nomad.api.exceptions  # type: ignore[import-untyped]
import requests

from evalbus_contracts import CaseRequested, PromptSnapshot, Snapshot
from evalbus_contracts.runner import JOB_ENV, RunnerLive
from evalbus_contracts.specs import ComputeSpec
from evalbus_dispatcher.backends.base import (
    Capacity,
    FileUnreadable,
    HarnessRun,
    LiveExec,
    Mark,
    OnOutput,
    OnSpawn,
    OrchestratorEvent,
    UnitPlacement,
    UnitUsage,
)
from evalbus_dispatcher.backends.job_log import JobLog, LineSplitter, UnitEnd
from evalbus_dispatcher.backends.job_spec import (
    LiveHandoff,
    LiveHandoffs,
    RunnerNats,
    label_value,
    longest_life_s,
    run_of,
    runner_job,
    runner_live,
)
from evalbus_dispatcher.errors import BackendError
from evalbus_grading import ExecResult

log = logging.getLogger(__name__)

TASK = "case"
"""The job's one task (and task group)."""
START_FAILURES = ("Driver Failure", "Failed Validation", "Setup Failure", "Failed Artifact Download")
"""Task event types after which the task will not start."""
_VAR_NAME = re.compile(r"^[A-Za-z0-9_.~-]+(/[A-Za-z0-9_.~-]+)*$")
_ENV_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")
FS_BLOCK = 1024 * 1024
"""Bytes of a declared file read per `fs/readat` request (one `fs/cat` when it is no larger)."""


@dataclass(frozen=True, slots=True)
class NomadTemplate:
    """What every case job of a dispatcher shares."""

    image: str
    """Image when the harness names none (`docker` driver)."""
    namespace: str = "default"
    """Nomad namespace of the jobs."""
    datacenters: tuple[str, ...] = ("*",)
    """Where the jobs may run."""
    driver: str = "docker"
    """Task driver: `docker` (the image), or `raw_exec`/`exec` (the runner on the node itself)."""
    runner_command: tuple[str, ...] = ("python", "-m", "evalbus.runner")
    """The runner's argv in the task."""
    variables_prefix: str = "evalbus/secrets"
    """Nomad Variables path a secret name is read under (`<prefix>/<name>`, item `value`)."""
    cpu_mhz_per_core: int = 1000
    """MHz asked per CPU core of `harness.compute.cpu`."""
    start_timeout_s: float = 600.0
    """How long an allocation may stay blocked or starting before the run fails."""
    runner_nats: RunnerNats | None = None
    """Where the runners publish the live view themselves (None: the dispatcher relays the job log)."""


def variable_template(var: str, secret: str, prefix: str) -> dict[str, Any]:
    """A template putting the Nomad Variable `<prefix>/<secret>` (item `value`) into `var`."""
    path = f"{prefix.strip('/')}/{secret}"
    if not _VAR_NAME.match(secret) or ".." in secret.split("/") or not _ENV_NAME.match(var):
        raise BackendError(
            f"secret {secret!r} (for {var}) is not a Nomad Variable name",
            code="invalid_secret_name",
            failure_class="config",
            retryable=False,
        )
    return {
        "DestPath": f"secrets/evalbus-{var.lower()}.env",
        "EmbeddedTmpl": f'{{{{ with nomadVar "{path}" }}}}{var}={{{{ .value }}}}{{{{ end }}}}',
        "Envvars": True,
        "ChangeMode": "noop",
    }


def nomad_job(
    job: CaseRequested, run_id: str, job_id: str, template: NomadTemplate, live: RunnerLive | None = None
) -> dict[str, Any]:
    """The JSON job (`{"Job": …}` as `POST /v1/jobs` takes it) for one execution of a case attempt
    (`live`: its runner publishes the live view itself)."""
    harness, compute = job.harness, job.harness.resources()
    spec = runner_job(job, run_id, live=live)
    templates = [
        variable_template(var, secret, template.variables_prefix) for var, secret in harness.secret_env.items()
    ]
    argv = [*template.runner_command, "--workdir", "${NOMAD_TASK_DIR}/work"]
    if template.driver == "docker":
        config: dict[str, Any] = {"image": compute.image or template.image, "command": argv[0], "args": argv[1:]}
        if compute.network == "none":
            config["network_mode"] = "none"
    else:
        config = {"command": argv[0], "args": argv[1:]}
    resources: dict[str, Any] = {
        "CPU": max(1, int(compute.cpu * template.cpu_mhz_per_core)),
        "MemoryMB": compute.memory_mb,
    }
    if compute.gpus:
        resources["Devices"] = [{"Name": "nvidia/gpu", "Count": compute.gpus}]
    checks_s = sum(c.timeout_s for c in spec.checks)
    meta = {"evalbus_run": run_id, "evalbus_attempt": str(job.attempt)}
    if job.batch_id is not None:
        meta["evalbus_batch"] = job.batch_id
    task = {
        "Name": TASK,
        "Driver": template.driver,
        "Config": config,
        "Env": {JOB_ENV: msgspec.json.encode(spec).decode("utf-8")},
        "Templates": templates,
        "Resources": resources,
        "KillTimeout": 5_000_000_000,
        "Meta": meta,
    }
    group: dict[str, Any] = {
        "Name": TASK,
        "Count": 1,
        "RestartPolicy": {"Attempts": 0, "Mode": "fail"},
        "ReschedulePolicy": {"Attempts": 0, "Unlimited": False},
        "Meta": {"evalbus_deadline_s": str(math.ceil(spec.timeout_s + checks_s + 120))},
        "Tasks": [task],
    }
    if compute.network == "none":
        # An isolated network namespace with no interface but loopback (the `network` block's `mode`).
        group["Networks"] = [{"Mode": "none"}]
    return {
        "Job": {
            "ID": job_id,
            "Name": job_id,
            "Type": "batch",
            "Namespace": template.namespace,
            "Datacenters": list(template.datacenters),
            "Meta": meta,
            "Constraints": [
                {"LTarget": f"${{meta.{key}}}", "RTarget": value, "Operand": "="}
                for key, value in compute.node_selector.items()
            ],
            "TaskGroups": [group],
        }
    }


def job_id_for(run_id: str, attempt: int) -> str:
    """A fresh job id for one execution of an attempt."""
    return f"evb-{label_value(run_id)}-a{attempt}-{token.token_hex(3)}"


# ---------------------------------------------------------------- reading allocations (pure)


def _event_time(ns: Any) -> datetime | None:
    return datetime.fromtimestamp(ns / 1e9, tz=UTC) if isinstance(ns, int) and ns > 0 else None


def task_events(alloc: dict[str, Any] | None) -> tuple[OrchestratorEvent, ...]:
    """The task's events, oldest first."""
    if alloc is None:
        return ()
    state = (alloc.get("TaskStates") or {}).get(TASK) or {}
    return tuple(
        OrchestratorEvent(
            at=_event_time(e.get("Time")),
            kind="Task",
            reason=e.get("Type") or "",
            message=e.get("DisplayMessage") or e.get("Message") or "",
        )
        for e in state.get("Events") or ()
    )


def blocked_reason(evaluations: Sequence[dict[str, Any]]) -> str | None:
    """The blocked evaluation's verdict in words (None when nothing is blocked)."""
    for ev in reversed(evaluations):
        if ev.get("Status") != "blocked":
            continue
        words = []
        for metric in (ev.get("FailedTGAllocs") or {}).values():
            evaluated = metric.get("NodesEvaluated", 0)
            for dim, n in sorted((metric.get("DimensionExhausted") or {}).items()):
                words.append(f"{dim} exhausted on {n} node{'s' if n != 1 else ''}")
            for constraint, n in sorted((metric.get("ConstraintFiltered") or {}).items()):
                words.append(f"constraint {constraint} filtered {n} node{'s' if n != 1 else ''}")
            head = f"{evaluated} node{'s' if evaluated != 1 else ''} evaluated"
            return f"{head}: {', '.join(words)}" if words else head
        return ev.get("StatusDescription") or "the evaluation is blocked"
    return None


def read_alloc(alloc: dict[str, Any] | None, evaluations: Sequence[dict[str, Any]]) -> UnitPlacement:
    """An allocation (the job's newest, or None) and the job's evaluations as a placement."""
    events = task_events(alloc)
    if alloc is None:
        blocked = blocked_reason(evaluations)
        if blocked is not None:
            return UnitPlacement(phase="blocked", reason=blocked)
        return UnitPlacement(phase="queued", reason="the job is evaluated")
    state = (alloc.get("TaskStates") or {}).get(TASK) or {}
    base = UnitPlacement(
        phase="starting",
        unit=alloc.get("ID"),
        node=alloc.get("NodeName") or alloc.get("NodeID"),
        restarts=int(state.get("Restarts") or 0),
        events=events,
    )
    failed_start = next((e for e in events if e.reason in START_FAILURES), None)
    missing = next((e for e in events if e.reason == "Template" and e.message.startswith("Missing:")), None)
    if state.get("State") == "dead" or alloc.get("ClientStatus") in ("complete", "failed", "lost"):
        terminated = next((e for e in reversed(state.get("Events") or ()) if e.get("Type") == "Terminated"), None)
        if terminated is None:
            why = failed_start.message if failed_start is not None else (alloc.get("ClientDescription") or "dead")
            return _with(base, phase="dead", reason=f"{failed_start.reason}: {why}" if failed_start else why)
        details = terminated.get("Details") or {}
        code = int(details.get("exit_code") or terminated.get("ExitCode") or 0)
        oom = str(details.get("oom_killed", "")).lower() == "true"
        return _with(base, phase="dead", reason=("OOMKilled" if oom else "Terminated") + f" (exit {code})",
                     oom=oom, exit_code=code)  # fmt: skip
    if failed_start is not None:
        return _with(base, phase="blocked", reason=f"{failed_start.reason}: {failed_start.message}")
    if missing is not None:
        return _with(base, phase="blocked", reason=f"Template: {missing.message}")
    if state.get("State") == "running":
        return _with(base, phase="running")
    return base


def _with(placement: UnitPlacement, **changes: Any) -> UnitPlacement:
    fields = {name: getattr(placement, name) for name in UnitPlacement.__slots__}
    fields.update(changes)
    return UnitPlacement(**fields)


def start_failure(placement: UnitPlacement) -> str | None:
    """Why the task will never start (None: it may still)."""
    reason = placement.reason or ""
    if placement.phase == "dead" and placement.exit_code is None:
        return reason
    if placement.phase == "blocked" and (reason.startswith(START_FAILURES) or reason.startswith("Template: Missing")):
        return reason
    return None


# ---------------------------------------------------------------- the backend


class NomadBackend:
    """Case sandboxes as Nomad batch jobs, through one `nomad.Nomad` client."""

    def __init__(self, client: Any, template: NomadTemplate, *, slots: int = 4, poll_s: float = 1.0,
                 address: str, token_value: str | None = None, live: LiveHandoffs | None = None) -> None:  # fmt: skip
        self._client = client
        self._live = live
        self._template = template
        self._slots = slots
        self._poll_s = poll_s
        self._used = 0
        self._address = address.rstrip("/")
        self._token = token_value
        self._pool = ThreadPoolExecutor(max_workers=slots + 4, thread_name_prefix="evalbus-nomad")
        self._session: aiohttp.ClientSession | None = None

    @property
    def template(self) -> NomadTemplate:
        """What every job shares."""
        return self._template

    @property
    def client(self) -> Any:
        """The python-nomad client."""
        return self._client

    @property
    def poll_s(self) -> float:
        """Seconds between two reads of a job's allocation."""
        return self._poll_s

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A client call in the backend's thread pool."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def session(self) -> aiohttp.ClientSession:
        """The HTTP session exec connections use."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    def exec_url(self, alloc_id: str, command: Sequence[str], *, tty: bool) -> str:
        """The alloc exec WebSocket endpoint for `command`."""
        base = self._address.replace("https://", "wss://", 1).replace("http://", "ws://", 1)
        query = urlencode({"task": TASK, "tty": "true" if tty else "false", "command": json.dumps(list(command))})
        return f"{base}/v1/client/allocation/{quote(alloc_id)}/exec?{query}"

    def headers(self) -> dict[str, str]:
        """The ACL token, when there is one."""
        return {"X-Nomad-Token": self._token} if self._token else {}

    async def close(self) -> None:
        """Close the exec session and the thread pool."""
        if self._session is not None:
            await self._session.close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    def capacity(self) -> Capacity:
        """Slots configured and held by unreleased sandboxes."""
        return Capacity(total=self._slots, used=self._used)

    async def node_resources(self) -> list[tuple[str, int, int]]:
        """(name, CPU MHz, memory MiB) each node offers (its resources less what is reserved)."""
        return [(name, cpu, mem) for _, name, cpu, mem in await self._nodes()]

    async def _nodes(self, *, schedulable: bool = False) -> list[tuple[str, str, int, int]]:
        nodes = await self.call(self._client.nodes.get_nodes, resources=True)
        out = []
        for node in nodes:
            if schedulable and not _schedulable(node):
                continue
            res, reserved = node.get("NodeResources") or {}, node.get("ReservedResources") or {}
            cpu = int((res.get("Cpu") or {}).get("CpuShares") or 0) - int(
                (reserved.get("Cpu") or {}).get("CpuShares") or 0
            )
            mem = int((res.get("Memory") or {}).get("MemoryMB") or 0) - int(
                (reserved.get("Memory") or {}).get("MemoryMB") or 0
            )
            out.append((node.get("ID") or "", node.get("Name") or node.get("ID") or "?", cpu, mem))
        return out

    async def room(self, compute: ComputeSpec | None = None) -> int:
        """How many more cases of this size (default: the default compute) fit in the cluster now:
        each eligible node's resources less what is reserved and what its pending and running
        allocations were given (`GET /v1/allocations?resources=true`), ignoring node selectors."""
        size = compute or ComputeSpec()
        cpu = max(1, int(size.cpu * self._template.cpu_mhz_per_core))
        nodes = await self._nodes(schedulable=True)
        allocs = await self.call(self._client.allocations.get_allocations, resources=True)
        return nomad_room(nodes, allocs, cpu_mhz=cpu, memory_mb=size.memory_mb)

    async def provision(self, job: CaseRequested) -> NomadSandbox:
        """Register the case's batch job; `BackendError` (config, not retryable) when no node
        could ever fit it."""
        run_id = run_of(job)
        job_id = job_id_for(run_id, job.attempt)
        handoff = self._live.get(run_id) if self._live is not None else None
        life = longest_life_s(job, start_timeout_s=self._template.start_timeout_s)
        live = runner_live(self._template.runner_nats, handoff, job, life_s=life)
        body = nomad_job(job, run_id, job_id, self._template, live)  # refuses bad secret names first
        await self._refuse_unfit(job.harness.resources())
        try:
            await self.call(self._client.jobs.register_job, body)
        except nomad.api.exceptions.BaseNomadException as e:
            raise _nomad_error("cannot register the job", e) from e
        except requests.RequestException as e:
            raise BackendError(f"cannot reach Nomad: {e}", code="orchestrator_unreachable") from e
        self._used += 1
        return NomadSandbox(
            self, job, job_id, free_slot=self._slot_freed, handoff=handoff if live is not None else None
        )

    def _slot_freed(self) -> None:
        self._used -= 1

    async def _refuse_unfit(self, compute: ComputeSpec) -> None:
        cpu = max(1, int(compute.cpu * self._template.cpu_mhz_per_core))
        try:
            nodes = await self._nodes()
            big = [(i, n, c, m) for i, n, c, m in nodes if c >= cpu and m >= compute.memory_mb]
            for node_id, *_ in big:
                if not compute.node_selector:
                    return
                meta = (await self.call(self._client.node.get_node, node_id)).get("Meta") or {}
                if all(meta.get(k) == v for k, v in compute.node_selector.items()):
                    return
        except (nomad.api.exceptions.BaseNomadException, requests.RequestException) as e:
            log.warning("cannot read Nomad's nodes; the fit check is skipped: %s", e)
            return
        have = ", ".join(f"{n}: {c} MHz, {m} MiB" for _, n, c, m in nodes) or "no nodes"
        where = f" with meta {compute.node_selector}" if compute.node_selector else ""
        raise BackendError(
            f"no node{where} can ever fit cpu={cpu} MHz, memory={compute.memory_mb} MiB ({have})",
            code="unschedulable",
            failure_class="config",
            retryable=False,
        )

    async def deregister(self, job_id: str) -> None:
        """Stop and purge a job; one already gone is fine."""
        try:
            await self.call(self._client.job.deregister_job, job_id, purge=True)
        except nomad.api.exceptions.URLNotFoundNomadException:
            return
        except nomad.api.exceptions.BaseNomadException as e:
            raise _nomad_error(f"cannot deregister job {job_id}", e) from e


def _schedulable(node: dict[str, Any]) -> bool:
    """Whether Nomad may place new work on the node: ready, eligible, not draining."""
    return (
        node.get("Status") == "ready" and node.get("SchedulingEligibility", "eligible") == "eligible"
        and not node.get("Drain")
    )  # fmt: skip


_HOLDING = frozenset({"pending", "running"})
"""Client statuses of an allocation that holds its node's resources."""


def nomad_room(
    nodes: Sequence[tuple[str, str, int, int]], allocs: Sequence[dict[str, Any]], *, cpu_mhz: int, memory_mb: int
) -> int:
    """How many more tasks of `cpu_mhz` and `memory_mb` fit on `nodes` ((id, name, CPU MHz, memory
    MiB) offered) given `allocs` (allocation stubs with `AllocatedResources`) (pure)."""
    used: dict[str, list[int]] = {}
    for alloc in allocs:
        if alloc.get("ClientStatus") not in _HOLDING:
            continue
        resources = alloc.get("AllocatedResources") or {}
        tasks = list((resources.get("Tasks") or {}).values())
        cpu = sum(int((t.get("Cpu") or {}).get("CpuShares") or 0) for t in tasks)
        mem = sum(int((t.get("Memory") or {}).get("MemoryMB") or 0) for t in tasks)
        shared = resources.get("Shared") or {}
        mem += int(shared.get("MemoryMB") or 0)
        held = used.setdefault(str(alloc.get("NodeID") or ""), [0, 0])
        held[0] += cpu
        held[1] += mem
    total = 0
    for node_id, _, cpu, mem in nodes:
        held_cpu, held_mem = used.get(node_id, (0, 0))
        total += max(0, min((cpu - held_cpu) // cpu_mhz, (mem - held_mem) // max(1, memory_mb)))
    return total


def _nomad_error(what: str, e: Any) -> BackendError:
    response = getattr(e, "nomad_resp", None)
    status = getattr(response, "status_code", None)
    text = (getattr(response, "text", "") or str(e)).strip()
    if status in (400, 403):
        return BackendError(f"{what}: {text}", code="orchestrator_refused", failure_class="config", retryable=False)
    return BackendError(f"{what}: {status} {text}", code="orchestrator_error")


class NomadSandbox:
    """One case attempt's batch job and its allocation."""

    def __init__(
        self, backend: NomadBackend, job: CaseRequested, job_id: str, *, free_slot: Callable[[], None],
        handoff: LiveHandoff | None = None,
    ) -> None:  # fmt: skip
        self._backend = backend
        self._handoff = handoff
        self._job = job
        self.job_id = job_id
        """The Nomad job id."""
        self._free_slot = free_slot
        self._mark: Mark | None = None
        self._alloc: str | None = None
        self._node: str | None = None
        self._placement = UnitPlacement(phase="queued", reason="the job was registered")
        self._seen: set[tuple[str, str, str]] = set()
        self._blocked: str | None = None
        self._log: JobLog | None = None
        self._released = False
        self._running = False
        self._pid: int | None = None
        self._offset = 0

    @property
    def unit(self) -> str | None:
        """`alloc:<id>` once placed."""
        return f"alloc:{self._alloc}" if self._alloc else None

    @property
    def node(self) -> str | None:
        """The node the allocation was placed on."""
        return self._node

    def observe(self, mark: Mark) -> None:
        """Mark the run's trace as the allocation comes up."""
        self._mark = mark

    async def placement(self) -> UnitPlacement:
        """The allocation now, read from Nomad."""
        return await self._poll()

    def usage(self) -> UnitUsage | None:
        """The harness's pid and the allocation's resident memory while the task runs (the client's
        allocation stats; blocking — the sampler calls it in a thread)."""
        if not self._running or self._pid is None or self._alloc is None:
            return None
        rss: int | None = None
        try:
            stats = self._backend.client.client.allocation.read_allocation_stats(self._alloc)
            rss = int(((stats.get("ResourceUsage") or {}).get("MemoryStats") or {}).get("RSS") or 0) or None
        except (nomad.api.exceptions.BaseNomadException, requests.RequestException, ValueError) as e:
            log.debug("cannot read the stats of %s: %s", self._alloc, e)
        return UnitUsage(pid=self._pid, processes=1, rss_bytes=rss, cpu_seconds=None)

    async def _say(self, event: str, message: str) -> None:
        if self._mark is None:
            return
        try:
            await self._mark(event, message)
        except Exception:
            log.warning("marking the trace failed", exc_info=True)

    async def _poll(self) -> UnitPlacement:
        backend = self._backend
        try:
            allocs = await backend.call(backend.client.job.get_allocations, self.job_id)
            evaluations = await backend.call(backend.client.job.get_evaluations, self.job_id)
        except (nomad.api.exceptions.BaseNomadException, requests.RequestException) as e:
            log.warning("cannot read job %s: %s", self.job_id, e)
            return self._placement
        newest = max(allocs, key=lambda a: a.get("CreateTime") or 0) if allocs else None
        placement = read_alloc(newest, evaluations)
        await self._report(placement)
        self._placement = placement
        return placement

    async def _report(self, now: UnitPlacement) -> None:
        if now.unit and self._alloc is None:
            self._alloc = now.unit
        if now.phase == "blocked" and now.reason != self._blocked and now.unit is None:
            self._blocked = now.reason
            await self._say("waiting", f"blocked: {now.reason}")
        if now.node and self._node is None:
            self._node = now.node
            await self._say("scheduled", f"allocation {now.unit} placed on node {now.node}")
        for event in now.events:
            key = (event.at.isoformat() if event.at else "", event.reason, event.message)
            if key in self._seen:
                continue
            self._seen.add(key)
            at = event.at.strftime("%H:%M:%S.%fZ")[:-4] + "Z " if event.at else ""
            await self._say("task", f"{at}{event.reason}: {event.message}")

    async def run_harness(self, on_output: OnOutput, on_spawn: OnSpawn | None = None) -> HarnessRun:
        """Wait for the task to run, read its log while it runs, and read how it ended."""
        self._check_live()
        await self._say("submitted", f"job {self.job_id} registered in namespace {self._backend.template.namespace}")
        started = time.monotonic()
        limit = self._backend.template.start_timeout_s
        while True:
            placement = await self._poll()
            failure = start_failure(placement)
            if failure is not None:
                return HarnessRun(exit_code=None, stdout="", stderr="", spawn_error=f"the task cannot start: {failure}")
            if placement.phase in ("running", "dead"):
                break
            if time.monotonic() - started > limit:
                why = placement.reason or placement.phase
                return HarnessRun(exit_code=None, stdout="", stderr="",
                                  spawn_error=f"the allocation did not start within {limit:g}s: {why}")  # fmt: skip
            await asyncio.sleep(self._backend.poll_s)

        async def spawned(pid: int) -> None:
            self._pid = pid
            if on_spawn is not None:
                await on_spawn(pid)

        self._running = placement.phase == "running"
        ran_from = time.monotonic()
        job_log = self._log = JobLog(on_output, spawned, handoff=self._handoff)
        lines = LineSplitter()
        while placement.phase != "dead" and placement.unit is not None:
            await self._read_log(job_log, lines)
            await asyncio.sleep(self._backend.poll_s)
            placement = await self._poll()
        await self._read_log(job_log, lines)
        for line in lines.end():
            await job_log.line(line)
        self._running = False
        end = UnitEnd(exit_code=placement.exit_code, reason=placement.reason, oom=placement.oom)
        return job_log.harness_run(end, time.monotonic() - ran_from)

    async def _read_log(self, job_log: JobLog, lines: LineSplitter) -> None:
        """The task's stdout from where the last read ended (the fs/logs API, by byte offset)."""
        if self._alloc is None:
            return
        backend = self._backend
        params = {"task": TASK, "type": "stdout", "offset": self._offset, "origin": "start", "plain": "true"}
        try:  # the bytes, not python-nomad's decoded `.text`: the offset counts bytes
            response = await backend.call(
                backend.client.client.stream_logs.request, self._alloc, params=params, method="get"
            )
        except (nomad.api.exceptions.BaseNomadException, requests.RequestException) as e:
            log.info("cannot read the log of %s: %s", self._alloc, e)
            return
        data: bytes = response.content
        self._offset += len(data)
        for line in lines.push(data):
            await job_log.line(line)

    async def exec(self, command: str, timeout_s: float) -> ExecResult:
        """What the runner's check gave for `command`."""
        self._check_live()
        if self._log is None:
            return ExecResult(exit_code=127, stdout="", stderr="[evalbus] the job never ran", timed_out=False)
        return self._log.exec_result(command)

    async def snapshot(self, answer: str) -> Snapshot:
        """The workdir's git changes the runner recorded, else the answer."""
        self._check_live()
        return self._log.snapshot(answer) if self._log is not None else PromptSnapshot(output=answer)

    async def open_file(self, rel: str, *, max_bytes: int) -> AsyncIterator[bytes]:
        """The workdir's file `rel` (`case/local/work/<rel>` in the allocation directory) through the
        client filesystem API; `FileUnreadable` when it is missing, no regular file, larger than
        `max_bytes`, or the allocation is gone."""
        self._check_live()
        if self._alloc is None:
            raise FileUnreadable("the job never had an allocation")
        alloc, path = self._alloc, f"{TASK}/local/work/{rel}"
        fs = self._backend.client.client
        parent, _, leaf = path.rpartition("/")
        try:
            response = await self._backend.call(fs.stat.request, alloc, params={"path": path}, method="get")
            stat = response.json()
            listed = await self._backend.call(fs.ls.request, alloc, params={"path": parent}, method="get")
            entry = next((e for e in listed.json() if isinstance(e, dict) and e.get("Name") == leaf), {})
        except nomad.api.exceptions.BaseNomadException as e:
            raise _fs_refusal(e) from e
        except (requests.RequestException, ValueError) as e:
            raise FileUnreadable(f"the Nomad client cannot be read: {e}") from e
        is_file = isinstance(stat, dict) and not stat.get("IsDir") and str(stat.get("FileMode", "")).startswith("-")
        if not is_file or not str(entry.get("FileMode", "")).startswith("-"):  # `L…`: a link
            raise FileUnreadable.not_a_file()
        size = int(stat.get("Size") or 0)
        if size > max_bytes:
            raise FileUnreadable.too_large(size, max_bytes)
        return _fs_blocks(self._backend, alloc, path, size)

    async def exec_live(
        self, command: str, timeout_s: float, *, cap_bytes: int, on_spawn: OnSpawn | None = None
    ) -> LiveExec:
        """Run `command` with `sh -c` in the runner's workdir over the alloc exec WebSocket, through
        the runner (`--exec`: the job's secret values masked in what it prints)."""
        runner = " ".join(shlex.quote(part) for part in self._backend.template.runner_command)
        script = f'exec {runner} --workdir "$NOMAD_TASK_DIR/work" --exec "$1"'
        ws = await self._open(["/bin/sh", "-c", script, "sh", command])  # the runner masks the secrets
        out, err = bytearray(), bytearray()
        code: int | None = None
        timed_out = False
        try:
            async with asyncio.timeout(timeout_s):
                async for msg in ws:
                    if msg.type != aiohttp.WSMsgType.TEXT:
                        continue
                    frame = json.loads(msg.data)
                    for name, buf in (("stdout", out), ("stderr", err)):
                        data = (frame.get(name) or {}).get("data")
                        if data:
                            buf.extend(base64.b64decode(data))
                            del buf[: -cap_bytes or None]
                    if frame.get("exited"):
                        code = int((frame.get("result") or {}).get("exit_code") or 0)
        except TimeoutError:
            timed_out = True
        finally:
            await ws.close()
        return LiveExec(
            exit_code=124 if timed_out else (1 if code is None else code),
            stdout=out.decode("utf-8", errors="replace"),
            stderr=err.decode("utf-8", errors="replace"),
            timed_out=timed_out,
            truncated=len(out) >= cap_bytes or len(err) >= cap_bytes,
        )

    async def open_shell(self, cols: int, rows: int, on_output: Callable[[bytes], Awaitable[None]]) -> NomadShell:
        """An interactive shell in the running task, in the runner's workdir."""
        ws = await self._open(["/bin/sh", "-c", 'cd "$NOMAD_TASK_DIR/work" 2>/dev/null; exec /bin/sh -i'], tty=True)
        shell = NomadShell(ws, on_output)
        shell.resize(cols, rows)
        return shell

    def kill_group(self, pgid: int) -> None:
        """Nothing to do: an exec's processes end with its connection."""

    async def _open(self, command: list[str], *, tty: bool = False) -> aiohttp.ClientWebSocketResponse:
        self._check_live()
        if not self._running or self._alloc is None:
            raise BackendError("the case's task is not running", code="not_running", retryable=False)
        backend = self._backend
        try:
            return await backend.session().ws_connect(
                backend.exec_url(self._alloc, command, tty=tty), headers=backend.headers(), heartbeat=30.0
            )
        except aiohttp.WSServerHandshakeError as e:
            raise BackendError(f"exec refused ({e.status}): {e.message}", code="exec_failed", retryable=False) from e
        except aiohttp.ClientError as e:
            raise BackendError(f"exec connection failed: {e}", code="exec_failed", retryable=False) from e

    async def release(self) -> None:
        """Deregister and purge the job (its allocation stops). Idempotent."""
        if self._released:
            return
        self._released = True
        self._running = False
        try:
            await self._backend.deregister(self.job_id)
        finally:
            self._free_slot()

    def _check_live(self) -> None:
        if self._released:
            raise BackendError("the sandbox was already released", code="released", retryable=False)


class NomadShell:
    """An interactive shell over one alloc exec connection (JSON frames, data base64)."""

    shell = "/bin/sh"

    def __init__(self, ws: aiohttp.ClientWebSocketResponse, on_output: Callable[[bytes], Awaitable[None]]) -> None:
        self._ws = ws
        self._on_output = on_output
        self._code: int | None = None
        self._sends: set[asyncio.Task[Any]] = set()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        async for msg in self._ws:
            if msg.type != aiohttp.WSMsgType.TEXT:
                continue
            frame = json.loads(msg.data)
            for name in ("stdout", "stderr"):
                data = (frame.get(name) or {}).get("data")
                if data:
                    await self._on_output(base64.b64decode(data))
            if frame.get("exited"):
                self._code = int((frame.get("result") or {}).get("exit_code") or 0)

    def _send(self, frame: dict[str, Any]) -> None:
        if self._ws.closed:
            return
        task = asyncio.create_task(self._ws.send_str(json.dumps(frame)))
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    def write(self, data: bytes) -> None:
        """Type into it."""
        self._send({"stdin": {"data": base64.b64encode(data).decode("ascii")}})

    def resize(self, cols: int, rows: int) -> None:
        """Tell the terminal its size."""
        self._send({"tty_size": {"width": cols, "height": rows}})

    def kill(self) -> None:
        """Close the connection (Nomad ends the shell)."""
        task = asyncio.create_task(self._ws.close())
        self._sends.add(task)
        task.add_done_callback(self._sends.discard)

    async def wait(self) -> int | None:
        """Until the shell ended; its exit code."""
        try:
            await self._reader
        except aiohttp.ClientError:
            return None
        return self._code


def _fs_refusal(e: Any) -> FileUnreadable:
    """A client filesystem API error as the reason a file is not given."""
    response = getattr(e, "nomad_resp", None)
    status = getattr(response, "status_code", None)
    text = (getattr(response, "text", "") or str(e)).strip()
    if "unknown allocation" in text.lower():
        return FileUnreadable("the allocation is gone (garbage-collected) before its files were read")
    if status == 404 or "no such file" in text.lower():
        return FileUnreadable.missing()
    if "escapes" in text.lower():  # a link leading out of the allocation directory
        return FileUnreadable.not_a_file()
    return FileUnreadable(f"the Nomad client did not give it: {status} {text[:300]}")


async def _fs_blocks(backend: NomadBackend, alloc: str, path: str, size: int) -> AsyncIterator[bytes]:
    """`size` bytes of the file: one `fs/cat` when it fits a block, else `fs/readat` block by block."""
    fs = backend.client.client
    offset = 0
    while offset < size:
        try:
            if size <= FS_BLOCK:
                response = await backend.call(fs.cat.request, alloc, params={"path": path}, method="get")
            else:
                limit = min(FS_BLOCK, size - offset)
                params = {"path": path, "offset": offset, "limit": limit}
                response = await backend.call(fs.read_at.request, alloc, params=params, method="get")
        except (nomad.api.exceptions.BaseNomadException, requests.RequestException) as e:
            raise BackendError(f"reading {path} failed at byte {offset}: {e}", code="file_read_failed") from e
        data: bytes = response.content
        if not data:
            raise BackendError(f"{path} ended at byte {offset} of {size}", code="file_read_failed")
        offset += len(data)
        yield data


def connect_nomad(template: NomadTemplate, *, address: str, token_value: str | None = None, slots: int = 4,
                  poll_s: float = 1.0, live: LiveHandoffs | None = None) -> NomadBackend:  # fmt: skip
    """A backend on the Nomad agent at `address` (`NOMAD_ADDR`), with an ACL token when given."""
    client = nomad.Nomad(address=address.rstrip("/"), token=token_value, namespace=template.namespace, timeout=30)
    return NomadBackend(client, template, slots=slots, poll_s=poll_s, address=address, token_value=token_value,
                        live=live)  # fmt: skip
