"""The local backend: each case runs on this machine in its own temporary workdir and its own
process group.

The harness command (argv, no shell) gets the case input on stdin and in the file named by
`EVALBUS_INPUT_FILE`, the run's ids in its environment, its plain `env`, and its `secret_env`
resolved by name from the secret store. Secret values are redacted from everything read back.
A timeout kills the whole process group (SIGTERM, then SIGKILL after a grace) and reads exit 124
(`process_group`); release kills whatever is left of the group and deletes the workdir.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import platform
import re
import shutil
import signal
import tempfile
from collections.abc import Awaitable, Callable, Iterable, Mapping
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING
from urllib.parse import quote

from evalbus_contracts import CaseRequested, PromptSnapshot, RepoSnapshot, Snapshot
from evalbus_dispatcher.backends import disk, orphans, procfs
from evalbus_dispatcher.backends.base import (
    Capacity,
    HarnessRun,
    LiveExec,
    OnOutput,
    OnSpawn,
    UnitUsage,
)
from evalbus_dispatcher.backends.process_group import (
    OWNER_FILE,
    owner_mark,
    run_process,
    signal_group,
)
from evalbus_dispatcher.backends.pty_shell import PtyShell
from evalbus_dispatcher.errors import BackendError
from evalbus_grading import ExecResult
from evalbus_runtime.secrets import SecretStore

if TYPE_CHECKING:
    from evalbus_dispatcher.backends.worker import WorkerPool

log = logging.getLogger(__name__)

INHERITED_ENV: tuple[str, ...] = (
    "PATH", "HOME", "USER", "LOGNAME", "SHELL", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "TZ", "TMPDIR", "TERM",
)  # fmt: skip
"""Variables of the dispatcher's own environment a harness inherits. Nothing else leaks through
(in particular no `EVALBUS_SECRET_*` and no service settings)."""

REDACTED = "[redacted]"
"""What a secret value is replaced with in any text read back from a sandbox."""

_DIFF_CAP = 256 * 1024
_UNSAFE = re.compile(r"[^A-Za-z0-9_-]+")
_RESOURCE_KEY = "evalbus.run_id"


# ---------------------------------------------------------------- environment (pure)


def merge_resource_attributes(existing: str | None, run_id: str) -> str:
    """`OTEL_RESOURCE_ATTRIBUTES` with `evalbus.run_id=<run id>` set, keeping the other attributes."""
    kept = [
        part for part in (existing or "").split(",") if part.strip() and part.split("=", 1)[0].strip() != _RESOURCE_KEY
    ]
    kept.append(f"{_RESOURCE_KEY}={quote(run_id, safe='-._~')}")
    return ",".join(kept)


def run_environment(job: CaseRequested, *, base: Mapping[str, str], input_file: Path) -> dict[str, str]:
    """The environment of anything run for `job` (harness and grader commands), secrets excluded.

    Precedence: inherited base < `harness.env` < evalbus's own variables.
    """
    env = dict(base)
    env.update(job.harness.env)
    env["EVALBUS_RUN_ID"] = job.run_id or ""
    env["EVALBUS_CASE_ID"] = job.case.id
    env["EVALBUS_TRIAL"] = str(job.trial or 1)
    env["EVALBUS_ATTEMPT"] = str(job.attempt)
    env["EVALBUS_INPUT_FILE"] = str(input_file)
    if job.batch_id is not None:
        env["EVALBUS_BATCH_ID"] = job.batch_id
    else:
        env.pop("EVALBUS_BATCH_ID", None)
    env["OTEL_RESOURCE_ATTRIBUTES"] = merge_resource_attributes(env.get("OTEL_RESOURCE_ATTRIBUTES"), job.run_id or "")
    return env


def safe_relative_path(raw: str) -> PurePosixPath:
    """A harness file path that stays inside the workdir; `BackendError` (config) otherwise."""
    path = PurePosixPath(raw)
    if not raw or path.is_absolute() or ".." in path.parts or str(path) in ("", "."):
        raise BackendError(
            f"harness file path {raw!r} must be relative and stay inside the workdir",
            code="invalid_file_path",
            failure_class="config",
            retryable=False,
        )
    return path


def _redactor(values: Iterable[str]) -> Callable[[str], str]:
    secrets = sorted({v for v in values if v}, key=len, reverse=True)

    def redact(text: str) -> str:
        for value in secrets:
            if value in text:
                text = text.replace(value, REDACTED)
        return text

    return redact


# ---------------------------------------------------------------- backend


SMALL_TREE_ENTRIES = 64
"""A workdir of at most this many files and folders is deleted on the event loop (tens of
microseconds); a larger one in a thread. A thread hop per case cost more than the deletion
itself: with the zero-latency worker harness, the release's two hops were a third of the
dispatcher's CPU per case."""


