"""The dashboard (``GET /``) in a real headless Chromium (Debian's, driven by Playwright) while a real job
trains: no console errors, the current step shown, the loss plot growing, the straggler highlighted, and
the page fits a 1280 px window (no sideways scrolling, the workers table inside the page, the straggler's
name on one line), checked on the live page and kept as a screenshot in the test's tmp dir."""
from __future__ import annotations

import os
import shutil
from contextlib import contextmanager

import pytest

from cluster.processes import LocalCluster, wait_for
from tests.conftest import degraded
from tests.timing import allow

CHROMIUM = os.environ.get("SYNCPS_CHROMIUM") or shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
         "--disable-background-networking", "--disable-component-update", "--disable-sync"]
WIDTH, HEIGHT = 1280, 800
# names as Compose gives them (docker-compose.yml: the container's name): the widest a user sees
FAST, SLOW = "syncps-worker-10", "syncps-worker-11"

try:
    from playwright.sync_api import sync_playwright
except ImportError as exc:  # pragma: no cover - depends on the machine
    sync_playwright = None
    MISSING = f"the Python package playwright is not installed ({exc})"
else:
    MISSING = None if CHROMIUM else "no chromium binary (Debian package 'chromium'; .ci/run installs it)"

# Measured in the page: what sticks out of a 1280 px window.
LAYOUT_JS = """() => {
  const box = (el) => el.getBoundingClientRect();
  const lines = (el) => { const r = document.createRange(); r.selectNodeContents(el);
                          return new Set([...r.getClientRects()].map((x) => Math.round(x.top))).size; };
  const table = (id) => { const t = document.getElementById(id);
                          return {right: box(t).right, scroll: t.parentElement.scrollWidth,
                                  client: t.parentElement.clientWidth}; };
  const s = document.getElementById("straggler");
  return {
    viewport: window.innerWidth,
    docScroll: document.documentElement.scrollWidth,
    bodyScroll: document.body.scrollWidth,
    workers: table("workers"), rounds: table("rounds"),
    straggler: {text: s.textContent, lines: lines(s), scroll: s.scrollWidth, client: s.clientWidth},
  };
}"""


@contextmanager
def dashboard_page(chromium: str, errors: list[str], failed_requests: bool = True):
    """A page of a headless Chromium, WIDTH x HEIGHT, that appends console errors, page errors and (if
    ``failed_requests``) failed requests to ``errors``; the browser closes on exit."""
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=chromium, args=FLAGS, timeout=allow(60) * 1000)
        try:
            page = browser.new_page(viewport={"width": WIDTH, "height": HEIGHT})
            page.set_default_timeout(allow(15) * 1000)
            page.on("console", lambda m: errors.append(f"console {m.type}: {m.text}") if m.type == "error" else None)
            page.on("pageerror", lambda e: errors.append(f"page error: {e}"))
            if failed_requests:
                page.on("requestfailed", lambda r: errors.append(f"request failed: {r.url} {r.failure}"))
            yield page
        finally:
            browser.close()


@pytest.fixture
def chromium():
    if MISSING:
        degraded("dashboard in a browser (test_dashboard.py)", f"skipped: {MISSING}")
        pytest.skip(f"DASHBOARD TEST SKIPPED: {MISSING}")
    return CHROMIUM


def test_dashboard_shows_live_training_and_fits_1280px(chromium, tmp_path):
    c = LocalCluster(2, ps_env={"PS_MAX_STEPS": 100000, "PS_STARTUP_GRACE_SECONDS": 0},
                     worker_env={"WORKER_COMPUTE_DELAY_SECONDS": 0.01, "WORKER_LOG_EVERY_SECONDS": 60})
    errors: list[str] = []
    shot = tmp_path / f"dashboard-{WIDTH}px.png"
    try:
        c.start_ps()
        with dashboard_page(chromium, errors) as page:
            page.goto(f"{c.url}/", wait_until="load")
            assert page.title() == "syncps parameter server"
            wait_for(lambda: page.text_content("#state") == "waiting for model", allow(15),
                     "the page to show the job state")
            assert page.text_content("#step") == "0"

            c.start_worker(0, env={"WORKER_NAME": FAST})
            c.start_worker(1, env={"WORKER_NAME": SLOW, "WORKER_COMPUTE_DELAY_SECONDS": 0.08})  # the straggler
            step = lambda: int(page.text_content("#step"))  # noqa: E731
            wait_for(lambda: page.text_content("#state") == "training" and step() > 0, allow(60),
                     "training on the page")
            points = lambda: int(page.get_attribute("#loss-plot", "data-points"))  # noqa: E731
            wait_for(lambda: points() >= 2, allow(30), "a loss curve")
            first_points, first_path, first_step = points(), page.get_attribute("#loss-plot path", "d"), step()
            # the page polls once a second: the curve and the step move on while training runs
            wait_for(lambda: points() > first_points and step() > first_step, allow(30), "the plot to update")
            assert page.get_attribute("#loss-plot path", "d") != first_path
            now = c.status()["global_step"]
            assert 0 <= now - step() < 100  # the current step: at most a poll (1 s of rounds) behind
            wait_for(lambda: page.get_attribute("#workers tr.straggler", "data-name") == SLOW, allow(30),
                     "the straggler row to be highlighted")
            assert page.locator("#workers tbody tr").count() == 2
            assert page.locator("#workers tbody tr td:nth-child(4)").all_text_contents() == ["shm", "shm"]
            assert float(page.text_content("#rps")) > 0
            assert int(page.get_attribute("#rate-plot", "data-points")) >= 2
            assert page.text_content("#straggler") == SLOW
            wait_for(lambda: page.locator("#rounds tbody tr").count() == 10, allow(30), "the last 10 rounds listed")

            page.screenshot(path=str(shot), full_page=True)
            print(f"\ndashboard screenshot at {WIDTH} px: {shot}")
            layout = page.evaluate(LAYOUT_JS)
    finally:
        c.stop()
    assert errors == [], errors
    assert shot.stat().st_size > 10_000
    # Fits the window: nothing scrolls sideways, the tables end inside the page.
    assert layout["viewport"] == WIDTH
    assert layout["docScroll"] <= WIDTH and layout["bodyScroll"] <= WIDTH, layout
    for t in ("workers", "rounds"):
        assert layout[t]["right"] <= WIDTH and layout[t]["scroll"] <= layout[t]["client"], (t, layout)
    # The straggler card shows the whole name on one line.
    s = layout["straggler"]
    assert s["text"] == SLOW and s["lines"] == 1 and s["scroll"] <= s["client"], s


def test_the_page_and_its_assets_are_served_as_they_are_with_their_types_and_never_cached():
    from ps_service.dashboard import STATIC
    from tests.live_ps import live_ps

    with live_ps() as ps, ps.http() as h:
        for path, kind, file in (("/", "text/html", "dashboard.html"), ("/dashboard.js", "text/javascript", None),
                                 ("/dashboard.css", "text/css", None)):
            r = h.get(path, params={"name": "dashboard.html"})  # (no route takes a parameter)
            assert r.status_code == 200 and r.headers["content-type"].startswith(kind), (path, r.headers)
            assert r.headers["cache-control"] == "no-cache"
            assert r.content == (STATIC / (file or path[1:])).read_bytes()
