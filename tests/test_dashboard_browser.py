"""The web dashboard in real headless Chromium (Debian's `chromium`, driven by Playwright for Python
through `executable_path`; Playwright's own browser download is never used): log in with a token,
watch a batch's cases turn green live, open a running run and read its live log and trace, see it
sealed, read the summary and the online page. Screenshots go to `.test-artifacts/dashboard/`.

The services are real processes (`open_pipeline`). Chromium is installed with apt by
`evalbus.testing.chromium.ensure_chromium` when it is missing and this runs as root; a run that
cannot get it fails — it never skips.
"""

from __future__ import annotations

import json
import sys
import uuid
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from playwright.async_api import Browser, Page, async_playwright, expect

from evalbus.testing.chromium import ensure_chromium
from evalbus.testing.pipeline import Pipeline, eventually, open_pipeline, wait_path
from evalbus_contracts import AnswerMatchGrader, BatchSpec, CaseSpec, CommandHarness, SuiteSpec

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[1]
LIVE_AGENT = ROOT / "tests" / "harnesses" / "live_agent.py"
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


async def logged_in(browser: Browser, p: Pipeline) -> Page:
    page = await browser.new_page(viewport={"width": 1300, "height": 900})
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

    await page.locator('tr[data-case="held"] a').click()
    await expect(page.get_by_test_id("log")).to_contain_text("held: searching the archive", timeout=30_000)
    await expect(page.locator('[data-testid="trace"] li[data-kind="tool_call"]')).to_have_count(2, timeout=30_000)
    await expect(page.get_by_test_id("trace-state")).to_have_text("Live trace")
    await shot(page, "03-run-live")

    (gates / "go").touch()
    await expect(page.get_by_test_id("log")).to_contain_text("held: found it", timeout=30_000)
    await expect(page.get_by_test_id("log").locator("span.stderr")).to_contain_text("held: a warning")
    await expect(page.get_by_test_id("trace-state")).to_contain_text("Sealed trajectory", timeout=60_000)
    await expect(page.get_by_test_id("run-facts")).to_contain_text("pass")
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
    await page.get_by_test_id("logout").click()
    await expect(page.get_by_test_id("login-error")).to_have_text("Logged out.")
    await page.close()


async def test_a_cookie_session_cannot_write_without_the_csrf_header(pipeline: Pipeline) -> None:
    p = pipeline
    # unsafe=True: aiohttp's jar keeps cookies of IP-address hosts (127.0.0.1) only when told to
    async with aiohttp.ClientSession(cookie_jar=aiohttp.CookieJar(unsafe=True)) as http:
        async with http.post(f"{p.stack.gateway_url}/ui/login", json={"token": p.stack.admin_token}) as resp:
            assert resp.status == 200
            cookie = resp.cookies["evalbus_session"]
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
    await page.close()
