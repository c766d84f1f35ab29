"""The Kubernetes backend: a Job per case attempt, through the official `kubernetes` client.

The Job runs the in-job runner (`python -m evalbus.runner`, docs/backends.md) in the case image
with the job spec in `EVALBUS_JOB`; `harness.compute` gives its image, CPU/memory (requests =
limits), GPUs (`nvidia.com/gpu`) and `nodeSelector`; `network: none` labels the pod
`evalbus.dev/network: none`, which the deny-all NetworkPolicy `evalbus-network-none` selects (the
backend creates it once, before the first such Job; only a CNI that enforces NetworkPolicy cuts the
pod off); each `secret_env` entry becomes a `secretKeyRef` by name (`name` → Secret `name`, key
`value`; `name/key` → that key), so no secret value is ever in the Job spec or known to the
dispatcher. The run id is a label (label-safe form) and an annotation (exact). With `runner_nats`
the runner publishes the live log and trace itself, logged in with its run's token (in the job
spec: it is worth that run's live view only; docs/backends.md, "The live view straight to NATS").

While the pod comes up the sandbox polls it and its Events and marks the run's trace: `submitted`,
`waiting` with the scheduler's `FailedScheduling` message (the run reads *blocked*), `scheduled`
(pod, node), and every Event with the orchestrator's own timestamp — so the failure evidence is in
the marks at the moment it happens, and outlives the Job. A container that cannot start
(`ErrImagePull`, `ImagePullBackOff`, `CreateContainerConfigError`…) fails the run at once. The log
is followed while the container runs (the live log and trace) and decoded from the runner's record
lines; out of memory is read from the container's `OOMKilled` status. A finished pod cannot be
exec'd into, so when the harness declared artifact files the runner holds the pod (`holding`, at
most `artifact_hold_s`): the log is no longer followed, each file is read by an exec of the runner
(`--send-file`, its raw bytes on the stdout channel), and release tells the runner to end the hold
(`kill -USR1`) before it deletes the Job with `propagationPolicy: Background` (its pod goes with it).

The client is synchronous: its calls run in a thread pool of the backend's own, sized for the log
followers (one per running case) plus the polls.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import os
import re
import secrets as token
import time
from collections.abc import AsyncGenerator, AsyncIterator, Awaitable, Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

import aiohttp
import msgspec
from kubernetes import client as k8s
from kubernetes import config as k8s_config
from kubernetes import watch
from kubernetes.client.exceptions import ApiException

from evalbus_contracts import CaseRequested, PromptSnapshot, Snapshot
from evalbus_contracts.runner import (
    JOB_ENV,
    SEND_MISSING,
    SEND_NOT_A_FILE,
    SEND_TOO_LARGE,
    Holding,
    RunnerCheck,
    RunnerJob,
    RunnerLive,
)
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
    runner_checks,
    runner_job,
    runner_live,
)
from evalbus_dispatcher.backends.kubernetes_exec import (
    ERROR,
    STDERR,
    STDOUT,
    ApiAccess,
    ExecError,
    ExecShell,
    connect,
    exec_frames,
    exec_url,
    exit_code,
    run_once,
)
from evalbus_dispatcher.errors import BackendError
from evalbus_grading import ExecResult

log = logging.getLogger(__name__)

CONTAINER = "case"
"""The Job's one container."""
WORKING_DIR = "/evalbus"
"""The container's working directory (an `emptyDir`); the runner's workdir is `work` under it."""
RUN_LABEL = "evalbus.dev/run"
"""Label holding the run id (label-safe form); the annotation of the same name holds it exactly."""
MANAGED_BY = {"app.kubernetes.io/managed-by": "evalbus"}
NETWORK_LABEL = "evalbus.dev/network"
"""Pod label of a case asking `network: none`; the isolating NetworkPolicy selects it."""
NETWORK_NONE_POLICY = "evalbus-network-none"
"""The NetworkPolicy denying all ingress and egress to pods labelled `evalbus.dev/network: none`."""
START_FAILURES = frozenset(
    {"ErrImagePull", "ImagePullBackOff", "InvalidImageName", "ErrImageNeverPull", "CreateContainerConfigError",
     "CreateContainerError", "RunContainerError"}
)  # fmt: skip
"""Container waiting reasons that will not resolve by waiting: the run fails at once."""
DEFAULT_DATA_KEY = "value"
"""Key read from a Secret named without one."""
_NAME = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")
_KEY = re.compile(r"^[-._a-zA-Z0-9]+$")
_LOG_CHUNK = 64 * 1024
FILE_IDLE_S = 60.0
"""Longest a file's exec may send nothing before its read fails."""
_EPOCH = datetime.min.replace(tzinfo=UTC)


# ---------------------------------------------------------------- the Job (pure)


def job_name(run_id: str, attempt: int) -> str:
    """A fresh DNS-1123 name for one execution of an attempt (`evb-<run>-a<n>-<random>`)."""
    slug = re.sub(r"[^a-z0-9]+", "-", run_id.lower()).strip("-")
    suffix = f"-a{attempt}-{token.token_hex(3)}"
    return f"evb-{slug}"[: 63 - len(suffix)].rstrip("-") + suffix


def secret_ref(name: str, var: str) -> dict[str, str]:
    """`name` or `name/key` as a `secretKeyRef`; `BackendError` (config) when it is no Secret name."""
    secret, _, key = name.partition("/")
    key = key or DEFAULT_DATA_KEY
    if len(secret) > 253 or not _NAME.match(secret) or not _KEY.match(key):
        raise BackendError(
            f"secret {name!r} (for {var}) is not a Kubernetes Secret name (`name` or `name/key`)",
            code="invalid_secret_name",
            failure_class="config",
            retryable=False,
        )
    return {"name": secret, "key": key}


