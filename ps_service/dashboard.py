"""The live dashboard: ``GET /`` serves one static page that polls the monitoring API.

The page (``static/dashboard.html``, ``.js``, ``.css``; plain SVG, no CDN, no build step) reads ``/v1/status``,
``/v1/workers``, ``/v1/rounds`` and ``/v1/loss`` once a second; its files are read once, at import. What it shows and
promises (every column in view from 800 px, text >= 11 px, no e-notation, the loss on a remembered log/linear scale,
the awaited workers from one ``/v1/status`` answer): tests/test_dashboard_widths.py. With ``PS_MONITOR_TOKEN`` set,
the script sends the token of the page's ``#token=<token>`` fragment (never sent by the browser) as a bearer header;
the page and its files hold no data and are open.
"""
from __future__ import annotations

from pathlib import Path

from fastapi import APIRouter
from fastapi.responses import Response

STATIC = Path(__file__).parent / "static"
FILES = {
    "dashboard.html": "text/html; charset=utf-8",
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
}
_CONTENT = {name: (STATIC / name).read_bytes() for name in FILES}

router = APIRouter(tags=["monitoring"])


def _file(name: str):
    async def serve() -> Response:
        return Response(_CONTENT[name], media_type=FILES[name], headers={"Cache-Control": "no-cache"})
    return serve


router.add_api_route("/", _file("dashboard.html"), name="index", response_class=Response,
                     responses={200: {"content": {"text/html": {}}}}, description="The live dashboard (HTML): job "
                     "state, step, loss curve, rounds/s, workers with the straggler highlighted.")
for _name in ("dashboard.js", "dashboard.css"):
    router.add_api_route(f"/{_name}", _file(_name), include_in_schema=False)
