"""The local backend with real subprocesses: input, environment, secrets, streaming, timeouts that
kill the whole process group, exec in the workdir, snapshots, idempotent release."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import time
from collections.abc import Callable
from pathlib import Path

import pytest

from evalbus_contracts import CaseRequested, PromptSnapshot, RepoSnapshot, TraceSpec
from evalbus_dispatcher import BackendError, LocalBackend, OutputStream
from evalbus_dispatcher.backends.local import REDACTED, SMALL_TREE_ENTRIES, is_small_tree, merge_resource_attributes

pytestmark = pytest.mark.integration

SECRET_VALUE = "s3cr3t-VALUE-9f2c7e1d"  # the value the conftest store holds for `api-key`

Script = Callable[[str], tuple[str, ...]]
MakeRequest = Callable[..., CaseRequested]


def listing(path: Path) -> list[Path]:
    """The entries of a directory (sync: a test's check, not I/O on the loop's hot path)."""
    return list(path.iterdir())


def exists(path: Path) -> bool:
    """Whether a path exists."""
    return path.exists()


def process_gone(pid: int) -> bool:
    """True when `pid` no longer runs (reaped, or a zombie waiting for a reaper)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


async def wait_until(condition: Callable[[], bool], deadline_s: float = 10.0) -> bool:
    """Poll a condition until it holds or the deadline passes."""
    end = time.monotonic() + deadline_s
    while time.monotonic() < end:
        if condition():
            return True
        await asyncio.sleep(0.02)
    return condition()


async def no_output(stream: OutputStream, line: str) -> None:
    return None


async def test_input_env_files_and_secrets(backend: LocalBackend, script: Script, make_request: MakeRequest) -> None:
    argv = script(
        """
        import hashlib, json, os, sys
        stdin = sys.stdin.read()
        with open(os.environ["EVALBUS_INPUT_FILE"]) as f:
            from_file = f.read()
        print("leak " + os.environ["API_KEY"], file=sys.stderr)
        print(json.dumps({
            "stdin": stdin,
            "file": from_file,
            "cwd": os.getcwd(),
            "env": {k: v for k, v in os.environ.items() if k.startswith(("EVALBUS_", "OTEL_", "PLAIN"))},
            "api_key_sha": hashlib.sha256(os.environ["API_KEY"].encode()).hexdigest(),
            "db_pass": os.environ["DB_PASS"],  # printed: must come back redacted
            "db_pass_sha": hashlib.sha256(os.environ["DB_PASS"].encode()).hexdigest(),
            "leaked": sorted(k for k in os.environ if k.startswith("EVALBUS_SECRET_") or k == "NATS_URL"),
            "settings": open("cfg/settings.json").read(),
        }))
        print("also " + os.environ["API_KEY"])
        """
    )
    req = make_request(
        argv,
        input="line one\nline two ünïcode",
        trial=2,
        env={"PLAIN": "1", "OTEL_RESOURCE_ATTRIBUTES": "service.name=agent,evalbus.run_id=stale"},
        secret_env={"API_KEY": "api-key", "DB_PASS": "db-pass"},
        files={"cfg/settings.json": '{"k": 1}'},
    )
    handle = await backend.provision(req)
    try:
        lines: list[tuple[OutputStream, str]] = []

        async def collect(stream: OutputStream, line: str) -> None:
            lines.append((stream, line))

        run = await handle.run_harness(collect)
        assert run.exit_code == 0, run.stderr
        report = json.loads(run.stdout.splitlines()[0])
        assert report["stdin"] == report["file"] == "line one\nline two ünïcode"
        assert Path(report["cwd"]) == handle.workdir
        env = report["env"]
        assert env["EVALBUS_RUN_ID"] == req.run_id
        assert env["EVALBUS_CASE_ID"] == "c1"
        assert env["EVALBUS_BATCH_ID"] == req.batch_id
        assert env["EVALBUS_TRIAL"] == "2"
        assert env["PLAIN"] == "1"
        assert env["OTEL_RESOURCE_ATTRIBUTES"] == f"service.name=agent,evalbus.run_id={req.run_id}"
        assert report["api_key_sha"] == hashlib.sha256(SECRET_VALUE.encode()).hexdigest()
        assert report["db_pass"] == REDACTED
        assert report["db_pass_sha"] == hashlib.sha256(b"from-a-file").hexdigest()  # trailing newline stripped
        assert report["leaked"] == []  # the dispatcher's own secrets and settings do not leak
        assert report["settings"] == '{"k": 1}'
        # A secret the harness prints is redacted before anything reads it.
        assert SECRET_VALUE not in run.stdout + run.stderr
        assert ("stderr", f"leak {REDACTED}") in lines
        assert ("stdout", f"also {REDACTED}") in lines
        assert not any(SECRET_VALUE in text for _, text in lines)
    finally:
        await handle.release()


