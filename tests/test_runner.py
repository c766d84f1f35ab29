"""The in-job runner (`python -m evalbus.runner`) as a real subprocess: what it prints is what a
cluster backend decodes from the job log."""

from __future__ import annotations

import asyncio
import os
import shutil
import signal
import sys
from pathlib import Path

import msgspec
import pytest

from evalbus_contracts.runner import (
    JOB_ENV,
    RECORD_PREFIX,
    SEND_MISSING,
    SEND_NOT_A_FILE,
    SEND_TOO_LARGE,
    Done,
    ExecDone,
    Exited,
    Holding,
    Record,
    RunnerCheck,
    RunnerJob,
    SnapshotTaken,
    Started,
    StderrLine,
    StdoutLine,
    read_line,
    record_line,
)

HARNESS = """
import os, sys
text = sys.stdin.read()
print("thinking about", text.strip())
print("progress on stderr", file=sys.stderr)
print('EVALBUS_EVENT {"kind": "message", "role": "assistant", "text": "hi", "t": 0.1}')
print('EVALBUS_RUNNER {"kind": "exited", "exit_code": 0}')
print("token is", os.environ.get("API_TOKEN"))
print("leak on stderr", os.environ.get("API_TOKEN"), file=sys.stderr)
open("answer.txt", "w").write(open(os.environ["EVALBUS_INPUT_FILE"]).read().upper())
print('EVALBUS_RESULT {"answer": "42"}')
sys.exit(int(os.environ.get("EXIT_WITH", "0")))
"""


def job(**overrides: object) -> RunnerJob:
    base: dict[str, object] = {
        "run_id": "evb-run-runner-1",
        "case_id": "c1",
        "batch_id": "b1",
        "command": (sys.executable, "harness.py"),
        "input": "the question",
        "files": {"harness.py": HARNESS},
        "secret_vars": ("API_TOKEN",),
        "timeout_s": 30.0,
        "checks": (
            RunnerCheck(command="cat answer.txt; echo token=$API_TOKEN", timeout_s=10),
            RunnerCheck(command="exit 3", timeout_s=10),
        ),
    }
    base.update(overrides)
    return msgspec.convert(base, RunnerJob, from_attributes=True)


