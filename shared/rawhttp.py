"""A lean HTTP/1.1 keep-alive client connection: the worker's tensor calls (pull, push), the standby link's steps.

Contract: the request is sent with ``sendmsg`` straight from the caller's buffers (headers, framing and tensor memory,
no join); a response body is received with ``recv_into`` into one of two reusable numpy byte arrays (a large one
:data:`LOW_WATER` bytes a call at least), taken only when nothing still views it (the arrays a caller decoded from
the previous answer stay valid). ``Content-Length`` and
chunked bodies (a chunked one received chunk after chunk into one pooled buffer, returned whole), keep-alive,
``http://`` only; every call has a timeout. A kept-alive socket is reused only while idle for less than half the
server's keep-alive timeout (shared/keepalive.py) and still open (a poll, no wait). A request is never sent twice from
here: a failure once sending began closes the connection and raises :class:`ConnectionLost` (the caller's retry
policy decides; pushes are idempotent at the PS); :class:`StaleConnection` when the server closed or reset a
kept-alive socket before answering (an idempotent request may go again at once on a new one). An answer the server
sent before it stopped reading (e.g. a 413) is still returned.
"""
from __future__ import annotations

import errno
import json
import select
import socket
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Iterable, Mapping
from urllib.parse import urlsplit

import numpy as np

from shared import keepalive, liveness, marks, refs

HEADER_LIMIT = 64 * 1024
#: bodies smaller than this are plain bytes (a buffer pool is not worth it)
POOL_MIN_BYTES = 64 * 1024
#: a body part at least this large is received this much at a time at least (``SO_RCVLOWAT``; its last bytes: all
#: that is left): one wake-up and one ``recv_into`` where a 1 Gb/s link shared by a worker's pulls gave ~80 KB each
LOW_WATER = 256 * 1024


class ConnectionLost(Exception):
    """The connection broke, timed out or spoke something that is not HTTP/1.1."""


class StaleConnection(ConnectionLost):
    """A kept-alive connection the server had closed: it closed or reset it before a byte of the answer."""


@dataclass
class RawResponse:
    status_code: int
    headers: dict[str, str]  # lower-case names
    content: bytes | memoryview

    def json(self):
        return json.loads(bytes(self.content))

    @property
    def text(self) -> str:
        return bytes(self.content).decode("utf-8", "replace")


