"""A **protocol-level** fake of the Docker Engine API — not a Docker engine.

It serves, on a unix socket (and a loopback TCP port), the endpoints the dispatcher's Docker
backend uses, under version-prefixed paths (`/v1.<n>/…`) as the Engine API documents them:
`GET /_ping`, `GET /info`, `POST /images/create` (a pull's progress stream), `POST
/containers/create`, `GET /containers/json`, `POST /containers/{id}/start`, `…/wait`, `…/kill`,
`GET /containers/{id}/json`, `…/logs` (the multiplexed stream framing, followed or not), `…/stats`,
`DELETE /containers/{id}`, `GET /containers/{id}/archive` (a tar stream, `application/x-tar`, of
the path — an absolute one, under the container's `WorkingDir`, the only part of its filesystem
the fake has — with the path's stat in `X-Docker-Container-Path-Stat`; `404` for a missing path;
served for a stopped container too, until it is removed), `GET /events` (since / until / filters, streamed), `POST
/containers/{id}/exec`, `POST /exec/{id}/start` (the hijacked connection: `101 UPGRADED`, then the
process's stdin and output on the raw socket), `POST /exec/{id}/resize`, `GET /exec/{id}/json`.
Every request is checked against the documented shapes — the path and method, the query
parameters each endpoint takes, the field names of `ContainerConfig`, `HostConfig`,
`DeviceRequest`, `ExecConfig` and `ExecStartConfig`, their types, an attached exec start asking for
the upgrade — and one that does not match is answered `400`/`404` with `{"message": …}` *and*
recorded in `violations`, so a test can assert none happened.

Behind it the "containers" run their `Cmd` **as local processes** (the real in-job runner, as the
Nomad and Kubernetes fakes do; `WorkingDir` is a temporary folder of the fake's): an image that is
not in `images` cannot be pulled (`404` with the registry's `pull access denied` message, as the
engine answers); one not pulled yet is `No such image` at create; a container whose processes
together use more resident memory than `HostConfig.Memory` is killed (`State.OOMKilled`, exit
137, an `oom` event before `die`); a container removed or killed loses all its processes at once
(its main process is stopped first, as a PID namespace's end leaves it no moment to report); a TTY exec runs on a real pseudo-terminal, so a resize is seen
by the program (`stty size`). Events carry real timestamps.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import fcntl
import io
import json
import os
import re
import secrets
import signal
import ssl
import stat
import struct
import tarfile
import tempfile
import termios
import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from aiohttp import web

from evalbus.testing.fake_kubernetes import image_path, kill_tree, tree_rss

Json = dict[str, Any]

DEFAULT_IMAGE = "evalbus/case:test"
"""An image the fake can "pull"."""
API_VERSIONS = range(24, 52)
"""Minor versions of `/v1.<n>/` the fake answers."""

_CONTAINER_CONFIG = {
    "Hostname", "Domainname", "User", "AttachStdin", "AttachStdout", "AttachStderr", "ExposedPorts", "Tty",
    "OpenStdin", "StdinOnce", "Env", "Cmd", "Healthcheck", "ArgsEscaped", "Image", "Volumes", "WorkingDir",
    "Entrypoint", "NetworkDisabled", "MacAddress", "OnBuild", "Labels", "StopSignal", "StopTimeout", "Shell",
    "HostConfig", "NetworkingConfig",
}  # fmt: skip
_HOST_CONFIG = {
    "CpuShares", "Memory", "CgroupParent", "BlkioWeight", "BlkioWeightDevice", "BlkioDeviceReadBps",
    "BlkioDeviceWriteBps", "BlkioDeviceReadIOps", "BlkioDeviceWriteIOps", "CpuPeriod", "CpuQuota",
    "CpuRealtimePeriod", "CpuRealtimeRuntime", "CpusetCpus", "CpusetMems", "Devices", "DeviceCgroupRules",
    "DeviceRequests", "KernelMemoryTCP", "MemoryReservation", "MemorySwap", "MemorySwappiness", "NanoCpus",
    "OomKillDisable", "Init", "PidsLimit", "Ulimits", "CpuCount", "CpuPercent", "IOMaximumIOps",
    "IOMaximumBandwidth", "Binds", "ContainerIDFile", "LogConfig", "NetworkMode", "PortBindings", "RestartPolicy",
    "AutoRemove", "VolumeDriver", "VolumesFrom", "Mounts", "ConsoleSize", "Annotations", "CapAdd", "CapDrop",
    "CgroupnsMode", "Dns", "DnsOptions", "DnsSearch", "ExtraHosts", "GroupAdd", "IpcMode", "Cgroup", "Links",
    "OomScoreAdj", "PidMode", "Privileged", "PublishAllPorts", "ReadonlyRootfs", "SecurityOpt", "StorageOpt",
    "Tmpfs", "UTSMode", "UsernsMode", "ShmSize", "Sysctls", "Runtime", "Isolation", "MaskedPaths", "ReadonlyPaths",
}  # fmt: skip
_DEVICE_REQUEST = {"Driver", "Count", "DeviceIDs", "Capabilities", "Options"}
_RESTART_NAMES = {"", "no", "always", "unless-stopped", "on-failure"}
_EXEC_CONFIG = {
    "AttachStdin", "AttachStdout", "AttachStderr", "ConsoleSize", "DetachKeys", "Tty", "Env", "Cmd", "Privileged",
    "User", "WorkingDir",
}  # fmt: skip
_EXEC_START = {"Detach", "Tty", "ConsoleSize"}
_INTEGERS = {"NanoCpus", "Memory", "MemorySwap", "CpuShares", "CpuPeriod", "CpuQuota", "PidsLimit", "ShmSize"}
_BOOLEANS = {"AutoRemove", "Init", "Privileged", "ReadonlyRootfs", "OomKillDisable", "PublishAllPorts"}
_NAME = re.compile(r"^/?[a-zA-Z0-9][a-zA-Z0-9_.-]+$")
_FALSE = {"", "0", "no", "false", "none"}


def _bool(value: str | None) -> bool:
    """A query flag as the engine reads it (anything but empty, 0, no, false, none is true)."""
    return value is not None and value.strip().lower() not in _FALSE


def _stamp(t: float | None) -> str:
    if t is None:
        return "0001-01-01T00:00:00Z"
    return datetime.fromtimestamp(t, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _frame(stream: int, payload: bytes) -> bytes:
    return struct.pack(">BxxxL", stream, len(payload)) + payload


def normalize(image: str) -> str:
    """An image reference with its tag (`latest` when none)."""
    if "@" in image:
        return image
    return image if image.rfind(":") > image.rfind("/") else f"{image}:latest"


@dataclass
class FakeContainer:
    """A created container and the process its command runs as."""

    id: str
    name: str
    config: Json
    host: Json
    created: float = field(default_factory=time.time)
    status: str = "created"
    exit_code: int = 0
    oom_killed: bool = False
    started_at: float | None = None
    finished_at: float | None = None
    output: bytearray = field(default_factory=bytearray)
    """Everything it wrote, as multiplexed frames (stdout 1, stderr 2)."""
    process: asyncio.subprocess.Process | None = None
    workdir: Path | None = None
    env: dict[str, str] = field(default_factory=dict)
    changed: asyncio.Event = field(default_factory=asyncio.Event)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def notify(self) -> None:
        self.changed.set()
        self.changed = asyncio.Event()

    def summary(self) -> Json:
        return {
            "Id": self.id, "Names": [f"/{self.name}"], "Image": self.config.get("Image"),
            "Command": " ".join(self.config.get("Cmd") or []), "Created": int(self.created), "State": self.status,
            "Status": self.status, "Labels": self.config.get("Labels") or {},
        }  # fmt: skip

    def inspect(self) -> Json:
        running = self.status == "running"
        config = {k: v for k, v in self.config.items() if k not in ("HostConfig", "NetworkingConfig")}
        return {
            "Id": self.id,
            "Created": _stamp(self.created),
            "Path": (self.config.get("Cmd") or [""])[0],
            "Args": (self.config.get("Cmd") or [])[1:],
            "State": {
                "Status": self.status, "Running": running, "Paused": False, "Restarting": False,
                "OOMKilled": self.oom_killed, "Dead": self.status == "dead",
                "Pid": self.process.pid if running and self.process is not None else 0,
                "ExitCode": self.exit_code, "Error": "", "StartedAt": _stamp(self.started_at),
                "FinishedAt": _stamp(self.finished_at),
            },
            "Image": f"sha256:{secrets.token_hex(32)}",
            "Name": f"/{self.name}",
            "RestartCount": 0,
            "Driver": "overlay2",
            "Platform": "linux",
            "Config": config,
            "HostConfig": self.host,
            "NetworkSettings": {"Networks": {self.host.get("NetworkMode") or "bridge": {}}},
            "Mounts": [],
        }  # fmt: skip


@dataclass
class FakeExec:
    """An exec instance of a container."""

    id: str
    container: FakeContainer
    config: Json
    running: bool = False
    exit_code: int | None = None
    pid: int = 0
    pty: int | None = None
    """The pseudo-terminal's controlling side (a TTY exec while it runs)."""
    sizes: list[tuple[int, int]] = field(default_factory=list)
    """(rows, cols) of every resize."""


