"""A stand-in for a service process in `evalbus up` tests: a real HTTP server on `HTTP_HOST:HTTP_PORT`
answering `/healthz`, `/readyz` and `/metrics` the way the service chassis does.

Run as `python tests/standin_service.py [--exit-at-once N] [--ignore-sigterm] [--with-child]`:
`--exit-at-once` prints a line and exits with code N (a service that crashes at start),
`--ignore-sigterm` makes `down` escalate to SIGKILL, `--with-child` starts a child process in the
same process group that ignores SIGTERM (as a harness process of the dispatcher might).
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class Handler(BaseHTTPRequestHandler):
    """Health endpoints only."""

    def do_GET(self) -> None:
        body = {"/healthz": b"ok\n", "/readyz": b"ready\n", "/metrics": b"standin_up 1\n"}.get(self.path)
        self.send_response(200 if body is not None else 404)
        self.end_headers()
        self.wfile.write(body or b"not found\n")

    def log_message(self, format: str, *args: object) -> None:
        """Keep the log quiet."""


def main() -> None:
    """Serve until SIGTERM (or ignore it, when asked)."""
    parser = argparse.ArgumentParser()
    parser.add_argument("--exit-at-once", type=int, default=None)
    parser.add_argument("--ignore-sigterm", action="store_true")
    parser.add_argument("--with-child", action="store_true")
    args = parser.parse_args()
    if args.exit_at_once is not None:
        print(f"standin: failing at start with code {args.exit_at_once}", flush=True)
        raise SystemExit(args.exit_at_once)
    if args.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    else:
        signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    if args.with_child:
        code = "import signal, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); time.sleep(3600)"
        child = subprocess.Popen([sys.executable, "-c", code])
        print(f"standin: child pid {child.pid}", flush=True)
    server = ThreadingHTTPServer((os.environ["HTTP_HOST"], int(os.environ["HTTP_PORT"])), Handler)
    print(f"standin: serving on {server.server_address}", flush=True)
    server.serve_forever()


if __name__ == "__main__":
    main()