def test_resource_attributes_merge() -> None:
    assert merge_resource_attributes(None, "evb-b-c") == "evalbus.run_id=evb-b-c"
    assert merge_resource_attributes("a=1, evalbus.run_id=x ,b=2", "evb-b c") == "a=1,b=2,evalbus.run_id=evb-b%20c"


async def test_missing_secret_is_a_config_failure_and_creates_nothing(
    backend: LocalBackend, script: Script, make_request: MakeRequest, sandbox_root: Path
) -> None:
    req = make_request(script("print(1)"), secret_env={"TOKEN": "no-such-secret"})
    with pytest.raises(BackendError) as info:
        await backend.provision(req)
    assert (info.value.stage, info.value.failure_class, info.value.code) == ("dispatch", "config", "missing_secret")
    assert info.value.retryable is False
    assert listing(sandbox_root) == []
    assert backend.capacity().used == 0


@pytest.mark.parametrize("path", ["../escape.txt", "/etc/passwd", "a/../../b", ""])
async def test_harness_file_outside_workdir_is_a_config_failure(
    backend: LocalBackend, script: Script, make_request: MakeRequest, path: str
) -> None:
    with pytest.raises(BackendError) as info:
        await backend.provision(make_request(script("print(1)"), files={path: "x"}))
    assert info.value.failure_class == "config"


async def test_unwritable_root_is_a_retryable_infra_failure(tmp_path: Path, make_request: MakeRequest) -> None:
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    backend = LocalBackend(root=not_a_dir, environ={})
    with pytest.raises(BackendError) as info:
        await backend.provision(make_request(("true",)))
    assert (info.value.failure_class, info.value.code, info.value.retryable) == ("infra", "workdir_failed", True)


async def test_output_streams_line_by_line_while_the_harness_runs(
    backend: LocalBackend, script: Script, make_request: MakeRequest
) -> None:
    # The harness waits for a file the test only creates once it has seen the first line:
    # if output were delivered at exit, the harness would give up and exit 3.
    argv = script(
        """
        import os, sys, time
        print("first", flush=True)
        deadline = time.monotonic() + 20
        while not os.path.exists("go"):
            if time.monotonic() > deadline:
                sys.exit(3)
            time.sleep(0.01)
        print("err line", file=sys.stderr, flush=True)
        sys.stdout.write("second without newline")
        """
    )
    handle = await backend.provision(make_request(argv))
    seen: list[tuple[OutputStream, str]] = []

    async def on_output(stream: OutputStream, line: str) -> None:
        seen.append((stream, line))
        if line == "first":
            (handle.workdir / "go").write_text("")

    try:
        run = await handle.run_harness(on_output)
    finally:
        await handle.release()
    assert run.exit_code == 0
    assert seen == [("stdout", "first"), ("stderr", "err line"), ("stdout", "second without newline")]


