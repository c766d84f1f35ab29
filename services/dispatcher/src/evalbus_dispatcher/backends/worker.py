"""Warm workers: the local backend's long-lived harness processes for `harness.kind: worker`.

One worker process serves one case at a time over the worker protocol
(`evalbus_contracts.worker_protocol`, JSON lines on its stdin and stdout); the pool keeps at most
one worker per compute slot, reuses an idle one of the same batch whose harness (argv and
environment) matches, and spawns one otherwise (first retiring an idle worker of another harness
or batch when every slot has one). A worker serves one batch: the next batch — the user's edited
agent, typically — imports the code afresh, and no state a harness keeps in memory crosses from one
batch's results to another's. An idle worker exits after `WORKER_IDLE_S`.

A worker lives in its own process group and its own home folder (`evalbus-worker-*`, swept like a
case root when its dispatcher dies), is killed with the dispatcher (`PR_SET_PDEATHSIG`), and is
killed and dropped — never reused — when it crashes, hangs past the case's timeout, breaks the
protocol or is cancelled with its case; the next case gets a fresh one. `max_cases_per_worker`
retires a worker after that many cases (stdin closed: it exits by itself, or is killed after a
grace).

What a case's worker says is turned into the command harness's own lines (`EVALBUS_EVENT`,
`EVALBUS_RESULT`, `EVALBUS_CDP`, `EVALBUS_DISPLAY`, and the printed text as is), so the live tee,
the answer and the trace are read exactly as for a command harness.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
import time
from collections import deque
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from evalbus_contracts import CaseRequested
from evalbus_contracts.worker_protocol import (
    CaseMessage,
    CdpMessage,
    DisplayMessage,
    EventMessage,
    LogMessage,
    Ready,
    ResultMessage,
    WorkerOutput,
)
from evalbus_dispatcher.backends import disk, procfs
from evalbus_dispatcher.backends.base import HarnessRun, OnOutput, OnSpawn, OutputStream, RunFailure, UnitUsage
from evalbus_dispatcher.backends.process_group import (
    OWNER_FILE,
    TIMEOUT_EXIT,
    Capture,
    ExitAwareProtocol,
    die_with_parent,
    exit_code,
    owner_mark,
    signal_group,
)

log = logging.getLogger(__name__)

CASE_VARIABLES: tuple[str, ...] = (
    "EVALBUS_RUN_ID", "EVALBUS_CASE_ID", "EVALBUS_TRIAL", "EVALBUS_ATTEMPT", "EVALBUS_INPUT_FILE",
    "EVALBUS_BATCH_ID", "OTEL_RESOURCE_ATTRIBUTES",
)  # fmt: skip
"""Variables that differ from case to case: sent with each case, not in the worker's environment."""

WORKER_IDLE_S = 60.0
"""How long a worker waits idle for its batch's next case before it is retired (its agent may hold
a model in memory: it is not kept for a batch that has ended)."""

PROTOCOL_SNIPPET = 200
"""Characters of an offending line quoted in a `worker_protocol` failure."""

_READ_CHUNK = 64 * 1024
_MAX_LINE = 64 * 1024 * 1024
_RECENT_LINES = 200
_decoder: msgspec.json.Decoder[WorkerOutput] = msgspec.json.Decoder(WorkerOutput)
_encoder = msgspec.json.Encoder()


def worker_argv(job: CaseRequested, python: str = sys.executable) -> tuple[str, ...]:
    """The argv of `job`'s worker: the SDK serving `harness.python`, else `harness.command`."""
    harness = job.harness
    if harness.python is not None:
        return (python, "-m", "evalbus.harness", harness.python)
    return harness.command


class _ProtocolError(Exception):
    """The worker wrote something the protocol does not allow."""


