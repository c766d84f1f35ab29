"""The live screen of a browser case: one frame captured over the Chrome DevTools Protocol from the
browser the harness declared (`EVALBUS_CDP <url>` on its stdout, or `EVALBUS_CDP_URL` in its
environment), with `Page.captureScreenshot`.

Which tab is a decision: a browser reports several page targets (a blank tab, an extension's
panel, the tab the agent works in). The work tab is the most recently active one, and DevTools
lists page targets in that order (most recent first), so the first page that is not blank is
taken. Never by URL: an extension-driven work tab may itself start on a `chrome-extension://` page.

`supported` is the attempt itself: true when the endpoint answered with a page to capture, false
when nothing was declared or nothing answered — never a guess from what the case claims to be.
"""

from __future__ import annotations

import asyncio
import base64
import logging
from collections.abc import Sequence
from typing import Any

import aiohttp

from evalbus_contracts.control import ScreenReply

log = logging.getLogger(__name__)

CDP_ENV = "EVALBUS_CDP_URL"
"""A harness environment variable declaring its browser's DevTools endpoint."""
MAX_IMAGE_BYTES = 600 * 1024
"""Largest frame (decoded) sent as is; a larger one is captured again as a JPEG, then smaller."""
CAPTURE_TIMEOUT_S = 10.0
BLANK = {"about:blank", "chrome://newtab/", "chrome://new-tab-page/", ""}


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


async def capture(session: aiohttp.ClientSession, endpoint: str | None) -> ScreenReply:
    """One frame of the work tab of the browser at `endpoint`."""
    if not endpoint:
        return ScreenReply(supported=False, found=False, reason="the harness declared no browser (EVALBUS_CDP)")
    base = endpoint.rstrip("/").replace("ws://", "http://").replace("wss://", "https://")
    timeout = aiohttp.ClientTimeout(total=CAPTURE_TIMEOUT_S)
    try:
        async with session.get(f"{base}/json/list", timeout=timeout) as resp:
            targets = await resp.json(content_type=None)
    except (aiohttp.ClientError, TimeoutError, ValueError) as e:
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
        for media, params in attempts:
            async with asyncio.timeout(CAPTURE_TIMEOUT_S):
                image = await _screenshot(session, str(page["webSocketDebuggerUrl"]), params)
            if len(image) <= MAX_IMAGE_BYTES:
                data_url = f"data:{media};base64," + base64.b64encode(image).decode("ascii")
                return ScreenReply(supported=True, found=True, data_url=data_url, target=url)
    except (aiohttp.ClientError, TimeoutError, RuntimeError, KeyError, ValueError) as e:
        log.warning("screen capture of %s failed: %s", url, e)
        return ScreenReply(supported=True, found=False, target=url, reason=f"the capture failed: {e}")
    return ScreenReply(supported=True, found=False, target=url, reason="the frame is too large to send")
