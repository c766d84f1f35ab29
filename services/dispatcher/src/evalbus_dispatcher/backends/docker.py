"""The Docker backend: one container per case attempt on one Docker engine, through the Engine API.

The container runs the in-job runner (docs/backends.md) in the case image with the job spec in
`EVALBUS_JOB`, as the cluster backends do; `harness.compute` gives its image, CPUs
(`HostConfig.NanoCpus`), memory (`Memory`, and `MemorySwap` the same: no swap, so past it the
kernel's OOM killer ends it) and GPUs (`DeviceRequests`, capability `gpu`); the network mode is the
dispatcher's (`DISPATCHER_DOCKER_NETWORK`); the run id, attempt and batch are labels. A
`node_selector` is matched against the engine's own labels (`/info` `Labels`, `key=value`).

Secrets: without swarm the engine has no secret store a container can read by name, so each
`secret_env` entry is resolved at dispatch from the dispatcher's secret store and put in the
container's environment through the create request only — never in a log line, a mark or an event;
the runner masks the values in what it prints. The runner's own NATS password, when it publishes the
live view itself (`runner_nats`), travels the same way. (Whoever can `docker inspect` on that engine
can read them: docs/backends.md says so.)

While it runs the sandbox follows the engine's event feed for the container (`GET /events`, the
engine's own timestamps) and marks the run's trace: `submitted`, `scheduled` (created on the
engine), and an `engine` mark per lifecycle event (`create`, `start`, `oom`, `die`…). An image the
engine lacks is pulled (`POST /images/create`); one that cannot be pulled fails the run at once as
`ErrImagePull`, the engine's answer in the marks. The log is followed (`/containers/{id}/logs`,
multiplexed frames) and decoded from the runner's record lines; how it ended comes from
`/containers/{id}/wait` and `State.OOMKilled`. A declared file is read from the container, stopped
but not yet removed, as its archive (`GET /containers/{id}/archive?path=…`: the path's stat header
says whether it is a regular file, the tar stream's one member is read as it comes). Exec and the terminal are engine execs over the
hijacked connection (`/containers/{id}/exec`, `/exec/{id}/start`, `/exec/{id}/resize`). Release
removes the container (`force`). The HTTP client is `docker_engine.py` (why aiohttp and not the
synchronous `docker` SDK: its docstring); what the container is told and how the engine's answers
read, `docker_container.py`.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import json
import logging
import math
import ssl
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp

from evalbus_contracts import CaseRequested, PromptSnapshot, Snapshot
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
from evalbus_dispatcher.backends.docker_container import (
    LIFECYCLE,
    RUN_LABEL,
    SHELL,
    WORKING_DIR,
    DockerTemplate,
    StreamMask,
    container_body,
    container_name,
    fit_problem,
    image_reference,
    masker,
    read_container,
    read_event,
    read_stats,
    resolve_secrets,
)
from evalbus_dispatcher.backends.docker_engine import (
    API_VERSION,
    DEFAULT_HOST,
    PATH_STAT_HEADER,
    STDERR,
    STDOUT,
    DockerEngine,
    EngineError,
    FrameSplitter,
    Hijacked,
    parse_host,
    path_stat,
    query,
    read_tar_entry,
    tls_context,
)
from evalbus_dispatcher.backends.job_log import JobLog, LineSplitter, UnitEnd
from evalbus_dispatcher.backends.job_spec import (
    LiveHandoff,
    LiveHandoffs,
    longest_life_s,
    run_of,
    runner_job,
    runner_live,
)
from evalbus_dispatcher.errors import BackendError
from evalbus_grading import ExecResult
from evalbus_runtime.secrets import SecretStore
from evalbus_runtime.tasks import cancel_and_wait

__all__ = ["DockerBackend", "DockerSandbox", "DockerShell", "DockerTemplate", "connect_docker"]

log = logging.getLogger(__name__)

HOLD_S = 0.2
"""Longest a terminal's output is held back to see whether it continues into a secret value."""
_MIB = 1024 * 1024


# ---------------------------------------------------------------- the backend


