"""A deterministic agent that writes its output in phases, for the live-read tests (stdlib only).

The input is a JSON object: `phases`, a list of `{"stdout": [...], "stderr": [...], "events": n,
"ready": path, "go": path}`, run in order. Each phase writes its stdout lines (flushing each),
its stderr lines, `n` tool-call trace events (`EVALBUS_EVENT` lines), then creates `ready` and
waits until `go` exists (`go_timeout_s` of the task, default 300 s — longer than any test's wait on
a loaded machine, so only the test ends a phase — else exit 3) — so a test reads
the live views of a run that is still running, between phases. After the last phase: `answer` as an `EVALBUS_RESULT` line, then
exit with `exit_code` (default 0). `cwd_file`, when given, gets the agent's working directory
first (a test checks the sandbox is gone afterwards).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

POLL_S = 0.02


def main() -> int:
    task = json.loads(sys.stdin.read())
    if "cwd_file" in task:
        Path(task["cwd_file"]).write_text(os.getcwd())
    calls = 0
    for phase in task.get("phases", []):
        for line in phase.get("stdout", []):
            print(line, flush=True)
        for line in phase.get("stderr", []):
            print(line, file=sys.stderr, flush=True)
        for _ in range(int(phase.get("events", 0))):
            event = {"kind": "tool_call", "id": f"call-{calls}", "name": "step", "args": {"n": calls}}
            print("EVALBUS_EVENT " + json.dumps(event), flush=True)
            calls += 1
        if "ready" in phase:
            partial = Path(f"{phase['ready']}.{os.getpid()}.tmp")
            partial.write_text(str(os.getpid()))
            partial.replace(phase["ready"])  # atomically: a test waiting for it never reads it empty
        if "go" in phase:
            deadline = time.monotonic() + float(task.get("go_timeout_s", 300))
            while not Path(phase["go"]).exists():
                if time.monotonic() > deadline:
                    print(f"gave up waiting for {phase['go']}", file=sys.stderr)
                    return 3
                time.sleep(POLL_S)
    print("EVALBUS_RESULT " + json.dumps({"answer": task.get("answer", "")}), flush=True)
    return int(task.get("exit_code", 0))


if __name__ == "__main__":
    sys.exit(main())