def resources(compute: ComputeSpec) -> dict[str, dict[str, str]]:
    """Requests = limits (a case gets what it asked for, and no more)."""
    asked = {"cpu": f"{compute.cpu:g}", "memory": f"{compute.memory_mb}Mi"}
    if compute.gpus:
        asked["nvidia.com/gpu"] = str(compute.gpus)
    return {"requests": dict(asked), "limits": dict(asked)}


@dataclass(frozen=True, slots=True)
class JobTemplate:
    """What every case Job of a dispatcher shares."""

    namespace: str
    """Where Jobs are made."""
    image: str
    """Image when the harness names none."""
    runner_command: tuple[str, ...] = ("python", "-m", "evalbus.runner")
    """The runner's argv in the image."""
    start_timeout_s: float = 600.0
    """How long a pod may stay unscheduled or starting before the run fails."""
    ttl_after_finished_s: int = 3600
    """The cluster removes a finished Job after this, should the dispatcher not (it died)."""
    service_account: str | None = None
    """The pods' service account (None: the namespace's default; its token is not mounted)."""
    artifact_hold_s: float = 120.0
    """Longest the runner keeps a finished harness's pod alive for the dispatcher to read the files
    it declared (`RunnerJob.hold_s`; 0: never, and declared files are not collected)."""
    runner_nats: RunnerNats | None = None
    """Where the runners publish the live view themselves (None: the dispatcher relays the job log)."""


def network_none_policy(namespace: str) -> dict[str, Any]:
    """The `networking.k8s.io/v1` NetworkPolicy cutting off `network: none` pods: it selects them and
    lists both policy types with no rule, so no ingress and no egress is allowed (DNS included)."""
    return {
        "apiVersion": "networking.k8s.io/v1",
        "kind": "NetworkPolicy",
        "metadata": {"name": NETWORK_NONE_POLICY, "namespace": namespace, "labels": dict(MANAGED_BY)},
        "spec": {"podSelector": {"matchLabels": {NETWORK_LABEL: "none"}}, "policyTypes": ["Ingress", "Egress"]},
    }


def job_manifest(
    job: CaseRequested, run_id: str, name: str, template: JobTemplate, live: RunnerLive | None = None
) -> dict[str, Any]:
    """The `batch/v1` Job for one execution of a case attempt (`live`: its runner publishes the live
    view itself)."""
    harness = job.harness
    spec = runner_job(job, run_id, hold_s=template.artifact_hold_s, live=live)
    env: list[dict[str, Any]] = [{"name": JOB_ENV, "value": msgspec.json.encode(spec).decode("utf-8")}]
    env += [
        {"name": var, "valueFrom": {"secretKeyRef": secret_ref(secret, var)}}
        for var, secret in harness.secret_env.items()
    ]
    labels = {**MANAGED_BY, RUN_LABEL: label_value(run_id), "evalbus.dev/attempt": str(job.attempt)}
    if harness.resources().network == "none":
        labels[NETWORK_LABEL] = "none"
    annotations = {RUN_LABEL: run_id}
    if job.batch_id is not None:
        annotations["evalbus.dev/batch"] = job.batch_id
    checks_s = sum(c.timeout_s for c in spec.checks)
    deadline = math.ceil(template.start_timeout_s + spec.timeout_s + checks_s + spec.hold_s + 120)
    pod_spec: dict[str, Any] = {
        "restartPolicy": "Never",
        "automountServiceAccountToken": False,
        "enableServiceLinks": False,
        "volumes": [{"name": "workdir", "emptyDir": {}}],
        "containers": [
            {
                "name": CONTAINER,
                "image": harness.resources().image or template.image,
                "command": list(template.runner_command),
                "args": ["--workdir", "work"],
                "workingDir": WORKING_DIR,
                "env": env,
                "resources": resources(harness.resources()),
                "volumeMounts": [{"name": "workdir", "mountPath": WORKING_DIR}],
            }
        ],
    }
    if harness.resources().node_selector:
        pod_spec["nodeSelector"] = dict(harness.resources().node_selector)
    if template.service_account:
        pod_spec["serviceAccountName"] = template.service_account
    return {
        "apiVersion": "batch/v1",
        "kind": "Job",
        "metadata": {"name": name, "namespace": template.namespace, "labels": labels, "annotations": annotations},
        "spec": {
            "backoffLimit": 0,
            "activeDeadlineSeconds": deadline,
            "ttlSecondsAfterFinished": template.ttl_after_finished_s,
            "template": {"metadata": {"labels": labels, "annotations": annotations}, "spec": pod_spec},
        },
    }


# ---------------------------------------------------------------- reading a pod (pure)


def _event_time(event: Any) -> datetime | None:
    when = event.last_timestamp or event.event_time or event.first_timestamp
    return when if isinstance(when, datetime) else None


def read_events(items: Sequence[Any]) -> tuple[OrchestratorEvent, ...]:
    """Kubernetes Events (`CoreV1Event`) as the feed, oldest first."""
    events = [
        OrchestratorEvent(at=_event_time(e), kind=e.type or "Normal", reason=e.reason or "", message=e.message or "")
        for e in items
    ]
    return tuple(sorted(events, key=lambda e: (e.at is None, e.at or _EPOCH)))


