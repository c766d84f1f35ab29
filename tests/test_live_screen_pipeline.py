"""The live screen end to end: the five services as real processes plus a second gateway replica,
and a harness that drives real headless Chromium (Debian's) and declares it with `EVALBUS_CDP`, or
one that paints a real Xvfb (Debian's) and declares it with `EVALBUS_DISPLAY`.

The frame comes from the browser's front tab (the one brought forward last, not the newest, not the
blank one), through either replica, for the run's creator or an admin only; a run whose harness
declared no screen is `supported: false`, and so is a settled run (no live sandbox holds it). The
desktop's frame is the dispatcher's PNG of an `xwd` dump taken in the sandbox: its decoded pixels
are the painted colour. A display nobody serves is `supported: true, found: false`, with xwd's
reason. Declarations are control lines: they never show in the run's log.
"""

from __future__ import annotations

import base64
import json
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import msgspec
import pytest

from evalbus.testing.chromium import ensure_chromium, png_size_and_first_pixel
from evalbus.testing.pipeline import REPO_ROOT, Pipeline, open_pipeline, wait_path
from evalbus.testing.png import decode_png
from evalbus.testing.xvfb import ensure_x11, unused_display
from evalbus_api.actions import ScreenView
from evalbus_api.client import GatewayClient
from evalbus_contracts import BatchSpec, CaseSpec, CommandHarness, SuiteSpec
from evalbus_gateway.testing import RunningGateway, member, running_gateway

pytestmark = pytest.mark.e2e

BROWSER_AGENT = REPO_ROOT / "tests" / "harnesses" / "browser_agent.py"
LIVE_AGENT = REPO_ROOT / "tests" / "harnesses" / "live_agent.py"
DESKTOP_AGENT = REPO_ROOT / "tests" / "harnesses" / "desktop_agent.py"
ALICE, BOB = "tok-alice-screen", "tok-bob-screen"


def page(colour: str) -> str:
    return f"data:text/html,<style>body{{margin:0;background:{colour}}}</style>{colour}"


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    workdir = tmp_path_factory.mktemp("live-screen")
    tokens = workdir / "tokens.json"
    tokens.write_text(
        json.dumps({ALICE: {"principal": "alice", "role": "member"}, BOB: {"principal": "bob", "role": "member"}})
    )
    env = {"dispatcher": {"DISPATCHER_SLOTS": "2"}, "gateway": {"GATEWAY_TOKENS_FILE": str(tokens)}}
    async with open_pipeline(pg_admin_url, workdir, service_env=env) as p:
        yield p


@pytest.fixture(scope="module")
async def replica(pipeline: Pipeline) -> AsyncIterator[RunningGateway]:
    async with running_gateway(
        pipeline.nats.url,
        pipeline.database_url,
        admin_token=pipeline.stack.admin_token,
        tokens={ALICE: member("alice"), BOB: member("bob")},
    ) as gateway:
        yield gateway


async def screen(base: str, run_id: str, token: str | None) -> tuple[int, Any]:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    async with aiohttp.ClientSession() as http, http.get(f"{base}/v1/runs/{run_id}/screen", headers=headers) as resp:
        return resp.status, await resp.json()


async def submit(pipeline: Pipeline, harness: CommandHarness, task: dict[str, Any]) -> str:
    spec = BatchSpec(
        suite=SuiteSpec(id="screen", cases=(CaseSpec(id="c1", input=msgspec.json.encode(task).decode()),)),
        harness=harness,
    )
    async with GatewayClient(pipeline.stack.gateway_url, ALICE) as alice:
        return (await alice.submit(spec)).batch_id


async def test_the_screen_of_a_live_browser_case(pipeline: Pipeline, replica: RunningGateway, tmp_path: Path) -> None:
    ready, go = tmp_path / "ready", tmp_path / "go"
    task = {
        "chromium": ensure_chromium(),
        "profile": str(tmp_path / "profile"),
        "pages": [{"name": "work", "url": page("rgb(255,0,0)")}, {"name": "side", "url": page("rgb(0,0,255)")}],
        "front": "work",
        "ready": str(ready),
        "go": str(go),
    }
    harness = CommandHarness(id="browser-agent", command=(sys.executable, str(BROWSER_AGENT)), timeout_s=120)
    batch_id = await submit(pipeline, harness, task)
    run_id = f"evb-{batch_id}-c1"
    await wait_path(ready, timeout_s=60)

    for base, token in ((replica.base_url, ALICE), (pipeline.stack.gateway_url, pipeline.stack.admin_token)):
        status, body = await screen(base, run_id, token)
        assert status == 200, body
        shot = msgspec.convert(body, ScreenView)
        assert (shot.run_id, shot.supported, shot.found) == (run_id, True, True), shot.reason
        assert shot.target == page("rgb(255,0,0)")
        assert shot.data_url is not None
        assert shot.data_url.startswith("data:image/png;base64,")
        width, _, pixel = png_size_and_first_pixel(base64.b64decode(shot.data_url.split(",", 1)[1]))
        assert width == 800
        assert pixel == (255, 0, 0)  # the front tab, not the newer blue one

    assert (await screen(pipeline.stack.gateway_url, run_id, BOB))[0] == 404
    assert (await screen(replica.base_url, run_id, None))[0] == 401
    assert (await screen(replica.base_url, f"evb-{batch_id}-nope", ALICE))[0] == 404
    tail = await pipeline.gw.logs(run_id)
    assert "browser is up" in tail.text
    assert "EVALBUS_CDP" not in tail.text

    go.touch()
    await pipeline.finalized(batch_id)
    status, body = await screen(replica.base_url, run_id, ALICE)
    assert (status, body["supported"], body["found"], body["reason"]) == (
        200,
        False,
        False,
        "no live sandbox holds the run",
    )