async def test_timeout_kills_the_whole_process_group(
    backend: LocalBackend, script: Script, make_request: MakeRequest
) -> None:
    # The harness ignores SIGTERM and starts a grandchild; both must be gone after the timeout.
    argv = script(
        """
        import signal, subprocess, sys, time
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
        print(f"GRANDCHILD {child.pid}", flush=True)
        time.sleep(300)
        """
    )
    handle = await backend.provision(make_request(argv, timeout_s=1.0))
    try:
        started = time.monotonic()
        run = await handle.run_harness(no_output)
        elapsed = time.monotonic() - started
        assert run.timed_out is True
        assert run.exit_code == 124
        assert elapsed < 10, elapsed
        grandchild = int(run.stdout.split("GRANDCHILD ")[1].split()[0])
        assert handle.unit is not None
        pgid = int(handle.unit.removeprefix("pgid:"))
        assert await wait_until(lambda: process_gone(grandchild)), "grandchild survived the timeout"
        assert await wait_until(lambda: process_gone(pgid)), "harness survived the timeout"
    finally:
        await handle.release()


async def test_release_kills_leftovers_removes_workdir_and_is_idempotent(
    backend: LocalBackend, script: Script, make_request: MakeRequest
) -> None:
    argv = script(
        """
        import subprocess, sys
        child = subprocess.Popen(
            [sys.executable, "-c", "import time; time.sleep(300)"],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        print(child.pid)
        """
    )
    handle = await backend.provision(make_request(argv))
    assert backend.capacity().used == 1
    run = await handle.run_harness(no_output)
    assert run.exit_code == 0
    leftover = int(run.stdout.strip())
    assert not process_gone(leftover)  # it outlived the harness, in the harness's group
    workdir = handle.workdir
    assert workdir.is_dir()
    await handle.release()
    assert not workdir.exists()
    assert not workdir.parent.exists()
    assert await wait_until(lambda: process_gone(leftover)), "leftover process survived release"
    assert backend.capacity().used == 0
    await handle.release()  # idempotent: no error, no double count
    assert backend.capacity().used == 0
    with pytest.raises(BackendError):
        await handle.exec("true", 5)


async def test_spawn_failure_is_reported_not_raised(backend: LocalBackend, make_request: MakeRequest) -> None:
    handle = await backend.provision(make_request(("/nonexistent/agent-binary", "--flag")))
    try:
        run = await handle.run_harness(no_output)
    finally:
        await handle.release()
    assert run.exit_code is None
    assert run.spawn_error is not None
    assert "/nonexistent/agent-binary" in run.spawn_error


async def test_killed_by_signal_reads_128_plus_n(
    backend: LocalBackend, script: Script, make_request: MakeRequest
) -> None:
    handle = await backend.provision(make_request(script("import os, signal; os.kill(os.getpid(), signal.SIGKILL)")))
    try:
        run = await handle.run_harness(no_output)
    finally:
        await handle.release()
    assert run.exit_code == 137


async def test_exec_runs_in_the_workdir_without_secrets(
    backend: LocalBackend, script: Script, make_request: MakeRequest
) -> None:
    argv = script("open('out.txt', 'w').write('produced by the harness')")
    handle = await backend.provision(make_request(argv, secret_env={"API_KEY": "api-key"}))
    try:
        assert (await handle.run_harness(no_output)).exit_code == 0
        cat = await handle.exec("cat out.txt; echo; echo $EVALBUS_RUN_ID; echo err >&2", 10)
        assert cat.exit_code == 0
        assert cat.stdout.splitlines() == ["produced by the harness", make_request(argv).run_id]
        assert cat.stderr == "err"
        assert (await handle.exec('test -z "$API_KEY"', 10)).exit_code == 0
        slow = await handle.exec("sleep 30", 0.3)
        assert (slow.timed_out, slow.exit_code) == (True, 124)
    finally:
        await handle.release()


