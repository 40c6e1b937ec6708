"""Large request bodies written by the HTTP protocol straight into the route's buffer.

uvicorn hands a body to the app through a growing ``bytearray`` and a ``bytes`` copy per ``receive()``: two copies
and an event-loop round trip per 64 KB, a third of the PS's time on 40 MB pushes. A route that knows the body's size
(:func:`ps_service.transport.body.read_body`) puts a :class:`~ps_service.transport.body.BodySink` in the ASGI scope
(``SINK_KEY``); through :class:`BufferedSinkProtocol` (the PS's uvicorn protocol) the loop then reads the rest of a
``Content-Length`` body straight into the sink (what the parser held of it lands first; ``get_buffer`` hands out
exactly its remaining bytes; the message is ended by hand and a fresh parser takes the next request) and wakes the
route every ``WAKE_BYTES`` or ``WAKE_SECONDS`` and at the end. Every other byte goes through the thread's scratch
buffer (:func:`scratch`) to uvicorn's parser, and a body's to the route as uvicorn gives them. Under another server
``read_body`` gets the chunks as usual: the sink is an optimisation, never a contract.

Two mixins of the protocol, which the probe port's (ps_service/probes.py) shares, judge a request's head before any
route sees it: :class:`IdleUntilHead` (the idle timeout runs until the head is whole) and :class:`CheckedHead`
(malformed HTTP, a head without one ``Host`` header, and an ``Upgrade`` request with a body, answered 400
``bad_http`` in JSON).
"""
from __future__ import annotations

import asyncio
import json
import sys
import threading

import httptools
from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

from ps_service.transport.body import SINK_KEY, BodySink
from ps_service.transport.unread import LingeringTransport, has_body
from shared import liveness

#: bytes per socket read outside a sink. Small on purpose: the read that brings a push's headers also brings the
#: start of its body, through the parser (two more copies) before the route set its sink; headers and JSON fit.
READ_CHUNK = 16 << 10
_thread = threading.local()

def scratch() -> memoryview:
    """This thread's read buffer (:data:`READ_CHUNK` bytes), made on first use."""
    buf = getattr(_thread, "scratch", None)
    if buf is None:
        buf = _thread.scratch = memoryview(bytearray(READ_CHUNK))
    return buf


def _content_length(headers: list[tuple[bytes, bytes]]) -> int | None:
    """The body length of a plain ``Content-Length`` request (None if chunked, absent or odd)."""
    lengths = [v.strip(b" \t") for k, v in headers if k == b"content-length"]
    if len(lengths) != 1 or not lengths[0].isdigit() or any(k == b"transfer-encoding" for k, _ in headers):
        return None
    return int(lengths[0])


class IdleUntilHead:
    """Mixed into uvicorn's httptools protocol (main and probe ports): the idle timeout is armed from the
    connection's start until a request's head is whole, so a connection that sends no request, or a head never
    finished (slowloris), is closed as an idle one (docs/protocol.md, Connections)."""

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.timeout_keep_alive_task = self.loop.call_later(self.timeout_keep_alive, self.timeout_keep_alive_handler)

    def data_received(self, data: bytes) -> None:
        idle, self.timeout_keep_alive_task = self.timeout_keep_alive_task, None
        super().data_received(data)
        if idle is None:
            return
        if self.timeout_keep_alive_task is None and (self.cycle is None or self.cycle.response_complete):
            self.timeout_keep_alive_task = idle  # no request in progress yet
        else:
            idle.cancel()


class CheckedHead:
    """Mixed into uvicorn's httptools protocol (the PS's main port, its probe port): a request head that HTTP bids a
    server refuse, HTTP/1.1 without a ``Host`` header or any request with more than one (RFC 9112 3.2), or one the PS
    cannot read (an ``Upgrade`` request with a body: the parser switches protocols where the head ends), is refused as
    the HTTP parser refuses malformed framing, before any route (or the fast lane, :mod:`ps_service.hotpath`) sees it:
    400 ``bad_http`` with the protocol's JSON error body, and the connection is closed."""
    #: why the head at hand is refused (None: it was not)
    refused_head: str | None = None

    def on_headers_complete(self) -> None:
        hosts = sum(name == b"host" for name, _ in self.headers)
        if hosts > 1 or (not hosts and self.parser.get_http_version() == "1.1"):
            self.refused_head = (f"{hosts} Host headers: an HTTP/1.1 request carries exactly one, any other at most "
                                 "one (RFC 9112 3.2)")
        elif self.parser.should_upgrade() and has_body(self.headers):
            self.refused_head = ("an Upgrade request with a body: the PS speaks HTTP/1.1 only and its parser reads no "
                                 "body past an Upgrade head; send the request without Upgrade")
        if self.refused_head:
            raise httptools.HttpParserError(self.refused_head)  # the parser stops; uvicorn calls send_400_response
        super().on_headers_complete()

    #: the bytes read past an Upgrade head, where the parser paused (a pipelined request): parsed next
    _past_upgrade: bytes = b""

    def data_received(self, data: bytes) -> None:
        while data:  # (a loop, not a call again: a packet of many Upgrade requests recurses no deeper)
            self._received = data  # (for _unsupported_upgrade_warning; not kept past the call)
            super().data_received(data)
            data, self._past_upgrade, self._received = self._past_upgrade, b"", b""
            if self.transport.is_closing():
                return

    def _unsupported_upgrade_warning(self) -> None:
        """An Upgrade request without a body is served as plain HTTP/1.1 (uvicorn runs without websockets:
        :func:`ps_service.app.server_options`); a client's request, not the operator's concern: no warning. The
        bytes after its head go to the parser next (uvicorn drops them: a request pipelined behind it went
        unanswered)."""
        paused = sys.exc_info()[1]  # uvicorn calls this handling httptools.HttpParserUpgrade(offset in the bytes)
        if isinstance(paused, httptools.HttpParserUpgrade) and paused.args:
            self._past_upgrade = self._received[paused.args[0]:]

    def send_400_response(self, msg: str) -> None:
        """uvicorn's answer to a request its HTTP parser refuses (bad framing: a bad chunk size, a
        Content-Length that is not one non-negative number, Content-Length with chunked...), or to a head refused
        above, with the protocol's JSON error body instead of plain text. The connection is closed."""
        detail = self.refused_head or ("the HTTP request is malformed (request line, headers, Content-Length or "
                                       "chunked encoding): " + msg[:200])
        body = json.dumps({"error": "bad_http", "detail": detail}).encode()
        head = [b"HTTP/1.1 400 Bad Request\r\n"]
        head += [name + b": " + value + b"\r\n" for name, value in self.server_state.default_headers]
        head += [b"content-type: application/json\r\n", b"content-length: %d\r\n" % len(body),
                 b"connection: close\r\n\r\n"]
        self.transport.write(b"".join(head) + body)
        self.transport.close()