async def test_a_case_without_a_browser_has_no_screen(pipeline: Pipeline, tmp_path: Path) -> None:
    ready, go = tmp_path / "ready", tmp_path / "go"
    harness = CommandHarness(id="live-agent", command=(sys.executable, str(LIVE_AGENT)), timeout_s=60)
    batch_id = await submit(pipeline, harness, {"phases": [{"stdout": ["hi"], "ready": str(ready), "go": str(go)}]})
    await wait_path(ready)
    status, body = await screen(pipeline.stack.gateway_url, f"evb-{batch_id}-c1", ALICE)
    assert (status, body["supported"], body["found"]) == (200, False, False)
    assert body["reason"] == "the harness declared no screen (EVALBUS_CDP or EVALBUS_DISPLAY)"
    go.touch()
    await pipeline.finalized(batch_id)


async def test_the_screen_of_a_live_desktop_case(pipeline: Pipeline, replica: RunningGateway, tmp_path: Path) -> None:
    x11 = ensure_x11()
    ready, go = tmp_path / "ready", tmp_path / "go"
    task = {"xvfb": x11.xvfb, "xsetroot": x11.xsetroot, "colour": "#ff0000", "ready": str(ready), "go": str(go)}
    harness = CommandHarness(id="desktop-agent", command=(sys.executable, str(DESKTOP_AGENT)), timeout_s=120)
    batch_id = await submit(pipeline, harness, task)
    run_id = f"evb-{batch_id}-c1"
    await wait_path(ready, timeout_s=60)
    display = ready.read_text()

    for base, token in ((replica.base_url, ALICE), (pipeline.stack.gateway_url, pipeline.stack.admin_token)):
        status, body = await screen(base, run_id, token)
        assert status == 200, body
        shot = msgspec.convert(body, ScreenView)
        assert (shot.run_id, shot.supported, shot.found) == (run_id, True, True), shot.reason
        assert shot.target == f"display {display} (320x200)"
        assert shot.data_url is not None
        assert shot.data_url.startswith("data:image/png;base64,")
        pixels = decode_png(base64.b64decode(shot.data_url.split(",", 1)[1]))
        assert (pixels.width, pixels.height) == (320, 200)
        assert pixels.colours() == {(255, 0, 0)}  # every pixel is the painted root window

    assert (await screen(pipeline.stack.gateway_url, run_id, BOB))[0] == 404
    tail = await pipeline.gw.logs(run_id)
    assert "desktop is up" in tail.text
    assert "EVALBUS_DISPLAY" not in tail.text

    go.touch()
    await pipeline.finalized(batch_id)
    status, body = await screen(replica.base_url, run_id, ALICE)
    assert (status, body["supported"], body["reason"]) == (200, False, "no live sandbox holds the run")


async def test_a_display_nobody_serves_is_supported_but_not_found(pipeline: Pipeline, tmp_path: Path) -> None:
    ensure_x11()  # xwd must be there for the attempt to say what X said
    ready, go = tmp_path / "ready", tmp_path / "go"
    display = unused_display()
    harness = CommandHarness(
        id="live-agent", command=(sys.executable, str(LIVE_AGENT)), timeout_s=60, env={"EVALBUS_DISPLAY": display}
    )
    batch_id = await submit(pipeline, harness, {"phases": [{"stdout": ["hi"], "ready": str(ready), "go": str(go)}]})
    await wait_path(ready)
    status, body = await screen(pipeline.stack.gateway_url, f"evb-{batch_id}-c1", ALICE)
    assert (status, body["supported"], body["found"], body["target"]) == (200, True, False, f"display {display}")
    assert body["reason"].startswith("the capture failed: xwd:"), body["reason"]
    assert display in body["reason"]
    go.touch()
    await pipeline.finalized(batch_id)