def read_pod(pod: Any | None, events: tuple[OrchestratorEvent, ...] = ()) -> UnitPlacement:
    """A pod (`V1Pod`, or None before the Job controller made it) normalised to a placement."""
    if pod is None:
        return UnitPlacement(phase="queued", reason="the Job's pod is not created yet", events=events)
    name, node = pod.metadata.name, pod.spec.node_name
    status = pod.status
    statuses = [s for s in status.container_statuses or () if s.name == CONTAINER]
    container = statuses[0] if statuses else None
    restarts = container.restart_count if container is not None else 0
    base = UnitPlacement(phase="starting", unit=name, node=node, restarts=restarts, events=events)
    if pod.metadata.deletion_timestamp is not None:
        return _replace(base, phase="dead", reason="the pod is being deleted")
    state = container.state if container is not None else None
    if state is not None and state.terminated is not None:
        done = state.terminated
        reason = done.reason or "Terminated"
        detail = f"{reason} (exit {done.exit_code})" + (f": {done.message}" if done.message else "")
        return _replace(base, phase="dead", reason=detail, oom=reason == "OOMKilled", exit_code=done.exit_code)
    if state is not None and state.running is not None:
        return _replace(base, phase="running")
    if state is not None and state.waiting is not None:
        waiting = state.waiting
        why = waiting.reason or "Waiting"
        detail = f"{why}: {waiting.message}" if waiting.message else why
        return _replace(base, phase="blocked" if why in START_FAILURES else "starting", reason=detail)
    if node is None:
        for cond in status.conditions or ():
            if cond.type == "PodScheduled" and cond.status == "False":
                return _replace(base, phase="blocked", reason=cond.message or cond.reason or "unschedulable")
        return _replace(base, phase="queued", reason="waiting for the scheduler")
    if status.phase in ("Succeeded", "Failed"):
        return _replace(base, phase="dead", reason=f"the pod {status.phase.lower()}")
    return base


def _replace(placement: UnitPlacement, **changes: Any) -> UnitPlacement:
    fields = {name: getattr(placement, name) for name in UnitPlacement.__slots__}
    fields.update(changes)
    return UnitPlacement(**fields)


def start_failure(placement: UnitPlacement) -> str | None:
    """Why the container will never start (None: it may still)."""
    if placement.phase == "blocked" and placement.reason and placement.reason.split(":", 1)[0] in START_FAILURES:
        return placement.reason
    return None


def event_line(event: OrchestratorEvent) -> str:
    """An event as the words of its trace mark (the orchestrator's own time first)."""
    at = event.at.strftime("%H:%M:%SZ") + " " if event.at is not None else ""
    return f"{at}{event.kind} {event.reason}: {event.message}"


# ---------------------------------------------------------------- fit and capacity (pure)


@dataclass(frozen=True, slots=True)
class NodeRoom:
    """A node's allocatable resources and what its running pods requested."""

    name: str
    labels: dict[str, str]
    cpu: float
    memory_mb: float
    gpus: int
    cpu_used: float = 0.0
    memory_used_mb: float = 0.0
    gpus_used: int = 0


_SCALE = {"": 1.0, "m": 1e-3, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "Ki": 1024.0, "Mi": 1024.0**2,
          "Gi": 1024.0**3, "Ti": 1024.0**4}  # fmt: skip
_QUANTITY = re.compile(r"^([0-9.]+)([A-Za-z]*)$")


def quantity(text: str | None) -> float:
    """A Kubernetes quantity (`250m`, `4`, `8Gi`) as a number (0 when absent or unreadable)."""
    m = _QUANTITY.match(text or "")
    if m is None or m.group(2) not in _SCALE:
        return 0.0
    return float(m.group(1)) * _SCALE[m.group(2)]


def fits(compute: ComputeSpec, node: NodeRoom, *, now: bool) -> bool:
    """Whether a case fits the node: ever (`now` False: its allocatable) or now (minus requests)."""
    if any(node.labels.get(k) != v for k, v in compute.node_selector.items()):
        return False
    used = (node.cpu_used, node.memory_used_mb, node.gpus_used) if now else (0.0, 0.0, 0)
    return (
        compute.cpu <= node.cpu - used[0] + 1e-9
        and compute.memory_mb <= node.memory_mb - used[1] + 1e-9
        and compute.gpus <= node.gpus - used[2]
    )


def cases_that_fit(compute: ComputeSpec, nodes: Sequence[NodeRoom]) -> int:
    """How many more cases of this size the cluster has room for now."""
    total = 0
    for node in nodes:
        if not fits(compute, node, now=True):
            continue
        room = [(node.cpu - node.cpu_used) / compute.cpu, (node.memory_mb - node.memory_used_mb) / compute.memory_mb]
        if compute.gpus:
            room.append((node.gpus - node.gpus_used) / compute.gpus)
        total += int(min(room) + 1e-9)
    return total


def _asked(container: Any) -> tuple[float, float, int]:
    res = container.resources
    asked = {**((res.limits if res else None) or {}), **((res.requests if res else None) or {})}
    return (
        quantity(asked.get("cpu")),
        quantity(asked.get("memory")) / 1024**2,
        int(quantity(asked.get("nvidia.com/gpu"))),
    )


def node_rooms(nodes: Sequence[Any], pods: Sequence[Any]) -> list[NodeRoom]:
    """Nodes (`V1Node`) with the requests of the pods (`V1Pod`) bound to them subtracted."""
    used: dict[str, list[float]] = {}
    for pod in pods:
        if pod.spec.node_name is None:
            continue
        acc = used.setdefault(pod.spec.node_name, [0.0, 0.0, 0.0])
        for container in pod.spec.containers:
            cpu, memory, gpus = _asked(container)
            acc[0] += cpu
            acc[1] += memory
            acc[2] += gpus
    rooms = []
    for node in nodes:
        alloc = node.status.allocatable or {}
        taken = used.get(node.metadata.name, [0.0, 0.0, 0.0])
        rooms.append(
            NodeRoom(
                name=node.metadata.name,
                labels=dict(node.metadata.labels or {}),
                cpu=quantity(alloc.get("cpu")),
                memory_mb=quantity(alloc.get("memory")) / 1024**2,
                gpus=int(quantity(alloc.get("nvidia.com/gpu"))),
                cpu_used=taken[0],
                memory_used_mb=taken[1],
                gpus_used=int(taken[2]),
            )
        )
    return rooms


