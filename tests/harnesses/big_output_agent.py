"""A harness whose outputs are far larger than a bus message (stdlib only), for the claim-check
tests: it prints `trace_bytes` of trace events on stdout, writes `artifact_bytes` to
`out/big.bin` and declares it as an artifact, writes `stderr_bytes` to stderr, and answers with
`answer_bytes` of text ending in `MARKER-END`. The case input is a JSON object with those keys.

The artifact's bytes are `block(seed)` repeated, so a test can compute the digest it must have.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

BLOCK = 1024 * 1024


def block(seed: int) -> bytes:
    """The 1 MiB block the artifact repeats."""
    return random.Random(seed).randbytes(BLOCK)


def main() -> int:
    spec = json.loads(sys.stdin.read() or "{}")
    trace_bytes = int(spec.get("trace_bytes", 0))
    artifact_bytes = int(spec.get("artifact_bytes", 0))
    stderr_bytes = int(spec.get("stderr_bytes", 0))
    answer_bytes = int(spec.get("answer_bytes", 16))
    seed = int(spec.get("seed", 7))
    out = sys.stdout
    printed, i = 0, 0
    filler = "x" * 900
    while printed < trace_bytes:
        line = "EVALBUS_EVENT " + json.dumps(
            {
                "kind": "tool_call",
                "id": f"call-{i}",
                "name": "shell",
                "args": {"step": i, "note": filler},
                "t": i * 1e-4,
            }
        )
        out.write(line + "\n")
        printed += len(line) + 1
        i += 1
    if artifact_bytes:
        path = Path("out") / "big.bin"
        path.parent.mkdir(exist_ok=True)
        data = block(seed)
        with path.open("wb") as f:
            left = artifact_bytes
            while left > 0:
                f.write(data[: min(left, BLOCK)])
                left -= BLOCK
        declared = {"kind": "artifact", "name": "big", "ref": "out/big.bin", "media_type": "application/octet-stream"}
        out.write("EVALBUS_EVENT " + json.dumps(declared) + "\n")
    if stderr_bytes:
        sys.stderr.write(("e" * 99 + "\n") * (stderr_bytes // 100))
    answer = ("a" * 99 + "\n") * max(0, (answer_bytes - 10) // 100) + "MARKER-END"
    out.write("EVALBUS_RESULT " + json.dumps({"answer": answer}) + "\n")
    out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
