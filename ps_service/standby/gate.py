"""The pair's gate (ASGI middleware, only when ``PS_ROLE`` is set; docs/protocol-standby.md, "Every answer carries the
term"): every answer carries ``x-syncps-term`` and ``x-syncps-role``; a training request (:data:`TRAINING`) with the
training token is refused before any route runs unless this PS is the primary (503 ``standby``, ``election`` or
``fenced``; a malformed ``x-syncps-term``: 400 ``bad_request`` first, nothing counted), and its
``x-syncps-peer-lost`` is the standby's cue (:meth:`Pair.reported`).
"""
from __future__ import annotations

from ps_service.auth import authorised
from ps_service.http import refusal_response
from shared.errors import ProtocolError
from shared.protocol import API, MAX_INT

TERM, ROLE = "x-syncps-term", "x-syncps-role"
TRAINING = tuple(f"{API}/{p}" for p in ("workers", "model", "gradients", "shm"))
WORKERS = f"{API}/workers"


def _headers(scope) -> tuple[int | None, bool]:
    """The request's ``x-syncps-term`` (None: none) and whether it carries ``x-syncps-peer-lost``; a term that is not
    one decimal integer in [0, 2^53 - 1], or given twice: 400 ``bad_request``."""
    term, lost = None, False
    for name, value in scope["headers"]:
        if name == b"x-syncps-term":
            if term is not None or not (value.isdigit() and len(value) < 17 and int(value) <= MAX_INT):
                raise ProtocolError(400, "bad_request", f"x-syncps-term must be given once, a decimal integer in "
                                                        f"[0, {MAX_INT}]: got {value[:40]!r}")
            term = int(value)
        elif name == b"x-syncps-peer-lost":
            lost = True
    return term, lost


class Gate:
    def __init__(self, app) -> None:
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        ha = scope["app"].state.runtime.ha
        marks = [(TERM.encode(), str(ha.term).encode()), (ROLE.encode(), ha.role.encode())]
        path = scope["path"]
        if (path.startswith(TRAINING) and not (scope["method"] == "GET" and path == WORKERS)  # (the list: monitoring)
                and authorised(scope)):  # else the route answers 401 (its headers change nothing)
            try:
                term, lost = _headers(scope)
                if lost:  # a worker lost its connection to the other PS just now
                    ha.reported(scope["app"].state.runtime.now())
                exc = ha.refusal(term)
            except ProtocolError as bad:  # a malformed term (_headers): refused before anything counts
                exc = bad
            if exc is not None and exc.code == "fenced":
                ha.deposed(exc.detail)
            if exc is not None:
                resp = refusal_response(exc)
                resp.raw_headers.extend(marks)
                return await resp(scope, receive, send)

        async def marked(message) -> None:
            if message["type"] == "http.response.start":
                message = {**message, "headers": [*message.get("headers", ()), *marks]}
            await send(message)

        await self.app(scope, receive, marked)