class DockerBackend:
    """Case sandboxes as containers on one Docker engine."""

    def __init__(
        self, engine: DockerEngine, template: DockerTemplate, secrets: SecretStore, *, slots: int = 4,
        live: LiveHandoffs | None = None,
    ) -> None:  # fmt: skip
        self._engine = engine
        self._live = live
        self._template = template
        self._secrets = secrets
        self._slots = slots
        self._held: dict[int, ComputeSpec] = {}
        self._keys = itertools.count()

    @property
    def engine(self) -> DockerEngine:
        """The Engine API client."""
        return self._engine

    @property
    def template(self) -> DockerTemplate:
        """What every container shares."""
        return self._template

    async def close(self) -> None:
        """Close the engine's session."""
        await self._engine.close()

    def capacity(self) -> Capacity:
        """Slots configured and held by unreleased sandboxes (the engine's room: `room`)."""
        return Capacity(total=self._slots, used=len(self._held))

    async def info(self) -> dict[str, Any]:
        """`GET /info`; `BackendError` — infra, retried, when the engine cannot be reached; config
        when it refuses (an engine whose API is older than evalbus can speak)."""
        try:
            found = await self._engine.call("GET", "/info")
        except EngineError as e:
            if e.status == 0:
                raise BackendError(f"cannot read the Docker engine's info: {e}", code="orchestrator_unreachable") from e
            raise BackendError(f"the Docker engine refused: {e}", code="orchestrator_refused", failure_class="config",
                               retryable=False) from e  # fmt: skip
        return found if isinstance(found, dict) else {}

    async def room(self, compute: ComputeSpec | None = None) -> int:
        """How many more cases of this size fit the engine now: its CPUs and memory (`/info`) less
        what this backend's unreleased containers asked for."""
        size = compute or ComputeSpec()
        info = await self.info()
        cpus = float(info.get("NCPU") or 0) - sum(c.cpu for c in self._held.values())
        memory = int(info.get("MemTotal") or 0) // _MIB - sum(c.memory_mb for c in self._held.values())
        return max(0, int(min(cpus / size.cpu, memory / size.memory_mb) + 1e-9))

    async def provision(self, job: CaseRequested) -> DockerSandbox:
        """A sandbox for the case (its container is made when the harness runs); `BackendError` —
        config, not retried — for a secret the store lacks or a case the engine can never fit."""
        run_id = run_of(job)
        compute = job.harness.resources()
        secret_env = resolve_secrets(job, self._secrets)
        info = await self.info()
        problem = fit_problem(compute, info)
        if problem is not None:
            raise BackendError(problem, code="unschedulable", failure_class="config", retryable=False)
        await self._sweep(run_id)
        handoff = self._live.get(run_id) if self._live is not None else None
        life = longest_life_s(job, start_timeout_s=self._template.start_timeout_s)
        live = runner_live(self._template.runner_nats, handoff, job, life_s=life)
        body = container_body(job, run_id, self._template, secret_env, live)
        name = container_name(run_id, job.attempt)
        node = str(info.get("Name") or "docker")
        key = next(self._keys)
        self._held[key] = compute

        def freed() -> None:
            self._held.pop(key, None)

        return DockerSandbox(
            self, job, name, body, node=node, secret_values=list(secret_env.values()), free_slot=freed,
            handoff=handoff if live is not None else None,
        )  # fmt: skip

    async def _sweep(self, run_id: str) -> None:
        """Remove containers an earlier execution of this run left (its dispatcher died holding them)."""
        try:
            found = await self._engine.call(
                "GET", "/containers/json", params=query(all=True, filters={"label": [f"{RUN_LABEL}={run_id}"]})
            )
        except EngineError as e:
            log.warning("cannot list earlier containers of %s: %s", run_id, e)
            return
        for item in found or ():
            if (item.get("Labels") or {}).get(RUN_LABEL) == run_id:
                await self.remove(str(item.get("Id")))

    async def remove(self, container: str) -> None:
        """Remove a container, running or not (`force`), with its anonymous volumes; one gone is fine."""
        try:
            await self._engine.call("DELETE", f"/containers/{container}", params=query(force=True, v=True))
        except EngineError as e:
            if e.status != 404:
                raise BackendError(f"cannot remove container {container}: {e}", code="orchestrator_error") from e


class _PullFailed(Exception):
    pass


