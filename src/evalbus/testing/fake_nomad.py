"""A **protocol-level** fake of the Nomad HTTP API and a client agent — not a real Nomad cluster.

It answers the endpoints the dispatcher's Nomad backend uses, as the Nomad HTTP API docs define
them: `POST /v1/jobs` (the JSON job; every object checked against its documented field names — an
unknown field, a wrong `Type`, a task without `Driver`/`Resources` is a 400 *and* a recorded
violation), `GET /v1/job/:id/allocations`, `GET /v1/job/:id/evaluations`, `DELETE /v1/job/:id`,
`GET /v1/nodes`, `GET /v1/allocations` (with `resources`), `GET /v1/client/fs/logs/:alloc`, the
allocation filesystem (`GET
/v1/client/fs/stat/:alloc` answering the documented `AllocFileInfo` JSON (links followed),
`fs/ls/:alloc` a list of them (links as links, `L…` modes), `fs/cat/:alloc` and
`fs/readat/:alloc` raw bytes, `path` relative to the allocation directory — `<task>/local` is the
task directory — which outlives the task until the job is deregistered; a missing file is a `500`
with the client's `stat …: no such file or directory`, a path leaving the allocation directory a
`500` `Path escapes the alloc directory`) and the alloc exec WebSocket
`/v1/client/allocation/:alloc/exec` (JSON frames: `stdin`/`tty_size` in, `stdout`/`stderr`/`exited`
out). A request that does not match is recorded in `violations`, so a test can assert none happened.

Behind it a tiny client runs the task (`raw_exec`: `Config.command` + `Config.args`, with
`${NOMAD_TASK_DIR}` interpolated) **as a local process**: placement by the job's `${meta.*}`
constraints and the nodes' free CPU (MHz) and memory, else the evaluation is `blocked` with the
exhausted dimensions and placed once a node is added; a `docker` task whose image is not in
`images` fails with a `Driver Failure` event; a `nomadVar` template whose variable is missing blocks
with a `Template` event saying so; a task past its `MemoryMB` is killed (`oom_killed` in its
`Terminated` event, exit 137). Task events carry real timestamps (Unix nanoseconds). A group's
`Networks` (`NetworkResource`: its fields, one block, `Mode` one of the documented modes) and the
`docker` driver's `network_mode` are validated and kept in `jobs`, not enforced: the task still runs
as a local process with the host's network.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import mimetypes
import os
import re
import stat
import tempfile
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import WSMsgType, web

from evalbus.testing.fake_kubernetes import image_path, kill_tree, tree_rss

Json = dict[str, Any]

_JOB_FIELDS = {
    "Region", "Namespace", "ID", "ParentID", "Name", "Type", "Priority", "AllAtOnce", "Datacenters", "NodePool",
    "Constraints", "Affinities", "TaskGroups", "Update", "Multiregion", "Spreads", "Periodic", "ParameterizedJob",
    "Reschedule", "Migrate", "Meta", "ConsulToken", "VaultToken", "Payload", "UI",
}  # fmt: skip
_GROUP_FIELDS = {
    "Name", "Count", "Constraints", "Affinities", "Tasks", "Spreads", "Volumes", "RestartPolicy",
    "ReschedulePolicy", "EphemeralDisk", "Update", "Migrate", "Networks", "Meta", "Services", "ShutdownDelay",
    "StopAfterClientDisconnect", "MaxClientDisconnect", "Scaling", "Consul", "PreventRescheduleOnLost",
}  # fmt: skip
_TASK_FIELDS = {
    "Name", "Driver", "User", "Lifecycle", "Config", "Constraints", "Affinities", "Env", "Services", "Resources",
    "RestartPolicy", "Meta", "KillTimeout", "LogConfig", "Artifacts", "Vault", "Templates", "DispatchPayload",
    "VolumeMounts", "Leader", "ShutdownDelay", "KillSignal", "Kind", "ScalingPolicies", "Identity", "Identities",
}  # fmt: skip
_RESOURCE_FIELDS = {"CPU", "Cores", "MemoryMB", "MemoryMaxMB", "DiskMB", "Networks", "Devices", "IOPS"}
_TEMPLATE_FIELDS = {
    "SourcePath", "DestPath", "EmbeddedTmpl", "ChangeMode", "ChangeSignal", "ChangeScript", "Splay", "Perms",
    "Uid", "Gid", "LeftDelim", "RightDelim", "Envvars", "VaultGrace", "Wait", "ErrMissingKey",
}  # fmt: skip
_CONSTRAINT_FIELDS = {"LTarget", "RTarget", "Operand"}
_RESTART_FIELDS = {"Interval", "Attempts", "Delay", "Mode", "RenderTemplates"}
_RESCHEDULE_FIELDS = {"Attempts", "Interval", "Delay", "DelayFunction", "MaxDelay", "Unlimited"}
_DEVICE_FIELDS = {"Name", "Count", "Constraints", "Affinities"}
_NETWORK_FIELDS = {
    "Mode", "Device", "CIDR", "IP", "Hostname", "MBits", "DNS", "ReservedPorts", "DynamicPorts", "CNI",
}  # fmt: skip
"""`NetworkResource`, a group's `network` block (`TaskGroup.Networks[]`)."""
_NETWORK_MODE = re.compile(r"^(|host|bridge|none|cni/[A-Za-z0-9_.-]+)$")
"""The documented network modes: `host` (the default), `bridge`, `none`, `cni/<name>`."""
_VAR_TEMPLATE = re.compile(r'\{\{\s*with nomadVar "([^"]+)"\s*\}\}(\w+)=\{\{\s*\.(\w+)\s*\}\}\{\{\s*end\s*\}\}')
_DEFAULT_IMAGE = "evalbus/case:test"


