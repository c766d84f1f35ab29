"""The live screen of a case: one frame of what the harness declared it shows.

Browser cases: captured over the Chrome DevTools Protocol from the browser the harness declared
(`EVALBUS_CDP <url>` on its stdout, or `EVALBUS_CDP_URL` in its environment), with
`Page.captureScreenshot`. Desktop cases: the X display the harness declared (`EVALBUS_DISPLAY
:<n>` on its stdout, or `EVALBUS_DISPLAY`, then `DISPLAY`, in its environment) is dumped by
`xwd -root -silent` run inside the live sandbox through the same path as a person's exec (its
workdir and environment, `DISPLAY` set), and the dump becomes a PNG here (`xwd.xwd_to_png`). A
declared browser comes first; the display is tried when there is no browser or it did not answer.

Which tab is a decision: a browser reports several page targets (a blank tab, an extension's
panel, the tab the agent works in). The work tab is the most recently active one, and DevTools
lists page targets in that order (most recent first), so the first page that is not blank is
taken. Never by URL: an extension-driven work tab may itself start on a `chrome-extension://` page.

Why xwd: it is the X server's own dump tool (Debian's `x11-apps`, a few small libraries), present
wherever X is, and it needs nothing of the dispatcher's machine — the command runs where the
display is, on every backend that can exec. Its output is the server's raw pixels in a format
simple enough to convert without an imaging library; tools that write PNG themselves (ImageMagick's
`import`, `scrot`) pull in far more. The dump crosses the exec path as base64 (that path carries
text; a secret masked inside it makes the dump unreadable, reported as such, never a wrong frame).

`supported` is the attempt itself: true when the endpoint answered with a page to capture, or a
display was declared and the capture command ran in the sandbox; false when nothing was declared
or nothing answered — never a guess from what the case claims to be.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import logging
import shlex
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import aiohttp

from evalbus_contracts.control import ScreenReply
from evalbus_dispatcher.backends.base import Interactive, SandboxHandle
from evalbus_dispatcher.errors import BackendError
from evalbus_dispatcher.xwd import XwdError, xwd_to_png

log = logging.getLogger(__name__)

CDP_ENV = "EVALBUS_CDP_URL"
"""A harness environment variable declaring its browser's DevTools endpoint."""
DISPLAY_ENV = "EVALBUS_DISPLAY"
"""A harness environment variable declaring the X display it works on (before `DISPLAY`)."""
X_DISPLAY_ENV = "DISPLAY"
"""X's own variable: a harness whose `env` sets it works on that display."""
DUMP_MAX_BYTES = 64 * 1024 * 1024
"""Largest screen dump (base64) read back from the sandbox: an 8K screen at 32 bits a pixel."""
SCALES = (1, 2, 4)
"""A desktop frame over `MAX_IMAGE_BYTES` as a PNG is sent again at half, then a quarter, size."""
MAX_IMAGE_BYTES = 600 * 1024
"""Largest frame (decoded) sent as is; a larger one is captured again as a JPEG, then smaller."""
CAPTURE_TIMEOUT_S = 10.0
"""Longest a capture takes in all (the gateway waits `SCREEN_TIMEOUT_S`, 20 s, for its reply)."""
BLANK = {"about:blank", "chrome://newtab/", "chrome://new-tab-page/", ""}
NOTHING_DECLARED = "the harness declared no screen (EVALBUS_CDP or EVALBUS_DISPLAY)"


@dataclass
class Declared:
    """What a harness declared to show its screen, as last declared (control lines update it)."""

    cdp: str | None = None
    """The DevTools endpoint of its browser."""
    display: str | None = None
    """The X display it works on (`:99`)."""

    @classmethod
    def from_env(cls, env: Mapping[str, str]) -> Declared:
        """What the harness's `env` declares up front."""
        display = env.get(DISPLAY_ENV) or env.get(X_DISPLAY_ENV) or None
        return cls(cdp=env.get(CDP_ENV) or None, display=display)


