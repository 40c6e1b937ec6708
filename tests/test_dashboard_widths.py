"""The dashboard read in an 800 px window (a laptop's half screen) and a 1400 px one, in a real headless Chromium
while a real job trains (3 workers, one slowed), one render at a time (``<body data-polls>``):

- every column header of the workers table lies inside the window and inside the table's box (nothing hidden
  behind a sideways scroll), and neither table nor the page scrolls sideways;
- every visible text is at least 11 px on screen (an SVG label's computed size times the SVG's scale);
- a worker name is never broken across lines (names hold hyphens); no e-notation anywhere ("0.5 ms ago");
- the loss chart's log toggle: its tick labels sit on a log scale, then (unticked) on a linear one; the choice
  survives a reload (localStorage); a curve with a loss <= 0 is drawn linear and the caption says why;
- the current round's awaited names equal the table's awaited rows at every render, while the page's
  ``/v1/workers`` request is held until a later round than its ``/v1/status`` (what a round closing between the
  page's requests does now and then, made certain: the two answers then tell different rounds).

The page's clock (Playwright's) runs as the real one, but jumps over the second between a render and the next poll
whenever the test waits for a render: the renders it checks come as fast as the PS answers.

Screenshots at both widths are kept in the test's tmp dir (the path is printed)."""
from __future__ import annotations

import math
import re

from cluster.processes import LocalCluster, wait_for
from tests.test_dashboard import LAYOUT_JS, chromium, dashboard_page  # noqa: F401 (a fixture)
from tests.timing import allow

WIDTHS, HEIGHT = (800, 1400), 900
WORKERS = {"syncps-worker-10": 0.01, "syncps-worker-11": 0.06, "syncps-worker-12": 0.03}  # name: compute delay
RENDERS = 6  # renders checked at each width for the awaited names
POLL_MS = 1000  # dashboard.js's wait between a poll's answers and the next poll
MIN_PX = 11
E_NOTATION = re.compile(r"\d(\.\d+)?e[-+]?\d", re.I)
LAST_SEEN = re.compile(r"(< 0\.1 ms|\d+(\.\d)? ms|\d+(\.\d)? s|\d+ min|\d+ h \d+ min|\d+ d \d+ h) ago")
SUPERSCRIPT = str.maketrans("\u207b\u2070\u00b9\u00b2\u00b3\u2074\u2075\u2076\u2077\u2078\u2079", "-0123456789")

# One render, read at once (the page renders a poll's four answers in one task).
PAGE_JS = """() => {
  const rect = (el) => { const b = el.getBoundingClientRect(); return {left: b.left, right: b.right}; };
  const lines = (el) => { const r = document.createRange(); r.selectNodeContents(el);
                          return new Set([...r.getClientRects()].map((x) => Math.round(x.top))).size; };
  const small = [], texts = [];
  const walk = document.createTreeWalker(document.body, NodeFilter.SHOW_TEXT);
  for (let n = walk.nextNode(); n; n = walk.nextNode()) {
    const el = n.parentElement, text = n.textContent.trim();
    if (!text || el.closest("script") || !el.getClientRects().length) continue;  // hidden: display none
    texts.push(text);
    let px = parseFloat(getComputedStyle(el).fontSize);
    if (el instanceof SVGElement) { const m = el.getScreenCTM(); px *= Math.min(Math.abs(m.a), Math.abs(m.d)); }
    if (px < %(min)s) small.push([el.tagName, text.slice(0, 40), px]);
  }
  const table = document.getElementById("workers");
  return {
    polls: Number(document.body.dataset.polls || 0), viewport: innerWidth, box: rect(table.parentElement),
    headers: [...table.tHead.querySelectorAll("th")].map((th) => ({text: th.innerText, ...rect(th)})),
    small, texts,
    brokenNames: [...document.querySelectorAll(".name")].filter((el) => el.getClientRects().length && lines(el) > 1)
                   .map((el) => el.textContent),
    lineAwaited: [...document.querySelectorAll("#round-info .awaited .name")].map((el) => el.textContent),
    rowsAwaited: [...table.querySelectorAll("tbody tr.awaited")].map((tr) => tr.dataset.name),
    lastSeen: [...table.querySelectorAll("tbody td:nth-child(17)")].map((td) => td.textContent),
  };
}""" % {"min": MIN_PX}

