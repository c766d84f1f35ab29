"""A **protocol-level** fake of the Kubernetes API server and kubelet — not a real cluster.

It speaks the HTTP and WebSocket API the dispatcher's Kubernetes backend uses, checks every
request against the documented API (paths, verbs, query parameters as in the Kubernetes OpenAPI
document; Job bodies validated against its schemas by `kubernetes-validate`, strict: an unknown
field is an error; DeleteOptions against its field list), and answers with the documented object shapes (`PodList`,
`EventList`, `NodeList`, `Status`, the exec channel protocol `v5.channel.k8s.io` /
`v4.channel.k8s.io`). A request that does not match is answered 400/404 with a `Status` *and*
recorded in `violations`, so a test can assert none happened.

Behind it a tiny kubelet runs each pod's container command **as a local process** (the image name
only decides whether the pull succeeds): a pod is scheduled onto a node whose labels match its
`nodeSelector` and whose allocatable CPU/memory/GPUs minus the requests of the pods on it fit its
requests — otherwise it stays Pending with a `FailedScheduling` event, and is placed once a node
is added or a pod ends; an image not in `images` fails with `ErrImagePull` then `ImagePullBackOff`;
a `secretKeyRef` to a missing secret gives `CreateContainerConfigError` (an `optional` one leaves
the variable out); a container whose
processes together use more resident memory than its limit is killed (`OOMKilled`, exit 137); a
Job past its `activeDeadlineSeconds` is killed (`DeadlineExceeded`). Logs (stdout and stderr merged,
as the kubelet serves them) follow the process. Events carry real timestamps.

NetworkPolicies (`POST /apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies`) are validated
against the `networking.k8s.io/v1` schema, stored (a second create of a name is 409 AlreadyExists)
and listed in `network_policies`, but not enforced: pods run with the host's network, as on a
cluster whose CNI ignores NetworkPolicy.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import re
import secrets
import signal
import sys
import tempfile
import uuid
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import kubernetes_validate  # type: ignore[import-untyped]
from aiohttp import WSMsgType, web

Json = dict[str, Any]

KUBERNETES_VERSION = "1.33"
"""The API version request bodies are validated against."""
DEFAULT_IMAGE = "evalbus/case:test"
"""An image the fake can "pull"."""
CHANNEL_PROTOCOLS = ("v5.channel.k8s.io", "v4.channel.k8s.io")
"""Exec subprotocols the fake speaks, preferred first."""

_LIST_PARAMS = {
    "labelSelector", "fieldSelector", "limit", "resourceVersion", "resourceVersionMatch", "timeoutSeconds",
    "watch", "pretty", "allowWatchBookmarks", "continue", "sendInitialEvents",
}  # fmt: skip
_LOG_PARAMS = {
    "container", "follow", "previous", "sinceSeconds", "sinceTime", "tailLines", "timestamps", "limitBytes",
    "pretty", "insecureSkipTLSVerifyBackend", "stream",
}  # fmt: skip
_CREATE_PARAMS = {"dryRun", "fieldManager", "fieldValidation", "pretty"}
_DNS_SUBDOMAIN = r"[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*"
_DELETE_PARAMS = {
    "dryRun", "gracePeriodSeconds", "propagationPolicy", "orphanDependents", "pretty",
    "ignoreStoreReadErrorWithClusterBreakingPotential",
}  # fmt: skip
_DELETE_OPTIONS = {
    "apiVersion", "kind", "dryRun", "gracePeriodSeconds", "orphanDependents", "preconditions", "propagationPolicy",
    "ignoreStoreReadErrorWithClusterBreakingPotential",
}  # fmt: skip
_EXEC_PARAMS = {"command", "container", "stdin", "stdout", "stderr", "tty"}
_PULL_FAILURES = ("ErrImagePull", "ImagePullBackOff")
_QUANTITY = re.compile(r"^([0-9.]+)(m|Ki|Mi|Gi|Ti|k|M|G|T)?$")
_SCALE = {
    None: 1, "m": 0.001, "k": 1e3, "M": 1e6, "G": 1e9, "T": 1e12,
    "Ki": 1024, "Mi": 1024**2, "Gi": 1024**3, "Ti": 1024**4,
}  # fmt: skip


def quantity(text: str | int | float) -> float:
    """A Kubernetes quantity (`500m`, `2`, `64Mi`) as a number."""
    m = _QUANTITY.match(str(text))
    if m is None:
        raise ValueError(f"not a quantity: {text!r}")
    return float(m.group(1)) * _SCALE[m.group(2)]


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _status(code: int, reason: str, message: str) -> Json:
    return {
        "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Failure",
        "message": message, "reason": reason, "code": code,
    }  # fmt: skip


@dataclass
class FakeNode:
    """A node: its allocatable resources and labels."""

    name: str
    cpu: float
    memory: float
    gpus: int = 0
    labels: dict[str, str] = field(default_factory=dict)

    def body(self) -> Json:
        allocatable = {"cpu": f"{self.cpu:g}", "memory": f"{int(self.memory)}", "pods": "110"}
        if self.gpus:
            allocatable["nvidia.com/gpu"] = str(self.gpus)
        return {
            "metadata": {
                "name": self.name,
                "uid": str(uuid.uuid5(uuid.NAMESPACE_URL, self.name)),
                "labels": {"kubernetes.io/hostname": self.name, **self.labels},
            },
            "status": {
                "allocatable": allocatable,
                "capacity": allocatable,
                "conditions": [{"type": "Ready", "status": "True", "reason": "KubeletReady"}],
            },
        }


@dataclass
class FakePod:
    """A pod of a Job and the process its container runs as."""

    name: str
    namespace: str
    job: str
    uid: str
    spec: Json
    labels: dict[str, str]
    created: str = field(default_factory=_now)
    phase: str = "Pending"
    node: str | None = None
    unschedulable: str | None = None
    waiting: tuple[str, str] | None = ("ContainerCreating", "")
    started_at: str | None = None
    terminated: Json | None = None
    log: bytearray = field(default_factory=bytearray)
    process: asyncio.subprocess.Process | None = None
    workdir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    oom_killed: bool = False
    deadline_killed: bool = False
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    @property
    def container(self) -> Json:
        containers: list[Json] = self.spec["containers"]
        return containers[0]

    def requests(self) -> tuple[float, float, float]:
        resources = self.container.get("resources", {})
        asked = {**resources.get("limits", {}), **resources.get("requests", {})}
        return (
            quantity(asked.get("cpu", "0")),
            quantity(asked.get("memory", "0")),
            quantity(asked.get("nvidia.com/gpu", "0")),
        )

    def body(self) -> Json:
        container = self.container
        state: Json
        if self.terminated is not None:
            state = {"terminated": self.terminated}
        elif self.started_at is not None:
            state = {"running": {"startedAt": self.started_at}}
        else:
            reason, message = self.waiting or ("ContainerCreating", "")
            state = {"waiting": {"reason": reason, **({"message": message} if message else {})}}
        conditions: list[Json] = []
        if self.node is not None:
            conditions.append({"type": "PodScheduled", "status": "True", "lastTransitionTime": self.created})
        elif self.unschedulable is not None:
            conditions.append(
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "message": self.unschedulable,
                    "lastTransitionTime": self.created,
                }
            )
        status: Json = {"phase": self.phase, "conditions": conditions}
        if self.node is not None:
            status["startTime"] = self.created
            status["containerStatuses"] = [
                {
                    "name": container["name"],
                    "image": container["image"],
                    "imageID": "",
                    "ready": self.started_at is not None and self.terminated is None,
                    "restartCount": 0,
                    "started": self.started_at is not None and self.terminated is None,
                    "state": state,
                    "lastState": {},
                }
            ]
        return {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": self.name,
                "namespace": self.namespace,
                "uid": self.uid,
                "labels": self.labels,
                "creationTimestamp": self.created,
                "ownerReferences": [
                    {"apiVersion": "batch/v1", "kind": "Job", "name": self.job, "uid": self.uid, "controller": True}
                ],
            },
            "spec": {**self.spec, **({"nodeName": self.node} if self.node else {})},
            "status": status,
        }


class FakeKubernetes:
    """The fake API server; `async with FakeKubernetes() as k8s:` serves it on a loopback port."""

    def __init__(self, *, images: set[str] | None = None, namespace: str = "evalbus") -> None:
        self.images = {DEFAULT_IMAGE} if images is None else set(images)
        """Images a pull succeeds for."""
        self.namespaces = {namespace, "default"}
        self.nodes: dict[str, FakeNode] = {}
        self.secrets: dict[tuple[str, str], dict[str, str]] = {}
        self.jobs: dict[tuple[str, str], Json] = {}
        self.network_policies: dict[tuple[str, str], Json] = {}
        """Created NetworkPolicies by (namespace, name)."""
        self.forbid_network_policies = False
        """Answer NetworkPolicy creates `403 Forbidden`, as RBAC does for a Role without them."""
        self.created_jobs: list[Json] = []
        """Every Job body accepted, in order (kept after the Job is deleted)."""
        self.pods: dict[tuple[str, str], FakePod] = {}
        self.events: list[Json] = []
        self.violations: list[str] = []
        """Requests that did not match the documented API."""
        self.requests: list[tuple[str, str]] = []
        """(method, path) of every request, in order."""
        self.deletions: list[tuple[str, str | None]] = []
        """(job name, propagationPolicy) of every Job deletion."""
        self.watches = 0
        """Watches of pods opened."""
        self.exec_protocols: list[str] = []
        """The subprotocol each exec connection settled on."""
        self.exec_commands: list[list[str]] = []
        """The argv of every exec accepted, in order."""
        self._changed = asyncio.Condition()
        self._runner: web.AppRunner | None = None
        self._root = Path(tempfile.mkdtemp(prefix="fake-k8s-"))
        self.url = ""
        """`http://127.0.0.1:<port>` once started."""

    # ------------------------------------------------------------ test controls

    def add_node(
        self, name: str, *, cpu: float = 4, memory: str = "8Gi", gpus: int = 0, labels: Mapping[str, str] | None = None
    ) -> None:
        """A node joins (pods waiting for room are scheduled again)."""
        self.nodes[name] = FakeNode(name=name, cpu=cpu, memory=quantity(memory), gpus=gpus, labels=dict(labels or {}))
        self._notify()

    async def lose_node(self, name: str) -> None:
        """A node goes away: its pods' processes die and the pods are deleted (as the node lifecycle
        controller evicts them), their Events kept."""
        self.nodes.pop(name, None)
        for key, pod in list(self.pods.items()):
            if pod.node == name:
                self._event(pod, "NodeNotReady", f"Node {name} status is now: NodeNotReady", kind="Warning",
                            source="node-controller")  # fmt: skip
                await self._stop(pod)
                del self.pods[key]
        self._notify()

    def add_secret(self, name: str, data: Mapping[str, str], namespace: str = "evalbus") -> None:
        """A Secret the kubelet resolves `secretKeyRef`s from."""
        self.secrets[(namespace, name)] = dict(data)

    async def __aenter__(self) -> FakeKubernetes:
        app = web.Application(middlewares=[self._record])
        app.router.add_post("/apis/batch/v1/namespaces/{ns}/jobs", self._create_job)
        app.router.add_get("/apis/batch/v1/namespaces/{ns}/jobs", self._list_jobs)
        app.router.add_delete("/apis/batch/v1/namespaces/{ns}/jobs/{name}", self._delete_job)
        app.router.add_get("/api/v1/namespaces/{ns}/pods", self._list_pods)
        app.router.add_get("/api/v1/pods", self._list_all_pods)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}/log", self._log)
        app.router.add_get("/api/v1/namespaces/{ns}/pods/{name}/exec", self._exec)
        app.router.add_get("/api/v1/namespaces/{ns}/events", self._list_events)
        app.router.add_get("/api/v1/nodes", self._list_nodes)
        app.router.add_post("/apis/networking.k8s.io/v1/namespaces/{ns}/networkpolicies", self._create_network_policy)
        self._runner = web.AppRunner(app, handle_signals=False)
        await self._runner.setup()
        site = web.TCPSite(self._runner, "127.0.0.1", 0)
        await site.start()
        server = site._server
        assert isinstance(server, asyncio.Server)
        port = server.sockets[0].getsockname()[1]
        self.url = f"http://127.0.0.1:{port}"
        return self

    async def __aexit__(self, *_: object) -> None:
        for pod in list(self.pods.values()):
            await self._stop(pod)
        if self._runner is not None:
            await self._runner.cleanup()

    def _notify(self) -> None:
        async def wake() -> None:
            async with self._changed:
                self._changed.notify_all()

        with contextlib.suppress(RuntimeError):
            asyncio.get_running_loop().create_task(wake())

    async def _wait_change(self, limit_s: float = 0.5) -> None:
        """Until the cluster changes (or `limit_s`: a change notified just before waiting is not lost for long)."""
        async with self._changed:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(limit_s):
                    await self._changed.wait()

    # ------------------------------------------------------------ request checks

    @web.middleware
    async def _record(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        try:
            response: web.StreamResponse = await handler(request)
        except web.HTTPNotFound:
            return self._refuse(404, "NotFound", f"no such endpoint: {request.method} {request.path}")
        except web.HTTPMethodNotAllowed:
            return self._refuse(405, "MethodNotAllowed", f"method not allowed: {request.method} {request.path}")
        return response

    def _refuse(self, code: int, reason: str, message: str) -> web.Response:
        self.violations.append(message)
        return web.json_response(_status(code, reason, message), status=code)

    def _check(self, request: web.Request, allowed: set[str]) -> web.Response | None:
        unknown = sorted(set(request.query) - allowed)
        if unknown:
            return self._refuse(400, "BadRequest", f"{request.path}: unknown query parameter(s) {unknown}")
        ns = request.match_info.get("ns")
        if ns is not None and ns not in self.namespaces:
            return web.json_response(_status(404, "NotFound", f'namespaces "{ns}" not found'), status=404)
        return None

    def _selector(self, request: web.Request, name: str) -> dict[str, str] | web.Response:
        """`k=v,k2!=v2` as {"k": "v", "k2!": "v2"} (set-based selectors are not supported here)."""
        raw = request.query.get(name, "")
        out: dict[str, str] = {}
        for part in filter(None, raw.split(",")):
            m = re.fullmatch(r"([A-Za-z0-9./_-]+)(!=|==|=)(.*)", part)
            if m is None or (m.group(2) == "!=" and name != "fieldSelector"):
                return self._refuse(400, "BadRequest", f"{name} {raw!r}: only equality selectors are supported")
            out[m.group(1) + ("!" if m.group(2) == "!=" else "")] = m.group(3)
        return out

    async def _json_body(self, request: web.Request) -> Json | web.Response:
        # The API server reads a body without a Content-Type as its first media type, JSON.
        if request.headers.get("Content-Type") and request.content_type != "application/json":
            return self._refuse(415, "UnsupportedMediaType", f"{request.path}: body must be application/json")
        try:
            body = await request.json()
        except ValueError as e:
            return self._refuse(400, "BadRequest", f"{request.path}: body is not JSON: {e}")
        if not isinstance(body, dict):
            return self._refuse(400, "BadRequest", f"{request.path}: body must be an object")
        return body

    def _validate(self, body: Json, what: str) -> web.Response | None:
        try:
            kubernetes_validate.validate(body, KUBERNETES_VERSION, strict=True)
        except kubernetes_validate.ValidationError as e:
            where = ".".join(map(str, e.path))
            return self._refuse(422, "Invalid", f"{what} is invalid at {where or '<root>'}: {e.message}")
        return None

    # ------------------------------------------------------------ jobs

    async def _create_job(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._check(request, _CREATE_PARAMS)) is not None:
            return refused
        body = await self._json_body(request)
        if isinstance(body, web.Response):
            return body
        if (refused := self._validate(body, "Job")) is not None:
            return refused
        if body.get("apiVersion") != "batch/v1" or body.get("kind") != "Job":
            return self._refuse(400, "BadRequest", "POST .../jobs takes a batch/v1 Job")
        ns = request.match_info["ns"]
        meta = body["metadata"]
        name = meta.get("name")
        if not name or not re.fullmatch(r"[a-z0-9]([-a-z0-9]*[a-z0-9])?", name) or len(name) > 63:
            return self._refuse(422, "Invalid", f"Job name {name!r} must be a DNS-1123 label of at most 63 characters")
        for key, value in {**meta.get("labels", {}), **body["spec"]["template"]["metadata"]["labels"]}.items():
            if len(value) > 63 or not re.fullmatch(r"([A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?)?", value):
                return self._refuse(422, "Invalid", f"label {key}={value!r} is not a valid label value")
        if meta.get("namespace", ns) != ns:
            return self._refuse(400, "BadRequest", "the namespace of the body does not match the path")
        pod_spec = body["spec"]["template"]["spec"]
        if pod_spec.get("restartPolicy") not in ("Never", "OnFailure"):
            return self._refuse(422, "Invalid", "a Job's pod template needs restartPolicy Never or OnFailure")
        mounts = {m["name"] for c in pod_spec["containers"] for m in c.get("volumeMounts", [])}
        missing = mounts - {v["name"] for v in pod_spec.get("volumes", [])}
        if missing:
            return self._refuse(422, "Invalid", f"volumeMounts name volumes that do not exist: {sorted(missing)}")
        if (ns, name) in self.jobs:
            return web.json_response(_status(409, "AlreadyExists", f'jobs.batch "{name}" already exists'), status=409)
        uid = str(uuid.uuid4())
        job = {
            **body,
            "metadata": {**meta, "namespace": ns, "uid": uid, "creationTimestamp": _now(), "resourceVersion": "1"},
            "status": {"active": 1, "startTime": _now()},
        }
        self.jobs[(ns, name)] = job
        self.created_jobs.append(body)
        pod_name = f"{name}-{secrets.token_hex(3)[:5]}"
        labels = {
            **body["spec"]["template"]["metadata"].get("labels", {}),
            "job-name": name,
            "batch.kubernetes.io/job-name": name,
            "controller-uid": uid,
        }
        pod = FakePod(name=pod_name, namespace=ns, job=name, uid=uid, spec=pod_spec, labels=labels)
        self.pods[(ns, pod_name)] = pod
        pod.tasks.append(asyncio.create_task(self._kubelet(pod, job)))
        return web.json_response(job, status=201)

    # ------------------------------------------------------------ network policies

    async def _create_network_policy(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._check(request, _CREATE_PARAMS)) is not None:
            return refused
        ns = request.match_info["ns"]
        if self.forbid_network_policies:  # authorization comes before the body is read
            message = (f'networkpolicies.networking.k8s.io is forbidden: User "system:serviceaccount:{ns}:evalbus-'
                       f'dispatcher" cannot create resource "networkpolicies" in API group "networking.k8s.io" in the '
                       f'namespace "{ns}"')  # fmt: skip
            return web.json_response(_status(403, "Forbidden", message), status=403)
        body = await self._json_body(request)
        if isinstance(body, web.Response):
            return body
        if body.get("apiVersion") != "networking.k8s.io/v1" or body.get("kind") != "NetworkPolicy":
            return self._refuse(
                400, "BadRequest", "POST .../networkpolicies takes a networking.k8s.io/v1 NetworkPolicy"
            )
        if (refused := self._validate(body, "NetworkPolicy")) is not None:
            return refused
        meta = body.get("metadata") or {}
        name = meta.get("name")
        if not name or len(name) > 253 or not re.fullmatch(_DNS_SUBDOMAIN, name):
            return self._refuse(422, "Invalid", f"NetworkPolicy name {name!r} must be a DNS-1123 subdomain")
        if meta.get("namespace", ns) != ns:
            return self._refuse(400, "BadRequest", "the namespace of the body does not match the path")
        spec = body.get("spec") or {}
        if "podSelector" not in spec:
            return self._refuse(422, "Invalid", "spec.podSelector: Required value")
        types = spec.get("policyTypes", [])
        if any(t not in ("Ingress", "Egress") for t in types) or len(set(types)) != len(types):
            return self._refuse(422, "Invalid", f"spec.policyTypes {types!r}: each of Ingress, Egress at most once")
        if (ns, name) in self.network_policies:
            message = f'networkpolicies.networking.k8s.io "{name}" already exists'
            return web.json_response(_status(409, "AlreadyExists", message), status=409)
        policy = {
            **body,
            "metadata": {**meta, "namespace": ns, "uid": str(uuid.uuid4()), "creationTimestamp": _now(),
                         "resourceVersion": "1", "generation": 1},
        }  # fmt: skip
        self.network_policies[(ns, name)] = policy
        return web.json_response(policy, status=201)

    async def _list_jobs(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._check(request, _LIST_PARAMS)) is not None:
            return refused
        labels = self._selector(request, "labelSelector")
        if isinstance(labels, web.Response):
            return labels
        ns = request.match_info["ns"]
        items = [
            job
            for (job_ns, _), job in self.jobs.items()
            if job_ns == ns and all(job["metadata"].get("labels", {}).get(k) == v for k, v in labels.items())
        ]
        return web.json_response({"apiVersion": "batch/v1", "kind": "JobList", "metadata": {}, "items": items})

    async def _delete_job(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._check(request, _DELETE_PARAMS)) is not None:
            return refused
        policy = request.query.get("propagationPolicy")
        if request.can_read_body:
            body = await self._json_body(request)
            if isinstance(body, web.Response):
                return body
            unknown = sorted(set(body) - _DELETE_OPTIONS)
            if unknown:  # meta/v1 DeleteOptions, as the OpenAPI document defines it
                return self._refuse(422, "Invalid", f"DeleteOptions has no field(s) {unknown}")
            policy = body.get("propagationPolicy", policy)
        if policy not in (None, "Background", "Foreground", "Orphan"):
            return self._refuse(422, "Invalid", f"propagationPolicy {policy!r} is not Background, Foreground or Orphan")
        ns, name = request.match_info["ns"], request.match_info["name"]
        job = self.jobs.pop((ns, name), None)
        if job is None:
            return web.json_response(_status(404, "NotFound", f'jobs.batch "{name}" not found'), status=404)
        self.deletions.append((name, policy))
        if policy != "Orphan":
            for key, pod in list(self.pods.items()):
                if pod.namespace == ns and pod.job == name:
                    self._event(pod, "Killing", f"Stopping container {pod.container['name']}", source="kubelet")
                    await self._stop(pod)
                    del self.pods[key]
        self._notify()
        return web.json_response(
            {
                "kind": "Status", "apiVersion": "v1", "metadata": {}, "status": "Success",
                "details": {"name": name, "group": "batch", "kind": "jobs", "uid": job["metadata"]["uid"]},
            }
        )  # fmt: skip

    # ------------------------------------------------------------ reads

    async def _list_pods(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._check(request, _LIST_PARAMS)) is not None:
            return refused
        labels = self._selector(request, "labelSelector")
        if isinstance(labels, web.Response):
            return labels
        ns = request.match_info["ns"]

        def matching() -> dict[str, Json]:
            return {
                pod.name: pod.body()
                for pod in self.pods.values()
                if pod.namespace == ns and all(pod.labels.get(k) == v for k, v in labels.items())
            }

        if request.query.get("watch") in ("true", "1"):
            return await self._watch(request, matching)
        items = list(matching().values())
        return web.json_response({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})

    async def _watch(self, request: web.Request, matching: Any) -> web.StreamResponse:
        """A watch: one JSON `WatchEvent` per line (ADDED, MODIFIED, DELETED) until `timeoutSeconds`."""
        try:
            limit = float(request.query.get("timeoutSeconds", "1800"))
        except ValueError:
            return self._refuse(400, "BadRequest", "timeoutSeconds must be a number")
        self.watches += 1
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        sent: dict[str, Json] = {}
        deadline = asyncio.get_running_loop().time() + limit
        try:
            while asyncio.get_running_loop().time() < deadline:
                if request.transport is None or request.transport.is_closing():
                    break  # the client stopped watching
                now = matching()
                lines = [
                    {"type": "MODIFIED" if name in sent else "ADDED", "object": body}
                    for name, body in now.items()
                    if sent.get(name) != body
                ]
                lines += [{"type": "DELETED", "object": body} for name, body in sent.items() if name not in now]
                for line in lines:
                    await response.write(json.dumps(line).encode() + b"\n")
                sent = now
                await self._wait_change()
            await response.write_eof()
        except ConnectionError:  # the client stopped watching
            pass
        return response

    async def _list_all_pods(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._check(request, _LIST_PARAMS)) is not None:
            return refused
        fields = self._selector(request, "fieldSelector")
        if isinstance(fields, web.Response):
            return fields
        excluded = {v for k, v in fields.items() if k == "status.phase!"}
        if set(fields) - {"status.phase!"}:
            return self._refuse(400, "BadRequest", f"unsupported fieldSelector for pods: {sorted(fields)}")
        items = [pod.body() for pod in self.pods.values() if pod.phase not in excluded]
        return web.json_response({"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items})

    async def _list_events(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._check(request, _LIST_PARAMS)) is not None:
            return refused
        fields = self._selector(request, "fieldSelector")
        if isinstance(fields, web.Response):
            return fields
        allowed = {"involvedObject.name", "involvedObject.kind", "involvedObject.uid", "involvedObject.namespace"}
        if set(fields) - allowed:
            return self._refuse(400, "BadRequest", f"unsupported fieldSelector for events: {sorted(fields)}")
        ns = request.match_info["ns"]
        items = [
            e
            for e in self.events
            if e["metadata"]["namespace"] == ns
            and all(e["involvedObject"].get(k.split(".", 1)[1]) == v for k, v in fields.items())
        ]
        return web.json_response({"apiVersion": "v1", "kind": "EventList", "metadata": {}, "items": items})

    async def _list_nodes(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._check(request, _LIST_PARAMS)) is not None:
            return refused
        items = [node.body() for node in self.nodes.values()]
        return web.json_response({"apiVersion": "v1", "kind": "NodeList", "metadata": {}, "items": items})

    def _pod_for(self, request: web.Request) -> FakePod | web.Response:
        pod = self.pods.get((request.match_info["ns"], request.match_info["name"]))
        if pod is None:
            name = request.match_info["name"]
            return web.json_response(_status(404, "NotFound", f'pods "{name}" not found'), status=404)
        container = request.query.get("container")
        if container is not None and container != pod.container["name"]:
            return self._refuse(400, "BadRequest", f"container {container} is not valid for pod {pod.name}")
        return pod

    async def _log(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._check(request, _LOG_PARAMS)) is not None:
            return refused
        pod = self._pod_for(request)
        if isinstance(pod, web.Response):
            return pod
        if pod.started_at is None and pod.terminated is None:
            reason = (pod.waiting or ("ContainerCreating", ""))[0]
            message = f'container "{pod.container["name"]}" in pod "{pod.name}" is waiting to start: {reason}'
            return web.json_response(_status(400, "BadRequest", message), status=400)
        follow = request.query.get("follow") == "true"
        if not follow:
            return web.Response(body=bytes(pod.log), content_type="text/plain")
        response = web.StreamResponse(headers={"Content-Type": "text/plain"})
        await response.prepare(request)
        sent = 0
        while True:
            if len(pod.log) > sent:
                chunk = bytes(pod.log[sent:])
                sent += len(chunk)
                await response.write(chunk)
                continue
            if pod.terminated is not None or (pod.namespace, pod.name) not in self.pods:
                break
            await self._wait_change()
        await response.write_eof()
        return response

    # ------------------------------------------------------------ exec (channel protocol)

    async def _exec(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._check(request, _EXEC_PARAMS)) is not None:
            return refused
        command = request.query.getall("command", [])
        if not command:
            return self._refuse(400, "BadRequest", "exec needs at least one command parameter")
        for flag in ("stdin", "stdout", "stderr", "tty"):
            if request.query.get(flag, "false") not in ("true", "false"):
                return self._refuse(400, "BadRequest", f"exec parameter {flag} must be true or false")
        offered = [p.strip() for p in request.headers.get("Sec-WebSocket-Protocol", "").split(",") if p.strip()]
        if request.headers.get("Upgrade", "").lower() != "websocket" or not set(offered) & set(CHANNEL_PROTOCOLS):
            return self._refuse(400, "BadRequest", "exec is a WebSocket upgrade offering v5/v4.channel.k8s.io")
        pod = self._pod_for(request)
        if isinstance(pod, web.Response):
            return pod
        if pod.started_at is None or pod.terminated is not None or pod.workdir is None:
            message = f"unable to upgrade connection: container not found ({pod.container['name']!r})"
            return web.json_response(_status(400, "BadRequest", message), status=400)
        self.exec_commands.append(list(command))
        ws = web.WebSocketResponse(protocols=[p for p in CHANNEL_PROTOCOLS if p in offered])
        await ws.prepare(request)
        protocol = ws.ws_protocol or ""
        self.exec_protocols.append(protocol)
        tty = request.query.get("tty") == "true"
        with_stdin = request.query.get("stdin") == "true"
        try:
            proc = await asyncio.create_subprocess_exec(
                *command,
                cwd=pod.workdir,
                env=pod.env,
                stdin=asyncio.subprocess.PIPE if with_stdin else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT if tty else asyncio.subprocess.PIPE,
                start_new_session=True,
            )
        except OSError as e:
            await ws.send_bytes(b"\x03" + json.dumps(_status(500, "InternalError", str(e))).encode())
            await ws.close()
            return ws

        async def pump(reader: asyncio.StreamReader | None, channel: int) -> None:
            while reader is not None and (chunk := await reader.read(4096)):
                await ws.send_bytes(bytes([channel]) + chunk)

        pumps = [asyncio.create_task(pump(proc.stdout, 1)), asyncio.create_task(pump(proc.stderr, 2))]

        async def take_input() -> None:
            async for msg in ws:
                if msg.type != WSMsgType.BINARY or not msg.data:
                    continue
                channel, data = msg.data[0], msg.data[1:]
                if channel == 0 and proc.stdin is not None:
                    proc.stdin.write(data)
                    with contextlib.suppress(ConnectionError):
                        await proc.stdin.drain()
                elif channel == 255 and protocol.startswith("v5") and data[:1] == b"\x00" and proc.stdin:
                    proc.stdin.close()
                elif channel == 4:
                    json.loads(data)  # {"Width": .., "Height": ..}: no terminal to resize here
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)  # the client went away

        reader = asyncio.create_task(take_input())
        code = await proc.wait()
        await asyncio.gather(*pumps, return_exceptions=True)
        if code == 0:
            status: Json = {"metadata": {}, "status": "Success"}
        else:
            status = {
                "metadata": {},
                "status": "Failure",
                "message": f"command terminated with non-zero exit code: exit status {code}",
                "reason": "NonZeroExitCode",
                "details": {"causes": [{"reason": "ExitCode", "message": str(code if code >= 0 else 128 - code)}]},
            }
        if not ws.closed:
            with contextlib.suppress(ConnectionError):
                await ws.send_bytes(b"\x03" + json.dumps(status).encode())
            await ws.close()
        reader.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await reader
        return ws

    # ------------------------------------------------------------ the kubelet

    def _event(self, pod: FakePod, reason: str, message: str, *, kind: str = "Normal", source: str) -> None:
        now = _now()
        self.events.append(
            {
                "apiVersion": "v1",
                "kind": "Event",
                "metadata": {"name": f"{pod.name}.{secrets.token_hex(8)}", "namespace": pod.namespace},
                "involvedObject": {"kind": "Pod", "name": pod.name, "namespace": pod.namespace, "uid": pod.uid},
                "reason": reason,
                "message": message,
                "type": kind,
                "source": {"component": source},
                "firstTimestamp": now,
                "lastTimestamp": now,
                "count": 1,
            }
        )
        self._notify()

    def _fit(self, pod: FakePod) -> tuple[FakeNode | None, str]:
        cpu, memory, gpus = pod.requests()
        selector = pod.spec.get("nodeSelector", {})
        reasons: dict[str, int] = {}
        for node in self.nodes.values():
            if any(node.labels.get(k) != v and not (k == "kubernetes.io/hostname" and v == node.name)
                   for k, v in selector.items()):  # fmt: skip
                reasons["node(s) didn't match Pod's node affinity/selector"] = (
                    reasons.get("node(s) didn't match Pod's node affinity/selector", 0) + 1
                )
                continue
            others = [p for p in self.pods.values() if p.node == node.name and p.phase in ("Pending", "Running")]
            used = [sum(p.requests()[i] for p in others) for i in range(3)]
            short = [
                name
                for name, asked, have, taken in (
                    ("cpu", cpu, node.cpu, used[0]),
                    ("memory", memory, node.memory, used[1]),
                    ("nvidia.com/gpu", gpus, node.gpus, used[2]),
                )
                if asked > have - taken + 1e-9
            ]
            if not short:
                return node, ""
            for name in short:
                reasons[f"Insufficient {name}"] = reasons.get(f"Insufficient {name}", 0) + 1
        if not self.nodes:
            return None, "no nodes available to schedule pods"
        detail = ", ".join(f"{n} {why}" for why, n in sorted(reasons.items()))
        total = len(self.nodes)
        return None, (
            f"0/{total} nodes are available: {detail}. preemption: 0/{total} nodes are available: "
            f"{total} Preemption is not helpful for scheduling."
        )

    async def _kubelet(self, pod: FakePod, job: Json) -> None:
        try:
            await self._run_pod(pod, job)
        finally:
            self._notify()

    async def _run_pod(self, pod: FakePod, job: Json) -> None:
        while (pod.namespace, pod.name) in self.pods:
            node, why = self._fit(pod)
            if node is not None:
                break
            if why != pod.unschedulable:
                pod.unschedulable = why
                self._event(pod, "FailedScheduling", why, kind="Warning", source="default-scheduler")
            await self._wait_change()
        else:
            return
        pod.node, pod.unschedulable = node.name, None
        self._event(
            pod, "Scheduled", f"Successfully assigned {pod.namespace}/{pod.name} to {node.name}",
            source="default-scheduler",
        )  # fmt: skip
        image = pod.container["image"]
        self._event(pod, "Pulling", f'Pulling image "{image}"', source="kubelet")
        await asyncio.sleep(0.05)  # the pull takes a moment: a poll may see the pod between the two
        if image not in self.images:
            message = f'Failed to pull image "{image}": rpc error: code = NotFound desc = "{image}": not found'
            pod.waiting = ("ErrImagePull", message)
            self._event(pod, "Failed", message, kind="Warning", source="kubelet")
            self._event(pod, "Failed", "Error: ErrImagePull", kind="Warning", source="kubelet")
            await asyncio.sleep(0.2)
            pod.waiting = ("ImagePullBackOff", f'Back-off pulling image "{image}"')
            self._event(pod, "BackOff", f'Back-off pulling image "{image}"', source="kubelet")
            self._event(pod, "Failed", "Error: ImagePullBackOff", kind="Warning", source="kubelet")
            return
        self._event(pod, "Pulled", f'Successfully pulled image "{image}" in 50ms', source="kubelet")
        env = self._container_env(pod)
        if isinstance(env, str):
            pod.waiting = ("CreateContainerConfigError", env)
            self._event(pod, "Failed", f"Error: {env}", kind="Warning", source="kubelet")
            return
        pod.env = env
        pod.workdir = self._root / pod.name
        pod.workdir.mkdir(parents=True)
        container = pod.container
        argv = [*container.get("command", []), *container.get("args", [])]
        self._event(pod, "Created", f"Created container: {container['name']}", source="kubelet")
        try:
            pod.process = await asyncio.create_subprocess_exec(
                *argv,
                cwd=pod.workdir,
                env=env,
                stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.STDOUT,
                start_new_session=True,
            )
        except OSError as e:
            pod.terminated = {"exitCode": 128, "reason": "StartError", "message": str(e), "startedAt": _now(),
                              "finishedAt": _now()}  # fmt: skip
            pod.phase = "Failed"
            self._finish_job(pod, job)
            return
        pod.started_at = _now()
        pod.phase = "Running"
        self._event(pod, "Started", f"Started container {container['name']}", source="kubelet")
        watchers = [asyncio.create_task(self._memory_limit(pod)), asyncio.create_task(self._deadline(pod, job))]
        assert pod.process.stdout is not None
        while chunk := await pod.process.stdout.read(64 * 1024):
            pod.log.extend(chunk)
            self._notify()
        code = await pod.process.wait()
        for task in watchers:
            task.cancel()
        exit_code = code if code >= 0 else 128 - code
        reason = "OOMKilled" if pod.oom_killed else ("Completed" if exit_code == 0 else "Error")
        pod.terminated = {"exitCode": exit_code, "reason": reason, "startedAt": pod.started_at, "finishedAt": _now()}
        pod.phase = "Succeeded" if exit_code == 0 else "Failed"
        self._finish_job(pod, job)

    def _finish_job(self, pod: FakePod, job: Json) -> None:
        failed = pod.phase == "Failed"
        reason = "DeadlineExceeded" if pod.deadline_killed else ("BackoffLimitExceeded" if failed else None)
        job["status"] = {
            "startTime": job["status"].get("startTime"),
            "completionTime": None if failed else _now(),
            ("failed" if failed else "succeeded"): 1,
            "conditions": [
                {"type": "Failed" if failed else "Complete", "status": "True", "lastTransitionTime": _now(),
                 **({"reason": reason} if reason else {})}
            ],
        }  # fmt: skip
        self._notify()

    def _container_env(self, pod: FakePod) -> dict[str, str] | str:
        env = {"PATH": image_path(), "HOME": str(self._root), "HOSTNAME": pod.name}
        for var in pod.container.get("env", []):
            if "value" in var:
                env[var["name"]] = var["value"]
                continue
            ref = var.get("valueFrom", {}).get("secretKeyRef")
            if ref is None:
                continue
            data = self.secrets.get((pod.namespace, ref["name"]))
            if (data is None or ref["key"] not in data) and ref.get("optional") is True:
                continue  # an optional reference to a missing Secret or key: the variable is left out
            if data is None:
                return f'secret "{ref["name"]}" not found'
            if ref["key"] not in data:
                return f"couldn't find key {ref['key']} in Secret {pod.namespace}/{ref['name']}"
            env[var["name"]] = data[ref["key"]]
        return env

    async def _memory_limit(self, pod: FakePod) -> None:
        limit = pod.container.get("resources", {}).get("limits", {}).get("memory")
        if limit is None or pod.process is None:
            return
        cap = quantity(limit)
        while True:
            if tree_rss(pod.process.pid) > cap:
                pod.oom_killed = True
                kill_tree(pod.process.pid)
                return
            await asyncio.sleep(0.05)

    async def _deadline(self, pod: FakePod, job: Json) -> None:
        seconds = job["spec"].get("activeDeadlineSeconds")
        if seconds is None or pod.process is None:
            return
        await asyncio.sleep(seconds)
        pod.deadline_killed = True
        self._event(pod, "Killing", f"Stopping container {pod.container['name']}", source="kubelet")
        kill_tree(pod.process.pid)

    async def _stop(self, pod: FakePod) -> None:
        if pod.process is not None and pod.process.returncode is None:
            kill_tree(pod.process.pid)
        for task in pod.tasks:
            task.cancel()
        await asyncio.gather(*pod.tasks, return_exceptions=True)
        if pod.process is not None and pod.process.returncode is None:
            await pod.process.wait()
        if pod.terminated is None and pod.started_at is not None:
            pod.terminated = {"exitCode": 137, "reason": "Error", "startedAt": pod.started_at, "finishedAt": _now()}


def image_path() -> str:
    """`PATH` inside a fake container: this interpreter's folder first, so `python` in the image is
    one with evalbus installed (the image contract), then the host's."""
    return f"{Path(sys.executable).parent}:{os.environ.get('PATH', '/usr/bin:/bin')}"