def work_tab(targets: Sequence[dict[str, Any]]) -> dict[str, Any] | None:
    """The page to capture: the most recently active page that is not blank (DevTools lists them
    most recent first), else the most recent page; None without pages."""
    pages = [t for t in targets if t.get("type") == "page" and t.get("webSocketDebuggerUrl")]
    for page in pages:
        if str(page.get("url", "")) not in BLANK:
            return page
    return pages[0] if pages else None


async def _screenshot(session: aiohttp.ClientSession, ws_url: str, params: dict[str, Any]) -> bytes:
    async with session.ws_connect(ws_url, max_msg_size=64 * 1024 * 1024) as ws:
        await ws.send_json({"id": 1, "method": "Page.captureScreenshot", "params": params})
        async for message in ws:
            if message.type != aiohttp.WSMsgType.TEXT:
                continue
            doc = message.json()
            if doc.get("id") != 1:
                continue  # an event of the page
            if "error" in doc:
                raise RuntimeError(str(doc["error"].get("message", doc["error"])))
            return base64.b64decode(doc["result"]["data"])
    raise RuntimeError("the page closed the DevTools connection")


async def capture(
    session: aiohttp.ClientSession, handle: SandboxHandle, declared: Declared, *, budget_s: float = CAPTURE_TIMEOUT_S
) -> ScreenReply:
    """One frame of what the harness declared, within `budget_s` in all: its browser's work tab,
    else (no browser, or one that did not answer) its X display. With both declared the browser
    gets half the budget, so a hung browser leaves the display its time."""
    deadline = asyncio.get_running_loop().time() + budget_s
    if declared.cdp:
        shot = await capture_browser(session, declared.cdp, budget_s=budget_s / 2 if declared.display else budget_s)
        if shot.supported or not declared.display:
            return shot
    if declared.display:
        remaining = max(0.1, deadline - asyncio.get_running_loop().time())
        return await capture_display(handle, declared.display, budget_s=remaining)
    return ScreenReply(supported=False, found=False, reason=NOTHING_DECLARED)


async def capture_browser(
    session: aiohttp.ClientSession, endpoint: str | None, *, budget_s: float = CAPTURE_TIMEOUT_S
) -> ScreenReply:
    """One frame of the work tab of the browser at `endpoint`, within `budget_s` in all."""
    if not endpoint:
        return ScreenReply(supported=False, found=False, reason="the harness declared no browser (EVALBUS_CDP)")
    base = endpoint.rstrip("/").replace("ws://", "http://").replace("wss://", "https://")
    deadline = asyncio.get_running_loop().time() + budget_s
    try:
        async with asyncio.timeout_at(deadline):
            async with session.get(f"{base}/json/list") as resp:
                targets = await resp.json(content_type=None)
    except TimeoutError:
        reason = f"the browser at {base} did not answer within {budget_s:g}s"
        return ScreenReply(supported=False, found=False, reason=reason)
    except (aiohttp.ClientError, ValueError) as e:
        return ScreenReply(supported=False, found=False, reason=f"the browser at {base} did not answer: {e}")
    page = work_tab(targets if isinstance(targets, list) else [])
    if page is None:
        return ScreenReply(supported=False, found=False, reason=f"the browser at {base} has no page")
    url = str(page.get("url", ""))
    attempts: list[tuple[str, dict[str, Any]]] = [
        ("image/png", {"format": "png"}),
        ("image/jpeg", {"format": "jpeg", "quality": 60}),
        (
            "image/jpeg",
            {"format": "jpeg", "quality": 40, "clip": {"x": 0, "y": 0, "width": 1280, "height": 800, "scale": 0.5}},
        ),
    ]
    try:
        async with asyncio.timeout_at(deadline):
            for media, params in attempts:
                image = await _screenshot(session, str(page["webSocketDebuggerUrl"]), params)
                if len(image) <= MAX_IMAGE_BYTES:
                    data_url = f"data:{media};base64," + base64.b64encode(image).decode("ascii")
                    return ScreenReply(supported=True, found=True, data_url=data_url, target=url)
    except TimeoutError:
        log.warning("screen capture of %s took longer than %gs", url, budget_s)
        return ScreenReply(
            supported=True, found=False, target=url, reason=f"the capture took longer than {budget_s:g}s"
        )
    except (aiohttp.ClientError, RuntimeError, KeyError, ValueError) as e:
        log.warning("screen capture of %s failed: %s", url, e)
        return ScreenReply(supported=True, found=False, target=url, reason=f"the capture failed: {e}")
    return ScreenReply(supported=True, found=False, target=url, reason="the frame is too large to send")


