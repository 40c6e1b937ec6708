"""A refusal answered before its request's body arrived whole closes the connection.

The PS answers some requests without reading their body to the end: 401 (checked before the body), 413 from
the ``Content-Length``, 415, 408 (the body stalled), and any error a route raises before it reads. The rest of
that body may still be on its way, so the connection cannot carry another request: its next bytes would be read
as the old body's. :class:`CloseUnread` (the outermost ASGI middleware) watches ``receive`` and, when a response
starts while the request's body is not complete, adds ``connection: close`` to it; the server then closes the
connection once the response is written (uvicorn does on that header), and an HTTP client knows not to reuse it.
A request with no body (no ``Content-Length``, or 0, and not chunked) is complete from the start.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

CLOSE = (b"connection", b"close")


def has_body(headers: list[tuple[bytes, bytes]]) -> bool:
    """True when the request declares a body (a non-zero ``Content-Length``, or any ``Transfer-Encoding``)."""
    for name, value in headers:
        if name == b"transfer-encoding" or (name == b"content-length" and value.strip(b" \t0")):
            return True
    return False


class CloseUnread:
    def __init__(self, app: Callable[..., Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: dict, receive: Callable[[], Awaitable[dict]],
                       send: Callable[[dict], Awaitable[None]]) -> None:
        if scope["type"] != "http" or not has_body(scope["headers"]):
            return await self.app(scope, receive, send)
        complete = False

        async def receiver() -> dict[str, Any]:
            nonlocal complete
            message = await receive()
            if message["type"] == "http.request" and not message.get("more_body", False):
                complete = True
            return message

        async def sender(message: dict) -> None:
            if message["type"] == "http.response.start" and not complete:
                message = {**message, "headers": [*message.get("headers", ()), CLOSE]}
            await send(message)

        await self.app(scope, receiver, sender)