async def test_snapshot_prompt_and_repo(backend: LocalBackend, script: Script, make_request: MakeRequest) -> None:
    handle = await backend.provision(make_request(script("print('hi')")))
    try:
        await handle.run_harness(no_output)
        assert await handle.snapshot("hi") == PromptSnapshot(output="hi")
    finally:
        await handle.release()
    if shutil.which("git") is None:
        pytest.skip("git is not installed")
    argv = script(
        """
        import subprocess
        git = ["git", "-c", "user.name=t", "-c", "user.email=t@example.invalid"]
        subprocess.run(git + ["init", "-q"], check=True)
        open("a.txt", "w").write("one\\n")
        subprocess.run(git + ["add", "a.txt"], check=True)
        subprocess.run(git + ["commit", "-q", "-m", "init"], check=True)
        open("a.txt", "w").write("two\\n")
        open("new.txt", "w").write("new\\n")
        """
    )
    handle = await backend.provision(make_request(argv, trace=TraceSpec()))
    try:
        assert (await handle.run_harness(no_output)).exit_code == 0
        snap = await handle.snapshot("ignored")
    finally:
        await handle.release()
    assert isinstance(snap, RepoSnapshot)
    assert set(snap.changed_files) == {"a.txt", "new.txt"}
    assert "+two" in snap.diff
    assert snap.head_sha is not None
    assert len(snap.head_sha) == 40


async def test_capacity_counts_held_sandboxes(backend: LocalBackend, script: Script, make_request: MakeRequest) -> None:
    assert (backend.capacity().total, backend.capacity().used, backend.capacity().free) == (2, 0, 2)
    a = await backend.provision(make_request(script("pass"), case_id="a"))
    b = await backend.provision(make_request(script("pass"), case_id="b"))
    assert backend.capacity().free == 0
    await a.release()
    assert backend.capacity().used == 1
    await b.release()
    assert backend.capacity().used == 0
    assert not exists(a.workdir)


async def test_a_leftover_holding_the_pipes_does_not_hang_the_run(
    backend: LocalBackend, script: Script, make_request: MakeRequest
) -> None:
    # The grandchild inherits stdout/stderr and outlives the harness: the run still ends (after a
    # bounded drain), and release kills it.
    argv = script(
        """
        import subprocess, sys
        child = subprocess.Popen([sys.executable, "-c", "import time; print('child up', flush=True); time.sleep(300)"])
        print(child.pid, flush=True)
        """
    )
    handle = await backend.provision(make_request(argv))
    try:
        started = time.monotonic()
        run = await handle.run_harness(no_output)
        assert time.monotonic() - started < 10
        assert run.exit_code == 0
        # The child may print before or after its parent: find the pid line, whatever the order.
        leftover = int(next(line for line in run.stdout.splitlines() if line.strip().isdigit()))
    finally:
        await handle.release()
    assert await wait_until(lambda: process_gone(leftover))


def test_a_small_tree_is_told_from_a_large_one_without_walking_all_of_it(tmp_path: Path) -> None:
    root = tmp_path / "case"
    (root / "work" / "deep").mkdir(parents=True)
    (root / "input.txt").write_text("x")
    (root / "work" / "deep" / "a").write_text("a")
    assert is_small_tree(root, 4)  # work, input.txt, deep, a
    assert not is_small_tree(root, 3)
    (root / "link").symlink_to(tmp_path.parent)  # counted, never followed
    assert is_small_tree(root, 5)
    for i in range(SMALL_TREE_ENTRIES):
        (root / "work" / f"f{i}").write_text("")
    assert not is_small_tree(root, SMALL_TREE_ENTRIES)


async def test_release_deletes_a_large_workdir_too(backend: LocalBackend, make_request: MakeRequest) -> None:
    handle = await backend.provision(make_request(("true",)))
    for i in range(SMALL_TREE_ENTRIES + 1):  # past the inline limit: deleted in a thread
        (handle.workdir / f"f{i}").write_text("x")
    case_root = handle.workdir.parent
    await handle.release()
    assert not case_root.exists()
