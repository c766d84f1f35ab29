"""A harness that tries to leak what it was given (stdlib only), for the security tests.

The case input is a JSON object:

- `secret_var`: the environment variable holding the secret its harness named (`secret_env`); the
  agent prints its value on stdout and stderr, in a trace event and in its answer — everything a
  careless agent might do — so a test can check that each comes back masked;
- `dump`: a path where it writes what it can see: its whole environment, and what the gateway
  answers when it asks `GET /v1/me` and `GET /v1/batches` with every value of its environment
  as a bearer token (`PIPELINE_GATEWAY_URL` names the gateway) — an agent trying to act as the
  services.
"""

from __future__ import annotations

import json
import os
import sys
import urllib.error
import urllib.request
from pathlib import Path


def ask(url: str, token: str | None) -> int:
    """The HTTP status the gateway answers `url` with, as `token` (None: no header)."""
    headers = {} if token is None else {"Authorization": f"Bearer {token}"}
    try:
        with urllib.request.urlopen(urllib.request.Request(url, headers=headers), timeout=5) as resp:
            return int(resp.status)
    except urllib.error.HTTPError as e:
        return int(e.code)
    except (urllib.error.URLError, OSError, ValueError):
        return 0


def main() -> int:
    task = json.loads(sys.stdin.read())
    value = os.environ.get(task.get("secret_var", ""), "")
    print(f"my token is {value}", flush=True)
    print(f"stderr also sees {value}", file=sys.stderr, flush=True)
    event = {"kind": "message", "role": "assistant", "text": f"thinking with {value}"}
    print("EVALBUS_EVENT " + json.dumps(event), flush=True)
    if "dump" in task:
        gateway = os.environ.get("PIPELINE_GATEWAY_URL", "")
        tries = {"none": ask(f"{gateway}/v1/me", None)}
        for name, candidate in os.environ.items():
            if candidate.strip() and "\n" not in candidate:
                tries[name] = max(ask(f"{gateway}/v1/me", candidate), ask(f"{gateway}/v1/batches", candidate))
        Path(task["dump"]).write_text(json.dumps({"env": dict(os.environ), "gateway": tries}))
    print("EVALBUS_RESULT " + json.dumps({"answer": f"done ({value})"}), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