# ---------------------------------------------------------------- the backend


class KubernetesBackend:
    """Case sandboxes as Kubernetes Jobs, through one `kubernetes.client.ApiClient`."""

    def __init__(
        self,
        api: Any,
        template: JobTemplate,
        *,
        slots: int = 4,
        poll_s: float = 1.0,
        check_fit: bool = True,
        live: LiveHandoffs | None = None,
    ) -> None:
        self._api = api
        self._live = live
        self._core = k8s.CoreV1Api(api)
        self._batch = k8s.BatchV1Api(api)
        self._networking = k8s.NetworkingV1Api(api)
        self._template = template
        self._slots = slots
        self._poll_s = poll_s
        self._check_fit = check_fit
        self._used = 0
        self._pool = ThreadPoolExecutor(max_workers=2 * slots + 4, thread_name_prefix="evalbus-k8s")
        self._session: aiohttp.ClientSession | None = None
        self._access = ApiAccess.from_configuration(api.configuration)
        self._isolating: set[str] = set()
        """Namespaces where the deny-all NetworkPolicy is known to exist."""
        self._isolating_lock = asyncio.Lock()

    @property
    def template(self) -> JobTemplate:
        """What every Job shares."""
        return self._template

    async def call(self, fn: Callable[..., Any], *args: Any, **kwargs: Any) -> Any:
        """A client call in the backend's thread pool; `ApiException` as it is."""
        loop = asyncio.get_running_loop()
        return await loop.run_in_executor(self._pool, lambda: fn(*args, **kwargs))

    def session(self) -> aiohttp.ClientSession:
        """The HTTP session exec connections use (made on first use)."""
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession()
        return self._session

    @property
    def access(self) -> ApiAccess:
        """Where and how WebSocket connections reach the API server."""
        return self._access

    @property
    def core(self) -> Any:
        """`CoreV1Api`."""
        return self._core

    @property
    def batch(self) -> Any:
        """`BatchV1Api`."""
        return self._batch

    @property
    def poll_s(self) -> float:
        """Seconds between two reads of a starting or running pod."""
        return self._poll_s

    async def close(self) -> None:
        """Close the exec session, the client and the thread pool."""
        if self._session is not None:
            await self._session.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._api.close()

    def capacity(self) -> Capacity:
        """Slots configured and held by unreleased sandboxes (the cluster's room: `room`)."""
        return Capacity(total=self._slots, used=self._used)

    async def nodes(self) -> list[NodeRoom]:
        """Every node's allocatable resources minus the requests of the pods on it."""
        nodes = await self.call(self._core.list_node, _request_timeout=30)
        pods = await self.call(
            self._core.list_pod_for_all_namespaces,
            field_selector="status.phase!=Succeeded,status.phase!=Failed",
            _request_timeout=30,
        )
        return node_rooms(nodes.items, pods.items)

    async def room(self, compute: ComputeSpec | None = None) -> int:
        """How many cases of this size (default: the default compute) fit in the cluster now."""
        return cases_that_fit(compute or ComputeSpec(), await self.nodes())

    async def provision(self, job: CaseRequested) -> KubernetesSandbox:
        """Submit the case's Job (after removing any earlier execution of the same run); raises
        `BackendError` — config, not retryable, when no node could ever fit the case."""
        run_id = run_of(job)
        name = job_name(run_id, job.attempt)
        handoff = self._live.get(run_id) if self._live is not None else None
        life = longest_life_s(
            job, start_timeout_s=self._template.start_timeout_s, hold_s=self._template.artifact_hold_s
        )
        live = runner_live(self._template.runner_nats, handoff, job, life_s=life)
        manifest = job_manifest(job, run_id, name, self._template, live)  # refuses bad secret names first
        if self._check_fit:
            await self._refuse_unfit(job.harness.resources())
        if job.harness.resources().network == "none":
            await self._ensure_network_policy()
        await self._sweep(run_id)
        try:
            await self.call(
                self._batch.create_namespaced_job,
                self._template.namespace,
                manifest,
                _content_type="application/json",
                _request_timeout=30,
            )
        except ApiException as e:
            raise _api_error("cannot create the Job", e) from e
        except OSError as e:  # urllib3 wraps connection failures in OSError subclasses
            raise BackendError(f"cannot reach the Kubernetes API: {e}", code="orchestrator_unreachable") from e
        self._used += 1
        return KubernetesSandbox(
            self, job, name, spec_checks=runner_checks(job), free_slot=self._slot_freed,
            handoff=handoff if live is not None else None,
        )  # fmt: skip

    def _slot_freed(self) -> None:
        self._used -= 1

    async def _ensure_network_policy(self) -> None:
        """Create the deny-all NetworkPolicy once (one that exists is fine: another dispatcher, or an
        earlier run of this one, made it). A case asking `network: none` never runs without it: a
        cluster that refuses it (403: the dispatcher's Role lacks `networkpolicies` create) fails the
        case as a config error; another failure is an orchestrator error, tried again."""
        namespace = self._template.namespace
        if namespace in self._isolating:
            return
        async with self._isolating_lock:  # cases provisioned together: one create
            if namespace in self._isolating:
                return
            try:
                await self.call(
                    self._networking.create_namespaced_network_policy,
                    namespace,
                    network_none_policy(namespace),
                    _content_type="application/json",
                    _request_timeout=30,
                )
            except ApiException as e:
                if e.status != 409:
                    raise _api_error(f"cannot create the NetworkPolicy {NETWORK_NONE_POLICY}", e) from e
            except OSError as e:
                raise BackendError(f"cannot reach the Kubernetes API: {e}", code="orchestrator_unreachable") from e
            self._isolating.add(namespace)

    async def _refuse_unfit(self, compute: ComputeSpec) -> None:
        try:
            rooms = await self.nodes()
        except (ApiException, OSError) as e:
            log.warning("cannot read the cluster's nodes; the fit check is skipped: %s", e)
            return
        if any(fits(compute, room, now=False) for room in rooms):
            return
        biggest = max(rooms, key=lambda r: (r.cpu, r.memory_mb), default=None)
        where = f" with labels {compute.node_selector}" if compute.node_selector else ""
        have = (
            f"the largest node ({biggest.name}) has cpu={biggest.cpu:g}, memory={biggest.memory_mb:.0f}Mi, "
            f"gpus={biggest.gpus}"
            if biggest is not None
            else "the cluster has no nodes"
        )
        raise BackendError(
            f"no node{where} can ever fit cpu={compute.cpu:g}, memory={compute.memory_mb}Mi, gpus={compute.gpus}: "
            f"{have}",
            code="unschedulable",
            failure_class="config",
            retryable=False,
        )

    async def _sweep(self, run_id: str) -> None:
        """Delete Jobs an earlier execution of this run left (its dispatcher died holding it)."""
        selector = f"{RUN_LABEL}={label_value(run_id)}"
        try:
            found = await self.call(
                self._batch.list_namespaced_job, self._template.namespace, label_selector=selector, _request_timeout=30
            )
        except (ApiException, OSError) as e:
            log.warning("cannot list earlier Jobs of %s: %s", run_id, e)
            return
        for item in found.items:
            if (item.metadata.annotations or {}).get(RUN_LABEL) == run_id:
                await self.delete(item.metadata.name)

    async def delete(self, name: str) -> None:
        """Delete a Job and its pods (Background propagation); a Job already gone is fine."""
        options = k8s.V1DeleteOptions(propagation_policy="Background")
        try:
            await self.call(
                self._batch.delete_namespaced_job,
                name,
                self._template.namespace,
                body=options,
                _content_type="application/json",
                _request_timeout=30,
            )
        except ApiException as e:
            if e.status != 404:
                raise _api_error(f"cannot delete Job {name}", e) from e