class RawConnection:
    def __init__(self, base_url: str) -> None:
        url = urlsplit(base_url)
        if url.scheme != "http" or not url.hostname:
            raise ValueError(f"RawConnection speaks http:// only, not {base_url!r}")
        self.host, self.port = url.hostname, url.port or 80
        self.prefix = url.path.rstrip("/")
        self.host_header = url.netloc
        self.sock: socket.socket | None = None
        self._pool: list[np.ndarray] = []
        self._chunked_size = 0  # the last chunked body's size (its buffer's, the next time)
        self._idle = keepalive.IdleClock()  # of ``sock``

    def close(self) -> None:
        """Close the connection; a request another thread has in flight on it fails at once (ConnectionLost), not
        at its timeout: the socket is shut down first (a close alone wakes no thread blocked in it)."""
        sock, self.sock = self.sock, None
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:  # not connected (any more)
                pass
            sock.close()

    def _live(self) -> socket.socket:
        """The socket a request goes on; closed under it (:meth:`close` from another thread): :class:`_Closed`."""
        sock = self.sock
        if sock is None:
            raise _Closed("the connection was closed while the request was in flight")
        return sock

    def request(self, method: str, target: str, headers: Mapping[str, str], body: Iterable[bytes | memoryview] = (),
                timeout: float = 30.0) -> RawResponse:
        """Send one request (``body``: buffers sent as they are, in order) and read its answer. ``timeout`` bounds each
        socket operation (the connect, to all the host's addresses together: shared/liveness.py; every send, every
        receive)."""
        parts = self._message(method, target, headers, body)
        if self.sock is not None and (self._idle.expired() or _dropped(self.sock)):
            self.close()  # a kept-alive socket idle for long, or closed: nothing was sent on it
        with self._failures(timeout, kept=self.sock is not None):
            if self.sock is None:
                self.sock = liveness.connect(self.host, self.port, timeout)  # a silent peer host noticed in seconds
                self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            else:
                self.sock.settimeout(timeout)
            try:
                self._send(parts)
                if marks.ON:
                    marks.mark("http.sent", peer=self.host_header, target=target.split("?")[0],
                               local=self.sock.getsockname()[0])
            except (BrokenPipeError, ConnectionResetError) as cut:
                try:  # an answer sent before the server stopped reading (e.g. a 413)?
                    early = self._receive(method)
                except (OSError, ValueError, _Closed):
                    raise cut from None
                self.close()  # our request was cut short: the connection is done with
                return early
            answer = self._receive(method)
            self._idle.answered(answer.headers)
            return answer

    @contextmanager
    def _failures(self, timeout: float, kept: bool = False):
        """Every failure of the socket as :class:`ConnectionLost`, the connection closed; a close or reset before the
        answer on a ``kept`` (reused) socket as :class:`StaleConnection`."""
        lost = StaleConnection if kept else ConnectionLost
        try:
            yield
        except liveness.NoConnect as exc:  # every address the host has, and how long each took
            raise ConnectionLost(str(exc)) from None
        except TimeoutError as exc:
            self.close()
            if exc.errno == errno.ETIMEDOUT:  # TCP_USER_TIMEOUT or keep-alive probes (shared/liveness.py)
                raise ConnectionLost(f"the peer's host acknowledged nothing, or the peer read nothing, for "
                                     f"{liveness.USER_TIMEOUT_SECONDS:g} s (a network outage, the host gone, or "
                                     "the peer paused)") from None
            raise ConnectionLost(f"timed out: no progress for {timeout:g} s") from None
        except _Closed as exc:
            if self.sock is None:  # closed under the request by :meth:`close`, not by the server
                lost = ConnectionLost
            self.close()
            raise lost(str(exc)) from None
        except (BrokenPipeError, ConnectionResetError) as exc:
            self.close()
            raise lost(f"the server closed the connection during the request ({exc})") from None
        except (OSError, ValueError) as exc:
            self.close()
            raise ConnectionLost(f"{type(exc).__name__}: {exc}") from None

    def _message(self, method: str, target: str, headers: Mapping[str, str],
                 body: Iterable[bytes | memoryview]) -> list[memoryview]:
        """The request as a fresh list of byte views: the head, then the body's buffers (not copied)."""
        parts = [memoryview(p).cast("B") for p in body]
        size = sum(p.nbytes for p in parts)
        head = [f"{method} {self.prefix}{target} HTTP/1.1", f"host: {self.host_header}", f"content-length: {size}"]
        head += [f"{k}: {v}" for k, v in headers.items() if k.lower() not in ("host", "content-length")]
        parts.insert(0, memoryview(("\r\n".join(head) + "\r\n\r\n").encode("latin-1")))
        return parts

    def _send(self, parts: list[memoryview]) -> None:
        """sendmsg until every byte of ``parts`` went out (consumes the list: build one per request)."""
        i = 0
        while i < len(parts):
            sent = self._live().sendmsg(parts[i:i + 512])  # Linux takes at most 1024 buffers a call
            while i < len(parts) and sent >= parts[i].nbytes:
                sent -= parts[i].nbytes
                i += 1
            if sent:
                parts[i] = parts[i][sent:]

    def _receive(self, method: str) -> RawResponse:
        try:
            pending = bytearray(self._live().recv(65536))
        except ConnectionResetError:
            pending = bytearray()
        if not pending:
            raise _Closed("the server closed the connection before answering")
        lines = self._until(pending, b"\r\n\r\n", "the response headers").decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError(f"not an HTTP/1.x response: {lines[0][:40]!r}")
        status = int(rest[:3])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            content: bytes | memoryview = b""
        elif "content-length" in headers and "transfer-encoding" not in headers:
            content = self._exactly(int(headers["content-length"]), memoryview(pending))
        elif headers.get("transfer-encoding", "").lower() == "chunked":
            content = self._chunked(pending)
        else:
            raise ValueError("response not framed by content-length")
        if headers.get("connection", "").lower() == "close":
            self.close()
        return RawResponse(status, headers, content)

    def _exactly(self, n: int, extra: memoryview) -> bytes | memoryview:
        if len(extra) > n:
            raise ValueError("more bytes than content-length")
        small = n < POOL_MIN_BYTES  # plain bytes: a pooled buffer is not worth it
        view = memoryview(bytearray(n) if small else self._buffer(n))[:n]
        if marks.ON and not small:
            marks.mark("chunk.first", peer=self.host_header, n=n, whole=True)
        view[:len(extra)] = extra
        self._fill(view, len(extra), "the body")
        if marks.ON and not small:
            marks.mark("chunk.last", peer=self.host_header, n=n, whole=True)
        return bytes(view) if small else view

    def _fill(self, view: memoryview, got: int, what: str) -> None:
        """Receive into ``view`` from byte ``got`` to its end (a large part :data:`LOW_WATER` bytes a call at least:
        the socket's low-water mark, set back to 1 at the end)."""
        sock, low = self._live(), 1
        try:
            while got < len(view):
                sock = self._live()
                if low > 1 or len(view) - got >= LOW_WATER:
                    want = min(len(view) - got, LOW_WATER)
                    if want != low:
                        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, want)
                        low = want
                r = sock.recv_into(view[got:], len(view) - got)
                if not r:
                    raise ValueError(f"connection closed inside {what}")
                got += r
        finally:
            if low > 1 and self.sock is sock:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVLOWAT, 1)

    def _chunked(self, pending: bytearray) -> bytes | memoryview:
        """A chunked body (``pending``: its bytes already read), whole: each chunk received straight into one buffer,
        a pooled one as a ``Content-Length`` body's (sized by the last chunked body on this connection, grown by
        doubling if this one is larger); plain bytes when small."""
        arr, size = None, 0
        while True:
            n = int(self._until(pending, b"\r\n", "a chunk line").split(b";")[0], 16)
            if n == 0:
                while self._until(pending, b"\r\n", "a trailer"):  # trailers, then the empty line
                    pass
                self._chunked_size = size
                view = memoryview(arr)[:size] if arr is not None else memoryview(b"")
                return bytes(view) if size < POOL_MIN_BYTES else view
            if arr is None or arr.nbytes < size + n:  # the last chunked body's size at first, else twice as large
                grown = self._buffer(max(size + n, self._chunked_size if arr is None else 2 * arr.nbytes))
                if size:
                    grown[:size] = arr[:size]
                arr = grown
            with memoryview(arr)[size:size + n] as view:
                got = min(n, len(pending))
                if marks.ON:
                    marks.mark("chunk.first", peer=self.host_header, n=n)
                view[:got] = pending[:got]
                del pending[:got]
                self._fill(view, got, "a chunk")
                if marks.ON:
                    marks.mark("chunk.last", peer=self.host_header, n=n)
            size += n
            if self._until(pending, b"\r\n", "a chunk's end"):
                raise ValueError("a chunk does not end with CRLF")

    def _until(self, pending: bytearray, mark: bytes, what: str) -> bytes:
        """The bytes before the next ``mark`` (taken off ``pending`` with it, receiving more as needed)."""
        while (end := pending.find(mark)) < 0:
            if len(pending) > HEADER_LIMIT:
                raise ValueError(f"{what} too long")
            try:
                chunk = self._live().recv(65536)
            except ConnectionResetError:  # the answer began: lost, not stale
                chunk = b""
            if not chunk:
                raise ValueError(f"connection closed inside {what}")
            pending += chunk
        found = bytes(pending[:end])
        del pending[:end + len(mark)]
        return found

    def _buffer(self, n: int) -> np.ndarray:
        """A byte array of at least n bytes that no earlier answer's arrays still view."""
        for i in range(len(self._pool)):  # (not enumerate: its cached tuple holds the array, never free then)
            arr = self._pool[i]
            if refs.free(arr):
                if arr.nbytes < n:
                    arr = self._pool[i] = np.empty(n, np.uint8)
                return arr
        arr = np.empty(n, np.uint8)
        if len(self._pool) < 2:
            self._pool.append(arr)
        return arr


class _Closed(Exception):
    """The server closed the connection before the first byte of its answer."""


def _dropped(sock: socket.socket) -> bool:
    """Whether an idle kept-alive socket is unusable, without waiting (urllib3's ``is_connection_dropped``): between two
    requests the server has nothing to say, so readable means its FIN, a reset, or bytes nobody asked for."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    return bool(poller.poll(0))