class SinkHttpToolsProtocol(CheckedHead, IdleUntilHead, HttpToolsProtocol):
    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        #: where the bytes of the pending read go: a sink, "discard" (a bypassed body nobody reads any
        #: more), "linger" (the connection is closing: dropped), or None (the scratch buffer, then the parser)
        self._reading_into: BodySink | str | None = None
        #: bytes of the current request's body not yet received (None: not a Content-Length body)
        self._body_left: int | None = None
        #: the parser has been bypassed for part of this body: the rest must bypass it too
        self._bypassing = False

    def on_headers_complete(self) -> None:
        super().on_headers_complete()
        self._body_left = _content_length(self.headers)
        self._bypassing = False

    def _direct_sink(self) -> BodySink | None:
        """The sink the socket may be read into right now, leftovers flushed into it first."""
        cycle, left = self.cycle, self._body_left
        if cycle is None or not left or cycle.response_complete:
            return None
        sink = cycle.scope.get(SINK_KEY)
        if sink is None or sink.at + len(cycle.body) + left != len(sink.view):
            return None
        if cycle.body:  # arrived before the route set the sink: it goes first
            sink.write(cycle.body)
            cycle.body = bytearray()
        return sink

    def body_pending(self) -> bool:
        """The request being served has not sent its whole body yet."""
        return self.cycle is not None and self.cycle.more_body

    def get_buffer(self, sizehint: int) -> memoryview:
        if getattr(self.transport, "lingering", False):  # answered and half-closed mid-body: the rest is dropped
            self._reading_into = "linger"
            return scratch()
        sink = self._direct_sink()
        if sink is not None:
            self._reading_into, self._bypassing = sink, True
            return sink.view[sink.at:sink.at + self._body_left]
        if self._bypassing and self._body_left:  # the route gave up on this body: read the rest past the parser
            self._reading_into = "discard"
            return scratch()[:self._body_left]
        self._reading_into = None
        return scratch()

    def buffer_updated(self, nbytes: int) -> None:
        into, self._reading_into = self._reading_into, None
        if into is None:
            return self.data_received(bytes(scratch()[:nbytes]))
        if into == "linger":
            return
        self._unset_keepalive_if_required()
        self._body_left -= nbytes
        if isinstance(into, BodySink):
            into.at += nbytes
        if self._body_left == 0:  # the parser never saw this body: end the message, fresh parser for the next
            self._body_left, self._bypassing = None, False
            self.parser = httptools.HttpRequestParser(self)
            self.on_message_complete()
        elif isinstance(into, BodySink) and into.due():
            self.cycle.message_event.set()

    def on_body(self, body: bytes) -> None:
        """Bytes of the body through the parser (those read before the route's sink was set, or outside one): to
        the route as uvicorn gives them (``receive()``, then :func:`~ps_service.transport.body.read_body`), counted."""
        if self._body_left is not None:
            self._body_left -= len(body)
        super().on_body(body)


class BufferedSinkProtocol(asyncio.BufferedProtocol):
    """The PS's uvicorn ``http`` protocol: :class:`SinkHttpToolsProtocol` behind the buffered interface."""

    def __init__(self, *args, **kwargs) -> None:
        self.inner = SinkHttpToolsProtocol(*args, **kwargs)
        for name in ("get_buffer", "buffer_updated", "connection_lost", "eof_received", "pause_writing",
                     "resume_writing"):  # the inner protocol's, as they are
            setattr(self, name, getattr(self.inner, name))

    def connection_made(self, transport) -> None:
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a worker's host gone silent ends its connections in seconds (shared/liveness.py)
            liveness.apply(sock)
        # the fast lane's answers in one write each; a close mid-body lingers (ps_service/transport/unread.py)
        self.inner.connection_made(LingeringTransport(transport, self.inner.body_pending))