def _api_error(what: str, e: ApiException) -> BackendError:
    try:
        message = json.loads(e.body or "{}").get("message") or e.reason
    except ValueError:
        message = e.reason
    if e.status in (400, 403, 422):  # the cluster refuses this Job as it is: running again cannot help
        return BackendError(f"{what}: {message}", code="orchestrator_refused", failure_class="config", retryable=False)
    return BackendError(f"{what}: {e.status} {message}", code="orchestrator_error")


class KubernetesSandbox:
    """One case attempt's Job and its pod."""

    def __init__(
        self,
        backend: KubernetesBackend,
        job: CaseRequested,
        name: str,
        *,
        spec_checks: tuple[RunnerCheck, ...],
        free_slot: Callable[[], None],
        handoff: LiveHandoff | None = None,
    ) -> None:
        self._backend = backend
        self._handoff = handoff
        self._job = job
        self.name = name
        """The Job's name."""
        self._checks = spec_checks
        self._free_slot = free_slot
        self._mark: Mark | None = None
        self._pod: str | None = None
        self._node: str | None = None
        self._placement = UnitPlacement(phase="queued", reason="the Job was submitted")
        self._seen: set[tuple[str, str, str]] = set()
        self._blocked: str | None = None
        self._log: JobLog | None = None
        self._released = False
        self._running = False
        self._pid: int | None = None
        self._follower: asyncio.Future[None] | None = None
        self._response: Any = None
        self._received = 0
        self._changed = asyncio.Event()
        self._watch: Any = None
        self._watching: asyncio.Future[None] | None = None
        self._held: Holding | None = None

    @property
    def unit(self) -> str | None:
        """`pod:<name>` once the pod exists."""
        return f"pod:{self._pod}" if self._pod else None

    @property
    def node(self) -> str | None:
        """The node the pod was scheduled on."""
        return self._node

    @property
    def released(self) -> bool:
        """Whether `release` has run."""
        return self._released

    def observe(self, mark: Mark) -> None:
        """Mark the run's trace as the pod comes up (see the module's docstring)."""
        self._mark = mark

    async def placement(self) -> UnitPlacement:
        """The pod now, read from the cluster."""
        await self._poll()
        return self._placement

    def usage(self) -> UnitUsage | None:
        """The harness's pid while the container runs (the cluster's metrics are not read)."""
        if not self._running or self._pid is None:
            return None
        return UnitUsage(pid=self._pid, processes=1, rss_bytes=None, cpu_seconds=None)

    async def _say(self, event: str, message: str) -> None:
        if self._mark is None:
            return
        try:
            await self._mark(event, message)
        except Exception:  # a live-view problem never stops the run
            log.warning("marking the trace failed", exc_info=True)

    async def _poll(self) -> UnitPlacement:
        """Read the pod and its events once; mark what is new."""
        backend = self._backend
        ns = backend.template.namespace
        try:
            pods = await backend.call(
                backend.core.list_namespaced_pod, ns, label_selector=f"job-name={self.name}", _request_timeout=30
            )
        except (ApiException, OSError) as e:
            log.warning("cannot read the pod of %s: %s", self.name, e)
            return self._placement
        items = sorted(pods.items, key=lambda p: p.metadata.creation_timestamp or _EPOCH)
        pod = items[-1] if items else None
        events: tuple[OrchestratorEvent, ...] = ()
        if pod is not None:
            try:
                found = await backend.call(
                    backend.core.list_namespaced_event,
                    ns,
                    field_selector=f"involvedObject.name={pod.metadata.name}",
                    _request_timeout=30,
                )
                events = read_events(found.items)
            except (ApiException, OSError) as e:
                log.warning("cannot read the events of %s: %s", pod.metadata.name, e)
        placement = read_pod(pod, events)
        await self._report(placement)
        self._placement = placement
        return placement

    async def _report(self, now: UnitPlacement) -> None:
        if now.unit and self._pod is None:
            self._pod = now.unit
        for event in now.events:
            key = (event.at.isoformat() if event.at else "", event.reason, event.message)
            if key in self._seen:
                continue
            self._seen.add(key)
            await self._say("pod", event_line(event))
        if now.node and self._node is None:
            self._node = now.node
            await self._say("scheduled", f"pod {now.unit} scheduled on node {now.node}")
        if now.phase == "blocked" and now.reason != self._blocked:
            self._blocked = now.reason
            await self._say("waiting", f"blocked: {now.reason}")

    async def run_harness(self, on_output: OnOutput, on_spawn: OnSpawn | None = None) -> HarnessRun:
        """Wait for the pod to run, follow its log to the end, and read how the harness ended."""
        self._check_live()
        await self._say("submitted", f"Job {self.name} submitted to namespace {self._backend.template.namespace}")
        started = time.monotonic()
        limit = self._backend.template.start_timeout_s
        spec = runner_job(self._job, run_of(self._job), hold_s=self._backend.template.artifact_hold_s)
        self._start_watch(limit + spec.timeout_s + sum(c.timeout_s for c in spec.checks) + spec.hold_s + 120.0)
        try:
            return await self._run(on_output, on_spawn, started, limit, spec)
        finally:
            self._stop_watch()

    async def _run(
        self, on_output: OnOutput, on_spawn: OnSpawn | None, started: float, limit: float, spec: RunnerJob
    ) -> HarnessRun:
        while True:
            placement = await self._poll()
            failure = start_failure(placement)
            if failure is not None:
                return HarnessRun(
                    exit_code=None, stdout="", stderr="", spawn_error=f"the container cannot start: {failure}"
                )
            if placement.phase in ("running", "dead"):
                break
            if time.monotonic() - started > limit:
                why = placement.reason or placement.phase
                return HarnessRun(
                    exit_code=None, stdout="", stderr="", spawn_error=f"the pod did not start within {limit:g}s: {why}"
                )
            await self._pause()
        self._running = placement.phase == "running"
        ran_from = time.monotonic()

        async def spawned(pid: int) -> None:
            self._pid = pid
            if on_spawn is not None:
                await on_spawn(pid)

        job_log = self._log = JobLog(on_output, spawned, handoff=self._handoff)
        lines = LineSplitter()
        await self._follow(job_log, lines, spec.timeout_s + sum(c.timeout_s for c in spec.checks) + spec.hold_s + 120.0)
        followed_to_hold = job_log.holding is not None
        final = self._placement if followed_to_hold else await self._settled()
        if not followed_to_hold:
            await self._catch_up(job_log, lines)
        self._running = False
        if job_log.holding is not None:  # the runner reported everything and keeps the pod for its files
            self._held = job_log.holding
            return job_log.harness_run(UnitEnd(exit_code=None), time.monotonic() - ran_from)
        end = UnitEnd(
            exit_code=final.exit_code,
            reason=final.reason,
            oom=final.oom if final.phase == "dead" else None,
            timed_out=bool(final.reason and final.reason.startswith("DeadlineExceeded")),
        )
        return job_log.harness_run(end, time.monotonic() - ran_from)

    def _start_watch(self, seconds: float) -> None:
        """Watch the Job's pod in the pool: every change wakes `_pause` at once (the Events are
        still read on each poll). Without a watch (refused, dropped) the polls go on alone."""
        backend = self._backend
        loop = asyncio.get_running_loop()
        watcher = self._watch = watch.Watch()  # type: ignore[no-untyped-call]

        def changed() -> None:
            self._changed.set()

        def run() -> None:
            try:
                for _ in watcher.stream(  # type: ignore[no-untyped-call]
                    backend.core.list_namespaced_pod, backend.template.namespace,
                    label_selector=f"job-name={self.name}", timeout_seconds=int(seconds),
                    _request_timeout=(30.0, seconds + 30.0),
                ):  # fmt: skip
                    loop.call_soon_threadsafe(changed)
            except Exception as e:  # refused or dropped: polling carries on
                log.info("watching the pod of %s ended: %s", self.name, e)

        self._watching = loop.run_in_executor(backend._pool, run)

    def _stop_watch(self) -> None:
        if self._watch is not None:
            self._watch.stop()  # also unblocks the thread's read

    async def _pause(self) -> None:
        """Until the pod changes, or the poll interval passed."""
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(self._backend.poll_s):
                await self._changed.wait()
        self._changed.clear()

    async def _follow(self, job_log: JobLog, lines: LineSplitter, read_timeout_s: float) -> None:
        """The container's log while it runs, decoded line by line as it comes (whole lines only:
        the rest waits for `_catch_up`)."""
        backend = self._backend
        loop = asyncio.get_running_loop()
        chunks: asyncio.Queue[bytes | None] = asyncio.Queue()

        def read() -> None:  # in the backend's pool: the client's stream is blocking
            try:
                response = backend.core.read_namespaced_pod_log(
                    self._pod, backend.template.namespace, container=CONTAINER, follow=True,
                    _preload_content=False, _request_timeout=(30.0, read_timeout_s),
                )  # fmt: skip
                self._response = response
                for chunk in response.stream(_LOG_CHUNK):
                    loop.call_soon_threadsafe(chunks.put_nowait, chunk)
            except Exception as e:  # the pod went away, the connection dropped: `_catch_up` reads the rest
                log.info("following the log of %s ended: %s", self._pod, e)
            finally:
                loop.call_soon_threadsafe(chunks.put_nowait, None)

        self._follower = loop.run_in_executor(backend._pool, read)
        while (chunk := await chunks.get()) is not None:
            before = len(lines.rest)
            for line in lines.push(chunk):
                await job_log.line(line)
            self._received += before + len(chunk) - len(lines.rest)
            if job_log.holding is not None:
                return  # the pod is held: its log ends only with it (the reader ends at release)
        await self._follower

    async def _catch_up(self, job_log: JobLog, lines: LineSplitter) -> None:
        """What following missed (a dropped stream, the last line without a newline), from one read
        of the ended container's whole log; what was followed if the pod is gone already."""
        backend = self._backend
        try:
            whole = await backend.call(
                backend.core.read_namespaced_pod_log, self._pod, backend.template.namespace, container=CONTAINER,
                _preload_content=False, _request_timeout=60,
            )  # fmt: skip
            data: bytes = whole.data
            if len(data) >= self._received:
                lines.rest = b""  # the whole read covers the partial line again
                for line in lines.push(data[self._received :]):
                    await job_log.line(line)
        except (ApiException, OSError) as e:
            log.info("the whole log of %s could not be read: %s", self._pod, e)
        for line in lines.end():
            await job_log.line(line)

    async def _settled(self) -> UnitPlacement:
        """The pod once its container terminated (bounded: a pod gone or stuck gives what was seen)."""
        deadline = time.monotonic() + 30.0
        while True:
            placement = await self._poll()
            if placement.phase == "dead" or placement.unit is None or time.monotonic() > deadline:
                return placement
            await self._pause()

    async def exec(self, command: str, timeout_s: float) -> ExecResult:
        """What the runner's check gave for `command` (the job has ended: the runner ran it there)."""
        self._check_live()
        if self._log is None:
            return ExecResult(exit_code=127, stdout="", stderr="[evalbus] the job never ran", timed_out=False)
        return self._log.exec_result(command)

    async def snapshot(self, answer: str) -> Snapshot:
        """The workdir's git changes the runner recorded, else the answer."""
        self._check_live()
        return self._log.snapshot(answer) if self._log is not None else PromptSnapshot(output=answer)

    async def exec_live(
        self, command: str, timeout_s: float, *, cap_bytes: int, on_spawn: OnSpawn | None = None
    ) -> LiveExec:
        """Run `command` with `sh -c` in the runner's workdir of the running container, over the
        exec WebSocket, through the runner (`--exec`: the job's secret values masked in what it
        prints); `BackendError` when the container is not running (or released)."""
        self._check_live()
        runner = [*self._backend.template.runner_command, "--workdir", "work", "--exec", command]
        ws = await self._open(runner, tty=False)  # through the runner: the secrets masked in the output
        got = await run_once(ws, timeout_s, max(cap_bytes, 1))
        cut = len(got.stdout) >= cap_bytes or len(got.stderr) >= cap_bytes
        return LiveExec(
            exit_code=got.exit_code,
            stdout=got.stdout.decode("utf-8", errors="replace"),
            stderr=got.stderr.decode("utf-8", errors="replace"),
            timed_out=got.timed_out,
            truncated=cut,
        )

    async def open_shell(self, cols: int, rows: int, on_output: Callable[[bytes], Awaitable[None]]) -> ExecShell:
        """An interactive shell (with a terminal) in the running container, in the runner's workdir."""
        self._check_live()
        ws = await self._open(["/bin/sh", "-c", "cd work 2>/dev/null; exec /bin/sh -i"], tty=True, stdin=True)
        shell = ExecShell(ws, on_output, "/bin/sh")
        shell.resize(cols, rows)
        return shell

    def kill_group(self, pgid: int) -> None:
        """Nothing to do: an exec's processes end with its connection."""

    async def open_file(self, rel: str, *, max_bytes: int) -> AsyncIterator[bytes]:
        """The workdir's file `rel`, from the pod the runner holds, by an exec of the runner
        (`--send-file`: it checks the path as the local backend does and writes the bytes to stdout);
        `FileUnreadable` when it is missing, no regular file, too large, or the pod is not held."""
        self._check_live()
        if self._held is None or self._pod is None:
            hold = self._backend.template.artifact_hold_s
            why = "the Job's artifact hold is off (artifact_hold_s 0)" if hold <= 0 else "the runner did not hold it"
            raise FileUnreadable(f"the pod ended before its files could be read: {why}")
        argv = [*self._backend.template.runner_command, "--workdir", "work", "--send-file", rel,
                "--max-bytes", str(max_bytes)]  # fmt: skip
        try:
            ws = await self._open(argv, tty=False, held=True)
        except BackendError as e:
            raise FileUnreadable(f"the pod cannot be read: {e.message}") from e
        frames = exec_frames(ws, FILE_IDLE_S)
        stderr = bytearray()
        handed = False
        try:
            async for channel, data in frames:  # until the first bytes, or the runner's refusal
                if channel == STDOUT and data:
                    handed = True
                    return _file_blocks(data, frames, max_bytes)
                if channel == STDERR:
                    stderr.extend(data[:4096])
                elif channel == ERROR:
                    code = exit_code(data)
                    if code == 0:
                        return _no_blocks()  # an empty file
                    raise _refusal(code, stderr.decode("utf-8", errors="replace"), max_bytes)
        except TimeoutError as e:
            raise FileUnreadable(f"the pod sent nothing for {FILE_IDLE_S:g}s") from e
        except aiohttp.ClientError as e:
            raise FileUnreadable(f"the exec connection failed: {e}") from e
        finally:
            if not handed:
                await frames.aclose()  # the connection with it
        raise FileUnreadable("the exec ended without the runner's status")

    async def _release_hold(self) -> None:
        """Tell the holding runner the files are read (SIGUSR1: it says `done` and exits at once)."""
        held = self._held
        if held is None or self._pod is None:
            return
        try:
            ws = await self._open(["/bin/sh", "-c", f"kill -USR1 {held.pid}"], tty=False, held=True)
            await run_once(ws, 10.0, 4096)
        except Exception as e:  # deleting the Job ends the hold too (SIGTERM), only later
            log.info("ending the hold of %s failed: %s", self._pod, e)
        finally:
            self._held = None

    async def _open(
        self, command: list[str], *, tty: bool, stdin: bool = False, held: bool = False
    ) -> aiohttp.ClientWebSocketResponse:
        if not (self._running or (held and self._held is not None)) or self._pod is None:
            raise BackendError("the case's container is not running", code="not_running", retryable=False)
        backend = self._backend
        url = exec_url(backend.access, backend.template.namespace, self._pod, CONTAINER, command, stdin=stdin, tty=tty)
        try:
            return await connect(backend.session(), backend.access, url)
        except ExecError as e:
            raise BackendError(str(e), code="exec_failed", retryable=False) from e

    async def release(self) -> None:
        """Delete the Job (its pod with it). Idempotent."""
        if self._released:
            return
        self._released = True
        self._running = False
        self._stop_watch()
        try:
            await self._release_hold()
            await self._backend.delete(self.name)
        finally:
            if self._response is not None:
                try:
                    self._response.release_conn()
                except Exception:  # the follower may be closing it too
                    log.debug("closing the log stream failed", exc_info=True)
            self._free_slot()

    def _check_live(self) -> None:
        if self._released:
            raise BackendError("the sandbox was already released", code="released", retryable=False)