_TRUE = {"1", "t", "T", "TRUE", "true", "True"}
_BOOLS = _TRUE | {"0", "f", "F", "FALSE", "false", "False"}


def _flag(value: str | None) -> bool:
    """A query flag as Nomad reads it (Go's strconv.ParseBool)."""
    return value in _TRUE


def _ns() -> int:
    return time.time_ns()


@dataclass
class FakeNomadNode:
    """A client node: its CPU (MHz), memory and metadata."""

    name: str
    cpu_mhz: int
    memory_mb: int
    meta: dict[str, str]
    id: str = field(default_factory=lambda: str(uuid.uuid4()))

    def stub(self) -> Json:
        return {
            "ID": self.id,
            "Name": self.name,
            "Datacenter": "dc1",
            "NodePool": "default",
            "Status": "ready",
            "SchedulingEligibility": "eligible",
            "Drain": False,
            "Drivers": {"raw_exec": {"Detected": True, "Healthy": True}},
            "NodeResources": {"Cpu": {"CpuShares": self.cpu_mhz}, "Memory": {"MemoryMB": self.memory_mb}},
            "ReservedResources": {"Cpu": {"CpuShares": 0}, "Memory": {"MemoryMB": 0}},
        }


@dataclass
class FakeAlloc:
    """An allocation of a job's one task group and the process its task runs as."""

    id: str
    job: Json
    node: FakeNomadNode
    events: list[Json] = field(default_factory=list)
    state: str = "pending"
    client_status: str = "pending"
    failed: bool = False
    started_at: str | None = None
    stdout: bytearray = field(default_factory=bytearray)
    stderr: bytearray = field(default_factory=bytearray)
    process: asyncio.subprocess.Process | None = None
    task_dir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    oom: bool = False
    lost: bool = False
    description: str = ""
    task: asyncio.Task[None] | None = None

    @property
    def spec(self) -> Json:
        task: Json = self.job["TaskGroups"][0]["Tasks"][0]
        return task

    def stub(self) -> Json:
        name = self.spec["Name"]
        return {
            "ID": self.id,
            "EvalID": str(uuid.uuid5(uuid.NAMESPACE_OID, self.id)),
            "Name": f"{self.job['ID']}.{self.job['TaskGroups'][0]['Name']}[0]",
            "Namespace": self.job.get("Namespace", "default"),
            "NodeID": self.node.id,
            "NodeName": self.node.name,
            "JobID": self.job["ID"],
            "JobType": "batch",
            "TaskGroup": self.job["TaskGroups"][0]["Name"],
            "DesiredStatus": "run",
            "ClientStatus": self.client_status,
            "ClientDescription": self.description,
            "TaskStates": {
                name: {
                    "State": self.state,
                    "Failed": self.failed,
                    "Restarts": 0,
                    "StartedAt": self.started_at,
                    "Events": self.events,
                }
            },
            "CreateTime": self.events[0]["Time"] if self.events else _ns(),
        }


