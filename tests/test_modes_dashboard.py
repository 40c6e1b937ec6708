"""The dashboard in ssp mode, in a real headless Chromium while a real job trains (one worker slowed): the mode,
the worker clocks card (slowest..fastest, the spread within s + 1, staleness percentiles), each worker's clock
and mean staleness in the table, no console errors, and the page still fits 1280 px."""
from __future__ import annotations

import re

from cluster.processes import LocalCluster, wait_for
from tests.test_dashboard import LAYOUT_JS, WIDTH, chromium, dashboard_page  # noqa: F401
from tests.timing import allow

BOUND = 2
NUMBER = r"-|[0-9]+(\.[0-9]+)?(×10⁻?[⁰¹²³⁴⁵⁶⁷⁸⁹]+)?"  # a number as the page writes it: 0.25, 3×10⁻⁴


def test_dashboard_shows_clocks_spread_and_staleness_in_ssp(chromium):  # noqa: F811
    c = LocalCluster(2, ps_env={"PS_MODE": "ssp", "PS_SSP_STALENESS": BOUND, "PS_STARTUP_GRACE_SECONDS": 0},
                     worker_env={"WORKER_LOG_EVERY_SECONDS": 60, "WORKER_SHM_DIR": ""})
    errors: list[str] = []
    try:
        c.start_ps()
        c.start_worker(0)
        c.start_worker(1, env={"WORKER_COMPUTE_DELAY_SECONDS": 0.05})
        wait_for(lambda: c.status()["staleness"]["applied"] > 10, allow(60), "training")
        with dashboard_page(chromium, errors, failed_requests=False) as page:
            page.goto(f"{c.url}/", wait_until="load")
            wait_for(lambda: re.fullmatch(r"\d+\.\.\d+", page.text_content("#clocks") or ""), allow(15),
                     "the clocks card")
            assert page.text_content("#mode") == f"ssp, s = {BOUND}"
            lo, hi = map(int, page.text_content("#clocks").split(".."))
            assert 0 <= hi - lo <= BOUND + 1
            detail = page.text_content("#clocks-detail")
            spread = int(re.match(r"spread (\d+) \(max (\d+)\)", detail).group(2))
            assert spread <= BOUND + 1 and "staleness p50" in detail
            # columns: rank, name, state, via, last step, clock, staleness
            clocks = page.locator("#workers tbody tr td:nth-child(6)").all_text_contents()
            assert len(clocks) == 2 and all(re.fullmatch(r"\d+( \(waits\))?", v) for v in clocks), clocks
            stale = page.locator("#workers tbody tr td:nth-child(7)").all_text_contents()
            assert all(re.fullmatch(NUMBER, v) for v in stale), stale
            layout = page.evaluate(LAYOUT_JS)
    finally:
        c.stop()
    assert errors == [], errors
    assert layout["docScroll"] <= WIDTH and layout["workers"]["right"] <= WIDTH, layout