def is_small_tree(root: Path, limit: int) -> bool:
    """Whether the tree at `root` holds at most `limit` entries (its symlinks are not followed;
    the walk stops as soon as it has seen more)."""
    seen = 0
    for _, dirs, files in os.walk(root):
        seen += len(dirs) + len(files)
        if seen > limit:
            return False
    return True


class LocalBackend:
    """Sandboxes as temporary workdirs and process groups on this machine."""

    def __init__(
        self,
        *,
        slots: int = 4,
        root: Path | None = None,
        secrets: SecretStore | None = None,
        environ: Mapping[str, str] | None = None,
        inherit_env: Iterable[str] = INHERITED_ENV,
        kill_grace_s: float = 2.0,
        drain_s: float = 2.0,
        output_cap_bytes: int = 16 * 1024 * 1024,
        adopt_orphans: bool | None = None,
        worker_idle_s: float | None = None,
    ) -> None:
        """`adopt_orphans`: kill with each sandbox the daemons its harness forked, which needs
        this process to be the child subreaper of its descendants (`orphans`). True makes it one
        (process-wide); None (the default) adopts when it already is one — the dispatcher's
        entry point makes itself one, a program embedding the backend is left as it is.
        `worker_idle_s`: how long a warm worker waits idle before it is retired (None:
        `worker.WORKER_IDLE_S`)."""
        source = os.environ if environ is None else environ
        if adopt_orphans is None:
            self._adopting = orphans.is_subreaper()
        else:
            self._adopting = orphans.become_subreaper() if adopt_orphans else False
        self._slots = slots
        self._root = root
        self._secrets = secrets if secrets is not None else SecretStore(source)
        self._base_env = {name: source[name] for name in inherit_env if name in source}
        self._grace_s = kill_grace_s
        self._drain_s = drain_s
        self._cap = output_cap_bytes
        self._used = 0
        self._node = platform.node() or None
        self._workers: WorkerPool | None = None
        self._worker_idle_s = worker_idle_s
        self._owner = owner_mark(os.getpid())  # read once: /proc costs a few syscalls per case
        self._live: set[LocalSandbox] = set()
        """Sandboxes provisioned and not yet released: their processes are nobody's orphans."""

    @property
    def root(self) -> Path | None:
        """Folder case workdirs are made in (None: the system temp folder)."""
        return self._root

    def capacity(self) -> Capacity:
        """Slots configured and held by unreleased sandboxes."""
        return Capacity(total=self._slots, used=self._used)

    @property
    def workers(self) -> WorkerPool:
        """The warm workers of `kind: worker` harnesses (started on first use)."""
        if self._workers is None:
            from evalbus_dispatcher.backends.worker import WorkerPool

            self._workers = WorkerPool(
                slots=self._slots, root=self._root, grace_s=self._grace_s, idle_s=self._worker_idle_s
            )
        return self._workers

    async def close(self) -> None:
        """Stop the warm workers."""
        if self._workers is not None:
            await self._workers.close()

    async def provision(self, job: CaseRequested) -> LocalSandbox:
        """A fresh workdir with the harness files written, secrets resolved; raises `BackendError`."""
        if job.harness.resources().network == "none":
            # A process shares the dispatcher's network: running the case would break its promise.
            raise BackendError(
                "the local backend cannot cut a case off the network (compute.network: none); "
                "use the docker, kubernetes or nomad backend",
                code="network_isolation_unsupported",
                failure_class="config",
                retryable=False,
            )
        secret_env: dict[str, str] = {}
        for var, name in job.harness.secret_env.items():
            secret = self._secrets.get(name)
            if secret is None:
                raise BackendError(
                    f"secret {name!r} (for {var}) is not in the secret store",
                    code="missing_secret",
                    failure_class="config",
                    retryable=False,
                )
            secret_env[var] = secret.reveal()
        files = [(safe_relative_path(path), content) for path, content in job.harness.files.items()]
        try:
            prefix = f"evalbus-{_UNSAFE.sub('_', job.run_id or 'run')[:48]}-"
            case_root = Path(tempfile.mkdtemp(prefix=prefix, dir=self._root))
        except OSError as e:
            raise self._workdir_error("creating a workdir", e) from e
        try:
            (case_root / OWNER_FILE).write_text(self._owner)
            workdir = case_root / "work"
            workdir.mkdir()
            input_file = case_root / "input.txt"
            input_file.write_text(job.case.input, encoding="utf-8")
        except OSError as e:
            shutil.rmtree(case_root, ignore_errors=True)
            raise self._workdir_error("preparing the workdir", e) from e
        try:
            for rel, content in files:
                target = workdir / rel
                target.parent.mkdir(parents=True, exist_ok=True)
                target.write_text(content, encoding="utf-8")
        except (FileExistsError, NotADirectoryError, IsADirectoryError) as e:
            # The spec's files cannot be laid out (a file where a folder must be): running again
            # cannot help, so it is a configuration failure.
            shutil.rmtree(case_root, ignore_errors=True)
            raise BackendError(
                f"harness files conflict: {e}", code="files_conflict", failure_class="config", retryable=False
            ) from e
        except OSError as e:
            shutil.rmtree(case_root, ignore_errors=True)
            raise self._workdir_error("writing the harness files", e) from e
        self._used += 1
        env = run_environment(job, base=self._base_env, input_file=input_file)
        return LocalSandbox(
            job=job,
            case_root=case_root,
            workdir=workdir,
            env=env,
            secret_env=secret_env,
            node=self._node,
            free_slot=self._slot_freed,
            grace_s=self._grace_s,
            drain_s=self._drain_s,
            cap=self._cap,
            workers=self.workers if job.harness.kind == "worker" else None,
            adopting=self._adopting,
            peers=self._live,
        )

    def _slot_freed(self) -> None:
        self._used -= 1

    def _workdir_error(self, what: str, error: OSError) -> BackendError:
        """The failure of the backend's own write into the workdirs: `disk_full` naming the
        filesystem when it has no room left (it comes back as workdirs are released: retryable),
        else `workdir_failed`."""
        if disk.is_no_space(error):
            root = self._root or Path(tempfile.gettempdir())
            return BackendError(disk.no_space_message(root, what, error), code=disk.DISK_FULL)
        return BackendError(f"{what} failed: {error}", code="workdir_failed")


