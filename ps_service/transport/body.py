"""Request bodies, read bounded and into memory the PS owns.

:func:`read_body` is the only way a route reads a body, *in the endpoint*, after the auth dependency ran: content
type checked first (415), size checked while streaming (413), a stalled body cut off (408), a client that vanished
mid-body answered 400 without a traceback, a body longer than its Content-Length refused (400). The result is always
writable memory that nothing else uses: a body with a Content-Length in one buffer of
:data:`ps_service.core.buffers.POOL` (written by the HTTP protocol itself where it can: :class:`BodySink`), a chunked
one in a ``bytearray``; arrays made over it are the core's to keep and sum into. :func:`read_prefix` reads a body's
first bytes alone (a push's frame header) and leaves the rest in the kernel and the sender until its turn;
:func:`read_body` then takes what was read as its ``prefix``.
"""
from __future__ import annotations

import asyncio
import time
from typing import Callable

from starlette.requests import ClientDisconnect, Request

from ps_service.core.buffers import POOL
from ps_service.transport.unread import READ_KEY
from shared.errors import ProtocolError

#: the ASGI scope key under which a route hands its sink to the protocol (ps_service/transport/bodysink.py)
SINK_KEY = "syncps.body_sink"
#: wake the route after this many bytes or seconds of progress while a body streams into its sink
WAKE_BYTES = 4 << 20
WAKE_SECONDS = 0.5


class BodySink:
    """A writable view of the whole body and how much of it has arrived."""

    def __init__(self, view: memoryview) -> None:
        self.view = view
        self.at = 0
        #: a byte count the route asked to be woken at (its progress callback's answer; None: the default rhythm)
        self.wake_at: int | None = None
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
        """True when full, once :attr:`wake_at` bytes are in, and once per WAKE_BYTES or WAKE_SECONDS of progress."""
        now = time.monotonic()
        if (self.full or (self.wake_at is not None and self.at >= self.wake_at)
                or self.at - self._woken_at >= WAKE_BYTES or now - self._woken_time >= WAKE_SECONDS):
            self._woken_at, self._woken_time = self.at, now
            return True
        return False


def declared_length(request: Request, limit: int, media_types: tuple[str, ...] | str) -> int | None:
    """The body's Content-Length (None: chunked) after the checks every body meets first (415, 400, 413)."""
    allowed = (media_types,) if isinstance(media_types, str) else media_types
    ctype = request.headers.get("content-type", "").split(";")[0].strip().lower()
    if ctype not in allowed:
        raise ProtocolError(415, "unsupported_media_type",
                            f"send {' or '.join(allowed)}, not {ctype[:64] or 'nothing'!r}")
    declared = request.headers.get("content-length")
    if declared is None:
        return None
    declared = declared.strip(" \t")  # optional whitespace around a field value (RFC 9110 5.5)
    if not (declared.isascii() and declared.isdigit()):
        raise ProtocolError(400, "bad_content_length", "content-length must be a non-negative integer")
    if int(declared) > limit:
        raise ProtocolError(413, "body_too_large", f"body of {declared} bytes exceeds the limit of {limit}")
    return int(declared)


async def read_prefix(request: Request, want: Callable[[bytearray], int], idle_timeout: float
                      ) -> tuple[bytearray, bool]:
    """The body's first bytes, received until ``want(got)`` (the bytes it needs) is at most what came, or the body
    ended: (those bytes, whether it ended). Refusals as :func:`read_body`'s; the rest stays unread until
    :func:`read_body` is given them as its ``prefix``."""
    got = bytearray()

    def take(chunk: bytes) -> bool:
        got.extend(chunk)
        return want(got) <= len(got)
    return got, await _stream(request, take, idle_timeout)


async def read_body(request: Request, limit: int, media_types: tuple[str, ...] | str, idle_timeout: float,
                    recurring: bool = True, prefix: tuple[bytearray, bool] | None = None,
                    progress: Callable[[memoryview, int], int | None] | None = None) -> memoryview | bytearray:
    """The request body, refused with 415 for another content type, 413 past ``limit``, 408 if it stalls.
    ``recurring`` False: such bodies come once (a model's upload): a buffer made for it is not kept. ``prefix``: what
    :func:`read_prefix` received already. ``progress``: called with the buffer and the bytes in it so far as more
    come (a ``Content-Length`` body's; what it raises ends the read); it may answer the byte count to be called at
    next (a partitioned push: its next frame's end), besides every ``WAKE_BYTES`` or ``WAKE_SECONDS``."""
    declared = declared_length(request, limit, media_types)
    sink = BodySink(POOL.take(declared, keep=recurring)) if declared is not None else None
    chunks = bytearray() if sink is None else None

    def take(chunk: bytes) -> bool:
        if sink is not None:
            if chunk:
                sink.write(chunk)
            if progress is not None:
                sink.wake_at = progress(sink.view, sink.at)
        else:
            chunks.extend(chunk)
            if len(chunks) > limit:
                raise ProtocolError(413, "body_too_large", f"body exceeds the limit of {limit} bytes")
        return False
    ended = False
    if prefix is not None:
        try:
            take(prefix[0])
        except ValueError:
            raise ProtocolError(400, "bad_content_length", "the body is longer than its content-length") from None
        ended = prefix[1]
    if sink is not None:
        request.scope[SINK_KEY] = sink
    try:
        if not ended:
            await _stream(request, take, idle_timeout)
    finally:
        request.scope.pop(SINK_KEY, None)
    request.scope[READ_KEY] = True  # its end came: the connection may serve the next request (transport/unread.py)
    if sink is not None:
        if not sink.full:
            raise ProtocolError(400, "bad_content_length", "the body is shorter than its content-length")
        return sink.view
    return chunks


async def _stream(request: Request, take: Callable[[bytes], bool], idle_timeout: float) -> bool:
    """Receive the body, each chunk given to ``take`` (True: enough, stop after it), until it ends (True) or ``take``
    stops (False): 408 if it stalls ``idle_timeout`` s, 400 if the client goes or sends more than its length."""
    loop = asyncio.get_running_loop()
    try:
        async with asyncio.timeout(idle_timeout) as deadline:
            while True:
                message = await request.receive()
                if message["type"] == "http.disconnect":
                    raise ClientDisconnect()
                stop = take(message.get("body", b""))
                deadline.reschedule(loop.time() + idle_timeout)  # every wake-up brings bytes (or the end)
                if not message.get("more_body", False):
                    return True
                if stop:
                    return False
    except TimeoutError:
        raise ProtocolError(408, "body_timeout", f"the body stalled for {idle_timeout:g} s") from None
    except ClientDisconnect:
        raise ProtocolError(400, "client_disconnected", "the client went away before the end of the body") from None
    except ValueError:
        raise ProtocolError(400, "bad_content_length", "the body is longer than its content-length") from None