class FakeDocker:
    """The fake engine; `async with FakeDocker() as engine:` serves it on `engine.host` (a unix
    socket) and `engine.tcp_host` (loopback)."""

    def __init__(
        self,
        *,
        images: Iterable[str] = (DEFAULT_IMAGE,),
        ncpu: int = 2,
        max_api: int = 51,
        mem_total: int = 4 * 1024**3,
        labels: Iterable[str] = (),
        name: str = "fake-engine",
        tls: ssl.SSLContext | None = None,
    ) -> None:
        self.images = {normalize(i) for i in images}
        """Images the "registry" has: pulling them works."""
        self.pulled: set[str] = set()
        """Images the engine holds."""
        self.ncpu = ncpu
        self.mem_total = mem_total
        self.labels = list(labels)
        """The engine's labels (`key=value`), as `/info` reports them."""
        self.name = name
        self.max_api = max_api
        """The newest `1.<n>` it serves (`API-Version` of `/_ping`); a newer prefix is refused."""
        self.containers: dict[str, FakeContainer] = {}
        self.execs: dict[str, FakeExec] = {}
        self.events: list[Json] = []
        self.violations: list[str] = []
        self.requests: list[tuple[str, str]] = []
        """(method, path) of every request, version prefix included."""
        self.removals: list[tuple[str, bool]] = []
        """(container id, force) of every removal."""
        self.archives: list[tuple[str, str]] = []
        """(container id, path) of every archive read."""
        self.created: list[Json] = []
        """Every `ContainerCreateRequest` accepted, in order (kept after the container is removed)."""
        self._changed = asyncio.Event()
        self._root = Path(tempfile.mkdtemp(prefix="fake-docker-"))
        self._runner: web.AppRunner | None = None
        self.host = ""
        self.tcp_host = ""
        self._tls = tls
        """Serve the TCP address over TLS with this server context (`dockerd --tlsverify`)."""

    async def __aenter__(self) -> FakeDocker:
        app = web.Application(middlewares=[self._check_version])
        routes = [
            ("GET", "/_ping", self._ping),
            ("GET", "/info", self._info),
            ("POST", "/images/create", self._pull),
            ("POST", "/containers/create", self._create),
            ("GET", "/containers/json", self._list),
            ("POST", "/containers/{id}/start", self._start),
            ("POST", "/containers/{id}/wait", self._wait),
            ("POST", "/containers/{id}/kill", self._kill),
            ("GET", "/containers/{id}/json", self._inspect),
            ("GET", "/containers/{id}/logs", self._logs),
            ("GET", "/containers/{id}/stats", self._stats),
            ("DELETE", "/containers/{id}", self._remove),
            ("GET", "/containers/{id}/archive", self._archive),
            ("GET", "/events", self._events),
            ("POST", "/containers/{id}/exec", self._exec_create),
            ("POST", "/exec/{id}/start", self._exec_start),
            ("POST", "/exec/{id}/resize", self._exec_resize),
            ("GET", "/exec/{id}/json", self._exec_inspect),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, "/{version:v1\\.[0-9]+}" + path, handler)
        app.router.add_route("GET", "/_ping", self._ping)  # the engine serves it unversioned too
        self._runner = web.AppRunner(app, handle_signals=False, shutdown_timeout=2.0)
        await self._runner.setup()
        socket_path = self._root / "docker.sock"
        await web.UnixSite(self._runner, str(socket_path)).start()
        tcp = web.TCPSite(self._runner, "127.0.0.1", 0, ssl_context=self._tls)
        await tcp.start()
        server = tcp._server
        assert isinstance(server, asyncio.Server)
        self.host = f"unix://{socket_path}"
        self.tcp_host = f"tcp://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        return self

    async def remove_all(self) -> None:
        """Every container is removed under its run (someone's `docker rm -f`, an engine restarted
        without live-restore): its processes die, nothing reports how they ended."""
        for container in list(self.containers.values()):
            await self._stop(container)
            self.containers.pop(container.id, None)
            self._event(container, "destroy")
            container.notify()

    async def __aexit__(self, *_: object) -> None:
        for container in list(self.containers.values()):
            await self._stop(container)
        if self._runner is not None:
            await self._runner.cleanup()

    # ------------------------------------------------------------ checks

    @web.middleware
    async def _check_version(self, request: web.Request, handler: Any) -> web.StreamResponse:
        self.requests.append((request.method, request.path))
        try:
            version = request.match_info.get("version")
            if version is not None and int(version.split(".")[1]) > self.max_api:
                message = f"client version {version[1:]} is too new. Maximum supported API version is 1.{self.max_api}"
                return self._refuse(400, message)
            if version is not None and int(version.split(".")[1]) not in API_VERSIONS:
                return self._refuse(400, f"client version {version[1:]} is not supported by the fake")
            response: web.StreamResponse = await handler(request)
        except (web.HTTPNotFound, web.HTTPMethodNotAllowed):
            return self._refuse(404, f"no such endpoint (or no version prefix): {request.method} {request.path}")
        return response

    def _refuse(self, code: int, message: str) -> web.Response:
        self.violations.append(message)
        return web.json_response({"message": message}, status=code)

    def _params(self, request: web.Request, allowed: set[str]) -> web.Response | None:
        unknown = sorted(set(request.query) - allowed)
        if unknown:
            return self._refuse(400, f"{request.method} {request.path}: unknown query parameter(s) {unknown}")
        return None

    async def _body(self, request: web.Request, what: str) -> Json | web.Response:
        if request.content_type != "application/json":
            return self._refuse(400, f"{what}: the body must be application/json, not {request.content_type!r}")
        try:
            body = await request.json()
        except ValueError:
            return self._refuse(400, f"{what}: the body is not JSON")
        if not isinstance(body, dict):
            return self._refuse(400, f"{what}: the body must be an object")
        return body

    def _fields(self, what: str, obj: Any, allowed: set[str]) -> str | None:
        if not isinstance(obj, dict):
            return f"{what} must be an object"
        unknown = sorted(set(obj) - allowed)
        return f"{what} has unknown field(s) {unknown}" if unknown else None

    def _check_create(self, body: Json) -> str | None:
        if problem := self._fields("ContainerConfig", body, _CONTAINER_CONFIG):
            return problem
        if not isinstance(body.get("Image"), str) or not body["Image"]:
            return "ContainerConfig.Image must be a non-empty string"
        for name in ("Cmd", "Env", "Entrypoint"):
            value = body.get(name)
            if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
                return f"ContainerConfig.{name} must be an array of strings"
        if any("=" not in item for item in body.get("Env") or ()):
            return "ContainerConfig.Env entries are VAR=value"
        labels = body.get("Labels") or {}
        if not isinstance(labels, dict) or not all(isinstance(v, str) for v in labels.values()):
            return "ContainerConfig.Labels must be an object of strings"
        host = body.get("HostConfig") or {}
        if problem := self._fields("HostConfig", host, _HOST_CONFIG):
            return problem
        for name in _INTEGERS & set(host):
            if not isinstance(host[name], int) or isinstance(host[name], bool):
                return f"HostConfig.{name} must be an integer"
        for name in _BOOLEANS & set(host):
            if not isinstance(host[name], bool):
                return f"HostConfig.{name} must be a boolean"
        if "MemorySwap" in host and host["MemorySwap"] not in (-1, 0) and host["MemorySwap"] < host.get("Memory", 0):
            return "Minimum memoryswap limit should be larger than memory limit, see usage"
        restart = host.get("RestartPolicy") or {}
        if self._fields("RestartPolicy", restart, {"Name", "MaximumRetryCount"}) or (
            restart.get("Name", "") not in _RESTART_NAMES
        ):
            return f"invalid RestartPolicy {restart!r}"
        for device in host.get("DeviceRequests") or ():
            if problem := self._fields("DeviceRequest", device, _DEVICE_REQUEST):
                return problem
            caps = device.get("Capabilities")
            if caps is not None and not (isinstance(caps, list) and all(isinstance(c, list) for c in caps)):
                return "DeviceRequest.Capabilities is an array of arrays of strings"
        return None

    def _container(self, request: web.Request) -> FakeContainer | web.Response:
        key = request.match_info["id"]
        found = self.containers.get(key) or next(
            (c for c in self.containers.values() if c.name == key or c.id.startswith(key)), None
        )
        if found is None:
            return web.json_response({"message": f"No such container: {key}"}, status=404)
        return found

    def _event(self, container: FakeContainer, action: str, **attributes: str) -> None:
        now = time.time_ns()
        self.events.append(
            {
                "Type": "container", "Action": action, "status": action, "id": container.id, "from":
                container.config.get("Image"), "scope": "local", "time": now // 1_000_000_000, "timeNano": now,
                "Actor": {"ID": container.id, "Attributes": {
                    "name": container.name, "image": container.config.get("Image", ""),
                    **(container.config.get("Labels") or {}), **attributes,
                }},
            }
        )  # fmt: skip
        self._notify()

    def _notify(self) -> None:
        self._changed.set()
        self._changed = asyncio.Event()

    async def _wait_change(self, limit_s: float = 0.5) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._changed.wait(), limit_s)

    # ------------------------------------------------------------ the engine

    async def _ping(self, request: web.Request) -> web.StreamResponse:
        return web.Response(text="OK", headers={"API-Version": f"1.{self.max_api}", "Docker-Experimental": "false"})

    async def _info(self, request: web.Request) -> web.StreamResponse:
        running = sum(c.status == "running" for c in self.containers.values())
        return web.json_response(
            {
                "ID": "FAKE:ENGINE", "Name": self.name, "NCPU": self.ncpu, "MemTotal": self.mem_total,
                "Labels": self.labels, "ServerVersion": "fake", "OperatingSystem": "a protocol-level fake",
                "OSType": "linux", "Architecture": "x86_64", "Containers": len(self.containers),
                "ContainersRunning": running, "ContainersPaused": 0,
                "ContainersStopped": len(self.containers) - running, "Images": len(self.pulled),
                "Runtimes": {"runc": {"path": "runc"}}, "DefaultRuntime": "runc",
            }
        )  # fmt: skip

    async def _pull(self, request: web.Request) -> web.StreamResponse:
        allowed = {"fromImage", "fromSrc", "repo", "tag", "message", "changes", "platform"}
        if (refused := self._params(request, allowed)) is not None:
            return refused
        repo = request.query.get("fromImage", "")
        tag = request.query.get("tag", "")
        if not repo:
            return self._refuse(400, "POST /images/create needs fromImage (the fake does not import)")
        if not tag and ":" not in repo.rsplit("/", 1)[-1]:
            return self._refuse(400, "POST /images/create without a tag pulls every tag of the repository")
        ref = f"{repo}@{tag}" if tag.startswith("sha256:") else normalize(f"{repo}:{tag}" if tag else repo)
        if ref not in self.images:
            message = (
                f"pull access denied for {repo}, repository does not exist or may require 'docker login': "
                "denied: requested access to the resource is denied"
            )
            return web.json_response({"message": message}, status=404)
        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        for line in (
            {"status": f"Pulling from {repo}", "id": tag or "latest"},
            {"status": "Pull complete", "progressDetail": {}, "id": secrets.token_hex(6)},
            {"status": f"Digest: sha256:{secrets.token_hex(32)}"},
            {"status": f"Status: Downloaded newer image for {ref}"},
        ):
            await response.write(json.dumps(line).encode() + b"\r\n")
        self.pulled.add(ref)
        await response.write_eof()
        return response

    async def _create(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._params(request, {"name", "platform"})) is not None:
            return refused
        body = await self._body(request, "POST /containers/create")
        if isinstance(body, web.Response):
            return body
        if problem := self._check_create(body):
            return self._refuse(400, problem)
        name = request.query.get("name") or f"fake_{secrets.token_hex(4)}"
        if not _NAME.match(name):
            return self._refuse(400, f"Invalid container name ({name}), only [a-zA-Z0-9][a-zA-Z0-9_.-] are allowed")
        if any(c.name == name for c in self.containers.values()):
            return web.json_response({"message": f'Conflict. The container name "/{name}" is already in use'},
                                     status=409)  # fmt: skip
        image = normalize(body["Image"])
        if image not in self.pulled:
            return web.json_response({"message": f"No such image: {image}"}, status=404)
        container = FakeContainer(id=secrets.token_hex(32), name=name, config=body, host=body.get("HostConfig") or {})
        self.containers[container.id] = container
        self.created.append(body)
        self._event(container, "create")
        return web.json_response({"Id": container.id, "Warnings": []}, status=201)

    async def _list(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._params(request, {"all", "limit", "size", "filters"})) is not None:
            return refused
        try:
            filters = json.loads(request.query.get("filters") or "{}")
        except ValueError:
            return self._refuse(400, "GET /containers/json: filters must be JSON")
        if not isinstance(filters, dict) or set(filters) - {"label", "status", "name", "id", "ancestor"}:
            return self._refuse(400, f"GET /containers/json: unsupported filters {filters!r}")
        found = [c for c in self.containers.values() if _bool(request.query.get("all")) or c.status == "running"]
        for wanted in filters.get("label") or ():
            key, has_value, value = str(wanted).partition("=")
            labels = {c.id: c.config.get("Labels") or {} for c in found}
            found = [c for c in found if key in labels[c.id] and (not has_value or labels[c.id][key] == value)]
        if filters.get("status"):
            found = [c for c in found if c.status in filters["status"]]
        return web.json_response([c.summary() for c in found])

    async def _start(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._params(request, {"detachKeys"})) is not None:
            return refused
        container = self._container(request)
        if isinstance(container, web.Response):
            return container
        if container.status == "running":
            return web.Response(status=304)
        if container.status != "created":
            return web.json_response({"message": "the fake starts a container once"}, status=409)
        env = {"PATH": image_path(), "HOME": "/root", "HOSTNAME": container.id[:12]}
        env.update(item.split("=", 1) for item in container.config.get("Env") or ())
        container.env = env
        container.workdir = self._root / container.id[:12]
        container.workdir.mkdir(parents=True)
        argv = [*(container.config.get("Entrypoint") or []), *(container.config.get("Cmd") or [])]
        try:
            container.process = await asyncio.create_subprocess_exec(
                *argv, cwd=container.workdir, env=env, stdin=asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
        except OSError as e:
            container.status, container.exit_code = "exited", 127
            message = f"failed to create task for container: exec: {argv[0] if argv else ''!r}: {e.strerror}"
            return web.json_response({"message": message}, status=400)
        container.status, container.started_at = "running", time.time()
        self._event(container, "start")
        container.tasks.append(asyncio.create_task(self._run(container)))
        return web.Response(status=204)

    async def _run(self, container: FakeContainer) -> None:
        process = container.process
        assert process is not None

        async def pump(reader: asyncio.StreamReader | None, stream: int) -> None:
            while reader is not None and (chunk := await reader.read(64 * 1024)):
                container.output.extend(_frame(stream, chunk))
                container.notify()

        limit = container.host.get("Memory") or 0
        watcher = asyncio.create_task(self._memory(container, limit)) if limit else None
        await asyncio.gather(pump(process.stdout, 1), pump(process.stderr, 2))
        code = await process.wait()
        if watcher is not None:
            watcher.cancel()
        container.exit_code = code if code >= 0 else 128 - code
        container.status, container.finished_at = "exited", time.time()
        if container.oom_killed:
            self._event(container, "oom")
        self._event(container, "die", exitCode=str(container.exit_code))
        container.notify()

    async def _memory(self, container: FakeContainer, limit: int) -> None:
        assert container.process is not None
        while True:
            if tree_rss(container.process.pid) > limit:
                container.oom_killed = True
                kill_tree(container.process.pid)
                return
            await asyncio.sleep(0.05)

    async def _wait(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._params(request, {"condition"})) is not None:
            return refused
        condition = request.query.get("condition", "not-running")
        if condition not in ("not-running", "next-exit", "removed"):
            return self._refuse(400, f"invalid condition: {condition!r}")
        container = self._container(request)
        if isinstance(container, web.Response):
            return container
        if condition == "next-exit" or container.status == "running":
            while container.status != "exited" and not _gone(request):
                await _until(container.changed)
        elif condition == "removed":
            while container.id in self.containers and not _gone(request):
                await self._wait_change()
        return web.json_response({"StatusCode": container.exit_code, "Error": None})

    async def _kill(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._params(request, {"signal"})) is not None:
            return refused
        container = self._container(request)
        if isinstance(container, web.Response):
            return container
        if container.status != "running" or container.process is None:
            return web.json_response({"message": f"Container {container.id} is not running"}, status=409)
        self._event(container, "kill", signal=request.query.get("signal", "SIGKILL"))
        _kill_container(container.process.pid)
        return web.Response(status=204)

    async def _inspect(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._params(request, {"size"})) is not None:
            return refused
        container = self._container(request)
        if isinstance(container, web.Response):
            return container
        return web.json_response(container.inspect())

    async def _logs(self, request: web.Request) -> web.StreamResponse:
        allowed = {"follow", "stdout", "stderr", "since", "until", "timestamps", "tail"}
        if (refused := self._params(request, allowed)) is not None:
            return refused
        if not (_bool(request.query.get("stdout")) or _bool(request.query.get("stderr"))):
            return self._refuse(400, "Bad parameters: you must choose at least one stream")
        container = self._container(request)
        if isinstance(container, web.Response):
            return container
        if container.config.get("Tty"):
            return self._refuse(400, "the fake serves logs of containers without a TTY (multiplexed) only")
        wanted = {1} if not _bool(request.query.get("stderr")) else ({2} if not _bool(request.query.get("stdout"))
                                                                     else {1, 2})  # fmt: skip
        response = web.StreamResponse(headers={"Content-Type": "application/vnd.docker.multiplexed-stream"})
        await response.prepare(request)
        sent = 0
        follow = _bool(request.query.get("follow"))
        with contextlib.suppress(ConnectionResetError):  # the client stopped following
            while True:
                changed = container.changed
                if len(container.output) > sent:
                    data = bytes(container.output[sent:])
                    sent += len(data)
                    await response.write(_only(data, wanted))
                    continue
                if not follow or container.status != "running" or container.id not in self.containers:
                    break
                if _gone(request):
                    break
                await _until(changed)
            await response.write_eof()
        return response

    async def _stats(self, request: web.Request) -> web.StreamResponse:
        """One `ContainerStatsResponse` (the fake serves `stream=false` only): the container's process
        tree's resident memory as `memory_stats.usage`; CPU time is not measured (0)."""
        if (refused := self._params(request, {"stream", "one-shot"})) is not None:
            return refused
        if _bool(request.query.get("stream", "1")):
            return self._refuse(400, "the fake serves one stats read (stream=false), not a stream")
        container = self._container(request)
        if isinstance(container, web.Response):
            return container
        alive = container.status == "running" and container.process is not None
        rss = tree_rss(container.process.pid) if alive and container.process is not None else 0
        return web.json_response(
            {
                "read": _stamp(time.time()), "preread": _stamp(None), "name": f"/{container.name}",
                "id": container.id, "pids_stats": {"current": 1 if alive else 0},
                "memory_stats": {"usage": rss, "limit": container.host.get("Memory") or self.mem_total,
                                 "stats": {"inactive_file": 0}},
                "cpu_stats": {"cpu_usage": {"total_usage": 0}, "online_cpus": self.ncpu},
                "precpu_stats": {"cpu_usage": {"total_usage": 0}},
            }
        )  # fmt: skip

    async def _remove(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._params(request, {"v", "force", "link"})) is not None:
            return refused
        container = self._container(request)
        if isinstance(container, web.Response):
            return container
        force = _bool(request.query.get("force"))
        if container.status == "running" and not force:
            message = (
                f'cannot remove container "/{container.name}": container is running: stop the container before '
                "removing or force remove"
            )
            return web.json_response({"message": message}, status=409)
        self.removals.append((container.id, force))
        await self._stop(container)
        self.containers.pop(container.id, None)
        self._event(container, "destroy")
        container.notify()
        return web.Response(status=204)

    async def _archive(self, request: web.Request) -> web.StreamResponse:
        """A tar archive of the path (a file as one member named by its last element; a link kept as a
        link, not followed), its stat in `X-Docker-Container-Path-Stat`."""
        if (refused := self._params(request, {"path"})) is not None:
            return refused
        path = request.query.get("path", "")
        if not path.startswith("/"):
            return self._refuse(400, f"GET /containers/{{id}}/archive: path must be absolute, not {path!r}")
        container = self._container(request)
        if isinstance(container, web.Response):
            return container
        self.archives.append((container.id, path))
        working = "/" + str(container.config.get("WorkingDir") or "/").strip("/")
        missing = web.json_response(
            {"message": f"Could not find the file {path} in container {container.name}"}, status=404
        )
        if container.workdir is None or not (path == working or path.startswith(working.rstrip("/") + "/")):
            return missing
        target = container.workdir / path[len(working) :].lstrip("/")
        try:
            data, info = await asyncio.to_thread(_tar_of, target, container.workdir)
        except (FileNotFoundError, NotADirectoryError):
            return missing
        header = base64.b64encode(json.dumps(info).encode()).decode()
        response = web.StreamResponse(
            headers={"Content-Type": "application/x-tar", "X-Docker-Container-Path-Stat": header}
        )
        await response.prepare(request)
        for at in range(0, len(data), 64 * 1024):
            await response.write(data[at : at + 64 * 1024])
        await response.write_eof()
        return response

    async def _stop(self, container: FakeContainer) -> None:
        if container.process is not None and container.process.returncode is None:
            self._event(container, "kill", signal="SIGKILL")
            _kill_container(container.process.pid)
        await asyncio.gather(*container.tasks, return_exceptions=True)

    async def _events(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._params(request, {"since", "until", "filters"})) is not None:
            return refused
        try:
            filters = json.loads(request.query.get("filters") or "{}")
            since = float(request.query.get("since") or 0)
            until = float(request.query["until"]) if "until" in request.query else None
        except ValueError:
            return self._refuse(400, "GET /events: since/until are timestamps, filters JSON")
        if not isinstance(filters, dict) or set(filters) - {"type", "container", "event", "label", "image"}:
            return self._refuse(400, f"GET /events: unsupported filters {filters!r}")

        def wanted(event: Json) -> bool:
            ids = filters.get("container") or ()
            actor = event["Actor"]
            return (
                event["time"] >= int(since)
                and (not filters.get("type") or event["Type"] in filters["type"])
                and (not ids or actor["ID"] in ids or actor["Attributes"].get("name") in ids)
                and (not filters.get("event") or event["Action"] in filters["event"])
            )

        response = web.StreamResponse(headers={"Content-Type": "application/json"})
        await response.prepare(request)
        sent = 0
        with contextlib.suppress(ConnectionResetError):  # the client stopped following
            while until is None or time.time() < until:
                changed = self._changed
                for event in self.events[sent:]:
                    if wanted(event):
                        await response.write(json.dumps(event).encode() + b"\n")
                sent = len(self.events)
                if until is not None or _gone(request):
                    break
                await _until(changed)
            await response.write_eof()
        return response

    # ------------------------------------------------------------ exec

    async def _exec_create(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._params(request, set())) is not None:
            return refused
        body = await self._body(request, "POST /containers/{id}/exec")
        if isinstance(body, web.Response):
            return body
        if problem := self._fields("ExecConfig", body, _EXEC_CONFIG):
            return self._refuse(400, problem)
        cmd = body.get("Cmd")
        if not (isinstance(cmd, list) and cmd and all(isinstance(c, str) for c in cmd)):
            return self._refuse(400, "ExecConfig.Cmd must be a non-empty array of strings")
        container = self._container(request)
        if isinstance(container, web.Response):
            return container
        if container.status != "running":
            return web.json_response({"message": f"Container {container.id} is not running"}, status=409)
        made = FakeExec(id=secrets.token_hex(32), container=container, config=body)
        self.execs[made.id] = made
        return web.json_response({"Id": made.id}, status=201)

    async def _exec_start(self, request: web.Request) -> web.StreamResponse:
        body = await self._body(request, "POST /exec/{id}/start")
        if isinstance(body, web.Response):
            return body
        if problem := self._fields("ExecStartConfig", body, _EXEC_START):
            return self._refuse(400, problem)
        made = self.execs.get(request.match_info["id"])
        if made is None:
            return web.json_response({"message": "No such exec instance"}, status=404)
        if body.get("Detach"):
            return self._refuse(400, "the fake runs attached execs only")
        if (
            request.headers.get("Upgrade", "").lower() != "tcp"
            or "upgrade" not in request.headers.get("Connection", "").lower()
        ):
            return self._refuse(400, "an attached exec start asks to hijack: Connection: Upgrade, Upgrade: tcp")
        if bool(body.get("Tty")) != bool(made.config.get("Tty")):
            return self._refuse(400, "ExecStartConfig.Tty must match the exec's Tty")
        container = made.container
        if container.status != "running" or container.workdir is None:
            return web.json_response({"message": f"Container {container.id} is not running"}, status=409)
        tty = bool(made.config.get("Tty"))
        kind = "application/vnd.docker.raw-stream" if tty else "application/vnd.docker.multiplexed-stream"
        response = web.StreamResponse(
            status=101, reason="UPGRADED", headers={"Content-Type": kind, "Connection": "Upgrade", "Upgrade": "tcp"}
        )
        writer = await response.prepare(request)
        assert writer is not None
        await writer.drain()  # the headers go out now: the socket is the exec's from here
        transport = request.transport
        assert transport is not None
        await self._attached(made, request, transport)
        return response

    async def _attached(self, made: FakeExec, request: web.Request, transport: asyncio.Transport) -> None:
        container = made.container
        config = made.config
        tty = bool(config.get("Tty"))
        env = {**container.env, **dict(item.split("=", 1) for item in config.get("Env") or ())}
        cwd = container.workdir
        if config.get("WorkingDir"):
            cwd = container.workdir / str(config["WorkingDir"]).lstrip("/") if container.workdir else None
        primary: int | None = None
        if tty:
            primary, secondary = os.openpty()
            proc = await asyncio.create_subprocess_exec(
                *config["Cmd"], cwd=cwd, env=env, stdin=secondary, stdout=secondary, stderr=secondary,
                start_new_session=True, preexec_fn=_controlling,
            )  # fmt: skip
            os.close(secondary)
            made.pty = primary
        else:
            proc = await asyncio.create_subprocess_exec(
                *config["Cmd"], cwd=cwd, env=env,
                stdin=asyncio.subprocess.PIPE if config.get("AttachStdin") else asyncio.subprocess.DEVNULL,
                stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE, start_new_session=True,
            )  # fmt: skip
        made.running, made.pid = True, proc.pid
        loop = asyncio.get_running_loop()
        feed = _Input(proc, primary)
        request.protocol.set_parser(feed)  # type: ignore[arg-type]  # the client's bytes after the upgrade

        async def pump(reader: asyncio.StreamReader | None, stream: int) -> None:
            while reader is not None and (chunk := await reader.read(4096)):
                transport.write(_frame(stream, chunk))

        async def pump_pty(fd: int) -> None:
            while True:
                try:
                    chunk = await loop.run_in_executor(None, os.read, fd, 4096)
                except OSError:  # EIO: the terminal's last process is gone
                    return
                if not chunk:
                    return
                transport.write(chunk)

        pumps = (
            [asyncio.create_task(pump_pty(primary))]
            if primary is not None
            else [asyncio.create_task(pump(proc.stdout, 1)), asyncio.create_task(pump(proc.stderr, 2))]
        )
        code = await proc.wait()
        made.exit_code = code if code >= 0 else 128 - code
        made.running = False
        await asyncio.wait(pumps, timeout=2.0)
        for task in pumps:
            task.cancel()
        if primary is not None:
            made.pty = None
            with contextlib.suppress(OSError):
                os.close(primary)
        transport.close()

    async def _exec_resize(self, request: web.Request) -> web.StreamResponse:
        if (refused := self._params(request, {"h", "w"})) is not None:
            return refused
        try:
            rows, cols = int(request.query["h"]), int(request.query["w"])
        except (KeyError, ValueError):
            return self._refuse(400, "POST /exec/{id}/resize needs integer h and w")
        made = self.execs.get(request.match_info["id"])
        if made is None:
            return web.json_response({"message": "No such exec instance"}, status=404)
        if not made.config.get("Tty"):
            return self._refuse(400, "resize of an exec without a TTY")
        made.sizes.append((rows, cols))
        if made.pty is not None:
            with contextlib.suppress(OSError):
                fcntl.ioctl(made.pty, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))
        return web.Response(status=200)

    async def _exec_inspect(self, request: web.Request) -> web.StreamResponse:
        made = self.execs.get(request.match_info["id"])
        if made is None:
            return web.json_response({"message": "No such exec instance"}, status=404)
        cmd = made.config["Cmd"]
        return web.json_response(
            {
                "ID": made.id, "Running": made.running, "ExitCode": made.exit_code, "ContainerID": made.container.id,
                "Pid": made.pid, "CanRemove": not made.running, "DetachKeys": "",
                "OpenStdin": bool(made.config.get("AttachStdin")), "OpenStdout": bool(made.config.get("AttachStdout")),
                "OpenStderr": bool(made.config.get("AttachStderr")),
                "ProcessConfig": {"tty": bool(made.config.get("Tty")), "entrypoint": cmd[0], "arguments": cmd[1:],
                                  "privileged": False, "user": ""},
            }
        )  # fmt: skip