class FakeNomad:
    """The fake agent; `async with FakeNomad() as nomad:` serves it on a loopback port."""

    def __init__(self, *, images: set[str] | None = None) -> None:
        self.images = {_DEFAULT_IMAGE} if images is None else set(images)
        """Images a `docker` task can pull."""
        self.nodes: dict[str, FakeNomadNode] = {}
        self.variables: dict[str, dict[str, str]] = {}
        """Nomad Variables: path → items."""
        self.jobs: dict[str, Json] = {}
        self.registered: list[Json] = []
        """Every job accepted by `POST /v1/jobs`, in order (kept after it is deregistered)."""
        self.evals: dict[str, list[Json]] = {}
        self.allocs: dict[str, FakeAlloc] = {}
        self.violations: list[str] = []
        self.deregistered: list[tuple[str, bool]] = []
        """(job id, purge) of every deregistration."""
        self.fs_requests: list[tuple[str, str]] = []
        """(endpoint — `stat`, `cat`, `readat` — and path) of every allocation filesystem read."""
        self._waiting: list[str] = []
        self._root = Path(tempfile.mkdtemp(prefix="fake-nomad-"))
        self._runner: web.AppRunner | None = None
        self.url = ""

    def add_node(
        self, name: str, *, cpu_mhz: int = 4000, memory_mb: int = 4096, meta: Mapping[str, str] | None = None
    ) -> None:
        """A client node joins; blocked evaluations are tried again."""
        self.nodes[name] = FakeNomadNode(name=name, cpu_mhz=cpu_mhz, memory_mb=memory_mb, meta=dict(meta or {}))
        for job_id in list(self._waiting):
            self._place(job_id)

    async def lose_node(self, name: str) -> None:
        """A node goes down: its allocations are `lost` (their processes die, no `Terminated` event)."""
        node = self.nodes.pop(name, None)
        for alloc in list(self.allocs.values()):
            if alloc.node is node and alloc.client_status in ("pending", "running"):
                alloc.lost = True
                alloc.state, alloc.client_status, alloc.failed = "dead", "lost", True
                alloc.description = "alloc is lost since its node is down"
                if alloc.process is not None and alloc.process.returncode is None:
                    kill_tree(alloc.process.pid)
                if alloc.task is not None:
                    with contextlib.suppress(asyncio.CancelledError):
                        await alloc.task

    def set_variable(self, path: str, **items: str) -> None:
        """A Nomad Variable templates can read."""
        self.variables[path] = dict(items)

    async def __aenter__(self) -> FakeNomad:
        app = web.Application(middlewares=[self._record])
        app.router.add_post("/v1/jobs", self._register)
        app.router.add_get("/v1/jobs", self._list_jobs)
        app.router.add_get("/v1/job/{id}/allocations", self._allocations)
        app.router.add_get("/v1/job/{id}/evaluations", self._evaluations)
        app.router.add_delete("/v1/job/{id}", self._deregister)
        app.router.add_get("/v1/nodes", self._nodes)
        app.router.add_get("/v1/allocations", self._list_allocations)
        app.router.add_get("/v1/node/{id}", self._node)
        app.router.add_get("/v1/client/fs/logs/{alloc}", self._logs)
        app.router.add_get("/v1/client/fs/stat/{alloc}", self._fs_stat)
        app.router.add_get("/v1/client/fs/ls/{alloc}", self._fs_ls)
        app.router.add_get("/v1/client/fs/cat/{alloc}", self._fs_cat)
        app.router.add_get("/v1/client/fs/readat/{alloc}", self._fs_readat)
        app.router.add_get("/v1/client/allocation/{alloc}/exec", self._exec)
        app.router.add_get("/v1/client/allocation/{alloc}/stats", self._stats)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.Server)
        self.url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *_: object) -> None:
        for alloc in list(self.allocs.values()):
            await self._stop(alloc)
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------ checks

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        try:
            response: web.StreamResponse = await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed):
            return self._refuse(404, f"no such endpoint: {request.method} {request.path}")
        return response

    def _refuse(self, code: int, message: str) -> web.Response:
        self.violations.append(message)
        return web.Response(status=code, text=message)

    def _fields(self, what: str, obj: Any, allowed: set[str]) -> str | None:
        if not isinstance(obj, dict):
            return f"{what} must be an object"
        unknown = sorted(set(obj) - allowed)
        return f"{what} has unknown field(s) {unknown}" if unknown else None

    def _check_job(self, job: Any) -> str | None:
        problem = self._fields("Job", job, _JOB_FIELDS)
        if problem:
            return problem
        if not job.get("ID") or job.get("Type") != "batch":
            return "Job needs an ID and Type batch"
        for c in job.get("Constraints") or []:
            if problem := self._fields("Constraint", c, _CONSTRAINT_FIELDS):
                return problem
        groups = job.get("TaskGroups") or []
        if len(groups) != 1:
            return "the fake runs jobs of exactly one task group"
        group = groups[0]
        checks = [("TaskGroup", group, _GROUP_FIELDS)]
        checks += [("RestartPolicy", group.get("RestartPolicy") or {}, _RESTART_FIELDS)]
        checks += [("ReschedulePolicy", group.get("ReschedulePolicy") or {}, _RESCHEDULE_FIELDS)]
        tasks = group.get("Tasks") or []
        if len(tasks) != 1:
            return "the fake runs task groups of exactly one task"
        task = tasks[0]
        checks += [("Task", task, _TASK_FIELDS), ("Resources", task.get("Resources"), _RESOURCE_FIELDS)]
        checks += [("Template", t, _TEMPLATE_FIELDS) for t in task.get("Templates") or []]
        checks += [("RequestedDevice", d, _DEVICE_FIELDS) for d in (task.get("Resources") or {}).get("Devices") or []]
        networks = group.get("Networks") or []
        if not isinstance(networks, list):
            return "TaskGroup.Networks must be a list"
        checks += [("NetworkResource", n, _NETWORK_FIELDS) for n in networks]
        for what, obj, allowed in checks:
            if problem := self._fields(what, obj, allowed):
                return problem
        if len(networks) > 1:
            return "a task group takes at most one network block"
        for network in networks:
            if not isinstance(network.get("Mode", ""), str) or not _NETWORK_MODE.match(network.get("Mode", "")):
                return f"NetworkResource.Mode {network.get('Mode')!r} is not host, bridge, none or cni/<name>"
        if not task.get("Name") or task.get("Driver") not in ("raw_exec", "exec", "docker"):
            return "Task needs a Name and a Driver (raw_exec, exec or docker)"
        if not isinstance(task.get("Config"), dict) or not isinstance(task.get("Env", {}), dict):
            return "Task.Config and Task.Env must be objects"
        if not all(isinstance(v, str) for v in (task.get("Env") or {}).values()):
            return "Task.Env values must be strings"
        mode = task["Config"].get("network_mode")
        if task.get("Driver") == "docker" and mode is not None and not isinstance(mode, str):
            return "Task.Config.network_mode (docker) must be a string"
        if task.get("Driver") != "docker" and mode is not None:
            return f"Task.Config.network_mode is a docker driver option, not {task.get('Driver')}'s"
        return None

    # ------------------------------------------------------------ jobs

    async def _register(self, request: web.Request) -> web.StreamResponse:
        try:
            body = await request.json()
        except ValueError:
            return self._refuse(400, "POST /v1/jobs: the body is not JSON")
        if not isinstance(body, dict) or set(body) - {"Job", "EnforceIndex", "JobModifyIndex", "PolicyOverride",
                                                        "PreserveCounts", "EvalPriority", "Submission"}:  # fmt: skip
            return self._refuse(400, "POST /v1/jobs takes {Job, ...} (JobRegisterRequest)")
        if problem := self._check_job(body.get("Job")):
            return self._refuse(400, f"POST /v1/jobs: {problem}")
        job = body["Job"]
        self.jobs[job["ID"]] = job
        self.registered.append(job)
        self.evals[job["ID"]] = []
        self._place(job["ID"])
        eval_id = self.evals[job["ID"]][0]["ID"]
        return web.json_response({"EvalID": eval_id, "EvalCreateIndex": 1, "JobModifyIndex": 1, "Warnings": "",
                                  "Index": 1, "LastContact": 0, "KnownLeader": False})  # fmt: skip

    async def _list_jobs(self, request: web.Request) -> web.StreamResponse:
        prefix = request.query.get("prefix", "")
        return web.json_response(
            [{"ID": j["ID"], "Name": j["ID"], "Type": "batch", "Status": "running", "Meta": j.get("Meta") or {}}
             for j in self.jobs.values() if j["ID"].startswith(prefix)]
        )  # fmt: skip

    def _usage(self, node: FakeNomadNode) -> tuple[int, int]:
        cpu = mem = 0
        for alloc in self.allocs.values():
            if alloc.node is node and alloc.client_status in ("pending", "running"):
                cpu += alloc.spec["Resources"].get("CPU", 100)
                mem += alloc.spec["Resources"].get("MemoryMB", 300)
        return cpu, mem

    def _place(self, job_id: str) -> None:
        job = self.jobs.get(job_id)
        if job is None or any(a.job is job for a in self.allocs.values()):
            return
        task = job["TaskGroups"][0]["Tasks"][0]
        cpu, mem = task["Resources"].get("CPU", 100), task["Resources"].get("MemoryMB", 300)
        filtered: dict[str, int] = {}
        exhausted: dict[str, int] = {}
        chosen = None
        for node in self.nodes.values():
            miss = [
                c for c in job.get("Constraints") or []
                if c["LTarget"].startswith("${meta.") and node.meta.get(c["LTarget"][7:-1]) != c["RTarget"]
            ]  # fmt: skip
            if miss:
                key = f"{miss[0]['LTarget']} {miss[0]['Operand']} {miss[0]['RTarget']}"
                filtered[key] = filtered.get(key, 0) + 1
                continue
            used_cpu, used_mem = self._usage(node)
            short = [d for d, ask, have in (("cpu", cpu, node.cpu_mhz - used_cpu),
                                            ("memory", mem, node.memory_mb - used_mem)) if ask > have]  # fmt: skip
            if short:
                for d in short:
                    exhausted[d] = exhausted.get(d, 0) + 1
                continue
            chosen = node
            break
        evals = self.evals[job_id]
        if chosen is None:
            if not evals or evals[-1]["Status"] != "blocked":
                evals.append(
                    {
                        "ID": str(uuid.uuid4()), "JobID": job_id, "Type": "batch", "TriggeredBy": "job-register",
                        "Status": "blocked", "StatusDescription": "created due to placement conflicts",
                        "FailedTGAllocs": {job["TaskGroups"][0]["Name"]: {
                            "NodesEvaluated": len(self.nodes), "NodesFiltered": sum(filtered.values()),
                            "ConstraintFiltered": filtered or None, "NodesExhausted": sum(exhausted.values()),
                            "DimensionExhausted": exhausted or None, "ClassFiltered": None, "ClassExhausted": None,
                            "QuotaExhausted": None, "CoalescedFailures": 0,
                        }},
                        "QueuedAllocations": {job["TaskGroups"][0]["Name"]: 1}, "CreateTime": _ns(),
                    }
                )  # fmt: skip
            if job_id not in self._waiting:
                self._waiting.append(job_id)
            return
        if job_id in self._waiting:
            self._waiting.remove(job_id)
        for ev in evals:
            if ev["Status"] == "blocked":
                ev["Status"] = "complete"
        evals.append({"ID": str(uuid.uuid4()), "JobID": job_id, "Type": "batch", "Status": "complete",
                      "TriggeredBy": "job-register", "CreateTime": _ns()})  # fmt: skip
        alloc = FakeAlloc(id=str(uuid.uuid4()), job=job, node=chosen)
        self.allocs[alloc.id] = alloc
        alloc.task = asyncio.get_running_loop().create_task(self._client(alloc))

    async def _allocations(self, request: web.Request) -> web.StreamResponse:
        job_id = request.match_info["id"]
        if job_id not in self.jobs:
            return web.Response(status=404, text="job not found")
        return web.json_response([a.stub() for a in self.allocs.values() if a.job["ID"] == job_id])

    async def _list_allocations(self, request: web.Request) -> web.StreamResponse:
        """`GET /v1/allocations` (every allocation's stub); with `resources=true` each carries its
        `AllocatedResources` (`Tasks.<task>.Cpu.CpuShares`, `.Memory.MemoryMB`, and `Shared`)."""
        allowed = {"prefix", "next_token", "per_page", "filter", "resources", "task_states", "namespace", "region"}
        unknown = sorted(set(request.query) - allowed)
        if unknown:
            return self._refuse(400, f"GET /v1/allocations: unknown parameter(s) {unknown}")
        stubs = [a.stub() for a in self.allocs.values()]
        if _flag(request.query.get("resources")):
            for alloc, stub in zip(self.allocs.values(), stubs, strict=True):
                res = alloc.spec["Resources"]
                stub["AllocatedResources"] = {
                    "Tasks": {alloc.spec["Name"]: {"Cpu": {"CpuShares": res.get("CPU", 100)},
                                                   "Memory": {"MemoryMB": res.get("MemoryMB", 300)}}},
                    "Shared": {"DiskMB": 0, "Networks": None, "Ports": None},
                }  # fmt: skip
        if request.query.get("task_states") == "false":
            for stub in stubs:
                stub.pop("TaskStates")
        return web.json_response(stubs)

    async def _evaluations(self, request: web.Request) -> web.StreamResponse:
        job_id = request.match_info["id"]
        if job_id not in self.jobs:
            return web.Response(status=404, text="job not found")
        return web.json_response(self.evals.get(job_id, []))

    async def _deregister(self, request: web.Request) -> web.StreamResponse:
        job_id = request.match_info["id"]
        unknown = sorted(set(request.query) - {"purge", "global", "eval_priority", "namespace", "region"})
        if unknown:
            return self._refuse(400, f"DELETE /v1/job/:id: unknown parameter(s) {unknown}")
        job = self.jobs.pop(job_id, None)
        if job is None:
            return web.Response(status=404, text="job not found")
        self.deregistered.append((job_id, _flag(request.query.get("purge"))))
        for alloc_id, alloc in list(self.allocs.items()):
            if alloc.job is job:
                await self._stop(alloc)
                del self.allocs[alloc_id]
        if job_id in self._waiting:
            self._waiting.remove(job_id)
        for waiting in list(self._waiting):
            self._place(waiting)
        return web.json_response({"EvalID": str(uuid.uuid4()), "EvalCreateIndex": 2, "JobModifyIndex": 2})

    async def _nodes(self, request: web.Request) -> web.StreamResponse:
        unknown = sorted(set(request.query) - {"prefix", "resources", "os", "filter", "namespace", "region"})
        if unknown:
            return self._refuse(400, f"GET /v1/nodes: unknown parameter(s) {unknown}")
        stubs = [n.stub() for n in self.nodes.values()]
        if not _flag(request.query.get("resources")):
            for stub in stubs:
                stub.pop("NodeResources")
                stub.pop("ReservedResources")
        return web.json_response(stubs)

    async def _node(self, request: web.Request) -> web.StreamResponse:
        """`GET /v1/node/:id`: the node with its `Meta`."""
        node = next((n for n in self.nodes.values() if n.id == request.match_info["id"]), None)
        if node is None:
            return web.Response(status=404, text="node not found")
        return web.json_response({**node.stub(), "Meta": node.meta, "Attributes": {"kernel.name": "linux"}})

    # ------------------------------------------------------------ the client

    def _event(self, alloc: FakeAlloc, kind: str, message: str, **details: str) -> None:
        alloc.events.append({"Type": kind, "Time": _ns(), "DisplayMessage": message, "Message": message,
                             "Details": details})  # fmt: skip

    async def _client(self, alloc: FakeAlloc) -> None:
        task = alloc.spec
        self._event(alloc, "Received", "Task received by client")
        self._event(alloc, "Task Setup", "Building Task Directory")
        alloc.task_dir = self._root / alloc.id / task["Name"] / "local"  # NOMAD_TASK_DIR
        alloc.task_dir.mkdir(parents=True)
        if task["Driver"] == "docker":
            image = task["Config"].get("image", "")
            self._event(alloc, "Driver", f"Downloading image {image}")
            if image not in self.images:
                message = f"Failed to pull `{image}`: Error response from daemon: pull access denied for {image}"
                self._event(alloc, "Driver Failure", message)
                self._event(alloc, "Not Restarting", "Policy allows no restarts")
                alloc.state, alloc.client_status, alloc.failed = "dead", "failed", True
                return
        env = {"PATH": image_path(), "HOME": str(alloc.task_dir),
               "NOMAD_TASK_DIR": str(alloc.task_dir), "NOMAD_ALLOC_ID": alloc.id}  # fmt: skip
        env.update(task.get("Env") or {})
        for template in task.get("Templates") or []:
            m = _VAR_TEMPLATE.fullmatch((template.get("EmbeddedTmpl") or "").strip())
            if m is None:
                continue
            path, var, item = m.groups()
            items = self.variables.get(path)
            if items is None or item not in items:
                self._event(alloc, "Template", f"Missing: nomad.var.block({path}@default.global)")
                return  # the template blocks the task, as Nomad does
            if template.get("Envvars"):
                env[var] = items[item]
        alloc.env = env
        config = task["Config"]
        argv = [config.get("command", ""), *config.get("args", [])]
        argv = [a.replace("${NOMAD_TASK_DIR}", str(alloc.task_dir)) for a in argv]
        try:
            alloc.process = await asyncio.create_subprocess_exec(
                *argv, cwd=alloc.task_dir, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            self._event(alloc, "Driver Failure", f"failed to launch command with executor: {e}")
            alloc.state, alloc.client_status, alloc.failed = "dead", "failed", True
            return
        alloc.state, alloc.client_status = "running", "running"
        alloc.started_at = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
        self._event(alloc, "Started", "Task started by client")

        async def pump(reader: asyncio.StreamReader | None, into: bytearray) -> None:
            while reader is not None and (chunk := await reader.read(64 * 1024)):
                into.extend(chunk)

        watcher = asyncio.create_task(self._memory(alloc, task["Resources"].get("MemoryMB")))
        await asyncio.gather(pump(alloc.process.stdout, alloc.stdout), pump(alloc.process.stderr, alloc.stderr))
        code = await alloc.process.wait()
        watcher.cancel()
        if alloc.lost:  # its node went down: nothing reports how the task ended
            return
        exit_code = code if code >= 0 else 128 - code
        signal = -code if code < 0 else 0
        self._event(alloc, "Terminated", f"Exit Code: {exit_code}" + (", Signal: 9" if signal else ""),
                    exit_code=str(exit_code), signal=str(signal), oom_killed=str(alloc.oom).lower())  # fmt: skip
        alloc.state = "dead"
        alloc.failed = exit_code != 0
        alloc.client_status = "failed" if alloc.failed else "complete"
        if alloc.failed:
            self._event(alloc, "Not Restarting", "Policy allows no restarts")
        for waiting in list(self._waiting):
            self._place(waiting)

    async def _memory(self, alloc: FakeAlloc, limit_mb: int | None) -> None:
        if not limit_mb or alloc.process is None:
            return
        while True:
            if tree_rss(alloc.process.pid) > limit_mb * 1024 * 1024:
                alloc.oom = True
                self._event(alloc, "Killing", "OOM Killed")
                kill_tree(alloc.process.pid)
                return
            await asyncio.sleep(0.05)

    async def _stop(self, alloc: FakeAlloc) -> None:
        if alloc.process is not None and alloc.process.returncode is None:
            self._event(alloc, "Killing", "Sent interrupt. Waiting 5s before force killing")
            kill_tree(alloc.process.pid)
        if alloc.task is not None:
            with contextlib.suppress(asyncio.CancelledError):
                await alloc.task

    # ------------------------------------------------------------ logs and exec

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        allowed = {"task", "type", "follow", "offset", "origin", "plain", "namespace", "region"}
        if unknown := sorted(set(request.query) - allowed):
            return self._refuse(400, f"fs/logs: unknown parameter(s) {unknown}")
        alloc = self.allocs.get(request.match_info["alloc"])
        if alloc is None:
            return web.Response(status=404, text="Unknown allocation")
        if request.query.get("task") != alloc.spec["Name"] or request.query.get("type") not in ("stdout", "stderr"):
            return self._refuse(400, "fs/logs needs task=<the task> and type=stdout|stderr")
        flags = [request.query.get(k) for k in ("follow", "plain") if k in request.query]
        if any(f not in _BOOLS for f in flags):
            return self._refuse(400, "fs/logs: follow and plain are booleans")
        if _flag(request.query.get("follow")) or not _flag(request.query.get("plain")):
            return self._refuse(400, "the fake serves plain, unfollowed logs (plain=true, follow=false)")
        data = alloc.stdout if request.query["type"] == "stdout" else alloc.stderr
        offset = int(request.query.get("offset", "0"))
        body = bytes(data[offset:]) if request.query.get("origin", "start") == "start" else bytes(data[-offset:])
        return web.Response(body=body, content_type="text/plain")

    # ------------------------------------------------------------ allocation filesystem

    def _fs_target(self, request: web.Request, what: str, allowed: set[str]) -> Path | web.Response:
        """The file a filesystem request names in its allocation's directory, or the answer refusing it."""
        if unknown := sorted(set(request.query) - allowed):
            return self._refuse(400, f"fs/{what}: unknown parameter(s) {unknown}")
        path = request.query.get("path")
        if not path:
            return self._refuse(400, f"fs/{what} needs the path parameter (relative to the allocation directory)")
        alloc = self.allocs.get(request.match_info["alloc"])
        if alloc is None or alloc.task_dir is None:
            return web.Response(status=404, text="Unknown allocation")
        self.fs_requests.append((what, path))
        root = (self._root / alloc.id).resolve()
        target = root / path.lstrip("/")
        with contextlib.suppress(OSError):
            if not target.resolve().is_relative_to(root):  # Nomad resolves links before it checks
                return web.Response(status=500, text="Path escapes the alloc directory")
        return target

    async def _fs_stat(self, request: web.Request) -> web.StreamResponse:
        """`AllocFileInfo` of the path (links followed, as the client's `os.Stat`)."""
        target = self._fs_target(request, "stat", {"path", "namespace", "region"})
        if isinstance(target, web.Response):
            return target
        try:
            info = target.stat()
        except OSError as e:
            return web.Response(status=500, text=f"stat {target}: {os.strerror(e.errno or 2).lower()}")
        return web.json_response(_file_info(target.name, info))

    async def _fs_ls(self, request: web.Request) -> web.StreamResponse:
        """`AllocFileInfo` of every entry of the folder (not followed: a link is `L…`, as Go's `ReadDir`)."""
        target = self._fs_target(request, "ls", {"path", "namespace", "region"})
        if isinstance(target, web.Response):
            return target

        def listing() -> list[Json]:
            return [_file_info(entry.name, entry.lstat()) for entry in sorted(target.iterdir())]

        try:
            return web.json_response(await asyncio.to_thread(listing))
        except OSError as e:
            return web.Response(status=500, text=f"open {target}: {os.strerror(e.errno or 2).lower()}")

    async def _fs_cat(self, request: web.Request) -> web.StreamResponse:
        """The whole file, raw."""
        target = self._fs_target(request, "cat", {"path", "namespace", "region"})
        if isinstance(target, web.Response):
            return target
        return await self._fs_bytes(target, 0, None)

    async def _fs_readat(self, request: web.Request) -> web.StreamResponse:
        """`limit` bytes from `offset`, raw."""
        target = self._fs_target(request, "readat", {"path", "offset", "limit", "namespace", "region"})
        if isinstance(target, web.Response):
            return target
        try:
            offset, limit = int(request.query["offset"]), int(request.query["limit"])
        except (KeyError, ValueError):
            return self._refuse(400, "fs/readat needs integer offset and limit parameters")
        if offset < 0 or limit < 0:
            return self._refuse(400, "fs/readat: offset and limit must not be negative")
        return await self._fs_bytes(target, offset, limit)

    async def _fs_bytes(self, target: Path, offset: int, limit: int | None) -> web.StreamResponse:
        def read() -> bytes:
            with target.open("rb") as f:
                f.seek(offset)
                return f.read() if limit is None else f.read(limit)

        try:
            data = await asyncio.to_thread(read)
        except IsADirectoryError:
            return web.Response(status=500, text=f"file {target.name!r} is a directory")
        except OSError as e:
            return web.Response(status=500, text=f"open {target}: {os.strerror(e.errno or 2).lower()}")
        return web.Response(body=data, content_type="application/octet-stream")

    async def _stats(self, request: web.Request) -> web.StreamResponse:
        """`AllocResourceUsage`: the task's resident memory (its process tree), CPU not measured."""
        if unknown := sorted(set(request.query) - {"namespace", "region"}):
            return self._refuse(400, f"allocation stats: unknown parameter(s) {unknown}")
        alloc = self.allocs.get(request.match_info["alloc"])
        if alloc is None:
            return web.Response(status=404, text="Unknown allocation")
        rss = tree_rss(alloc.process.pid) if alloc.process is not None and alloc.process.returncode is None else 0
        usage = {
            "MemoryStats": {"RSS": rss, "Cache": 0, "Swap": 0, "Usage": rss, "MaxUsage": rss, "Measured": ["RSS"]},
            "CpuStats": {"SystemMode": 0, "UserMode": 0, "TotalTicks": 0, "Percent": 0, "Measured": []},
            "DeviceStats": [],
        }
        return web.json_response(
            {"ResourceUsage": usage, "Tasks": {alloc.spec["Name"]: {"ResourceUsage": usage, "Timestamp": _ns()}},
             "Timestamp": _ns()}
        )  # fmt: skip

    async def _exec(self, request: web.Request) -> web.StreamResponse:
        if unknown := sorted(set(request.query) - {"task", "command", "tty", "namespace", "region"}):
            return self._refuse(400, f"alloc exec: unknown parameter(s) {unknown}")
        alloc = self.allocs.get(request.match_info["alloc"])
        if alloc is None:
            return web.Response(status=404, text="Unknown allocation")
        try:
            command = json.loads(request.query.get("command", ""))
        except ValueError:
            return self._refuse(400, "alloc exec: command must be a JSON array of strings")
        if not isinstance(command, list) or not command or not all(isinstance(c, str) for c in command):
            return self._refuse(400, "alloc exec: command must be a JSON array of strings")
        if request.query.get("task") != alloc.spec["Name"]:
            return self._refuse(400, "alloc exec: task must name the allocation's task")
        if alloc.state != "running" or alloc.task_dir is None:
            return web.Response(status=400, text="task not running")
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        tty = _flag(request.query.get("tty"))
        proc = await asyncio.create_subprocess_exec(
            *command, cwd=alloc.task_dir, env=alloc.env, stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.STDOUT if tty else asyncio.subprocess.PIPE,
            start_new_session=True,
        )  # fmt: skip

        async def pump(reader: asyncio.StreamReader | None, name: str) -> None:
            while reader is not None and (chunk := await reader.read(4096)):
                await ws.send_str(json.dumps({name: {"data": base64.b64encode(chunk).decode()}}))

        pumps = [asyncio.create_task(pump(proc.stdout, "stdout")), asyncio.create_task(pump(proc.stderr, "stderr"))]

        async def take_input() -> None:
            async for msg in ws:
                if msg.type != WSMsgType.TEXT:
                    continue
                frame = json.loads(msg.data)
                if not isinstance(frame, dict) or set(frame) - {"stdin", "tty_size", "version", "auth_token"}:
                    self.violations.append(f"alloc exec: unknown input frame {msg.data!r}")
                    continue
                stdin = frame.get("stdin") or {}
                if stdin.get("data") and proc.stdin is not None:
                    proc.stdin.write(base64.b64decode(stdin["data"]))
                if stdin.get("close") and proc.stdin is not None:
                    proc.stdin.close()
            kill_tree(proc.pid)

        reader = asyncio.create_task(take_input())
        code = await proc.wait()
        await asyncio.gather(*pumps, return_exceptions=True)
        if not ws.closed:
            with contextlib.suppress(ConnectionError):
                await ws.send_str(
                    json.dumps({"exited": True, "result": {"exit_code": code if code >= 0 else 128 - code}})
                )
            await ws.close()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        return ws


def _file_info(name: str, info: os.stat_result) -> Json:
    """An `AllocFileInfo`."""
    kind = mimetypes.guess_type(name)[0] or "application/octet-stream"
    return {
        "Name": name, "IsDir": stat.S_ISDIR(info.st_mode), "Size": info.st_size, "FileMode": _go_mode(info.st_mode),
        "ModTime": datetime.fromtimestamp(info.st_mtime, tz=UTC).isoformat().replace("+00:00", "Z"),
        "ContentType": "text/directory" if stat.S_ISDIR(info.st_mode) else kind,
    }  # fmt: skip


def _go_mode(mode: int) -> str:
    """A file mode as Go's `fs.FileMode.String()` writes it (`-rw-r--r--`, `drwxr-xr-x`)."""
    kind = "d" if stat.S_ISDIR(mode) else "L" if stat.S_ISLNK(mode) else "p" if stat.S_ISFIFO(mode) else "S" if stat.S_ISSOCK(mode) else (
        "D" if stat.S_ISBLK(mode) or stat.S_ISCHR(mode) else "-")  # fmt: skip
    return kind + "".join(c if mode & (1 << (8 - i)) else "-" for i, c in enumerate("rwxrwxrwx"))