class LocalSandbox:
    """A case's workdir and the process groups started in it."""

    def __init__(
        self,
        *,
        job: CaseRequested,
        case_root: Path,
        workdir: Path,
        env: dict[str, str],
        secret_env: dict[str, str],
        node: str | None,
        free_slot: Callable[[], None],
        grace_s: float,
        drain_s: float,
        cap: int,
        workers: WorkerPool | None = None,
        adopting: bool = False,
        peers: set[LocalSandbox] | None = None,
    ) -> None:
        self._job = job
        self._adopting = adopting
        self._peers = peers if peers is not None else set()
        """The backend's live sandboxes, this one among them until it is released."""
        self._workers = workers
        self._case_root = case_root
        self.workdir = workdir
        """Where the harness and grader commands run."""
        self._env = env
        self._secret_env = secret_env
        self._node = node
        self._free_slot = free_slot
        self._grace_s = grace_s
        self._drain_s = drain_s
        self._cap = cap
        self._groups: set[int] = set()
        self._unit: str | None = None
        self._pgid: int | None = None
        self._released = False
        self._redact = _redactor(secret_env.values())
        self._peers.add(self)

    @property
    def unit(self) -> str | None:
        """`pgid:<n>` of the harness's process group, once started."""
        return self._unit

    @property
    def node(self) -> str | None:
        """This machine's name."""
        return self._node

    @property
    def released(self) -> bool:
        """Whether `release` has run."""
        return self._released

    @property
    def pid(self) -> int | None:
        """Process id of the harness (its process group's leader), once spawned."""
        return self._pgid

    def usage(self) -> UnitUsage | None:
        """Processes, memory and CPU of the harness's process group now (None before it started
        or once none of it is left)."""
        if self._pgid is None:
            return None
        # the tree under a live leader: a few reads; once the leader is gone, the trees of this
        # process's children when it is their subreaper (members left were re-parented to it),
        # else the whole of /proc (a /bin/echo case is over before its first sample: that scan
        # of every process was most of the dispatcher's CPU per command case)
        quick = self.quick_usage()
        if quick is not None or self._workers is not None:
            return quick if quick is None or quick.processes else None
        if self._adopting:
            found = procfs.members_usage(self._pgid, orphans.children())
        else:
            found = procfs.group_usage(self._pgid)
        if found is None:
            return None
        return UnitUsage(
            pid=self._pgid, processes=found.processes, rss_bytes=found.rss_bytes, cpu_seconds=found.cpu_seconds
        )

    def quick_usage(self) -> UnitUsage | None:
        """`usage()` when it costs a few reads: a warm worker's own stat file, the tree under a live
        leader, or (as the subreaper of its children) one signal-0 saying the group is empty once
        the leader is gone; None when only `usage()` can tell (members left by a dead leader)."""
        if self._pgid is None:
            return None
        if self._workers is not None:
            return self._workers.usage(self._pgid)
        found = procfs.tree_usage(self._pgid)
        if found is None:
            if self._adopting and not procfs.group_alive(self._pgid):
                return UnitUsage(pid=self._pgid, processes=0, rss_bytes=None, cpu_seconds=None)  # all gone
            return None
        return UnitUsage(
            pid=self._pgid, processes=found.processes, rss_bytes=found.rss_bytes, cpu_seconds=found.cpu_seconds
        )

    async def run_harness(self, on_output: OnOutput, on_spawn: OnSpawn | None = None) -> HarnessRun:
        """Run the harness command with the case input; a spawn failure is reported, not raised.
        `on_spawn(pid)` is awaited once the process exists, before its output is read. The
        workdir's disk is watched while it runs, and the run judged for it at exit."""
        self._check_live()
        watch = disk.DiskWatch(self.workdir)
        async with watch.watching():
            if self._workers is not None:
                ran = await self._run_on_worker(self._workers, watch.on_output(on_output), on_spawn)
            else:
                ran = await self._run_command(watch.on_output(on_output), on_spawn)
        return self._judged_for_disk(ran, watch.history())

    async def _run_command(self, on_output: OnOutput, on_spawn: OnSpawn | None) -> HarnessRun:
        """The harness command run in the workdir, in its own process group."""
        argv = self._job.harness.command
        if not argv:
            return HarnessRun(exit_code=None, stdout="", stderr="", spawn_error="the harness command is empty")
        timeout_s = self._job.case.timeout_s or self._job.harness.timeout_s
        oom_before = procfs.oom_kills()

        async def spawned(pgid: int) -> None:
            self._pgid = pgid
            self._unit = f"pgid:{pgid}"
            if on_spawn is not None:
                await on_spawn(pgid)

        try:
            exited = await run_process(
                argv,
                cwd=self.workdir,
                env={**self._env, **self._secret_env},
                stdin=self._job.case.input.encode("utf-8"),
                timeout_s=timeout_s,
                redact=self._redact,
                on_output=on_output,
                groups=self._groups,
                grace_s=self._grace_s,
                drain_s=self._drain_s,
                cap=self._cap,
                on_spawn=spawned,
            )
        except OSError as e:
            return HarnessRun(
                exit_code=None, stdout="", stderr="", spawn_error=self._redact(f"cannot start {argv[0]!r}: {e}")
            )
        killed = exited.signal == signal.SIGKILL and not exited.timed_out  # only then can it be the OOM killer
        after = procfs.oom_kills() if killed else None
        oom = procfs.oom_verdict(exited.signal, timed_out=exited.timed_out, before=oom_before, after=after)
        return HarnessRun(
            exit_code=exited.exit_code,
            stdout=exited.stdout.text(),
            stderr=exited.stderr.text(),
            duration_s=exited.duration_s,
            timed_out=exited.timed_out,
            stdout_truncated=exited.stdout.truncated,
            stderr_truncated=exited.stderr.truncated,
            signal=exited.signal,
            oom=oom,
            pid=self._pgid,
        )

    def _judged_for_disk(self, ran: HarnessRun, history: disk.DiskHistory) -> HarnessRun:
        """`ran`, failed `disk_full` when it failed on a full workdir disk (read before release), or
        its failure saying why not when it reported one (`disk.disk_verdict`)."""
        judged = disk.disk_full_failure(ran, self.workdir, history)
        return ran if judged is None else dataclasses.replace(ran, failure=judged)

    async def _run_on_worker(self, workers: WorkerPool, on_output: OnOutput, on_spawn: OnSpawn | None) -> HarnessRun:
        """The case served by a warm worker (`harness.kind: worker`) in this workdir."""

        async def spawned(pid: int) -> None:
            self._pgid = pid
            self._unit = f"pgid:{pid}"
            if on_spawn is not None:
                await on_spawn(pid)

        return await workers.run_case(
            self._job,
            workdir=self.workdir,
            env=self._env,
            secret_env=self._secret_env,
            timeout_s=self._job.case.timeout_s or self._job.harness.timeout_s,
            redact=self._redact,
            on_output=on_output,
            on_spawn=spawned,
            cap=self._cap,
        )

    async def exec(self, command: str, timeout_s: float) -> ExecResult:
        """Run `command` with `/bin/sh -c` in the workdir (no secrets in its environment)."""
        self._check_live()
        exited = await run_process(
            ("/bin/sh", "-c", command),
            cwd=self.workdir,
            env=self._env,
            stdin=None,
            timeout_s=timeout_s,
            redact=self._redact,
            on_output=None,
            groups=self._groups,
            grace_s=self._grace_s,
            drain_s=self._drain_s,
            cap=self._cap,
        )
        return ExecResult(
            exit_code=exited.exit_code,
            stdout=exited.stdout.text(),
            stderr=exited.stderr.text(),
            timed_out=exited.timed_out,
        )

    async def exec_live(
        self, command: str, timeout_s: float, *, cap_bytes: int, on_spawn: OnSpawn | None = None
    ) -> LiveExec:
        """Run `command` with `/bin/sh -c` in the workdir, in the harness's environment (its secrets
        too, masked in the output): a person looking into the live sandbox. The end of each stream,
        at most `cap_bytes`, comes back."""
        self._check_live()
        exited = await run_process(
            ("/bin/sh", "-c", command),
            cwd=self.workdir,
            env={**self._env, **self._secret_env},
            stdin=None,
            timeout_s=timeout_s,
            redact=self._redact,
            on_output=None,
            groups=self._groups,
            grace_s=self._grace_s,
            drain_s=self._drain_s,
            cap=max(cap_bytes, 1),
            on_spawn=on_spawn,
        )
        stdout, out_cut = exited.stdout.tail(cap_bytes)
        stderr, err_cut = exited.stderr.tail(cap_bytes)
        return LiveExec(
            exit_code=exited.exit_code,
            stdout=stdout,
            stderr=stderr,
            timed_out=exited.timed_out,
            truncated=out_cut or err_cut,
        )

    async def open_shell(self, cols: int, rows: int, on_output: Callable[[bytes], Awaitable[None]]) -> PtyShell:
        """An interactive shell on a pseudo-terminal in the workdir, in the harness's environment
        (secrets masked in what it prints); its process group is released with the sandbox."""
        self._check_live()
        shell = PtyShell(
            cwd=self.workdir,
            env={**self._env, **self._secret_env},
            secrets=self._secret_env.values(),
            on_output=on_output,
            cols=cols,
            rows=rows,
        )
        pid = await shell.start()
        self._groups.add(pid)
        if self._released:  # released while it started: it must not outlive the sandbox
            shell.kill()
        return shell

    def kill_group(self, pgid: int) -> None:
        """SIGKILL one process group started in this sandbox."""
        if pgid in self._groups:
            signal_group(pgid, signal.SIGKILL)

    async def snapshot(self, answer: str) -> Snapshot:
        """A repo snapshot when the workdir is a git repository, else the answer as a prompt snapshot."""
        self._check_live()
        if (self.workdir / ".git").exists() and shutil.which("git") is not None:
            repo = await self._repo_snapshot()
            if repo is not None:
                return repo
        return PromptSnapshot(output=answer)

    async def release(self) -> None:
        """Kill what is left of every process group started here and delete the workdir. Idempotent."""
        if self._released:
            return
        self._released = True
        try:
            for pgid in self._groups:
                signal_group(pgid, signal.SIGKILL)
            if self._adopting:  # the daemons it forked, re-parented to this process
                # Every process a live sandbox started (and every warm worker) is known: a child
                # of this process outside them is an orphan. None (the common case, found with a
                # few small reads) needs no thread.
                ours = set(self._workers.pids()) if self._workers is not None else set()
                for sandbox in self._peers:
                    ours |= sandbox._groups
                if orphans.others(ours):
                    await asyncio.to_thread(orphans.kill_adopted, self._case_root, ours)
            if is_small_tree(self._case_root, SMALL_TREE_ENTRIES):
                shutil.rmtree(self._case_root, ignore_errors=True)
            else:
                await asyncio.to_thread(shutil.rmtree, self._case_root, ignore_errors=True)
            if self._case_root.exists():
                raise BackendError(f"workdir {self._case_root} could not be deleted", code="release_failed")
        finally:
            self._peers.discard(self)
            self._free_slot()

    def _check_live(self) -> None:
        if self._released:
            raise BackendError("the sandbox was already released", code="released", retryable=False)

    async def _git(self, *args: str) -> str | None:
        exited = await run_process(
            ("git", "-C", str(self.workdir), *args),
            cwd=self.workdir,
            env=self._env,
            stdin=None,
            timeout_s=60.0,
            redact=self._redact,
            on_output=None,
            groups=self._groups,
            grace_s=self._grace_s,
            drain_s=self._drain_s,
            cap=self._cap,
        )
        return exited.stdout.text() if exited.exit_code == 0 else None

    async def _repo_snapshot(self) -> RepoSnapshot | None:
        status = await self._git("status", "--porcelain=v1", "--untracked-files=all")
        if status is None:
            return None
        changed = tuple(line[3:] for line in status.split("\n") if len(line) > 3)
        head = await self._git("rev-parse", "HEAD")
        diff = await self._git("diff", "HEAD") if head is not None else None
        diff_text = diff or ""
        if len(diff_text.encode("utf-8")) > _DIFF_CAP:
            diff_text = diff_text.encode("utf-8")[:_DIFF_CAP].decode("utf-8", errors="ignore")
        return RepoSnapshot(diff=diff_text, changed_files=changed, head_sha=head.strip() if head else None)