def dump_command(display: str) -> str:
    """The shell command that writes the display's dump, base64, on stdout."""
    return f"DISPLAY={shlex.quote(display)} xwd -root -silent | base64"


def _last_line(text: str) -> str | None:
    lines = [line.strip() for line in text.strip().splitlines() if line.strip()]
    return lines[-1] if lines else None


def frame_of(dump: bytes, display: str) -> ScreenReply:
    """The reply for a display's XWD dump: a PNG at the largest of `SCALES` that fits."""
    try:
        for scale in SCALES:
            width, height, png = xwd_to_png(dump, scale)
            if len(png) <= MAX_IMAGE_BYTES:
                size = "" if scale == 1 else f", at 1/{scale} size"
                data_url = "data:image/png;base64," + base64.b64encode(png).decode("ascii")
                return ScreenReply(
                    supported=True, found=True, data_url=data_url, target=f"display {display} ({width}x{height}{size})"
                )
    except XwdError as e:
        return ScreenReply(supported=True, found=False, target=f"display {display}", reason=f"unreadable dump: {e}")
    return ScreenReply(
        supported=True, found=False, target=f"display {display}", reason="the frame is too large to send"
    )


async def capture_display(handle: SandboxHandle, display: str, *, budget_s: float = CAPTURE_TIMEOUT_S) -> ScreenReply:
    """One frame of X display `display`, dumped by `xwd` inside the sandbox (`dump_command`) within
    `budget_s`."""
    target = f"display {display}"
    if not isinstance(handle, Interactive):
        return ScreenReply(supported=False, found=False, target=target, reason="the sandbox cannot run commands")
    try:
        done = await handle.exec_live(dump_command(display), budget_s, cap_bytes=DUMP_MAX_BYTES)
    except BackendError as e:
        return ScreenReply(supported=False, found=False, target=target, reason=f"no live sandbox: {e}")
    except OSError as e:
        return ScreenReply(supported=True, found=False, target=target, reason=f"the capture could not start: {e}")
    if done.timed_out:
        reason = f"the capture took longer than {budget_s:g}s"
        return ScreenReply(supported=True, found=False, target=target, reason=reason)
    if done.truncated:
        reason = f"the screen dump is over {DUMP_MAX_BYTES // (1024 * 1024)} MiB"
        return ScreenReply(supported=True, found=False, target=target, reason=reason)
    text = "".join(done.stdout.split())
    if not text:
        said = _last_line(done.stderr) or f"xwd wrote nothing (exit {done.exit_code})"
        return ScreenReply(supported=True, found=False, target=target, reason=f"the capture failed: {said}")
    try:
        dump = base64.b64decode(text, validate=True)
    except (binascii.Error, ValueError) as e:
        return ScreenReply(supported=True, found=False, target=target, reason=f"unreadable dump: {e}")
    return await asyncio.to_thread(frame_of, dump, display)


class ScreenSessions:
    """The HTTP session screen captures talk to harnesses' browsers with (open while the service runs)."""

    def __init__(self) -> None:
        self._session: aiohttp.ClientSession | None = None

    @property
    def session(self) -> aiohttp.ClientSession:
        if self._session is None:
            raise RuntimeError("the service is not started")
        return self._session

    async def start(self) -> None:
        self._session = aiohttp.ClientSession()

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