class DockerSandbox:
    """One case attempt's container."""

    def __init__(
        self,
        backend: DockerBackend,
        job: CaseRequested,
        name: str,
        body: dict[str, Any],
        *,
        node: str,
        secret_values: list[str],
        free_slot: Callable[[], None],
        handoff: LiveHandoff | None = None,
    ) -> None:
        self._backend = backend
        self._handoff = handoff
        self._engine = backend.engine
        self._job = job
        self.name = name
        """The container's name."""
        self._body = body
        self._node = node
        self._mask = masker(secret_values)
        self._secret_values = list(secret_values)
        self._free_slot = free_slot
        self._mark: Mark | None = None
        self.container: str | None = None
        """The container's id, once created."""
        self._events: list[OrchestratorEvent] = []
        self._died = asyncio.Event()
        self._follower: asyncio.Task[None] | None = None
        self._log: JobLog | None = None
        self._released = False
        self._running = False
        self._pid: int | None = None
        self._since = time.time()
        self._sessions: set[Hijacked] = set()
        self._stats: dict[str, Any] = {}
        self._sampler: asyncio.Task[None] | None = None

    @property
    def unit(self) -> str | None:
        """`container:<short id>` once created."""
        return f"container:{self.container[:12]}" if self.container else None

    @property
    def node(self) -> str:
        """The engine (its `/info` name)."""
        return self._node

    def observe(self, mark: Mark) -> None:
        """Mark the run's trace as the container comes up (see the module's docstring)."""
        self._mark = mark

    async def placement(self) -> UnitPlacement:
        """The container now, read from the engine."""
        inspect = None
        if self.container is not None:
            with contextlib.suppress(EngineError):
                inspect = await self._engine.call("GET", f"/containers/{self.container}/json")
        return read_container(inspect, self._node, tuple(self._events))

    def usage(self) -> UnitUsage | None:
        """What the container uses while it runs: its last stats read (every `stats_interval_s`, in
        the background: the sampler calls this from a thread) and the harness's pid."""
        if not self._running or self._pid is None:
            return None
        return read_stats(self._stats, self._pid)

    async def _read_stats(self) -> None:
        """Keep the container's stats fresh while it runs (one-shot reads: no streaming, no pre-read)."""
        endpoint = f"/containers/{self.container}/stats"
        while self._running:
            with contextlib.suppress(EngineError):
                found = await self._engine.call("GET", endpoint, params=query(stream=False, **{"one-shot": True}))
                if isinstance(found, dict):
                    self._stats = found
            await asyncio.sleep(self._backend.template.stats_interval_s)

    async def _say(self, event: str, message: str) -> None:
        if self._mark is None:
            return
        try:
            await self._mark(event, message)
        except Exception:  # a live-view problem never stops the run
            log.warning("marking the trace failed", exc_info=True)

    # ------------------------------------------------------------ running

    async def run_harness(self, on_output: OnOutput, on_spawn: OnSpawn | None = None) -> HarnessRun:
        """Create and start the container (pulling its image when the engine lacks it), follow its
        log to the end, and read how the harness ended."""
        self._check_live()
        image = str(self._body["Image"])
        await self._say("submitted", f"container {self.name} (image {image}) submitted to engine {self._node}")
        limit = self._backend.template.start_timeout_s
        try:
            async with asyncio.timeout(limit):
                await self._create(image)
                self._follower = asyncio.create_task(self._follow_events())
                await self._say("scheduled", f"container {(self.container or '')[:12]} created on engine {self._node}")
                await self._engine.call("POST", f"/containers/{self.container}/start")
        except _PullFailed as e:
            return HarnessRun(exit_code=None, stdout="", stderr="", spawn_error=f"the container cannot start: {e}")
        except EngineError as e:
            if e.status == 0:
                raise BackendError(str(e), code="orchestrator_unreachable") from e
            why = self._mask(e.message)
            return HarnessRun(exit_code=None, stdout="", stderr="", spawn_error=f"the container cannot start: {why}")
        except TimeoutError:
            return HarnessRun(exit_code=None, stdout="", stderr="",
                              spawn_error=f"the container did not start within {limit:g}s")  # fmt: skip
        self._running = True
        self._sampler = asyncio.create_task(self._read_stats())
        ran_from = time.monotonic()

        async def spawned(pid: int) -> None:
            self._pid = pid
            if on_spawn is not None:
                await on_spawn(pid)

        job_log = self._log = JobLog(on_output, spawned, handoff=self._handoff)
        deadline = deadline_s(self._job)
        timed_out = False
        waited: Any = None
        try:
            async with asyncio.timeout(deadline):
                await self._follow_log(job_log)
                with contextlib.suppress(EngineError):  # 404: removed under the run (read below as gone)
                    waited = await self._engine.call(
                        "POST", f"/containers/{self.container}/wait", params=query(condition="not-running"),
                        timeout_s=deadline + 30.0,
                    )  # fmt: skip
        except TimeoutError:  # the runner itself kills the harness at its timeout: this is the backstop
            timed_out = True
            with contextlib.suppress(EngineError):
                await self._engine.call("POST", f"/containers/{self.container}/kill", params=query(signal="SIGKILL"))
        self._running = False
        await self._stop_sampler()
        inspect: dict[str, Any] | None = None
        with contextlib.suppress(EngineError):
            inspect = await self._engine.call("GET", f"/containers/{self.container}/json")
        with contextlib.suppress(TimeoutError):  # the `die` (and `oom`) events, for the marks
            await asyncio.wait_for(self._died.wait(), 2.0)
        if inspect is None:  # removed under the run (`docker rm -f`, an engine restarted): nothing says how it ended
            end = UnitEnd(exit_code=None, reason="the container is gone (removed under the run)", timed_out=timed_out)
        else:
            final = read_container(inspect, self._node)
            code = final.exit_code
            if code is None and isinstance(waited, dict):
                code = int(waited.get("StatusCode") or 0)
            end = UnitEnd(exit_code=code, reason=final.reason, oom=final.oom, timed_out=timed_out)
        return job_log.harness_run(end, time.monotonic() - ran_from)

    async def _create(self, image: str) -> None:
        """`POST /containers/create`; on `No such image`, pull it once and create again."""
        params = query(name=self.name)
        try:
            made = await self._engine.call("POST", "/containers/create", params=params, body=self._body)
        except EngineError as e:
            if e.status != 404:
                raise
            await self._pull(image)
            made = await self._engine.call("POST", "/containers/create", params=params, body=self._body)
        self.container = str(made["Id"])
        for warning in made.get("Warnings") or ():
            await self._say("engine", f"warning: {self._mask(str(warning))}")

    async def _pull(self, image: str) -> None:
        """`POST /images/create`; `_PullFailed` with the engine's words when it cannot be pulled."""
        repo, tag = image_reference(image)
        await self._say("engine", f"pulling image {image}")
        error: str | None = None
        try:
            async with self._engine.stream("POST", "/images/create", params=query(fromImage=repo, tag=tag)) as response:
                async for raw in response.content:
                    with contextlib.suppress(ValueError):
                        progress = json.loads(raw)
                        if isinstance(progress, dict) and progress.get("error"):
                            error = str(progress["error"])
        except EngineError as e:
            if e.status == 0:
                raise
            error = e.message
        if error is not None:
            await self._say("engine", f"Failed to pull image {image}: {error}")
            raise _PullFailed(f"ErrImagePull: Failed to pull image {image}: {error}")
        await self._say("engine", f"pulled image {image}")

    async def _follow_events(self) -> None:
        """The engine's events about the container, from its creation on, each marked as it comes."""
        params = query(since=f"{self._since - 1:.0f}", filters={"type": ["container"], "container": [self.container]})
        try:
            async with self._engine.stream("GET", "/events", params=params) as response:
                async for raw in response.content:
                    with contextlib.suppress(ValueError):
                        message = json.loads(raw)
                        if isinstance(message, dict):
                            await self._event(message)
        except EngineError as e:
            log.info("following the events of %s ended: %s", self.name, e)

    async def _event(self, message: dict[str, Any]) -> None:
        event = read_event(message)
        if event.reason not in LIFECYCLE:
            return
        self._events.append(event)
        at = event.at.strftime("%H:%M:%S.%f")[:-4] + "Z " if event.at is not None else ""
        await self._say("engine", f"{at}{event.message}")
        if event.reason == "die":
            self._died.set()

    async def _follow_log(self, job_log: JobLog) -> None:
        """The container's log (stdout and stderr, multiplexed) while it runs, decoded line by line;
        should the stream drop, one read of the whole log afterwards adds what it missed."""
        frames = FrameSplitter()
        lines = {STDOUT: LineSplitter(), STDERR: LineSplitter()}
        seen = {STDOUT: 0, STDERR: 0}
        endpoint = f"/containers/{self.container}/logs"
        try:
            async with self._engine.stream("GET", endpoint, params=query(follow=True, stdout=True, stderr=True)) as r:
                async for chunk in r.content.iter_any():
                    for stream, payload in frames.push(chunk):
                        if stream in lines:
                            seen[stream] += len(payload)
                            for line in lines[stream].push(payload):
                                await job_log.line(line)
        except EngineError as e:  # the connection dropped: read the rest once the container ended
            log.info("following the log of %s ended: %s", self.name, e)
            with contextlib.suppress(EngineError, TimeoutError):
                await self._engine.call("POST", f"/containers/{self.container}/wait", timeout_s=deadline_s(self._job))
            await self._catch_up(job_log, lines, seen)
        for splitter in lines.values():
            for line in splitter.end():
                await job_log.line(line)

    async def _catch_up(self, job_log: JobLog, lines: dict[int, LineSplitter], seen: dict[int, int]) -> None:
        endpoint = f"/containers/{self.container}/logs"
        try:
            async with self._engine.stream("GET", endpoint, params=query(stdout=True, stderr=True)) as r:
                data = await r.read()
        except EngineError as e:
            log.info("the whole log of %s could not be read: %s", self.name, e)
            return
        offsets = {STDOUT: 0, STDERR: 0}
        for stream, payload in FrameSplitter().push(data):
            if stream not in lines:
                continue
            start, offsets[stream] = offsets[stream], offsets[stream] + len(payload)
            skip = max(0, seen[stream] - start)
            if skip < len(payload):
                for line in lines[stream].push(payload[skip:]):
                    await job_log.line(line)

    async def exec(self, command: str, timeout_s: float) -> ExecResult:
        """What the runner's check gave for `command` (the runner ran it in the container)."""
        self._check_live()
        if self._log is None:
            return ExecResult(exit_code=127, stdout="", stderr="[evalbus] the container never ran", timed_out=False)
        return self._log.exec_result(command)

    async def snapshot(self, answer: str) -> Snapshot:
        """The workdir's git changes the runner recorded, else the answer."""
        self._check_live()
        return self._log.snapshot(answer) if self._log is not None else PromptSnapshot(output=answer)

    async def open_file(self, rel: str, *, max_bytes: int) -> AsyncIterator[bytes]:
        """The workdir's file `rel` from the container (ended, not yet removed) as its archive;
        `FileUnreadable` when the engine has no such path, or it is no regular file (a folder, a
        link), or larger than `max_bytes`."""
        self._check_live()
        if self.container is None:
            raise FileUnreadable("the container was never created")
        path = f"{WORKING_DIR}/work/{rel}"
        endpoint = f"/containers/{self.container}/archive"
        try:
            response = await self._engine.open_stream("GET", endpoint, params=query(path=path))
        except EngineError as e:
            if e.status == 404:
                raise FileUnreadable.missing() from e
            raise FileUnreadable(f"the engine did not give it: {self._mask(e.message)}") from e
        try:
            stat = path_stat(response.headers.get(PATH_STAT_HEADER))
            if stat is not None and not stat.regular:
                raise FileUnreadable.not_a_file()
            if stat is not None and stat.size > max_bytes:
                raise FileUnreadable.too_large(stat.size, max_bytes)
            try:
                entry = await read_tar_entry(response.content)
            except (ValueError, asyncio.IncompleteReadError) as e:
                raise FileUnreadable(f"the engine's archive of it cannot be read: {e}") from e
            if entry is None or not entry.regular:
                raise FileUnreadable.not_a_file()
            if entry.size > max_bytes:
                raise FileUnreadable.too_large(entry.size, max_bytes)
        except BaseException:
            response.close()
            raise
        return _member_blocks(response, entry.size)

    # ------------------------------------------------------------ live actions

    async def _start_exec(self, config: dict[str, Any], *, tty: bool) -> tuple[str, Hijacked]:
        self._check_live()
        if not self._running or self.container is None:
            raise BackendError("the case's container is not running", code="not_running", retryable=False)
        try:
            made = await self._engine.call("POST", f"/containers/{self.container}/exec", body=config)
            exec_id = str(made["Id"])
            session = await self._engine.hijack(
                f"/exec/{exec_id}/start", {"Detach": False, "Tty": tty}, multiplexed=not tty
            )
        except EngineError as e:
            raise BackendError(f"exec failed: {e}", code="exec_failed", retryable=False) from e
        self._sessions.add(session)
        return exec_id, session

    async def exit_code(self, exec_id: str) -> int | None:
        """The exec's exit code once it ended (`GET /exec/{id}/json`; None: unknown)."""
        for _ in range(20):
            try:
                found = await self._engine.call("GET", f"/exec/{exec_id}/json")
            except EngineError:
                return None
            if not found.get("Running") and found.get("ExitCode") is not None:
                return int(found["ExitCode"])
            await asyncio.sleep(0.05)  # the engine records the exit just after the stream closes
        return None

    async def exec_live(
        self, command: str, timeout_s: float, *, cap_bytes: int, on_spawn: OnSpawn | None = None
    ) -> LiveExec:
        """Run `command` with `sh -c` in the runner's workdir of the running container, through the
        runner (`--exec`: the secret values masked in what it prints), over an attached exec."""
        argv = [*self._backend.template.runner_command, "--workdir", "work", "--exec", command]
        config = {"AttachStdin": False, "AttachStdout": True, "AttachStderr": True, "Tty": False, "Cmd": argv}
        exec_id, session = await self._start_exec(config, tty=False)
        out, err = bytearray(), bytearray()
        frames = FrameSplitter()
        timed_out = False
        try:
            async with asyncio.timeout(timeout_s):
                while chunk := await session.reader.read(64 * 1024):
                    for stream, payload in frames.push(chunk) if session.multiplexed else [(STDOUT, chunk)]:
                        buf = err if stream == STDERR else out
                        buf.extend(payload)
                        del buf[: -cap_bytes or None]
        except TimeoutError:
            timed_out = True
        finally:
            session.close()
            self._sessions.discard(session)
        code = None if timed_out else await self.exit_code(exec_id)
        return LiveExec(
            exit_code=124 if timed_out else (1 if code is None else code),
            stdout=self._mask(out.decode("utf-8", errors="replace")),
            stderr=self._mask(err.decode("utf-8", errors="replace")),
            timed_out=timed_out,
            truncated=len(out) >= cap_bytes or len(err) >= cap_bytes,
        )

    async def open_shell(self, cols: int, rows: int, on_output: Callable[[bytes], Awaitable[None]]) -> DockerShell:
        """An interactive shell on a TTY exec in the running container, in the runner's workdir."""
        config = {
            "AttachStdin": True, "AttachStdout": True, "AttachStderr": True, "Tty": True, "Cmd": SHELL,
            "Env": ["TERM=xterm-256color"],
        }  # fmt: skip
        exec_id, session = await self._start_exec(config, tty=True)
        shell = DockerShell(self, exec_id, session, on_output)
        shell.resize(cols, rows)
        return shell

    def kill_group(self, pgid: int) -> None:
        """Nothing to do: an exec's processes end with its connection."""

    def stream_mask(self) -> StreamMask:
        """A mask of this case's secret values for a terminal's output."""
        return StreamMask(self._secret_values)

    async def resize(self, exec_id: str, cols: int, rows: int) -> None:
        """`POST /exec/{id}/resize`."""
        try:
            await self._engine.call("POST", f"/exec/{exec_id}/resize", params=query(h=rows, w=cols))
        except EngineError as e:
            log.info("resizing exec %s failed: %s", exec_id, e)

    # ------------------------------------------------------------ release

    async def release(self) -> None:
        """Remove the container (force: it stops if it runs). Idempotent."""
        if self._released:
            return
        self._released = True
        self._running = False
        for session in list(self._sessions):
            session.close()
        try:
            if self.container is not None:
                await self._backend.remove(self.container)
        finally:
            await self._stop_sampler()
            if self._follower is not None:
                await cancel_and_wait(self._follower)
            self._free_slot()

    async def _stop_sampler(self) -> None:
        if self._sampler is not None:
            await cancel_and_wait(self._sampler)

    def _check_live(self) -> None:
        if self._released:
            raise BackendError("the sandbox was already released", code="released", retryable=False)