def _processes() -> dict[int, tuple[int, int]]:
    """pid → (parent pid, resident bytes) of every process."""
    page = os.sysconf("SC_PAGE_SIZE")
    out: dict[int, tuple[int, int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            rss = int((entry / "statm").read_text().split()[1]) * page
        except (OSError, IndexError, ValueError):
            continue
        fields = stat.rsplit(")", 1)[1].split()
        out[int(entry.name)] = (int(fields[1]), rss)
    return out


def _tree(root: int, procs: dict[int, tuple[int, int]]) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, (ppid, _) in procs.items():
        children.setdefault(ppid, []).append(pid)
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        if pid in procs:
            found.append(pid)
        todo.extend(children.get(pid, []))
    return found


def tree_rss(root: int) -> int:
    procs = _processes()
    return sum(procs[pid][1] for pid in _tree(root, procs))


def kill_tree(root: int) -> None:
    """SIGKILL a container's processes (every process group under its first process), the first
    process's own group first: a lost node or a killed container takes its supervisor (the
    runner) before it can see its harness die and report that as the harness's own exit (which
    made the node-lost test flaky: `exit_nonzero` instead of `unit_lost`, once in a CI run)."""
    procs = _processes()
    groups = set()
    for pid in _tree(root, procs):
        with contextlib.suppress(OSError):
            groups.add(os.getpgid(pid))
    with contextlib.suppress(OSError):
        root_group = os.getpgid(root)
        os.killpg(root_group, signal.SIGKILL)
        groups.discard(root_group)
    for pgid in groups | {root}:
        with contextlib.suppress(OSError):
            os.killpg(pgid, signal.SIGKILL)
