"""Judge plugins for the cross-service tests, loaded by a real judge process with
`JUDGE_PLUGINS=evalbus.testing.judges:register` (this package is importable wherever evalbus is
installed, so no `PYTHONPATH` is needed).

Specs reference them as `{"kind": "registered", "id": ..., "name": <name>, "params": {...}}`:

- `wait-file`: a rendezvous. It waits until a file exists, then scores 1 (pass); at its deadline it
  scores 0 (fail), so a test that needed the rendezvous fails with a clear score instead of hanging.
  Its score never names the file, so runs with different rendezvous paths score identically.
  The file is `params.path` when given, else the value of the key `params.key` (default
  `judge_waits_for`) in the case input read as a JSON object; a case naming no file passes at once.
  Before it waits it appends its process id to `<file>.waiting.<run id>`, so a test can see which
  run it holds, in which judge process, and how many times it started on it.
  `params.timeout_s` (default 30) is the deadline.
- `delay`: sleeps a per-run amount derived from the run id (0 to `params.max_ms`, default 40 ms),
  like a remote judge of varying latency, and scores the answer's length (pass when it is not
  empty). Same input, same score, whatever the timing.
- `fail`: raises inside the judge — a judge's own error, which must become an `unmeasured` score.
- `escape`: raises `JudgeMachineryError` — the one error allowed to escape a judge, which marks the
  batch `error.phase = "judges"`.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import time
from pathlib import Path

from evalbus_contracts import RegisteredJudge, Score
from evalbus_judge.context import JudgeContext, measured
from evalbus_judge.errors import JudgeMachineryError
from evalbus_judge.registry import JudgeRegistry

WAIT_FILE = "wait-file"
"""Registry name of the rendezvous judge."""
DELAY = "delay"
"""Registry name of the judge of varying latency."""
FAIL = "fail"
"""Registry name of the judge that raises its own error."""
ESCAPE = "escape"
"""Registry name of the judge whose error escapes the judge machinery."""

INPUT_KEY = "judge_waits_for"
"""Default key of the case input naming the file `wait-file` waits for."""
POLL_S = 0.02
"""How often `wait-file` looks for its file."""


def waiting_marker(path: str | Path, run_id: str) -> Path:
    """The file `wait-file` creates when it starts waiting for `path` on run `run_id`."""
    return Path(f"{path}.waiting.{run_id}")


def _append_pid(marker: Path) -> None:
    with marker.open("a") as f:
        f.write(f"{os.getpid()}\n")


def input_field(case_input: str | None, key: str) -> str | None:
    """`key` of the case input read as a JSON object (None when the input is not one or lacks it)."""
    if not case_input:
        return None
    try:
        doc = json.loads(case_input)
    except ValueError:
        return None
    value = doc.get(key) if isinstance(doc, dict) else None
    return value if isinstance(value, str) and value else None


class WaitFileJudge:
    """Passes once a file exists; fails at its deadline."""

    def __init__(self, spec: RegisteredJudge) -> None:
        self.judge_id = spec.id
        self.path = spec.params.get("path")
        self.key = spec.params.get("key", INPUT_KEY)
        self.timeout_s = float(spec.params.get("timeout_s", "30"))

    async def judge(self, ctx: JudgeContext) -> Score:
        """Wait for the case's file (see the module docstring)."""
        target = self.path or input_field(ctx.case_input, self.key)
        if target is None:
            return measured(self.judge_id, 1.0, passed=True, detail="nothing to wait for")
        await asyncio.to_thread(_append_pid, waiting_marker(target, ctx.run_id))
        deadline = time.monotonic() + self.timeout_s
        while not await asyncio.to_thread(Path(target).exists):
            if time.monotonic() > deadline:
                return measured(
                    self.judge_id, 0.0, passed=False, detail=f"the file did not appear within {self.timeout_s:g}s"
                )
            await asyncio.sleep(POLL_S)
        return measured(self.judge_id, 1.0, passed=True, detail="the file appeared")


class DelayJudge:
    """Sleeps a per-run time, then scores the answer's length."""

    def __init__(self, spec: RegisteredJudge) -> None:
        self.judge_id = spec.id
        self.max_ms = int(spec.params.get("max_ms", "40"))

    async def judge(self, ctx: JudgeContext) -> Score:
        """Sleep (0..max_ms ms, fixed per run and judge), then score `len(answer)`."""
        digest = hashlib.sha256(f"{self.judge_id}:{ctx.run_id}".encode()).digest()
        await asyncio.sleep((int.from_bytes(digest[:4], "big") % (self.max_ms + 1)) / 1000.0)
        answer = ctx.answer or ""
        return measured(self.judge_id, float(len(answer)), passed=bool(answer), detail="answer length")


class FailingJudge:
    """A judge whose own code raises."""

    def __init__(self, spec: RegisteredJudge) -> None:
        self.judge_id = spec.id

    async def judge(self, ctx: JudgeContext) -> Score:
        """Raise a plain error (the judge's own failure)."""
        raise RuntimeError(f"judge {self.judge_id} failed on purpose for {ctx.run_id}")


class EscapingJudge:
    """A judge reporting that the machinery around it is broken."""

    def __init__(self, spec: RegisteredJudge) -> None:
        self.judge_id = spec.id

    async def judge(self, ctx: JudgeContext) -> Score:
        """Raise `JudgeMachineryError` (escapes the judge)."""
        raise JudgeMachineryError(f"judge machinery broken on purpose for {ctx.run_id}")


def register(registry: JudgeRegistry) -> None:
    """Register the test judges (the `JUDGE_PLUGINS` entry)."""
    registry.register(WAIT_FILE, WaitFileJudge)
    registry.register(DELAY, DelayJudge)
    registry.register(FAIL, FailingJudge)
    registry.register(ESCAPE, EscapingJudge)
