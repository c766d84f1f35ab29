"""The live screen's capture over CDP against real headless Chromium (Debian's): the work tab is the
most recently active page that is not blank — not the newest, not the first listed by URL — and
its frame comes back as a PNG data URL; no declared browser, or one that does not answer, is
`supported: false`."""

from __future__ import annotations

import asyncio
import base64
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest

from evalbus.testing.chromium import ensure_chromium, png_size_and_first_pixel
from evalbus.testing.pipeline import eventually
from evalbus.testing.png import decode_png
from evalbus_dispatcher.screen import capture_browser, work_tab

pytestmark = pytest.mark.integration

FLAGS = ["--headless=new", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
         "--disable-component-update", "--disable-sync", "--window-size=640,480"]  # fmt: skip


def page(colour: str) -> str:
    return f"data:text/html,<style>body{{margin:0;background:{colour}}}</style>{colour}"  # no spaces: kept as is


@pytest.fixture
async def browser(tmp_path: Path) -> AsyncIterator[str]:
    """A headless Chromium of the test's own: its DevTools base URL."""
    profile = tmp_path / "profile"
    proc = await asyncio.create_subprocess_exec(
        ensure_chromium(),
        *FLAGS,
        "--remote-debugging-port=0",
        f"--user-data-dir={profile}",
        "about:blank",
        stdout=asyncio.subprocess.DEVNULL,
        stderr=asyncio.subprocess.DEVNULL,
    )
    port_file = profile / "DevToolsActivePort"

    def up() -> bool:
        return port_file.exists() and bool(port_file.read_text().strip())

    try:
        await eventually(up, timeout_s=30, what="chromium's DevTools port")
        yield f"http://127.0.0.1:{port_file.read_text().split()[0]}"
    finally:
        proc.terminate()
        await asyncio.wait_for(proc.wait(), 10)


async def open_page(http: aiohttp.ClientSession, base: str, url: str) -> str:
    async with http.put(f"{base}/json/new?{url}") as resp:
        return str((await resp.json(content_type=None))["id"])


@pytest.mark.unit
def test_the_work_tab_is_the_most_recent_page_that_is_not_blank() -> None:
    def target(url: str, kind: str = "page") -> dict[str, str]:
        return {"type": kind, "url": url, "webSocketDebuggerUrl": f"ws://x/{url}"}

    listed = [
        target("chrome://omnibox", "browser_ui"),
        target("about:blank"),
        target("chrome-extension://a/panel.html"),
    ]
    assert work_tab(listed) == listed[2]  # an extension page may be the work tab: never judged by URL
    assert work_tab([target("about:blank")]) == target("about:blank")
    assert work_tab([target("x", "service_worker")]) is None


async def test_the_frame_is_the_front_tab_of_a_real_browser(browser: str) -> None:
    async with aiohttp.ClientSession() as http:
        work = await open_page(http, browser, page("rgb(255,0,0)"))
        await open_page(http, browser, page("rgb(0,0,255)"))  # opened later, so newer
        async with http.get(f"{browser}/json/activate/{work}") as resp:
            assert resp.status == 200
        shot = await capture_browser(http, browser)
    assert (shot.supported, shot.found) == (True, True), shot.reason
    assert shot.target == page("rgb(255,0,0)")
    assert shot.data_url is not None
    assert shot.data_url.startswith("data:image/png;base64,")
    width, height, pixel = png_size_and_first_pixel(base64.b64decode(shot.data_url.split(",", 1)[1]))
    assert width == 640
    assert 0 < height <= 480  # the window less what headless Chromium keeps for itself
    assert pixel == (255, 0, 0)
    # the whole frame decoded (Chromium's rows use every PNG filter): the far corner is the page too
    pixels = decode_png(base64.b64decode(shot.data_url.split(",", 1)[1]))
    assert (pixels.width, pixels.height) == (width, height)
    assert pixels.at(width - 1, height - 1) == (255, 0, 0)
    assert len(pixels.colours()) > 1  # the page's text is drawn on it


async def test_nothing_declared_or_nothing_answering_is_unsupported() -> None:
    async with aiohttp.ClientSession() as http:
        none = await capture_browser(http, None)
        assert (none.supported, none.found, none.reason) == (
            False,
            False,
            "the harness declared no browser (EVALBUS_CDP)",
        )
        gone = await capture_browser(http, "http://127.0.0.1:1")
        assert (gone.supported, gone.found) == (False, False)
        assert gone.reason is not None
        assert gone.reason.startswith("the browser at http://127.0.0.1:1 did not answer")