@dataclass
class _Serving:
    """The case a worker is serving and what it said so far."""

    run_id: str
    on_output: OnOutput
    redact: Callable[[str], str]
    out: Capture
    err: Capture
    done: asyncio.Future[ResultMessage | RunFailure] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    def finish(self, outcome: ResultMessage | RunFailure) -> None:
        if not self.done.done():
            self.done.set_result(outcome)


class _Worker:
    """One warm worker process."""

    def __init__(self, key: tuple[object, ...], home: Path, max_cases: int, on_dead: Callable[[_Worker], None]) -> None:
        self.key = key
        self._on_dead = on_dead
        self.home = home
        self.max_cases = max_cases
        self.pid = 0
        self.served = 0
        self.serving: _Serving | None = None
        self.dead = False
        self.ready: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self.drained = asyncio.Event()
        self.oom_kills: int | None = None
        """The memory cgroup's OOM-kill count when it started."""
        """Set once it exited and what it wrote was read (bounded)."""
        self.recent: deque[str] = deque(maxlen=_RECENT_LINES)
        """Its last stderr lines outside any case (evidence when it dies starting)."""
        self._transport: asyncio.SubprocessTransport | None = None
        self._protocol: ExitAwareProtocol | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._redact: Callable[[str], str] = lambda text: text

    @property
    def exited(self) -> asyncio.Event:
        assert self._protocol is not None
        return self._protocol.exited

    def returncode(self) -> int | None:
        return None if self._transport is None else self._transport.get_returncode()

    async def start(self, argv: tuple[str, ...], env: Mapping[str, str], redact: Callable[[str], str]) -> None:
        """Spawn it (OSError when it cannot be)."""
        loop = asyncio.get_running_loop()
        self._redact = redact
        transport, protocol = await loop.subprocess_exec(
            lambda: ExitAwareProtocol(loop),
            *die_with_parent(argv, self.home, env),
            cwd=self.home,
            env=dict(env),
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
            start_new_session=True,
        )
        self._transport, self._protocol = transport, protocol
        self.pid = transport.get_pid()
        assert protocol.stdout is not None
        assert protocol.stderr is not None
        self._tasks = [
            asyncio.create_task(self._read(protocol.stdout, self._stdout_line)),
            asyncio.create_task(self._read(protocol.stderr, self._stderr_line)),
            asyncio.create_task(self._watch()),
        ]

    async def send(self, case: CaseMessage) -> None:
        assert self._protocol is not None
        assert self._protocol.stdin is not None
        self._protocol.stdin.write(_encoder.encode(case) + b"\n")
        await self._protocol.stdin.drain()

    async def _read(self, reader: asyncio.StreamReader, on_line: Callable[[bytes], Awaitable[None]]) -> None:
        pending = b""
        while chunk := await reader.read(_READ_CHUNK):
            pending += chunk
            if b"\n" not in chunk and len(pending) <= _MAX_LINE:
                continue
            *complete, pending = pending.split(b"\n")
            for raw in complete:
                await on_line(raw)
            if len(pending) > _MAX_LINE:
                await on_line(pending)
                pending = b""
        if pending:
            await on_line(pending)

    async def _stdout_line(self, raw: bytes) -> None:
        if self.dead:
            return
        text = self._redact(raw.decode("utf-8", errors="replace").removesuffix("\r"))
        try:
            await self._message(text)
        except _ProtocolError as e:
            self.broken(str(e))
        except Exception as e:  # a live-view problem must never stall the worker's pipe
            log.exception("worker output callback failed")
            if self.serving is None:
                self.broken(f"{type(e).__name__}: {e}")

    async def _message(self, text: str) -> None:
        if not text.strip():
            return
        try:
            message = _decoder.decode(text)
        except msgspec.DecodeError as e:
            raise _ProtocolError(f"not a protocol message ({e}): {text[:PROTOCOL_SNIPPET]!r}") from e
        if isinstance(message, Ready):
            if self.ready.done():
                raise _ProtocolError("a second ready")
            self.ready.set_result(None)
            return
        serving = self.serving
        if serving is None:
            raise _ProtocolError(f"a {_kind(message)} line while no case is being served")
        if message.run_id != serving.run_id:
            raise _ProtocolError(f"a {_kind(message)} line for run {message.run_id!r} while serving {serving.run_id!r}")
        if isinstance(message, EventMessage):
            await self._line(serving, "stdout", "EVALBUS_EVENT " + bytes(message.event).decode("utf-8"))
        elif isinstance(message, LogMessage):
            for line in message.text.split("\n"):
                await self._line(serving, message.stream, line)
        elif isinstance(message, CdpMessage):
            await self._line(serving, "stdout", "EVALBUS_CDP " + message.url)
        elif isinstance(message, DisplayMessage):
            await self._line(serving, "stdout", "EVALBUS_DISPLAY " + message.display)
        else:
            if message.answer is not None:
                result = _encoder.encode({"answer": message.answer}).decode("utf-8")
                await self._line(serving, "stdout", "EVALBUS_RESULT " + result)
            serving.finish(message)

    async def _line(self, serving: _Serving, stream: OutputStream, line: str) -> None:
        (serving.out if stream == "stdout" else serving.err).add(line)
        await serving.on_output(stream, line)

    async def _stderr_line(self, raw: bytes) -> None:
        line = self._redact(raw.decode("utf-8", errors="replace").removesuffix("\r"))
        serving = self.serving
        if serving is None:
            self.recent.append(line)
            return
        serving.err.add(line)
        try:
            await serving.on_output("stderr", line)
        except Exception:
            log.exception("worker output callback failed; output keeps being read")

    async def _watch(self) -> None:
        await self.exited.wait()
        # what it wrote before it died is still in the pipes: read it, bounded
        await asyncio.wait(self._tasks[:2], timeout=2.0)
        self.dead = True
        self.drained.set()
        # an idle worker that died (or any other) leaves the pool; not from inside this task
        asyncio.get_running_loop().call_soon(self._on_dead, self)
        if not self.ready.done():
            self.ready.set_exception(_Exited())
        if self.serving is not None:
            self.serving.finish(self._death())

    def _death(self) -> RunFailure:
        code = self.returncode()
        sig = -code if code is not None and code < 0 else None
        if sig == signal.SIGKILL:
            return RunFailure(
                code="worker_killed",
                failure_class="infra",
                message=f"the worker (pid {self.pid}) was killed (SIGKILL) while serving the case; it is replaced",
                retryable=True,
            )
        how = f"died of {signal.Signals(sig).name}" if sig is not None else f"exited with {exit_code(code)}"
        return RunFailure(
            code="worker_crashed",
            failure_class="harness",
            message=f"the worker (pid {self.pid}) {how} while serving the case; it is replaced",
        )

    def broken(self, why: str) -> None:
        """The worker broke the protocol: kill it, fail what it serves."""
        if self.dead:
            return
        self.dead = True
        self.kill()
        failure = RunFailure(
            code="worker_protocol", failure_class="harness", message=f"the worker broke the protocol: {why}"
        )
        if not self.ready.done():
            self.ready.set_exception(_Broken(failure))
        if self.serving is not None:
            self.serving.finish(failure)

    def kill(self) -> None:
        """SIGKILL its process group: while the leader lives, or once it was reaped while processes
        of its group remain (a group with none left may have had its id reused by another)."""
        if not self.pid:
            return
        if self.exited.is_set() and procfs.group_usage(self.pid) is None:
            return
        signal_group(self.pid, signal.SIGKILL)

    async def stop(self, grace_s: float) -> None:
        """End it: stdin closed (a served worker exits by itself), killed after `grace_s`; its home
        deleted."""
        self.dead = True
        try:
            if self._protocol is not None and self._transport is not None:
                with contextlib.suppress(OSError, RuntimeError):
                    if self._protocol.stdin is not None:
                        self._protocol.stdin.close()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self.exited.wait(), grace_s)
                self.kill()
                await self.exited.wait()
        finally:
            for task in self._tasks:
                task.cancel()
            await asyncio.gather(*self._tasks, return_exceptions=True)
            if self._transport is not None:
                self._transport.close()
            await asyncio.to_thread(shutil.rmtree, self.home, ignore_errors=True)


