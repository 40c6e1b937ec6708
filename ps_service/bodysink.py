"""Large request bodies written by the HTTP protocol straight into the route's buffer.

uvicorn hands a body to the app chunk by chunk through a growing ``bytearray`` and a
``bytes`` copy per ``receive()``: two copies and an event-loop round trip per 64 KB,
about a third of the PS's time on 40 MB pushes. A route that knows the body's size
(:func:`ps_service.http.read_body`) puts a :class:`BodySink` in the ASGI scope under
:data:`SINK_KEY`; :class:`SinkHttpToolsProtocol` (the PS's uvicorn protocol,
``ps_service/__main__.py``) then copies each chunk once, into the sink, and wakes the
route only every :data:`WAKE_BYTES` or :data:`WAKE_SECONDS` of progress, and at the end
(so the route's idle timeout still sees a slow but steady body move). Bytes that arrived before the sink
was set are still delivered the usual way and land first (the sink keeps the offset).

Under another server (or uvicorn's stock protocol) nothing writes to the sink and
``read_body`` gets the chunks as usual: the sink is an optimisation, never a contract.
"""
from __future__ import annotations

import time

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

SINK_KEY = "syncps.body_sink"
#: wake the route after this many bytes or seconds of progress while a body streams into its sink
WAKE_BYTES = 4 << 20
WAKE_SECONDS = 0.5


class BodySink:
    """A writable view of the whole body and how much of it has arrived."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.at = 0
        self._woken_at = 0
        self._woken_time = time.monotonic()

    def write(self, data: bytes | bytearray | memoryview) -> None:
        end = self.at + len(data)
        if end > len(self.view):
            raise ValueError("the body is longer than its content-length")
        self.view[self.at:end] = data
        self.at = end

    @property
    def full(self) -> bool:
        return self.at == len(self.view)

    def due(self) -> bool:
        """True when full, and once per WAKE_BYTES or WAKE_SECONDS of progress."""
        now = time.monotonic()
        if self.full or self.at - self._woken_at >= WAKE_BYTES or now - self._woken_time >= WAKE_SECONDS:
            self._woken_at, self._woken_time = self.at, now
            return True
        return False


class SinkHttpToolsProtocol(HttpToolsProtocol):
    def on_body(self, body: bytes) -> None:
        cycle = self.cycle
        sink = cycle.scope.get(SINK_KEY) if cycle is not None else None
        if sink is None or cycle.response_complete or (self.parser.should_upgrade() and self._should_upgrade()):
            return super().on_body(body)
        try:
            if cycle.body:  # arrived before the route set the sink: it goes first
                sink.write(cycle.body)
                cycle.body = bytearray()
            sink.write(body)
        except ValueError:  # cannot happen with a Content-Length body; leave it to the stock path
            del cycle.scope[SINK_KEY]
            return super().on_body(body)
        if sink.due():
            cycle.message_event.set()