async def _file_blocks(
    first: bytes, frames: AsyncGenerator[tuple[int, bytes], None], max_bytes: int
) -> AsyncIterator[bytes]:
    """The file's bytes from an exec of `--send-file`: `first`, then the stdout channel to the
    runner's status; `BackendError` when it failed midway, or sent more than `max_bytes`."""
    seen = len(first)
    if first:
        yield first
    code: int | None = None
    try:
        async for channel, data in frames:
            if channel == STDOUT and data:
                seen += len(data)
                if seen > max_bytes:
                    raise FileUnreadable.too_large(seen, max_bytes)
                yield data
            elif channel == ERROR:
                code = exit_code(data)
    except TimeoutError as e:
        raise BackendError(f"the pod sent nothing for {FILE_IDLE_S:g}s", code="file_read_failed") from e
    except aiohttp.ClientError as e:
        raise BackendError(f"the exec connection failed: {e}", code="file_read_failed") from e
    finally:
        await frames.aclose()
    if code != 0:
        why = "without a status" if code is None else f"with exit code {code}"
        raise BackendError(f"reading the file from the pod ended {why}", code="file_read_failed")


async def _no_blocks() -> AsyncIterator[bytes]:
    """An empty file's blocks."""
    none: tuple[bytes, ...] = ()
    for block in none:
        yield block