class DockerShell:
    """An interactive shell over one TTY exec's hijacked connection (raw bytes both ways)."""

    shell = "/bin/sh"

    def __init__(
        self, sandbox: DockerSandbox, exec_id: str, session: Hijacked, on_output: Callable[[bytes], Awaitable[None]]
    ) -> None:
        self._sandbox = sandbox
        self._exec_id = exec_id
        self._session = session
        self._on_output = on_output
        self._tasks: set[asyncio.Task[Any]] = set()
        self._reader = asyncio.create_task(self._read())

    async def _read(self) -> None:
        """The terminal's output, its secret values masked; what could begin one waits for the next
        chunk, at most `HOLD_S` (a program does not pause in the middle of printing a value)."""
        reader = self._session.reader
        mask = self._sandbox.stream_mask()
        with contextlib.suppress(OSError):
            while True:
                try:
                    async with asyncio.timeout(HOLD_S if mask.holding else None):
                        chunk = await reader.read(64 * 1024)
                except TimeoutError:
                    await self._on_output(mask.flush())
                    continue
                if not chunk:
                    break
                if shown := mask.push(chunk):
                    await self._on_output(shown)
        if held := mask.flush():
            await self._on_output(held)

    def _spawn(self, work: Awaitable[Any]) -> None:
        task = asyncio.ensure_future(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def write(self, data: bytes) -> None:
        """Type into it."""
        with contextlib.suppress(OSError, RuntimeError):
            self._session.writer.write(data)

    def resize(self, cols: int, rows: int) -> None:
        """Tell the terminal its size (`POST /exec/{id}/resize`)."""
        self._spawn(self._sandbox.resize(self._exec_id, cols, rows))

    def kill(self) -> None:
        """Close the connection (the engine closes the shell's terminal)."""
        self._session.close()

    async def wait(self) -> int | None:
        """Until the shell ended; its exit code."""
        await self._reader
        self._session.close()
        return await self._sandbox.exit_code(self._exec_id)


async def _member_blocks(response: aiohttp.ClientResponse, size: int) -> AsyncIterator[bytes]:
    """The `size` bytes of the archive's member whose header was just read, as they come; the
    answer is closed once done."""
    left = size
    try:
        while left > 0:
            try:
                block = await response.content.readexactly(min(left, _BLOCK))
            except (asyncio.IncompleteReadError, aiohttp.ClientError) as e:
                raise BackendError(f"the archive ended {left} bytes short: {e}", code="file_read_failed") from e
            left -= len(block)
            yield block
    finally:
        response.close()


_BLOCK = 256 * 1024


def connect_docker(
    template: DockerTemplate,
    secrets: SecretStore,
    *,
    host: str = DEFAULT_HOST,
    api_version: str = API_VERSION,
    slots: int = 4,
    tls_verify: bool = False,
    tls: bool = False,
    cert_path: Path | None = None,
    live: LiveHandoffs | None = None,
) -> DockerBackend:
    """A backend on the engine at `host` (`DOCKER_HOST`: `unix:///path` or `tcp://host:port`), over
    TLS with `tls_verify` (the engine authenticated by `cert_path`'s `ca.pem`) or `tls` (encrypted
    only), the client certificate from `cert_path` (default `~/.docker`), as the docker CLI does.
    `ValueError` for an address or TLS files that cannot be used."""
    address = parse_host(host)
    context: ssl.SSLContext | None = None
    if tls_verify or tls:
        if address.kind != "tcp":
            raise ValueError(f"DOCKER_TLS_VERIFY / DOCKER_TLS need a tcp:// DOCKER_HOST, not {host!r}")
        address = dataclasses.replace(address, tls=True)
        context = tls_context(cert_path or Path.home() / ".docker", verify=tls_verify)
    engine = DockerEngine(address, api_version=api_version, tls=context)
    return DockerBackend(engine, template, secrets, slots=slots, live=live)


def deadline_s(job: CaseRequested) -> int:
    """Seconds the container may run: the harness's timeout, the compute graders', and 120 s."""
    spec = runner_job(job, run_of(job))
    return math.ceil(spec.timeout_s + sum(c.timeout_s for c in spec.checks) + 120)
