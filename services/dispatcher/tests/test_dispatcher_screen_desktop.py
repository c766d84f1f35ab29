"""The live screen of a desktop case: an XWD dump of the declared X display, taken by `xwd` inside a
real local sandbox against a real Xvfb (Debian's), converted to a PNG in pure Python — its decoded
pixels are the colour painted on the display. A display nobody serves is `supported: true, found:
false` with the reason; nothing declared is `supported: false`; a browser that does not answer
falls back to the display. The converter is checked on synthetic dumps of every layout it reads.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web

from evalbus.testing.pipeline import eventually
from evalbus.testing.png import decode_png
from evalbus.testing.xvfb import X11Tools, ensure_x11, paint, running_xvfb, unused_display
from evalbus_contracts import CasePlan, CaseRequested, CaseSpec, HarnessSpec, batch_run_id
from evalbus_dispatcher import LiveSink, LocalBackend, execute_case
from evalbus_dispatcher.backends.base import SandboxHandle
from evalbus_dispatcher.execute import MarkFn
from evalbus_dispatcher.harness_output import parse_line
from evalbus_dispatcher.screen import (
    MAX_IMAGE_BYTES,
    NOTHING_DECLARED,
    Declared,
    capture,
    capture_browser,
    capture_display,
    frame_of,
)
from evalbus_dispatcher.xwd import XwdError, xwd_to_png

from .conftest import LiveRecord

pytestmark = pytest.mark.integration

MakeRequest = Callable[..., CaseRequested]

DISPLAY_AGENT = """
import json, time
from pathlib import Path

from evalbus import harness


@harness
def solve(case, ctx):
    task = json.loads(case.input)
    ctx.display(task["display"])
    print("drawing on", task["display"])
    while not Path(task["go"]).exists():
        time.sleep(0.02)
    return "drawn"