_GO_TYPE_BITS = ((stat.S_ISDIR, 1 << 31), (stat.S_ISLNK, 1 << 27), (stat.S_ISBLK, 1 << 26),
                 (stat.S_ISFIFO, 1 << 25), (stat.S_ISSOCK, 1 << 24), (stat.S_ISCHR, (1 << 26) | (1 << 21)))  # fmt: skip


def _tar_of(target: Path, root: Path) -> tuple[bytes, Json]:
    """The archive of `target` (a folder with what it holds) and its stat as the engine gives it
    (`mode`: Go `fs.FileMode` bits); `FileNotFoundError` when it does not exist or a link in its
    path leads out of `root` (the container's filesystem, as the engine resolves it)."""
    if not target.parent.resolve().is_relative_to(root.resolve()):
        raise FileNotFoundError(target)
    info = os.lstat(target)
    mode = stat.S_IMODE(info.st_mode) & 0o777
    for test, bit in _GO_TYPE_BITS:
        if test(info.st_mode):
            mode |= bit
    link = os.readlink(target) if stat.S_ISLNK(info.st_mode) else ""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        tar.add(target, arcname=target.name, recursive=True)  # links stay links (no dereference)
    stamp = datetime.fromtimestamp(info.st_mtime, tz=UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")
    return buffer.getvalue(), {"name": target.name, "size": info.st_size, "mode": mode, "mtime": stamp,
                               "linkTarget": link}  # fmt: skip


def _kill_container(root: int) -> None:
    """Kill a container's processes as the engine does (the whole of it at once): its main process is
    stopped first, so it cannot see a child die and report before its own end."""
    with contextlib.suppress(OSError):
        os.kill(root, signal.SIGSTOP)
    kill_tree(root)


def _gone(request: web.Request) -> bool:
    """The client closed the connection (a streamed answer stops)."""
    return request.transport is None or request.transport.is_closing()


async def _until(changed: asyncio.Event, limit_s: float = 0.5) -> None:
    """Until `changed` is set, or a moment passed (to notice a client that went away)."""
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(changed.wait(), limit_s)


def _only(data: bytes, streams: set[int]) -> bytes:
    """Multiplexed frames of the wanted streams only."""
    if streams == {1, 2}:
        return data
    out, at = bytearray(), 0
    while at + 8 <= len(data):
        stream, size = struct.unpack_from(">BxxxL", data, at)
        if stream in streams:
            out.extend(data[at : at + 8 + size])
        at += 8 + size
    return bytes(out)


def _controlling() -> None:
    """In the child, after `setsid`: its stdin, the terminal, becomes its controlling terminal."""
    fcntl.ioctl(0, termios.TIOCSCTTY, 0)


class _Input:
    """Takes the hijacked connection's bytes (aiohttp's payload parser slot) into the exec's stdin."""

    def __init__(self, proc: asyncio.subprocess.Process, pty: int | None) -> None:
        self._proc = proc
        self._pty = pty

    def feed_data(self, data: bytes) -> tuple[bool, bytes]:
        with contextlib.suppress(OSError, RuntimeError):
            if self._pty is not None:
                os.write(self._pty, data)
            elif self._proc.stdin is not None:
                self._proc.stdin.write(data)
        return False, b""

    def feed_eof(self) -> None:  # the client closed the connection: the exec's input ends, and so does it
        if self._proc.returncode is None:
            kill_tree(self._proc.pid)
