"""A browser-driving agent for the live-screen tests (stdlib only): it starts headless Chromium with
a DevTools port of its own, opens its pages, brings the work page to the front, declares the browser
with an `EVALBUS_CDP <url>` line, and holds until the test lets it finish.

The input is a JSON object: `chromium` (the executable), `profile` (a folder for its profile),
`pages` (`{"name": …, "url": …}` in the order they are opened), `front` (the name of the page
brought to the front last), `ready` (a file created once all is up) and `go` (a file it waits for,
60 s at most, else exit 3).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path

FLAGS = [
    "--headless=new",
    "--no-sandbox",
    "--disable-gpu",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--window-size=800,600",
]


def _devtools(base: str, path: str, method: str = "GET") -> bytes:
    request = urllib.request.Request(base + path, method=method)
    with urllib.request.urlopen(request, timeout=10) as resp:  # noqa: S310 - loopback DevTools
        return bytes(resp.read())


def main() -> int:
    task = json.loads(sys.stdin.read())
    profile = Path(task["profile"])
    port_file = profile / "DevToolsActivePort"
    browser = subprocess.Popen(
        [task["chromium"], *FLAGS, "--remote-debugging-port=0", f"--user-data-dir={profile}", "about:blank"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 30
        while not port_file.exists() or not port_file.read_text().strip():
            if time.monotonic() > deadline or browser.poll() is not None:
                print("chromium did not start", file=sys.stderr)
                return 3
            time.sleep(0.05)
        base = f"http://127.0.0.1:{port_file.read_text().split()[0]}"
        ids = {}
        for page in task["pages"]:
            created = json.loads(_devtools(base, "/json/new?" + urllib.parse.quote(page["url"], safe=":/,<>="), "PUT"))
            ids[page["name"]] = created["id"]
        _devtools(base, f"/json/activate/{ids[task['front']]}")
        print(f"EVALBUS_CDP {base}", flush=True)
        print("browser is up", flush=True)
        Path(task["ready"]).write_text(base)
        deadline = time.monotonic() + 60
        while not Path(task["go"]).exists():
            if time.monotonic() > deadline:
                return 3
            time.sleep(0.02)
        print('EVALBUS_RESULT {"answer": "browsed"}', flush=True)
        return 0
    finally:
        browser.terminate()
        try:
            browser.wait(10)
        except subprocess.TimeoutExpired:
            browser.kill()


if __name__ == "__main__":
    sys.exit(main())
