"""The web dashboard in real headless Chromium (Debian's `chromium`, driven by Playwright for Python
through `executable_path`; Playwright's own browser download is never used): log in with a token,
watch a batch's cases turn green live, open a running run and read its live log and trace, see it
sealed, read the summary and the online page; watch a live browser case's screen and work in its
sandbox through the terminal widget (xterm.js over the terminal WebSocket) until the sandbox is
released; watch a desktop case's X display (a real Xvfb) in the same screen widget; compare two batches and find the regression. Screenshots go to
`.test-artifacts/dashboard/`.

The services are real processes (`open_pipeline`). Chromium is installed with apt by
`evalbus.testing.chromium.ensure_chromium` when it is missing and this runs as root; a run that
cannot get it fails — it never skips.
"""

from __future__ import annotations

import base64
import json
import re
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import asyncpg
import pytest
from playwright.async_api import Browser, Locator, Page, async_playwright, expect

from evalbus.testing.chromium import ensure_chromium, png_size_and_first_pixel
from evalbus.testing.pipeline import Pipeline, eventually, open_pipeline, wait_path
from evalbus.testing.png import decode_png
from evalbus.testing.xvfb import ensure_x11
from evalbus_contracts import (
    AnswerMatchGrader,
    BatchPolicy,
    BatchSpec,
    CaseSpec,
    CommandHarness,
    RegressionGate,
    SuiteSpec,
    batch_run_id,
)
from evalbus_gateway.store.recorder import RECORDER_LOCK

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
LIVE_AGENT = ROOT / "tests" / "harnesses" / "live_agent.py"
BROWSER_AGENT = ROOT / "tests" / "harnesses" / "browser_agent.py"
DESKTOP_AGENT = ROOT / "tests" / "harnesses" / "desktop_agent.py"
ARTIFACTS = ROOT / ".test-artifacts" / "dashboard"
CHROMIUM_FLAGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
"""As the machine's notes prescribe: without the background-networking flags Chromium keeps
trying hosts this closed network refuses."""


