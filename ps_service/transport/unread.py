"""An answer sent before its request's body arrived whole closes the connection, without a reset.

:class:`CloseUnread` (the outermost ASGI middleware) adds ``connection: close`` to a response that starts before the
request's body was read to its end (401, 413, 415, 408, an error before the read: docs/protocol.md), whose rest may
still come; :func:`ps_service.transport.body.read_body` marks the scope (:data:`READ_KEY`) at the body's end. Closing
a socket while the peer's bytes arrive would make the kernel answer them with a reset, which can reach the client
before the answer: :class:`LingeringTransport` closes in two stages (RFC 9112 9.6): the answer and a FIN, then what
still arrives is dropped until the peer closes its side, or :data:`LINGER_SECONDS`.
"""
from __future__ import annotations

import asyncio
from typing import Any, Awaitable, Callable

CLOSE = (b"connection", b"close")
#: the ASGI scope key :func:`~ps_service.transport.body.read_body` sets once it received the body's end
READ_KEY = "syncps.body_read"
#: how long a connection closed mid-body keeps reading (and dropping) the peer's bytes after its FIN
LINGER_SECONDS = 2.0


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

        async def sender(message: dict) -> None:
            if message["type"] == "http.response.start" and not scope.get(READ_KEY):
                message = {**message, "headers": [*message.get("headers", ()), CLOSE]}
            await send(message)

        await self.app(scope, receive, sender)


class LingeringTransport:
    """The connection's transport: :meth:`close` while ``body_pending()`` half-closes and lingers (:attr:`lingering`:
    the protocol drops what arrives); everything else is the inner transport's."""

    def __init__(self, inner: Any, body_pending: Callable[[], bool]) -> None:
        self.inner = inner
        self.body_pending = body_pending
        self.lingering = False

    def __getattr__(self, name: str) -> Any:  # write, get_extra_info, is_closing, pause_reading, ...
        return getattr(self.inner, name)

    def close(self) -> None:
        if self.lingering:
            return
        if self.inner.is_closing() or not self.body_pending() or not self.inner.can_write_eof():
            return self.inner.close()
        self.lingering = True
        self.inner.write_eof()  # after what is buffered: the answer, then the FIN
        asyncio.get_running_loop().call_later(LINGER_SECONDS, self.inner.close)  # the peer's EOF closes it sooner
