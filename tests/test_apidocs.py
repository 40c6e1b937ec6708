"""The API docs pages (``/docs``: Swagger UI, ``/redoc``: ReDoc) work with no internet: their scripts come from
the PS (the fastapi-offline package), not a CDN. Checked in a real headless Chromium that may reach nothing but
the PS: every route of the schema is listed on the page. (ReDoc's sidebar asks cdn.redoc.ly for its own small
logo: offline that image is missing, nothing else.)"""
from __future__ import annotations

import re

import httpx

from cluster.processes import LocalCluster, wait_for
from tests.test_dashboard import chromium, dashboard_page  # noqa: F401 (a fixture)
from tests.timing import allow


def _routes(url: str) -> set[str]:
    spec = httpx.get(f"{url}/openapi.json", timeout=allow(10)).json()
    return {p for p in spec["paths"] if p.startswith("/v1/")}


def test_docs_pages_name_no_other_host():
    c = LocalCluster(1)
    try:
        c.start_ps()
        for page in ("/docs", "/redoc"):
            r = httpx.get(f"{c.url}{page}", timeout=allow(10))
            assert r.status_code == 200
            assert not re.findall(r"(?:src|href)=\"(?:https?:)?//", r.text), (page, r.text)
            for asset in re.findall(r"(?:src|href)=\"(/[^\"]+)\"", r.text) + re.findall(r"url: '(/[^']+)'", r.text):
                assert httpx.get(f"{c.url}{asset}", timeout=allow(10)).status_code == 200, asset
    finally:
        c.stop()


def test_swagger_ui_and_redoc_render_offline(chromium):  # noqa: F811
    c = LocalCluster(1)
    try:
        c.start_ps()
        routes = _routes(c.url)
        assert {"/v1/gradients", "/v1/model", "/v1/workers", "/v1/status"} <= routes
        errors: list[str] = []
        with dashboard_page(chromium, errors) as page:
            # the browser reaches the PS and nothing else: a CDN asked for fails the page
            page.route(re.compile(r"^(?!" + re.escape(c.url) + r"/).*"),
                       lambda route: (errors.append(f"outside request: {route.request.url}"), route.abort()))
            page.goto(f"{c.url}/docs", wait_until="load")
            shown = lambda: {p.strip() for p in page.locator(".opblock-summary-path").all_text_contents()}  # noqa: E731
            wait_for(lambda: routes <= {p.replace("\u200b", "") for p in shown()}, allow(30), "every route on /docs")
            page.goto(f"{c.url}/redoc", wait_until="load")
            wait_for(lambda: "/v1/gradients" in (page.text_content("body") or ""), allow(30), "the routes on /redoc")
    finally:
        c.stop()
    redoc_logo = "https://cdn.redoc.ly/redoc/logo-mini.svg"
    # net::ERR_ABORTED: the browser dropped a request of /docs (its favicon, once in CI) when the test went on to
    # /redoc; a request the PS failed is another error
    assert [e for e in errors if redoc_logo not in e and "Failed to load resource" not in e
            and not e.endswith("net::ERR_ABORTED")] == [], errors