"""


def header(width: int, height: int, *, bits: int, msb: bool, pad: int, visual: int, ncolors: int) -> bytes:
    """An XWD header (and window name, colour map) as xwd writes it: 8-bit masks (5-6-5 at 16 bits)."""
    masks = (0xF800, 0x07E0, 0x001F) if bits == 16 else (0xFF0000, 0x00FF00, 0x0000FF)
    name = b"root\x00"
    fields = [100 + len(name), 7, 2, 16 if bits == 16 else 24, width, height, 0, int(msb), 32, int(msb), 32,
              bits, width * bits // 8 + pad, visual, *masks, 8, 256, ncolors, width, height, 0, 0, 0]  # fmt: skip
    return struct.pack(">25I", *fields) + name + b"\x00" * 12 * ncolors


def xwd(
    width: int,
    height: int,
    pixel: Callable[[int, int], tuple[int, int, int]],
    *,
    bits: int = 32,
    msb: bool = False,
    pad: int = 0,
    visual: int = 4,
    ncolors: int = 0,
) -> bytes:
    """A synthetic XWD dump laid out as an X server would."""
    rows = []
    for y in range(height):
        row = bytearray()
        for x in range(width):
            r, g, b = pixel(x, y)
            value = ((r >> 3) << 11 | (g >> 2) << 5 | b >> 3) if bits == 16 else (r << 16 | g << 8 | b)
            row += value.to_bytes(bits // 8, "big" if msb else "little")
        rows.append(bytes(row) + b"\xee" * pad)  # padding bytes must never be read as pixels
    return header(width, height, bits=bits, msb=msb, pad=pad, visual=visual, ncolors=ncolors) + b"".join(rows)


def noise(width: int, height: int) -> bytes:
    """A 32-bit dump of random pixels: as incompressible as a screen gets."""
    pixels = random.Random(7).randbytes(width * height * 4)
    return header(width, height, bits=32, msb=False, pad=0, visual=4, ncolors=0) + pixels


def _b64(data_url: str) -> bytes:
    return base64.b64decode(data_url.split(",", 1)[1])


def gradient(x: int, y: int) -> tuple[int, int, int]:
    return (x * 40) % 256, (y * 60) % 256, (x * y * 7) % 256


@pytest.mark.unit
@pytest.mark.parametrize(
    ("bits", "msb", "pad"),
    [(32, False, 0), (32, True, 0), (24, False, 3), (24, True, 1), (32, False, 8)],
)
def test_a_dump_becomes_a_png_of_the_same_pixels(bits: int, msb: bool, pad: int) -> None:
    width, height, png = xwd_to_png(xwd(7, 5, gradient, bits=bits, msb=msb, pad=pad, ncolors=3))
    pixels = decode_png(png)
    assert (width, height, pixels.width, pixels.height) == (7, 5, 7, 5)
    assert [[pixels.at(x, y) for x in range(7)] for y in range(5)] == [
        [gradient(x, y) for x in range(7)] for y in range(5)
    ]


@pytest.mark.unit
def test_a_16_bit_dump_is_scaled_up_to_8_bits_a_channel() -> None:
    colours = {(0, 0): (255, 255, 255), (1, 0): (255, 0, 0), (0, 1): (0, 0, 255), (1, 1): (0, 0, 0)}
    pixels = decode_png(xwd_to_png(xwd(2, 2, lambda x, y: colours[(x, y)], bits=16, pad=2))[2])
    assert {(x, y): pixels.at(x, y) for x in range(2) for y in range(2)} == colours


@pytest.mark.unit
def test_scale_keeps_every_nth_pixel_of_every_nth_row() -> None:
    width, height, png = xwd_to_png(xwd(7, 5, gradient), scale=2)
    pixels = decode_png(png)
    assert (width, height) == (4, 3)
    assert [[pixels.at(x, y) for x in range(4)] for y in range(3)] == [
        [gradient(2 * x, 2 * y) for x in range(4)] for y in range(3)
    ]


@pytest.mark.unit
@pytest.mark.parametrize(
    ("data", "says"),
    [
        (b"nope", "too short"),
        (xwd(4, 4, gradient, visual=3), "not TrueColor"),
        (xwd(4, 4, gradient)[:-5], "cut short"),
        (b"\x00" * 100, "not an XWD version 7"),
    ],
)
def test_what_is_not_a_truecolor_dump_is_refused_with_the_reason(data: bytes, says: str) -> None:
    with pytest.raises(XwdError, match=says):
        xwd_to_png(data)


@pytest.mark.unit
def test_a_frame_too_large_at_full_size_is_sent_smaller_and_says_so() -> None:
    shot = frame_of(noise(640, 480), ":5")
    assert (shot.supported, shot.found, shot.target) == (True, True, "display :5 (320x240, at 1/2 size)")
    assert shot.data_url is not None
    assert len(shot.data_url) <= 4 * MAX_IMAGE_BYTES // 3 + 100
    too_big = frame_of(noise(2560, 1600), ":5")  # a quarter is still 640x400 of noise
    assert (too_big.supported, too_big.found, too_big.reason) == (True, False, "the frame is too large to send")


@pytest.mark.unit
def test_the_display_line_is_a_control_line() -> None:
    assert parse_line("EVALBUS_DISPLAY :99").display == ":99"
    assert parse_line("  EVALBUS_DISPLAY localhost:10.0").display == "localhost:10.0"
    assert parse_line("EVALBUS_DISPLAY 99; rm -rf /").kind == "invalid"
    assert parse_line("EVALBUS_DISPLAY").kind == "invalid"
    assert parse_line("EVALBUS_DISPLAYS are great").kind == "text"


@pytest.mark.unit
def test_the_environment_declares_a_display_evalbus_first() -> None:
    assert Declared.from_env({"DISPLAY": ":1"}) == Declared(display=":1")
    assert Declared.from_env({"DISPLAY": ":1", "EVALBUS_DISPLAY": ":2"}) == Declared(display=":2")
    assert Declared.from_env({"EVALBUS_CDP_URL": "http://127.0.0.1:9"}) == Declared(cdp="http://127.0.0.1:9")


@pytest.fixture(scope="module")
def x11() -> X11Tools:
    return ensure_x11()


@pytest.fixture
async def sandbox(backend: LocalBackend, make_request: MakeRequest) -> AsyncIterator[SandboxHandle]:
    handle = await backend.provision(make_request(("true",)))
    try:
        yield handle
    finally:
        await handle.release()


async def test_the_frame_is_what_the_display_shows(x11: X11Tools, sandbox: SandboxHandle) -> None:
    async with running_xvfb(x11, 320, 200) as display:
        await paint(x11, display, "#ff0000")
        shot = await capture_display(sandbox, display)
        assert (shot.supported, shot.found) == (True, True), shot.reason
        assert shot.target == f"display {display} (320x200)"
        assert shot.data_url is not None
        assert shot.data_url.startswith("data:image/png;base64,")
        pixels = decode_png(_b64(shot.data_url))
        assert (pixels.width, pixels.height) == (320, 200)
        assert pixels.colours() == {(255, 0, 0)}

        await paint(x11, display, "#0080ff")  # a second frame is a new capture, not a cached one
        again = await capture_display(sandbox, display)
        assert again.data_url is not None
        assert decode_png(_b64(again.data_url)).colours() == {(0, 128, 255)}


async def test_a_display_nobody_serves_is_supported_but_not_found(x11: X11Tools, sandbox: SandboxHandle) -> None:
    display = unused_display()
    shot = await capture_display(sandbox, display)
    assert (shot.supported, shot.found, shot.data_url) == (True, False, None)
    assert shot.reason is not None
    assert shot.reason.startswith("the capture failed: xwd:"), shot.reason
    assert display in shot.reason  # xwd names the display it could not open


async def test_the_choice_between_browser_and_display(x11: X11Tools, sandbox: SandboxHandle) -> None:
    async with aiohttp.ClientSession() as http, running_xvfb(x11, 64, 48) as display:
        await paint(x11, display, "#00ff00")
        nothing = await capture(http, sandbox, Declared())
        assert (nothing.supported, nothing.found, nothing.reason) == (False, False, NOTHING_DECLARED)
        no_browser = await capture(http, sandbox, Declared(cdp="http://127.0.0.1:1"))
        assert (no_browser.supported, no_browser.found) == (False, False)
        fallback = await capture(http, sandbox, Declared(cdp="http://127.0.0.1:1", display=display))
        assert (fallback.supported, fallback.found) == (True, True), fallback.reason
        assert fallback.data_url is not None
        assert decode_png(_b64(fallback.data_url)).colours() == {(0, 255, 0)}


async def test_a_hung_browser_leaves_the_display_its_share_of_one_budget(x11: X11Tools, sandbox: SandboxHandle) -> None:
    """A browser that takes the connection and never answers costs half the capture's budget, not
    each step's own timeout in turn: the display's frame still comes back within the budget (the
    gateway gives up on a capture after `SCREEN_TIMEOUT_S`)."""
    answered = asyncio.Event()

    async def hang(_: web.Request) -> web.StreamResponse:
        await answered.wait()  # never set while the capture runs
        return web.Response()

    app = web.Application()
    app.router.add_get("/json/list", hang)
    runner = web.AppRunner(app, shutdown_timeout=0.1)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    budget_s = 3.0
    try:
        async with aiohttp.ClientSession() as http, running_xvfb(x11, 64, 48) as display:
            await paint(x11, display, "#0000ff")
            loop = asyncio.get_running_loop()
            started = loop.time()
            shot = await capture(
                http, sandbox, Declared(cdp=f"http://127.0.0.1:{port}", display=display), budget_s=budget_s
            )
            took = loop.time() - started
            assert (shot.supported, shot.found) == (True, True), shot.reason
            assert shot.data_url is not None
            assert decode_png(_b64(shot.data_url)).colours() == {(0, 0, 255)}
            assert budget_s / 2 <= took < budget_s + 1.0, took  # waited its half on the browser, no more

            alone = await capture_browser(http, f"http://127.0.0.1:{port}", budget_s=0.5)
            assert (alone.supported, alone.found) == (False, False)
            assert alone.reason == f"the browser at http://127.0.0.1:{port} did not answer within 0.5s"
    finally:
        answered.set()
        await runner.cleanup()


async def test_a_released_sandbox_has_no_screen(x11: X11Tools, sandbox: SandboxHandle) -> None:
    await sandbox.release()
    shot = await capture_display(sandbox, unused_display())
    assert (shot.supported, shot.found) == (False, False)
    assert shot.reason is not None
    assert shot.reason.startswith("no live sandbox")


async def test_a_worker_case_declares_its_display_with_the_sdk(
    x11: X11Tools, backend: LocalBackend, tmp_path: Path, live: LiveSink, live_records: list[LiveRecord]
) -> None:
    (tmp_path / "dagent.py").write_text(DISPLAY_AGENT)
    go = tmp_path / "go"
    harness = HarnessSpec(kind="worker", id="w", python="dagent:solve", env={"PYTHONPATH": str(tmp_path)})
    seen: dict[str, tuple[SandboxHandle, Declared]] = {}

    async def on_sandbox(handle: SandboxHandle, _mark: MarkFn, declared: Declared) -> Callable[[], Awaitable[None]]:
        seen["run"] = (handle, declared)

        async def detach() -> None:
            seen.pop("run", None)

        return detach

    async with aiohttp.ClientSession() as http, running_xvfb(x11, 40, 30) as display:
        await paint(x11, display, "#ffff00")
        req = CaseRequested(
            batch_id="wdisp",
            case_id="c1",
            run_id=batch_run_id("wdisp", "c1", None),
            case=CaseSpec(id="c1", input=json.dumps({"display": display, "go": str(go)})),
            harness=harness,
            plan=CasePlan(suite_id="suite"),
        )
        running = asyncio.create_task(
            execute_case(req, backend, live=live, on_release=lambda: None, on_sandbox=on_sandbox)
        )
        try:

            def declared_display() -> bool:
                return "run" in seen and seen["run"][1].display == display

            await eventually(declared_display, timeout_s=30, what="the worker case declaring its display")
            handle, declared = seen["run"]
            shot = await capture(http, handle, declared)
            assert (shot.supported, shot.found) == (True, True), shot.reason
            assert shot.data_url is not None
            assert decode_png(_b64(shot.data_url)).colours() == {(255, 255, 0)}
        finally:
            go.touch()
            executed = await asyncio.wait_for(running, 60)
            await backend.close()
    assert executed.status == "succeeded", executed.result.failure
    text = "".join(rec[1][1] for rec in live_records if rec[0] == "log")
    assert f"drawing on {display}" in text
    assert "EVALBUS_DISPLAY" not in text  # the declaration is a control line, never the log
