"""A small, deterministic agent for the pipeline tests (stdlib only; the dispatcher runs it as a
command harness with the case input on stdin).

The input is a JSON object telling the agent what to do, in this order (every key optional):

- `touch`: paths to create at start (each holds the agent's pid), so a test sees it running;
- `wait_file` (+ `wait_timeout_s`, default 30): block until that file exists, else exit 3;
- `wait_judged` (+ `wait_timeout_s`): block until case `wait_judged` of the same batch is judged,
  polling the gateway's `GET /v1/runs/evb-<batch>-<case>` (URL in `PIPELINE_GATEWAY_URL`, bearer
  token in `PIPELINE_GATEWAY_TOKEN`), else exit 4;
- `fill`: `{"path", "then_touch", "hold_until", "max_bytes"}` — write zeros to `path` until its
  disk is full (at most `max_bytes`, default 256 MiB), print the write error (`No space left on
  device`) to stderr, create `then_touch` (so a test sees the disk full), block until `hold_until`
  exists (keeping the disk full meanwhile: whatever space comes back is written over again;
  `wait_timeout_s` applies), and in the end exit 5, as an agent whose write failed would;
- `write`: files (name → content) to write in the working directory (for sandbox graders);
- `tool_calls`: that many tool calls (and results) as trace events;
- `llm_cost`: one LLM call of that cost (USD) as a trace event;
- `stderr`: text written to stderr;
- `sleep_s`: seconds to spend "thinking" (the agent's behaviour, for timeouts);
- `answer`: the final answer (an `EVALBUS_RESULT` line);
- `exit`: the exit code (default 0).

Any other input (not a JSON object) is answered as it is.
"""

from __future__ import annotations

import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path
from typing import Any

POLL_S = 0.02
FILL_CHUNK = 256 * 1024


def emit(event: dict[str, Any]) -> None:
    """One trace event line."""
    print("EVALBUS_EVENT " + json.dumps(event), flush=True)


def wait_for(ready: Callable[[], bool], timeout_s: float) -> bool:
    """Poll `ready()` until it is true or the deadline passes."""
    deadline = time.monotonic() + timeout_s
    while not ready():
        if time.monotonic() > deadline:
            return False
        time.sleep(POLL_S)
    return True


def fill(path: str, max_bytes: int, mode: str = "wb") -> str | None:
    """Write zeros to `path` until a write fails (its error) or `max_bytes` are written (None)."""
    chunk = bytes(FILL_CHUNK)
    written = 0
    try:
        with open(path, mode, buffering=0) as f:
            while written < max_bytes:
                written += f.write(chunk) or 0
    except OSError as e:
        return str(e)
    return None


def judged(case_id: str) -> bool:
    """Whether the gateway shows case `case_id` of this batch as judged."""
    run_id = f"evb-{os.environ['EVALBUS_BATCH_ID']}-{case_id}"
    request = urllib.request.Request(
        f"{os.environ['PIPELINE_GATEWAY_URL']}/v1/runs/{run_id}",
        headers={"Authorization": f"Bearer {os.environ['PIPELINE_GATEWAY_TOKEN']}"},
    )
    try:
        with urllib.request.urlopen(request, timeout=5) as resp:
            return json.load(resp).get("judged_status") is not None
    except (urllib.error.URLError, OSError, ValueError):
        return False  # not recorded yet (404) or the gateway is busy: ask again


def main() -> int:
    raw = sys.stdin.read()
    try:
        task = json.loads(raw)
    except ValueError:
        task = None
    if not isinstance(task, dict):
        print(raw.strip())
        return 0
    t0 = time.monotonic()
    for path in task.get("touch", []):
        # Atomically (write, then rename): a test waiting for the file must never read it empty.
        partial = Path(f"{path}.{os.getpid()}.tmp")
        partial.write_text(str(os.getpid()))
        partial.replace(path)
    timeout_s = float(task.get("wait_timeout_s", 30))
    if "wait_file" in task and not wait_for(lambda: Path(task["wait_file"]).exists(), timeout_s):
        print(f"gave up waiting for {task['wait_file']}", file=sys.stderr)
        return 3
    if "wait_judged" in task and not wait_for(lambda: judged(task["wait_judged"]), timeout_s):
        print(f"gave up waiting for case {task['wait_judged']} to be judged", file=sys.stderr)
        return 4
    fill_error: str | None = None
    if "fill" in task:
        spec = task["fill"]
        fill_error = fill(spec["path"], int(spec.get("max_bytes", 256 * 1024 * 1024)))
        print(f"fill {spec['path']}: {fill_error or 'never full'}", file=sys.stderr, flush=True)
        folder = os.path.dirname(os.path.abspath(spec["path"]))
        for _ in range(1000):  # what was freed while it wrote (a neighbour's file) is taken too
            if fill_error is None or os.statvfs(folder).f_bavail == 0:
                break
            fill(spec["path"], FILL_CHUNK, "ab")
        if "then_touch" in spec:
            Path(spec["then_touch"]).touch()

        def held() -> bool:
            fill(spec["path"], FILL_CHUNK, "ab")  # take back any space freed meanwhile
            return Path(spec["hold_until"]).exists()

        if "hold_until" in spec and not wait_for(held, timeout_s):
            print(f"gave up waiting for {spec['hold_until']}", file=sys.stderr)
            return 3
    for name, content in task.get("write", {}).items():
        Path(name).write_text(content)
    for i in range(int(task.get("tool_calls", 0))):
        t = round(time.monotonic() - t0, 6)
        emit({"kind": "tool_call", "id": f"call-{i}", "name": "search", "args": {"q": i}, "t": t})
        emit({"kind": "tool_result", "id": f"call-{i}", "output": f"result {i}", "t": t})
    if "llm_cost" in task:
        emit({"kind": "llm_call", "model": "test-model", "cost_usd": float(task["llm_cost"]), "t": 0.0})
    if "stderr" in task:
        print(task["stderr"], file=sys.stderr, flush=True)
    if "sleep_s" in task:
        time.sleep(float(task["sleep_s"]))
    if "answer" in task:
        print("EVALBUS_RESULT " + json.dumps({"answer": task["answer"]}), flush=True)
    return 5 if fill_error is not None else int(task.get("exit", 0))


if __name__ == "__main__":
    sys.exit(main())