async def run_runner(spec: RunnerJob | bytes, workdir: Path, *, via: str = "env") -> tuple[int, list[str], str]:
    raw = spec if isinstance(spec, bytes) else msgspec.json.encode(spec)
    env = {"PATH": os.environ["PATH"], "API_TOKEN": "s3cr3t-canary-value", "SERVICE_ONLY": "x"}
    args = [sys.executable, "-m", "evalbus.runner", "--workdir", str(workdir)]
    stdin: bytes | None = None
    if via == "env":
        env[JOB_ENV] = raw.decode()
    elif via == "stdin":
        args += ["--job", "-"]
        stdin = raw
    else:
        spec_file = workdir.parent / "job.json"
        spec_file.write_bytes(raw)
        args += ["--job", str(spec_file)]
    proc = await asyncio.create_subprocess_exec(
        *args,
        env=env,
        stdin=asyncio.subprocess.PIPE,
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate(stdin)
    assert proc.returncode is not None
    return proc.returncode, out.decode().splitlines(), err.decode()


def records(lines: list[str]) -> list[Record]:
    return [r for r in map(read_line, lines) if r is not None and not isinstance(r, str)]


@pytest.mark.parametrize("via", ["env", "stdin", "file"])
async def test_runner_runs_harness_checks_and_reports_every_step(tmp_path: Path, via: str) -> None:
    code, lines, err = await run_runner(job(), tmp_path / "work", via=via)
    assert code == 0, err
    assert "s3cr3t-canary-value" not in "\n".join(lines)
    got = records(lines)
    assert isinstance(got[0], Started)
    assert got[0].pid > 0
    # The two streams interleave as the harness flushes them; each keeps its own order.
    stdout = [r for r in got if isinstance(r, StdoutLine)]
    stderr = [r.text for r in got if isinstance(r, StderrLine)]
    assert len(stdout) == 1
    assert stdout[0].text.startswith(RECORD_PREFIX)
    assert stderr == ["progress on stderr", "leak on stderr [redacted]"]
    tail = [r for r in got if not isinstance(r, StdoutLine | StderrLine)]
    assert [type(r).__name__ for r in tail] == ["Started", "Exited", "ExecDone", "ExecDone", "Done"]
    _, exited, first, second, _ = tail
    assert isinstance(exited, Exited)
    assert exited.exit_code == 0
    assert not exited.timed_out
    # The checks see the harness's workdir, not its secret.
    assert isinstance(first, ExecDone)
    assert first.stdout == "THE QUESTIONtoken="
    assert first.exit_code == 0
    assert isinstance(second, ExecDone)
    assert second.exit_code == 3
    plain = [line for line in lines if read_line(line) == line]
    assert plain == [
        "thinking about the question",
        'EVALBUS_EVENT {"kind": "message", "role": "assistant", "text": "hi", "t": 0.1}',
        "token is [redacted]",
        'EVALBUS_RESULT {"answer": "42"}',
    ]


async def test_runner_reports_nonzero_exit_timeout_and_spawn_failure(tmp_path: Path) -> None:
    _, lines, _ = await run_runner(job(env={"EXIT_WITH": "7"}, checks=()), tmp_path / "a")
    exited = [r for r in records(lines) if isinstance(r, Exited)]
    assert exited[0].exit_code == 7

    sleeper = job(command=("sh", "-c", "echo started; sleep 30"), files={}, timeout_s=0.5, checks=())
    _, lines, _ = await run_runner(sleeper, tmp_path / "b")
    ended = next(r for r in records(lines) if isinstance(r, Exited))
    assert ended.timed_out
    assert ended.exit_code == 124
    assert "started" in lines

    missing = job(command=("/no/such/agent",), files={}, checks=())
    code, lines, _ = await run_runner(missing, tmp_path / "c")
    got = records(lines)
    assert code == 0
    assert isinstance(got[0], Exited)
    assert got[0].exit_code is None
    assert "/no/such/agent" in (got[0].spawn_error or "")
    assert isinstance(got[-1], Done)

    escaping = job(files={"../outside.txt": "x"}, checks=())
    _, lines, _ = await run_runner(escaping, tmp_path / "d")
    assert "stay inside the workdir" in (records(lines)[0].spawn_error or "")  # type: ignore[union-attr]
    assert not (tmp_path / "outside.txt").exists()


@pytest.mark.skipif(shutil.which("git") is None, reason="git is not installed")
async def test_runner_snapshots_a_git_workdir(tmp_path: Path) -> None:
    work = tmp_path / "repo"
    work.mkdir()
    script = "git init -q . && git -c user.email=a@b -c user.name=a commit -q --allow-empty -m init && echo new > f.txt"
    _, lines, err = await run_runner(job(command=("sh", "-c", script), files={}, checks=()), work)
    snaps = [r for r in records(lines) if isinstance(r, SnapshotTaken)]
    assert snaps, err
    assert snaps[0].snapshot.changed_files == ("f.txt",)
    assert snaps[0].snapshot.head_sha


async def test_runner_refuses_a_missing_or_invalid_job(tmp_path: Path) -> None:
    code, lines, err = await run_runner(b"{}", tmp_path / "w")
    assert code == 2
    assert lines == []
    assert "`run_id`" in err
    code, _, err = await run_runner(b"", tmp_path / "w", via="stdin")
    assert code == 2
    assert "no job spec" in err


async def test_a_live_exec_runs_in_the_workdir_with_the_jobs_secrets_masked(tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    (work / "notes.txt").write_text("in the workdir")
    env = {
        "PATH": os.environ["PATH"],
        "API_TOKEN": "s3cr3t-canary-value",
        JOB_ENV: msgspec.json.encode(job()).decode(),
    }
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "evalbus.runner", "--workdir", str(work), "--exec",
        "cat notes.txt; echo; echo token=$API_TOKEN; echo oops $API_TOKEN >&2; exit 4",
        env=env, stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    out, err = await proc.communicate()
    assert proc.returncode == 4
    assert out.decode().splitlines() == ["in the workdir", "token=[redacted]"]
    assert err.decode().splitlines() == ["oops [redacted]"]


DECLARING = """
import json
open("report.txt", "w").write("the report")
print("EVALBUS_EVENT " + json.dumps({"kind": "artifact", "name": "report", "ref": "report.txt"}))
print("EVALBUS_EVENT " + json.dumps({"kind": "artifact", "name": "done", "ref": "x", "sha256": "0" * 64}))
print('EVALBUS_RESULT {"answer": "ok"}')
"""


async def test_the_runner_holds_the_job_for_declared_files_until_told(tmp_path: Path) -> None:
    spec = job(files={"harness.py": DECLARING}, checks=(), hold_s=120.0)
    env = {"PATH": os.environ["PATH"], JOB_ENV: msgspec.json.encode(spec).decode()}
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "evalbus.runner", "--workdir", str(tmp_path / "work"), env=env,
        stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    assert proc.stdout is not None
    seen: list[Record] = []
    async with asyncio.timeout(60):
        while not any(isinstance(r, Holding) for r in seen):
            line = (await proc.stdout.readline()).decode().rstrip("\n")
            assert line, "the runner ended without holding"
            seen += records([line])
    holding = next(r for r in seen if isinstance(r, Holding))
    assert holding.files == ("report.txt",)  # a stored artifact (with its sha256) is no declaration
    assert holding.timeout_s == 120.0
    assert holding.pid == proc.pid
    assert not any(isinstance(r, Done) for r in seen)
    assert proc.returncode is None, "the runner ended while holding"  # the file can still be read from the job
    os.kill(holding.pid, signal.SIGUSR1)
    async with asyncio.timeout(30):
        rest, _ = await proc.communicate()
        assert await proc.wait() == 0
    assert isinstance(records(rest.decode().splitlines())[-1], Done)


async def test_the_runner_holds_only_for_declarations_and_no_longer_than_told(tmp_path: Path) -> None:
    _, lines, _ = await run_runner(job(checks=(), hold_s=120.0), tmp_path / "a")  # declares nothing
    assert not any(isinstance(r, Holding) for r in records(lines))
    _, lines, _ = await run_runner(job(files={"harness.py": DECLARING}, checks=(), hold_s=0.0), tmp_path / "b")
    assert not any(isinstance(r, Holding) for r in records(lines))  # 0: never (the default)
    _, lines, _ = await run_runner(job(files={"harness.py": DECLARING}, checks=(), hold_s=0.2), tmp_path / "c")
    kinds = [type(r).__name__ for r in records(lines)]
    assert kinds[-2:] == ["Holding", "Done"]  # the hold ran out on its own


async def test_send_file_writes_the_bytes_or_says_why_not(tmp_path: Path) -> None:
    work = tmp_path / "work"
    (work / "out").mkdir(parents=True)
    data = bytes(range(256)) * 9000
    (work / "out" / "a.bin").write_bytes(data)
    (tmp_path / "outside.txt").write_text("not yours")
    (work / "link.txt").symlink_to(tmp_path / "outside.txt")

    async def send(rel: str, max_bytes: int = 10**9) -> tuple[int | None, bytes, str]:
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "evalbus.runner", "--workdir", str(work), "--send-file", rel,
            "--max-bytes", str(max_bytes), stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )  # fmt: skip
        out, err = await proc.communicate()
        return proc.returncode, out, err.decode()

    assert await send("out/a.bin") == (0, data, "")
    for rel, code in (("out/none.bin", SEND_MISSING), ("out", SEND_NOT_A_FILE), ("link.txt", SEND_NOT_A_FILE),
                      ("../outside.txt", SEND_NOT_A_FILE)):  # fmt: skip
        got, out, err = await send(rel)
        assert (got, out) == (code, b""), rel
        assert rel in err
    got, out, err = await send("out/a.bin", max_bytes=1000)
    assert (got, out, err.strip()) == (SEND_TOO_LARGE, b"", f"size={len(data)}")


@pytest.mark.unit
def test_torn_record_lines_are_skipped_and_plain_lines_kept() -> None:
    line = record_line(Exited(exit_code=0, duration_s=1.5))
    assert read_line(line) == Exited(exit_code=0, duration_s=1.5)
    for cut in (len(RECORD_PREFIX) - 1, len(RECORD_PREFIX) + 3, len(line) - 1):
        assert read_line(line[:cut]) is None
    assert read_line("just text") == "just text"
    assert read_line("EVALBUS_RUNNERS are people") == "EVALBUS_RUNNERS are people"