def _refusal(code: int, stderr: str, max_bytes: int) -> FileUnreadable:
    """The runner's `--send-file` exit code as the reason a file is not given."""
    if code == SEND_MISSING:
        return FileUnreadable.missing()
    if code == SEND_NOT_A_FILE:
        return FileUnreadable.not_a_file()
    size = re.search(r"size=(\d+)", stderr)
    if code == SEND_TOO_LARGE and size is not None:
        return FileUnreadable.too_large(int(size.group(1)), max_bytes)
    return FileUnreadable(f"the runner could not send it (exit {code}): {stderr.strip()[-500:]}")


def connect_cluster(
    template: JobTemplate,
    *,
    kubeconfig: str | None = None,
    context: str | None = None,
    slots: int = 4,
    poll_s: float = 1.0,
    environ: Mapping[str, str] | None = None,
    live: LiveHandoffs | None = None,
) -> KubernetesBackend:
    """A backend on the cluster `kubeconfig` (and `context`) names; without one, the in-cluster
    service account when running in a pod, else the default kubeconfig (`~/.kube/config`)."""
    env = os.environ if environ is None else environ
    cfg = k8s.Configuration()
    if kubeconfig is None and env.get("KUBERNETES_SERVICE_HOST"):
        k8s_config.load_incluster_config(client_configuration=cfg)  # type: ignore[no-untyped-call]
    else:
        k8s_config.load_kube_config(  # type: ignore[no-untyped-call]
            config_file=kubeconfig, context=context, client_configuration=cfg
        )
    return KubernetesBackend(k8s.ApiClient(cfg), template, slots=slots, poll_s=poll_s, live=live)
