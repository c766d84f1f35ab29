"""A desktop agent for the live-screen tests (stdlib only): it starts an Xvfb of its own (the display
number is Xvfb's choice, `-displayfd`), paints its root window one colour with `xsetroot`, declares
the display with an `EVALBUS_DISPLAY :<n>` line, and holds until the test lets it finish.

The input is a JSON object: `xvfb` and `xsetroot` (the executables), `colour` (`#ff0000`), `ready`
(a file created once all is up, holding the display) and `go` (a file it waits for, 60 s at most,
else exit 3).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def main() -> int:
    task = json.loads(sys.stdin.read())
    read_fd, write_fd = os.pipe()
    server = subprocess.Popen(
        [task["xvfb"], "-displayfd", str(write_fd), "-screen", "0", "320x200x24", "-noreset", "-nolisten", "tcp"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        pass_fds=(write_fd,),
    )
    os.close(write_fd)
    try:
        with os.fdopen(read_fd) as numbers:
            number = numbers.readline().strip()  # written once the server takes clients; EOF if it died
        if not number.isdigit():
            print(f"Xvfb did not start (exit {server.poll()})", file=sys.stderr)
            return 3
        display = f":{number}"
        subprocess.run([task["xsetroot"], "-solid", task["colour"]], env={**os.environ, "DISPLAY": display}, check=True)
        print(f"EVALBUS_DISPLAY {display}", flush=True)
        print("desktop is up", flush=True)
        Path(task["ready"]).write_text(display)
        deadline = time.monotonic() + 60
        while not Path(task["go"]).exists():
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.02)
        print('EVALBUS_RESULT {"answer": "painted"}', flush=True)
        return 0
    finally:
        server.terminate()
        try:
            server.wait(10)
        except subprocess.TimeoutExpired:
            server.kill()


if __name__ == "__main__":
    sys.exit(main())