LOSS_JS = """() => { const svg = document.getElementById("loss-plot");
  return {scale: svg.dataset.scale, points: Number(svg.dataset.points),
          checked: document.getElementById("loss-log").checked, note: document.getElementById("loss-scale").textContent,
          path: svg.querySelector("path")?.getAttribute("d"),
          ticks: [...svg.querySelectorAll("text.y")].map((t) => [t.textContent, Number(t.getAttribute("y"))])}; }"""


def number(label: str) -> float:
    """A tick label as the page writes it ("1.5×10⁻⁶", "0.25", "12,000") as a float."""
    if "\u00d710" in label:
        mantissa, exponent = label.split("\u00d710")
        return float(mantissa) * 10 ** int(exponent.translate(SUPERSCRIPT))
    return float(label.replace(",", ""))


def placed_by(ticks: list, log: bool) -> bool:
    """Do the tick labels sit at heights linear in log10(value) (``log``; labels > 0 only) or in the value, to the
    pixel? Needs three ticks to tell."""
    values = [(number(label), y) for label, y in ticks]
    pts = sorted((math.log10(v), y) if log else (v, y) for v, y in values if v > 0 or not log)
    (v0, y0), (v1, y1) = pts[0], pts[-1]
    assert len(pts) >= 3 and v1 > v0, ticks
    return all(abs(y0 + (v - v0) * (y1 - y0) / (v1 - v0) - y) < 1.5 for v, y in pts)


def next_render(page, after: int) -> dict:
    """The page as rendered by a poll answered after render ``after``. The page's clock jumps over the wait before its
    next poll (POLL_MS, dashboard.js): that poll starts at once, instead of up to a second later."""
    page.clock.fast_forward(POLL_MS)
    wait_for(lambda: page.evaluate("() => Number(document.body.dataset.polls || 0)") > after, allow(30),
             "the next render")
    return page.evaluate(PAGE_JS)


def check_width(page, width: int, shot) -> list[list[str]]:
    """Every check of one window width; the awaited names seen at each render."""
    page.set_viewport_size({"width": width, "height": HEIGHT})
    now = next_render(page, page.evaluate(PAGE_JS)["polls"])  # drawn at this width (and redrawn by the resize)
    seen = []
    for _ in range(RENDERS):
        now = next_render(page, now["polls"])
        assert sorted(now["lineAwaited"]) == sorted(now["rowsAwaited"]), (width, now["lineAwaited"], now["rowsAwaited"])
        seen.append(now["lineAwaited"])
    page.screenshot(path=str(shot), full_page=True)
    print(f"\ndashboard screenshot at {width} px: {shot}")
    assert now["viewport"] == width
    box = now["box"]
    assert box["right"] <= width, (width, box)
    inside = lambda h: max(0, box["left"]) <= h["left"] and h["right"] <= min(width, box["right"]) + 0.5  # noqa: E731
    hidden = [h for h in now["headers"] if not inside(h)]
    assert not hidden and len(now["headers"]) == 20, (width, hidden)
    assert now["small"] == [], (width, now["small"])
    assert now["brokenNames"] == [], (width, now["brokenNames"])
    assert [t for t in now["texts"] if E_NOTATION.search(t)] == [], width
    seen_ago = now["lastSeen"]
    assert len(seen_ago) == len(WORKERS) and all(LAST_SEEN.fullmatch(v) for v in seen_ago), seen_ago
    layout = page.evaluate(LAYOUT_JS)
    assert layout["docScroll"] <= width and layout["bodyScroll"] <= width, layout
    for t in ("workers", "rounds"):
        assert layout[t]["right"] <= width and layout[t]["scroll"] <= layout[t]["client"], (width, t, layout)
    return seen