class _Exited(Exception):
    """The worker exited before it was ready."""


class _Broken(Exception):
    def __init__(self, failure: RunFailure) -> None:
        super().__init__(failure.message)
        self.failure = failure


def _kind(message: object) -> str:
    return type(message).__struct_config__.tag  # type: ignore[attr-defined,no-any-return]


class WorkerPool:
    """The warm workers of one local backend: at most `slots` processes."""

    def __init__(
        self,
        *,
        slots: int,
        root: Path | None,
        grace_s: float,
        python: str = sys.executable,
        idle_s: float | None = None,
    ) -> None:
        """`idle_s`: how long a worker waits idle before it is retired (None: `WORKER_IDLE_S`)."""
        self._slots = slots
        self._root = root
        self._grace_s = grace_s
        self._python = python
        self._idle_s = WORKER_IDLE_S if idle_s is None else idle_s
        self._expiry: dict[_Worker, asyncio.TimerHandle] = {}
        """The idle workers' retirement timers."""
        self._idle: dict[tuple[object, ...], list[_Worker]] = {}
        self._alive: set[_Worker] = set()
        self._stopping: set[asyncio.Task[None]] = set()
        self.spawned = 0
        """Workers started so far."""

    @property
    def size(self) -> int:
        """Workers alive now (serving or idle)."""
        return len(self._alive)

    def pids(self) -> set[int]:
        """Process ids of every worker alive (serving or idle)."""
        return {w.pid for w in self._alive if w.pid}

    def idle_pids(self) -> list[int]:
        """Process ids of the idle workers."""
        return [w.pid for workers in self._idle.values() for w in workers]

    def usage(self, pid: int) -> UnitUsage | None:
        """What worker `pid` uses now: its own process, read from `/proc/<pid>/stat` alone (the
        processes a case starts are not counted; a whole-group scan of `/proc` per case would cost
        more than the case)."""
        try:
            found = procfs._stat(Path(f"/proc/{pid}/stat").read_text())
        except OSError:
            return None
        if found is None:
            return None
        return UnitUsage(
            pid=pid, processes=1, rss_bytes=found.rss_pages * procfs._PAGE, cpu_seconds=found.cpu_ticks / procfs._TICKS
        )

    async def run_case(
        self,
        job: CaseRequested,
        *,
        workdir: Path,
        env: Mapping[str, str],
        secret_env: Mapping[str, str],
        timeout_s: float,
        redact: Callable[[str], str],
        on_output: OnOutput,
        on_spawn: OnSpawn,
        cap: int,
    ) -> HarnessRun:
        """Serve `job` on a warm worker in `workdir`; a spawn failure is reported, not raised."""
        argv = worker_argv(job, self._python)
        if not argv:
            return HarnessRun(exit_code=None, stdout="", stderr="", spawn_error="the worker harness has no command")
        case_env = {name: env[name] for name in CASE_VARIABLES if name in env}
        worker_env = {name: value for name, value in env.items() if name not in CASE_VARIABLES} | dict(secret_env)
        key = (job.batch_id, argv, tuple(sorted(worker_env.items())))
        started = time.monotonic()
        serving = _Serving(
            run_id=job.run_id or "", on_output=on_output, redact=redact, out=Capture(cap), err=Capture(cap)
        )
        worker = self._take_idle(key)
        if worker is None:
            try:
                worker = await self._spawn(key, argv, worker_env, redact, job.harness.max_cases_per_worker)
            except OSError as e:
                if disk.is_no_space(e):  # its home (on the workdirs' disk) could not be written
                    message = disk.no_space_message(workdir, "starting a worker", e)
                    full = RunFailure(code=disk.DISK_FULL, failure_class="infra", message=message, retryable=True)
                    return HarnessRun(exit_code=None, stdout="", stderr="", failure=full)
                return HarnessRun(
                    exit_code=None, stdout="", stderr="", spawn_error=redact(f"cannot start {argv[0]!r}: {e}")
                )
        worker.serving = serving
        try:
            try:
                await on_spawn(worker.pid)
            except Exception:  # a live-view problem must never stop the run
                log.exception("spawn callback failed; the run goes on")
            outcome = await self._serve(
                worker, job, serving, workdir, case_env, timeout_s - (time.monotonic() - started)
            )
            if isinstance(outcome, str):  # past its timeout: SIGTERM, a grace, SIGKILL, as a command's group
                worker.dead = True
                signal_group(worker.pid, signal.SIGTERM)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(worker.exited.wait(), self._grace_s)
            if isinstance(outcome, str | RunFailure):  # gone before the case goes on; its last words read
                worker.kill()
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(worker.drained.wait(), self._grace_s + 3.0)
        except BaseException:  # cancelled: the worker's state is unknown, it must not serve again
            worker.dead = True
            worker.kill()
            self._retire(worker)
            raise
        finally:
            worker.serving = None
        duration = time.monotonic() - started
        if isinstance(outcome, str):  # "timeout"
            return self._ended(serving, worker, duration)
        if isinstance(outcome, RunFailure):
            self._retire(worker)
            code = worker.returncode()
            sig = -code if code is not None and code < 0 else None
            # the cgroup's OOM kills counted since the worker started (read per worker, not per case)
            oom = procfs.oom_verdict(sig, timed_out=False, before=worker.oom_kills, after=procfs.oom_kills())
            return HarnessRun(
                exit_code=exit_code(code) if outcome.code != "worker_protocol" else None,
                stdout=serving.out.text(),
                stderr=serving.err.text(),
                duration_s=duration,
                stdout_truncated=serving.out.truncated,
                stderr_truncated=serving.err.truncated,
                signal=sig if outcome.code != "worker_protocol" else None,
                oom=oom if outcome.code != "worker_protocol" else False,
                pid=worker.pid,
                failure=outcome,
            )
        worker.served += 1
        self._release(worker)
        failure = (
            RunFailure(code="harness_error", failure_class="agent", message=f"the harness raised: {outcome.error}")
            if outcome.error is not None
            else None
        )
        return HarnessRun(
            exit_code=0 if failure is None else 1,
            stdout=serving.out.text(),
            stderr=serving.err.text(),
            duration_s=duration,
            stdout_truncated=serving.out.truncated,
            stderr_truncated=serving.err.truncated,
            oom=False,
            pid=worker.pid,
            failure=failure,
        )

    async def _serve(
        self,
        worker: _Worker,
        job: CaseRequested,
        serving: _Serving,
        workdir: Path,
        case_env: dict[str, str],
        timeout_s: float,
    ) -> ResultMessage | RunFailure | str:
        """The case's outcome: its result, why the worker failed, or `"timeout"` (`timeout_s`
        counts from now, a worker's start included)."""
        try:
            async with asyncio.timeout(max(0.0, timeout_s)):
                if not worker.ready.done():
                    try:
                        await asyncio.shield(worker.ready)
                    except _Exited:
                        return self._start_failure(worker, serving)
                    except _Broken as e:
                        return e.failure
                message = CaseMessage(
                    run_id=serving.run_id,
                    case_id=job.case.id,
                    batch_id=job.batch_id,
                    trial=job.trial or 1,
                    attempt=job.attempt,
                    input=job.case.input,
                    workdir=str(workdir),
                    input_file=case_env.get("EVALBUS_INPUT_FILE", ""),
                    env=case_env,
                    timeout_s=job.case.timeout_s or job.harness.timeout_s,
                )
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # dying: its death is the outcome
                    await worker.send(message)
                return await asyncio.shield(serving.done)
        except TimeoutError:
            return "timeout"

    def _start_failure(self, worker: _Worker, serving: _Serving) -> RunFailure:
        for line in worker.recent:
            serving.err.add(line)
        code = worker.returncode()
        return RunFailure(
            code="worker_start_failed",
            failure_class="harness",
            message=f"the worker exited with {exit_code(code)} before it was ready for cases",
            never_started=True,
        )

    def _ended(self, serving: _Serving, worker: _Worker, duration: float) -> HarnessRun:
        """A case killed on its timeout (its worker already gone)."""
        self._retire(worker)
        code = worker.returncode()
        return HarnessRun(
            exit_code=TIMEOUT_EXIT,
            stdout=serving.out.text(),
            stderr=serving.err.text(),
            duration_s=duration,
            timed_out=True,
            stdout_truncated=serving.out.truncated,
            stderr_truncated=serving.err.truncated,
            signal=-code if code is not None and code < 0 else None,
            oom=False,
            pid=worker.pid,
        )

    def _take_idle(self, key: tuple[object, ...]) -> _Worker | None:
        workers = self._idle.get(key)
        while workers:
            worker = workers.pop()
            if not workers:
                del self._idle[key]
            timer = self._expiry.pop(worker, None)
            if timer is not None:
                timer.cancel()
            if not worker.dead:
                return worker
        return None

    def _expire(self, worker: _Worker) -> None:
        """An idle worker's time is up: retired (a worker serving again meanwhile had its timer cancelled)."""
        self._expiry.pop(worker, None)
        log.debug("worker %d idle for %gs: retired", worker.pid, self._idle_s)
        self._retire(worker)

    async def _spawn(
        self,
        key: tuple[object, ...],
        argv: tuple[str, ...],
        env: Mapping[str, str],
        redact: Callable[[str], str],
        max_cases: int,
    ) -> _Worker:
        if len(self._alive) >= self._slots:
            self._evict_one()
        home = Path(tempfile.mkdtemp(prefix="evalbus-worker-", dir=self._root))
        (home / OWNER_FILE).write_text(owner_mark(os.getpid()))
        worker = _Worker(key, home, max_cases, self._retire)
        worker.oom_kills = procfs.oom_kills()
        try:
            await worker.start(argv, env, redact)
        except BaseException:
            shutil.rmtree(home, ignore_errors=True)
            raise
        self._alive.add(worker)
        self.spawned += 1
        return worker

    def _evict_one(self) -> None:
        """Retire the idle worker that has waited longest (of a batch that has likely ended)."""
        if self._expiry:
            self._retire(next(iter(self._expiry)))  # timers are added as workers go idle: oldest first

    def _release(self, worker: _Worker) -> None:
        """Back to the idle workers of its harness, or retired when it served its share or died."""
        if worker.dead or (worker.max_cases and worker.served >= worker.max_cases):
            self._retire(worker)
            return
        self._idle.setdefault(worker.key, []).append(worker)
        self._expiry[worker] = asyncio.get_running_loop().call_later(self._idle_s, self._expire, worker)

    def _retire(self, worker: _Worker, grace_s: float | None = None) -> None:
        if worker not in self._alive:
            return
        self._alive.discard(worker)
        timer = self._expiry.pop(worker, None)
        if timer is not None:
            timer.cancel()
        idle = self._idle.get(worker.key)
        if idle and worker in idle:
            idle.remove(worker)
            if not idle:
                del self._idle[worker.key]
        task = asyncio.create_task(worker.stop(self._grace_s if grace_s is None else grace_s))
        self._stopping.add(task)
        task.add_done_callback(self._stopping.discard)

    async def close(self) -> None:
        """Stop every worker (idle ones exit on end of input) and wait until they are gone."""
        for worker in list(self._alive):
            self._retire(worker)
        if self._stopping:
            await asyncio.gather(*self._stopping, return_exceptions=True)
