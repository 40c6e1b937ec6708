"""A response's status line and headers written together with its body: one write, one segment.

uvicorn writes a response in two calls, the head when the app sends ``http.response.start`` and the body at
``http.response.body``: two system calls and, on a loopback or LAN connection, two segments, the client woken
for the head alone. :class:`OneWriteTransport` wraps the connection's transport (the PS's protocol puts it there,
:mod:`ps_service.transport.bodysink`, and in the ASGI scope under :data:`KEY`); :func:`one_write_send` wraps an
ASGI ``send`` so that what is written while ``http.response.start`` is being sent is held and goes out with the
first bytes written after it (``writelines``: one ``writev``). Whatever the server does, nothing stays held once
the response's last message was sent: a flush follows every other message. Only the fast lane
(:mod:`ps_service.hotpath`) asks for it; every other write passes straight through.
"""
from __future__ import annotations

from typing import Any, Awaitable, Callable

KEY = "syncps.one_write"


class OneWriteTransport:
    """A transport that can hold writes (:attr:`hold`) until the next one; everything else is the inner one's."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.hold = False
        self._held: list[bytes] = []

    def write(self, data) -> None:
        if self.hold:
            self._held.append(bytes(data))
        elif self._held:
            held, self._held = self._held, []
            self.inner.writelines([*held, data])
        else:
            self.inner.write(data)

    def flush(self) -> None:
        if self._held:
            held, self._held = self._held, []
            self.inner.writelines(held)

    def close(self) -> None:
        self.hold = False
        self.flush()
        self.inner.close()

    def __getattr__(self, name: str) -> Any:  # get_extra_info, is_closing, pause_reading, ...: the inner one's
        return getattr(self.inner, name)


def one_write_send(scope: dict, send: Callable[[dict], Awaitable[None]]) -> Callable[[dict], Awaitable[None]]:
    """``send``, with a response's head held until its body is written (no-op under another protocol)."""
    transport = scope.get(KEY)
    if transport is None:
        return send

    async def sender(message: dict) -> None:
        transport.hold = message["type"] == "http.response.start"
        try:
            await send(message)
        finally:
            if transport.hold:
                transport.hold = False
            else:
                transport.flush()
    return sender