def later_round(c: LocalCluster):
    """A route handler: the request goes on to the PS only once two more rounds have closed."""
    def handler(route):
        step = c.status()["global_step"]
        wait_for(lambda: c.status()["global_step"] > step + 1, allow(30), "two more rounds")
        route.continue_()
    return handler


def check_log_toggle(page) -> None:
    """Log by default (a fresh browser), linear when unticked, the choice kept across a reload, log again."""
    log = page.evaluate(LOSS_JS)
    assert log["checked"] and log["scale"] == "log" and log["note"] == "", log
    assert placed_by(log["ticks"], True) and not placed_by(log["ticks"], False), log["ticks"]
    page.click("#loss-log")
    linear = page.evaluate(LOSS_JS)
    assert not linear["checked"] and linear["scale"] == "linear" and linear["path"] != log["path"], linear
    assert placed_by(linear["ticks"], False), linear["ticks"]  # evenly spaced values: not log
    page.reload(wait_until="load")
    wait_for(lambda: page.evaluate(LOSS_JS)["points"] >= 2, allow(30), "the loss curve after a reload")
    kept = page.evaluate(LOSS_JS)
    assert not kept["checked"] and kept["scale"] == "linear", kept
    page.click("#loss-log")
    assert page.evaluate(LOSS_JS)["scale"] == "log"


def check_nonpositive_loss(page) -> None:
    """The PS's real loss curve with its first loss made 0: log is impossible, so linear, and the caption says so."""
    def zero_first(route):
        body = route.fetch().json()
        body["loss"][:1] = [0.0] * len(body["loss"][:1])
        route.fulfill(json=body)

    page.route("**/v1/loss*", zero_first)
    page.reload(wait_until="load")
    wait_for(lambda: page.evaluate(LOSS_JS)["points"] >= 2, allow(30), "the loss curve with a zero")
    curve = page.evaluate(LOSS_JS)
    assert curve["checked"] and curve["scale"] == "linear" and "log impossible" in curve["note"], curve
    page.unroute("**/v1/loss*")


def test_dashboard_reads_at_800_and_1400px(chromium, tmp_path):  # noqa: F811
    c = LocalCluster(len(WORKERS), ps_env={"PS_MAX_STEPS": 1_000_000, "PS_STARTUP_GRACE_SECONDS": 0},
                     worker_env={"WORKER_LOG_EVERY_SECONDS": 60})
    errors: list[str] = []
    try:
        c.start_ps()
        for i, (name, delay) in enumerate(WORKERS.items()):
            c.start_worker(i, env={"WORKER_NAME": name, "WORKER_COMPUTE_DELAY_SECONDS": delay})
        wait_for(lambda: c.status()["global_step"] >= 20, allow(60), "training")
        with dashboard_page(chromium, errors) as page:
            page.clock.install()  # its time goes on as the real one, and next_render makes it jump
            page.set_viewport_size({"width": WIDTHS[0], "height": HEIGHT})
            page.goto(f"{c.url}/", wait_until="load")
            wait_for(lambda: page.evaluate(LOSS_JS)["points"] >= 20, allow(30), "a loss curve")
            wait_for(lambda: page.locator("#workers tbody tr").count() == len(WORKERS), allow(30), "the workers")
            check_log_toggle(page)
            page.route("**/v1/workers", later_round(c))
            seen = [names for w in WIDTHS for names in check_width(page, w, tmp_path / f"dashboard-{w}px.png")]
            page.unroute_all(behavior="wait")  # a held request finishes before the reload below
            check_nonpositive_loss(page)
    finally:
        c.stop()
    # a reload aborts the poll in flight: not an error of the page
    assert [e for e in errors if "net::ERR_ABORTED" not in e] == [], errors
    assert any(seen) and {n for names in seen for n in names} <= set(WORKERS), seen