@pytest.fixture(scope="module")
async def pipeline(pg_admin_url: str, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[Pipeline]:
    async with open_pipeline(pg_admin_url, tmp_path_factory.mktemp("dashboard")) as p:
        yield p


@pytest.fixture(scope="module")
async def browser() -> AsyncIterator[Browser]:
    executable = ensure_chromium()
    async with async_playwright() as playwright:
        launched = await playwright.chromium.launch(executable_path=executable, headless=True, args=CHROMIUM_FLAGS)
        try:
            yield launched
        finally:
            await launched.close()


async def shot(page: Page, name: str) -> None:
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    await page.screenshot(path=str(ARTIFACTS / f"{name}.png"), full_page=True)


CSP_RECORDER = """
window.cspViolations = [];
document.addEventListener("securitypolicyviolation", (e) => {
  window.cspViolations.push(`${e.effectiveDirective} refused ${e.blockedURI || "inline"}: ${e.sample}`);
});
"""
"""Records what the page's Content-Security-Policy refused (the page must need nothing it refuses)."""


async def csp_violations(page: Page) -> list[str]:
    return list(await page.evaluate("window.cspViolations"))


async def logged_in(browser: Browser, p: Pipeline) -> Page:
    page = await browser.new_page(viewport={"width": 1300, "height": 900})
    await page.add_init_script(CSP_RECORDER)
    await page.goto(p.stack.gateway_url + "/")
    await page.get_by_test_id("token").fill("not-a-token")
    await page.get_by_test_id("login").click()
    await expect(page.get_by_test_id("login-error")).to_have_text("Unknown token.")
    await page.get_by_test_id("token").fill(p.stack.admin_token)
    await page.get_by_test_id("login").click()
    await expect(page.locator("#who")).to_contain_text("admin (admin)")
    return page


def phased_case(case_id: str, gates: Path | None) -> CaseSpec:
    first: dict[str, object] = {"stdout": [f"{case_id}: searching the archive"], "events": 2}
    if gates is not None:
        first |= {"ready": str(gates / "ready"), "go": str(gates / "go")}
    phases = [first, {"stdout": [f"{case_id}: found it"], "stderr": [f"{case_id}: a warning"]}]
    return CaseSpec(
        id=case_id,
        input=json.dumps({"phases": phases, "answer": "42", "go_timeout_s": 240}),
        expected="42",
        graders=(AnswerMatchGrader(id="answer"),),
    )


async def test_a_batch_and_a_running_run_watched_live_in_the_browser(
    pipeline: Pipeline, browser: Browser, tmp_path: Path
) -> None:
    p = pipeline
    page = await logged_in(browser, p)
    # the session is an HttpOnly cookie: page scripts cannot read the token
    assert "evalbus_session" not in await page.evaluate("document.cookie")
    await shot(page, "01-batches")

    gates = tmp_path / "gates"
    gates.mkdir()
    cases = (phased_case("c1", None), phased_case("c2", None), phased_case("held", gates))
    spec = BatchSpec(
        suite=SuiteSpec(id=f"dash-{uuid.uuid4().hex[:6]}", cases=cases),
        harness=CommandHarness(id="live-agent", command=(sys.executable, str(LIVE_AGENT)), timeout_s=60),
    )
    batch_id = await p.submit(spec)
    await page.goto(f"{p.stack.gateway_url}/#/batch/{batch_id}")
    await expect(page.locator("h1")).to_contain_text(f"Batch {batch_id}")
    # the quick cases turn green while the held one still runs
    for case_id in ("c1", "c2"):
        await expect(page.locator(f'tr[data-case="{case_id}"]')).to_have_attribute(
            "data-verdict", "pass", timeout=60_000
        )
    await wait_path(gates / "ready", timeout_s=60)
    await expect(page.locator('tr[data-case="held"]')).to_have_attribute("data-verdict", "")
    await shot(page, "02-batch-running")
    # the batches page counts each run once per stage (the stream it follows replays the batch
    # from its first event, on top of the counts it read from the store)
    await page.goto(f"{p.stack.gateway_url}/#/batches")
    running = page.locator(f'tr[data-batch="{batch_id}"]')
    heard = running.locator("td[data-events]")
    await expect(heard).to_have_attribute("data-events", "9", timeout=30_000)  # c1, c2: 4 stages; held: 1
    await expect(running.locator('[data-count="requested"]')).to_have_text("3/3", timeout=30_000)
    await expect(running.locator('[data-count="exported"]')).to_have_text("2/3", timeout=30_000)
    await page.goto(f"{p.stack.gateway_url}/#/batch/{batch_id}")

    await page.locator('tr[data-case="held"] a').click()
    await expect(page.get_by_test_id("log")).to_contain_text("held: searching the archive", timeout=30_000)
    await expect(page.locator('[data-testid="trace"] li[data-kind="tool_call"]')).to_have_count(2, timeout=30_000)
    await expect(page.get_by_test_id("trace-state")).to_have_text("Live trace")
    # the live phase (its placement), not the recorded stage, which still reads "requested"
    await expect(page.get_by_test_id("run-phase")).to_have_text("running", timeout=30_000)
    await expect(page.get_by_test_id("screen-state")).to_have_text(
        "No screen for this run: the harness declared no screen (EVALBUS_CDP or EVALBUS_DISPLAY)."
    )
    await expect(page.get_by_test_id("open-shell")).to_be_visible()
    await shot(page, "03-run-live")

    (gates / "go").touch()
    await expect(page.get_by_test_id("log")).to_contain_text("held: found it", timeout=30_000)
    await expect(page.get_by_test_id("log").locator("span.stderr")).to_contain_text("held: a warning")
    await expect(page.get_by_test_id("trace-state")).to_contain_text("Sealed trajectory", timeout=60_000)
    await expect(page.get_by_test_id("run-facts")).to_contain_text("pass")
    await expect(page.get_by_test_id("run-phase")).to_have_text(re.compile(r"^(judged|exported)$"))
    await expect(page.get_by_test_id("open-shell")).to_be_hidden()
    await expect(page.get_by_test_id("terminal-state")).to_have_attribute("data-state", "settled")
    await shot(page, "04-run-sealed")

    await page.goto(f"{p.stack.gateway_url}/#/batch/{batch_id}")
    await expect(page.get_by_test_id("summary")).to_contain_text("verdicts: 3 passed, 0 failed", timeout=60_000)
    await expect(page.locator('tr[data-case="held"]')).to_have_attribute("data-verdict", "pass")
    await shot(page, "05-batch-final")

    await page.click('header nav a[data-nav="batches"]')
    await expect(page.locator(f'tr[data-batch="{batch_id}"] [data-badge="succeeded"]')).to_be_visible()
    await page.click('header nav a[data-nav="online"]')
    await expect(page.locator("h1")).to_have_text("Online suites")
    await shot(page, "06-online")
    assert await csp_violations(page) == []
    await page.get_by_test_id("logout").click()
    await expect(page.get_by_test_id("login-error")).to_have_text("Logged out.")
    await page.close()


async def test_a_row_catches_up_with_the_stream_when_the_store_records_late(
    pipeline: Pipeline, browser: Browser, tmp_path: Path
) -> None:
    """The batch page hears of a stage from the stream and reads the row from the event store,
    which records it a moment later (seconds when the recorder is busy). Here the recorder is held
    on its advisory lock while case `a` is exported: the page reads a stale row. Once the recorder
    goes on, the row turns green with no further event of `a` (and no `batch.finalized`: `held`
    still runs). A page that read the row once per event kept it stale, or never showed it when the
    first read came before the run was recorded (so this test fails on it at the first row)."""
    p = pipeline
    page = await logged_in(browser, p)
    gates_a, gates_held = tmp_path / "a", tmp_path / "held"
    gates_a.mkdir()
    gates_held.mkdir()
    spec = BatchSpec(
        suite=SuiteSpec(
            id=f"late-{uuid.uuid4().hex[:6]}", cases=(phased_case("a", gates_a), phased_case("held", gates_held))
        ),
        harness=CommandHarness(id="live-agent", command=(sys.executable, str(LIVE_AGENT)), timeout_s=60),
    )
    batch_id = await p.submit(spec)
    await page.goto(f"{p.stack.gateway_url}/#/batch/{batch_id}")
    await expect(page.locator('tr[data-case="a"]')).to_be_visible(timeout=60_000)
    await wait_path(gates_a / "ready", timeout_s=60)
    await wait_path(gates_held / "ready", timeout_s=60)

    lock: asyncpg.Connection[asyncpg.Record] = await asyncpg.connect(p.database_url)
    try:
        await lock.execute("SELECT pg_advisory_lock($1)", RECORDER_LOCK)
        run_a = batch_run_id(batch_id, "a")
        reads: list[str] = []  # the page's reads of a's row
        page.on("response", lambda r: reads.append(r.url) if f"/v1/runs/{run_a}" in r.url else None)
        (gates_a / "go").touch()  # a runs to its export

        async def exported_on_stream() -> bool:
            return (await p.stream_counts(batch_id)).get((run_a, "case.exported"), 0) == 1

        await eventually(exported_on_stream, timeout_s=60, what="a's case.exported on the stream")
        before = len(reads)
        await eventually(lambda: len(reads) > before, timeout_s=30, what="the page reading a's row again")
        await expect(page.locator('tr[data-case="a"]')).to_have_attribute("data-verdict", "")
    finally:
        await lock.close()  # the recorder goes on
    await expect(page.locator('tr[data-case="a"]')).to_have_attribute("data-verdict", "pass", timeout=30_000)
    await expect(page.locator('tr[data-case="held"]')).to_have_attribute("data-verdict", "")
    (gates_held / "go").touch()
    await expect(page.locator('tr[data-case="held"]')).to_have_attribute("data-verdict", "pass", timeout=60_000)


async def test_a_cookie_session_cannot_write_without_the_csrf_header(pipeline: Pipeline) -> None:
    p = pipeline
    # unsafe=True: aiohttp's jar keeps cookies of IP-address hosts (127.0.0.1) only when told to
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.post(f"{p.stack.gateway_url}/ui/login", json={"token": p.stack.admin_token}) as resp:
            assert resp.status == 200
            cookie = resp.cookies["evalbus_session"]
            assert p.stack.admin_token not in cookie.value  # a signed session, not the token
            assert cookie["httponly"]
            assert cookie["samesite"] == "Strict"
        async with http.get(f"{p.stack.gateway_url}/v1/me") as resp:
            assert resp.status == 200
            assert (await resp.json())["principal"] == "admin"
        body = {"id": "x", "target": {"service": "s"}, "judges": [{"kind": "exact", "id": "e"}]}
        async with http.post(f"{p.stack.gateway_url}/v1/online/suites", json=body) as resp:
            assert resp.status == 403
            assert (await resp.json())["error"]["field"] == "X-Evalbus-Csrf"
        async with http.post(
            f"{p.stack.gateway_url}/v1/online/suites", json=body, headers={"X-Evalbus-Csrf": "1"}
        ) as resp:
            assert resp.status == 201
        async with http.post(f"{p.stack.gateway_url}/ui/logout") as resp:
            assert resp.status == 200
        async with http.get(f"{p.stack.gateway_url}/v1/me") as resp:
            assert resp.status == 401


async def test_an_online_suite_page_shows_its_scores_fates_and_chart(pipeline: Pipeline, browser: Browser) -> None:
    p = pipeline
    suite_id = f"web-{uuid.uuid4().hex[:6]}"
    headers = {"Authorization": f"Bearer {p.stack.admin_token}"}
    suite = {
        "id": suite_id,
        "target": {"service": "web-bot"},
        "judges": [{"kind": "regex", "id": "polite", "pattern": "(?i)thank"}],
    }
    async with aiohttp.ClientSession(headers=headers) as http:
        async with http.post(f"{p.stack.gateway_url}/v1/online/suites", json=suite) as resp:
            assert resp.status == 201
        traces = [uuid.uuid4().hex for _ in range(4)]

        async def export(trace_id: str, answer: str) -> None:
            span = {
                "traceId": trace_id,
                "spanId": uuid.uuid4().hex[:16],
                "name": "handle",
                "startTimeUnixNano": "1700000000000000000",
                "endTimeUnixNano": "1700000001000000000",
                "attributes": [{"key": "output.value", "value": {"stringValue": answer}}],
            }
            body = {
                "resourceSpans": [
                    {
                        "resource": {"attributes": [{"key": "service.name", "value": {"stringValue": "web-bot"}}]},
                        "scopeSpans": [{"spans": [span]}],
                    }
                ]
            }
            async with http.post(f"{p.stack.otlp_url}/v1/traces", json=body) as resp:
                assert resp.status == 200

        async def judged_count() -> int:
            count = await p.pool.fetchval(
                "SELECT count(*) FROM runs WHERE batch_id = $1 AND judged_status IS NOT NULL", f"online-{suite_id}"
            )
            return int(count)

        # the collector learns the suite from the stream: send polite probes, one at a time (each
        # waits for its own fate), until one is sampled for this suite
        async def fates_of(trace_id: str) -> list[dict[str, str]]:
            async with http.get(f"{p.stack.gateway_url}/v1/online/observations/{trace_id}") as resp:
                return list((await resp.json())["fates"])

        probes = 0
        while True:
            probe = uuid.uuid4().hex
            await export(probe, "Thank you!")

            async def decided(trace_id: str = probe) -> bool:
                return bool(await fates_of(trace_id))

            await eventually(decided, timeout_s=60, what="the probe's fate")
            probes += 1
            if any(f["suite_id"] == suite_id and f["fate"] == "sampled" for f in await fates_of(probe)):
                break
            assert probes < 20, "the collector never took the suite"
        sampled_probes = 1

        async def probe_judged() -> bool:
            return await judged_count() == sampled_probes

        await eventually(probe_judged, timeout_s=60, what="the sampled probe judged")
        probes = sampled_probes
        for trace_id, answer in zip(traces, ("Thank you", "Thanks a lot", "No.", "Thank you"), strict=True):
            await export(trace_id, answer)

        async def all_judged() -> bool:
            return await judged_count() == probes + len(traces)

        await eventually(all_judged, timeout_s=60, what="every trace judged")
    n = probes + len(traces)
    expected = f"{100 * (probes + 3) / n:.1f}% (n={n})"

    page = await logged_in(browser, p)
    await page.goto(f"{p.stack.gateway_url}/#/online")
    await page.locator(f'tr[data-suite="{suite_id}"] a').click()
    await expect(page.locator("h1")).to_have_text(f"Online suite {suite_id}")
    await expect(page.get_by_test_id("suite-facts")).to_contain_text("ratio 100.0%")  # the default ratio
    await expect(page.get_by_test_id("online-metrics")).to_contain_text("judge:polite")
    await expect(page.get_by_test_id("online-metrics")).to_contain_text(expected)
    chart = page.locator('svg[aria-label="pass rate by hour, last 24 h"]')
    await expect(chart.locator("polyline")).to_have_count(1)
    await expect(page.get_by_test_id("online-fates")).to_contain_text("judged")
    await expect(page.get_by_test_id("online-recent").locator("tbody tr")).to_have_count(min(n, 20))
    await shot(page, "07-online-suite")
    assert await csp_violations(page) == []
    await page.close()


def terminal_rows(page: Page, pattern: str) -> Locator:
    """The rows of the terminal widget (xterm.js's DOM renderer, one element per row) whose whole
    text matches `pattern`."""
    return page.locator('[data-testid="terminal"] .xterm-rows > div').filter(has_text=re.compile(rf"^\s*{pattern}\s*$"))


async def test_a_live_runs_screen_and_terminal_in_the_browser(
    pipeline: Pipeline, browser: Browser, tmp_path: Path
) -> None:
    p = pipeline
    ready, go = tmp_path / "ready", tmp_path / "go"
    task = {
        "chromium": ensure_chromium(),
        "profile": str(tmp_path / "profile"),
        "pages": [{"name": "work", "url": "data:text/html,<style>body{margin:0;background:rgb(255,0,0)}</style>work"}],
        "front": "work",
        "ready": str(ready),
        "go": str(go),
    }
    spec = BatchSpec(
        suite=SuiteSpec(id=f"dash-live-{uuid.uuid4().hex[:6]}", cases=(CaseSpec(id="browse", input=json.dumps(task)),)),
        harness=CommandHarness(id="browser-agent", command=(sys.executable, str(BROWSER_AGENT)), timeout_s=120),
    )
    batch_id = await p.submit(spec)
    run_id = f"evb-{batch_id}-browse"
    await wait_path(ready, timeout_s=60)
    page = await logged_in(browser, p)
    await page.goto(f"{p.stack.gateway_url}/#/run/{run_id}")

    # The screen: a frame of the harness's own browser, its work tab (red), decoded by the page.
    await expect(page.get_by_test_id("screen-state")).to_have_attribute("data-state", "live", timeout=30_000)
    frame = page.get_by_test_id("screen")
    await expect(frame).to_be_visible()
    await expect(frame).to_have_js_property("naturalWidth", 800)  # decoded by the page
    src = await frame.get_attribute("src")
    assert src is not None
    assert src.startswith("data:image/png;base64,")
    assert png_size_and_first_pixel(base64.b64decode(src.split(",", 1)[1]))[2] == (255, 0, 0)

    # The terminal: a persistent shell in the sandbox — the directory changed by one command is the
    # one the next command runs in.
    await page.get_by_test_id("open-shell").click()
    await expect(page.get_by_test_id("terminal-state")).to_have_attribute("data-state", "attached", timeout=30_000)
    await page.get_by_test_id("terminal").click()
    await page.keyboard.type("cd /tmp\n")
    await page.keyboard.type("pwd\n")
    await expect(terminal_rows(page, "/tmp")).to_have_count(1, timeout=20_000)
    # A narrower window refits the widget, and the resize reaches the shell's pseudo-terminal.
    widget = page.get_by_test_id("terminal")
    wide = await widget.get_attribute("data-cols")
    await page.set_viewport_size({"width": 900, "height": 900})
    await expect(widget).not_to_have_attribute("data-cols", wide or "")
    await page.keyboard.type("stty size\n")
    size = f"{await widget.get_attribute('data-rows')} {await widget.get_attribute('data-cols')}"
    await expect(terminal_rows(page, size)).to_have_count(1, timeout=20_000)
    await shot(page, "08-run-screen-terminal")
    # The reader closes it and opens another: a new shell, the old one's state gone with it.
    await page.get_by_test_id("close-shell").click()
    await expect(page.get_by_test_id("terminal-state")).to_have_text("Shell ended: the reader closed it.")
    await page.get_by_test_id("open-shell").click()
    await expect(page.get_by_test_id("terminal-state")).to_have_attribute("data-state", "attached", timeout=30_000)
    await page.keyboard.type("echo $((6 * 7)) $OLDPWD.\n")
    await expect(terminal_rows(page, "42 .")).to_have_count(1, timeout=20_000)

    # The run finishes: its sandbox is released, the shell ends with it, and the widget says so.
    go.touch()
    await expect(page.get_by_test_id("terminal-state")).to_have_attribute("data-state", "closed", timeout=60_000)
    await expect(page.get_by_test_id("terminal-state")).to_contain_text("the run's sandbox was released")
    await expect(page.get_by_test_id("screen-state")).to_have_attribute("data-state", "ended", timeout=60_000)
    await expect(page.get_by_test_id("open-shell")).to_be_hidden()
    await expect(page.get_by_test_id("terminal-state")).to_contain_text("the run's sandbox was released")
    # xterm.js rendered under the strict policy: its <style> elements carried the page's nonce
    assert await page.locator('[data-testid="terminal"] style').count() > 0
    assert await csp_violations(page) == []
    await shot(page, "09-run-terminal-released")
    await page.close()


ADDER = """\
import json, os, sys
task = json.loads(sys.stdin.read())
answer = task["a"] + 1
if os.environ.get("ADDER_BUG") == "1" and task["a"] >= 2:
    answer += 1  # the regression: off by one from 2 on
trial = os.environ["EVALBUS_RUN_ID"].rpartition("-t")[2]
if os.environ.get("ADDER_FLAKY") == "1" and task["a"] == 1 and trial.isdigit() and int(trial) % 2 == 0:
    answer += 1  # flaky: wrong on every other trial of one case
print("EVALBUS_RESULT " + json.dumps({"answer": str(answer)}), flush=True)
"""


GATES = ("verdicts.pass_rate >= 80%", RegressionGate(no_significant_regression=("verdicts",)), "counts.executed >= 8")


def adder_batch(suite_id: str, *, bug: bool = False, flaky: bool = False) -> BatchSpec:
    """Eight sums; with the bug, six of them are wrong (an exact McNemar p of 2/64 on verdicts),
    and its gates: a pass rate, no regression against the baseline, every case executed. Flaky: two
    of the sums, two trials each, one of them wrong on one trial."""
    cases = tuple(
        CaseSpec(
            id=f"add-{a}",
            input=json.dumps({"a": a}),
            expected=str(a + 1),
            graders=(AnswerMatchGrader(id="answer"),),
        )
        for a in range(2 if flaky else 8)
    )
    env = {"ADDER_BUG": "1" if bug else "0", "ADDER_FLAKY": "1" if flaky else "0"}
    harness = CommandHarness(id="adder", command=(sys.executable, "-c", ADDER), env=env, timeout_s=60)
    return BatchSpec(
        suite=SuiteSpec(id=suite_id, cases=cases),
        harness=harness,
        gates=GATES if bug else (),
        policy=BatchPolicy(trials=2 if flaky else 1),
    )


async def test_a_live_desktop_runs_screen_in_the_browser(pipeline: Pipeline, browser: Browser, tmp_path: Path) -> None:
    p = pipeline
    x11 = ensure_x11()
    ready, go = tmp_path / "ready", tmp_path / "go"
    task = {"xvfb": x11.xvfb, "xsetroot": x11.xsetroot, "colour": "#0000ff", "ready": str(ready), "go": str(go)}
    spec = BatchSpec(
        suite=SuiteSpec(id=f"dash-desk-{uuid.uuid4().hex[:6]}", cases=(CaseSpec(id="desk", input=json.dumps(task)),)),
        harness=CommandHarness(id="desktop-agent", command=(sys.executable, str(DESKTOP_AGENT)), timeout_s=120),
    )
    batch_id = await p.submit(spec)
    run_id = f"evb-{batch_id}-desk"
    await wait_path(ready, timeout_s=60)
    display = ready.read_text()
    page = await logged_in(browser, p)
    await page.goto(f"{p.stack.gateway_url}/#/run/{run_id}")

    # The same widget shows the X display's frame (an xwd dump the dispatcher turned into a PNG).
    await expect(page.get_by_test_id("run-phase")).to_have_text("running", timeout=30_000)
    await expect(page.get_by_test_id("screen-state")).to_have_attribute("data-state", "live", timeout=30_000)
    await expect(page.get_by_test_id("screen-state")).to_contain_text(f"Live screen of display {display} (320x200)")
    frame = page.get_by_test_id("screen")
    await expect(frame).to_have_js_property("naturalWidth", 320)  # decoded by the page
    src = await frame.get_attribute("src")
    assert src is not None
    assert decode_png(base64.b64decode(src.split(",", 1)[1])).colours() == {(0, 0, 255)}
    await shot(page, "10-run-desktop-screen")

    go.touch()
    await expect(page.get_by_test_id("screen-state")).to_have_attribute("data-state", "ended", timeout=60_000)
    await expect(page.get_by_test_id("run-phase")).to_have_text(re.compile(r"^(executed|judged|exported)$"))
    assert await csp_violations(page) == []
    await page.close()


async def test_the_compare_page_shows_a_regression_against_the_baseline(pipeline: Pipeline, browser: Browser) -> None:
    p = pipeline
    suite_id = f"dash-adder-{uuid.uuid4().hex[:6]}"
    good = await p.submit(adder_batch(suite_id))
    buggy = await p.submit(adder_batch(suite_id, bug=True))
    flaky = await p.submit(adder_batch(suite_id, flaky=True))
    for batch_id in (good, buggy, flaky):
        await p.finalized(batch_id)

    page = await logged_in(browser, p)
    # The good batch becomes its suite's baseline from its page.
    await page.goto(f"{p.stack.gateway_url}/#/batch/{good}")
    await expect(page.get_by_test_id("baseline")).to_contain_text("the suite has no baseline")
    await page.get_by_test_id("make-baseline").click()
    await expect(page.get_by_test_id("baseline")).to_contain_text(f"of suite {suite_id}, set by admin")

    # The buggy batch's page links to its comparison with that baseline.
    await page.goto(f"{p.stack.gateway_url}/#/batch/{buggy}")
    await page.get_by_test_id("compare-link").click()
    verdict = page.get_by_test_id("compare-verdict")
    await expect(verdict).to_have_attribute("data-regressed", "verdicts,answer_match")
    await expect(page.locator(".sub").first).to_contain_text(f"against its suite's baseline {good}")
    row = page.locator('[data-testid="compare-metrics"] tr[data-metric="verdicts"]')
    await expect(row).to_have_attribute("data-change", "regressed")
    # base 100 %, candidate 25 %: −75 points, exact McNemar on 6 discordant pairs (p = 2/64)
    await expect(row).to_contain_text("100.0%25.0%−75.0 pp")
    await expect(row).to_contain_text("mcnemar0.031")
    await expect(
        page.locator('svg[aria-label="rate deltas with 95% intervals"] line[data-metric="verdicts"]')
    ).to_have_count(1)
    regressed = page.get_by_test_id("cases-regressed").locator("tbody tr")
    await expect(regressed).to_have_count(6)
    add2 = page.get_by_test_id("cases-regressed").locator('tr[data-case="add-2"] td')
    await expect(add2.nth(1)).to_contain_text("pass 3")  # the base's verdict and answer
    await expect(add2.nth(2)).to_contain_text("fail 4")  # the candidate's
    await expect(page.get_by_test_id("flaky")).to_contain_text("Each case ran once")
    # The candidate's gates, decided as `evalbus run` decides them.
    gates = page.get_by_test_id("gates")
    await expect(gates.locator('tr[data-passed="false"]')).to_have_count(2)
    await expect(gates.locator('tr[data-gate="verdicts.pass_rate >= 80%"]')).to_contain_text("fail0.250")
    await expect(gates.locator('tr[data-gate="no_significant_regression: verdicts"]')).to_contain_text("verdicts")
    await expect(gates.locator('tr[data-gate="counts.executed >= 8"]')).to_contain_text("pass8")
    await shot(page, "10-compare")

    # Each regressed case leads to both trajectories side by side.
    await page.get_by_test_id("cases-regressed").locator('tr[data-case="add-2"] [data-testid="side-by-side"]').click()
    await expect(page.get_by_test_id("pair-base")).to_contain_text(f"evb-{good}-add-2")
    await expect(page.get_by_test_id("pair-base")).to_contain_text("answer3")
    await expect(page.get_by_test_id("pair-candidate")).to_contain_text(f"evb-{buggy}-add-2")
    await expect(page.get_by_test_id("pair-candidate")).to_contain_text("answer4")
    await expect(page.get_by_test_id("pair-candidate").locator('[data-badge="fail"]')).to_be_visible()
    await shot(page, "11-compare-side-by-side")
    assert await csp_violations(page) == []

    # Two batches picked on the page: a batch with trials lists its flaky case.
    await page.click('header nav a[data-nav="compare"]')
    await page.get_by_test_id("pick-candidate").select_option(flaky)
    await page.get_by_test_id("pick-base").select_option(good)
    await page.get_by_test_id("compare").click()
    await expect(page.get_by_test_id("flaky")).to_contain_text(f"candidate ({flaky})1 flaky: add-1")
    await expect(page.get_by_test_id("flaky")).to_contain_text(f"base ({good})no trials")
    await expect(page.get_by_test_id("gates")).to_have_text("The candidate declares no gates.")
    await expect(page.locator("main")).not_to_contain_text("null")
    await shot(page, "12-compare-flaky")

    # Against a base nobody can see, the page says why instead of comparing.
    await page.goto(f"{p.stack.gateway_url}/#/compare?candidate={buggy}&base=nope-{uuid.uuid4().hex[:6]}")
    await expect(page.get_by_test_id("compare-error")).to_contain_text("no batch")
    await page.close()


async def test_the_page_mints_a_style_nonce_per_load_and_assets_revalidate(pipeline: Pipeline) -> None:
    base = pipeline.stack.gateway_url
    async with aiohttp.ClientSession() as http:
        nonces = []
        for _ in range(2):
            async with http.get(f"{base}/") as resp:
                assert resp.status == 200
                policy = resp.headers["Content-Security-Policy"]
                found = re.search(r"style-src 'self' 'nonce-([A-Za-z0-9_-]+)';", policy)
                assert found is not None, policy
                assert "unsafe-inline" not in policy
                assert f'nonce="{found[1]}"' in await resp.text()
                nonces.append(found[1])
        assert nonces[0] != nonces[1]

        async with http.get(f"{base}/ui/assets/xterm.js", headers={"Accept-Encoding": "gzip"}) as resp:
            assert resp.status == 200
            assert resp.headers["Content-Encoding"] == "gzip"
            etag = resp.headers["ETag"]
            assert "class" in await resp.text()  # decompressed by the client
        async with http.get(f"{base}/ui/assets/xterm.js", headers={"If-None-Match": etag}) as resp:
            assert resp.status == 304
            assert await resp.read() == b""
        async with http.get(f"{base}/ui/assets/app.js", headers={"If-None-Match": etag}) as resp:
            assert resp.status == 200  # another asset, another digest
        async with http.get(f"{base}/ui/assets/xterm.js.map") as resp:
            assert resp.status == 404
            assert (await resp.json())["error"]["field"] == "name"
