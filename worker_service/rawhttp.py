"""A lean HTTP/1.1 keep-alive connection for the worker's tensor calls (pull, push).

What httpx does for a 40 MB body costs several copies and fresh allocations per
request; this connection does neither:

- the request is sent with ``sendmsg`` straight from the caller's buffers
  (scatter-gather: headers, msgpack framing and tensor memory, no join);
- the response body is received with ``recv_into`` into a reusable buffer:
  one of two numpy byte arrays, taken only when nothing still views it, so the
  arrays a caller decoded from the previous answer stay valid.

Only what the PS speaks is supported: ``Content-Length`` or chunked bodies,
keep-alive, ``http://`` URLs. Every call has a timeout. A connection the server
closed while idle is reopened once, at once; any other failure closes it and
raises :class:`ConnectionLost` (the client's retry policy decides what next).
"""
from __future__ import annotations

import json
import socket
import sys
from dataclasses import dataclass
from typing import Iterable, Mapping
from urllib.parse import urlsplit

import numpy as np

HEADER_LIMIT = 64 * 1024
#: bodies smaller than this are plain bytes (a buffer pool is not worth it)
POOL_MIN_BYTES = 64 * 1024


class ConnectionLost(Exception):
    """The connection broke, timed out or spoke something that is not HTTP/1.1."""


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

    def close(self) -> None:
        if self.sock is not None:
            self.sock.close()
            self.sock = None

    def request(self, method: str, target: str, headers: Mapping[str, str], body: Iterable[bytes | memoryview] = (),
                timeout: float = 30.0) -> RawResponse:
        parts = [memoryview(p).cast("B") for p in body]
        size = sum(p.nbytes for p in parts)
        head = [f"{method} {self.prefix}{target} HTTP/1.1", f"host: {self.host_header}", f"content-length: {size}"]
        head += [f"{k}: {v}" for k, v in headers.items() if k.lower() not in ("host", "content-length")]
        parts.insert(0, memoryview(("\r\n".join(head) + "\r\n\r\n").encode("latin-1")))
        for attempt in (0, 1):
            reused = self.sock is not None
            try:
                if self.sock is None:
                    self.sock = socket.create_connection((self.host, self.port), timeout=timeout)
                    self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self.sock.settimeout(timeout)
                try:
                    self._send(parts)
                except _IdleClosed:
                    early = self._early_answer(method)  # e.g. a 413 sent before the server stopped reading
                    if early is None:
                        raise
                    return early
                return self._receive(method)
            except _IdleClosed:
                self.close()
                if not reused or attempt:
                    raise ConnectionLost("the server closed the connection") from None
            except (OSError, ValueError) as exc:
                self.close()
                raise ConnectionLost(f"{type(exc).__name__}: {exc}") from None
        raise AssertionError("unreachable")

    def _send(self, parts: list[memoryview]) -> None:
        try:
            while parts:
                sent = self.sock.sendmsg(parts[:512])
                while parts and sent >= parts[0].nbytes:
                    sent -= parts[0].nbytes
                    parts.pop(0)
                if sent:
                    parts[0] = parts[0][sent:]
        except (BrokenPipeError, ConnectionResetError):
            raise _IdleClosed from None

    def _early_answer(self, method: str) -> RawResponse | None:
        """The answer a server sent before it closed on our request, if there is one to read."""
        try:
            return self._receive(method)
        except (OSError, ValueError, _IdleClosed):
            return None

    def _receive(self, method: str) -> RawResponse:
        buf = bytearray()
        while True:
            end = buf.find(b"\r\n\r\n")
            if end >= 0:
                break
            if len(buf) > HEADER_LIMIT:
                raise ValueError("response headers too large")
            try:
                chunk = self.sock.recv(65536)
            except ConnectionResetError:
                chunk = b""
            if not chunk:
                if not buf:
                    raise _IdleClosed
                raise ValueError("connection closed inside the response headers")
            buf += chunk
        lines = bytes(buf[:end]).decode("latin-1").split("\r\n")
        version, _, rest = lines[0].partition(" ")
        if not version.startswith("HTTP/1."):
            raise ValueError(f"not an HTTP/1.x response: {lines[0][:40]!r}")
        status = int(rest[:3])
        headers = {}
        for line in lines[1:]:
            name, _, value = line.partition(":")
            headers[name.strip().lower()] = value.strip()
        extra = memoryview(buf)[end + 4:]
        if method == "HEAD" or status in (204, 304) or 100 <= status < 200:
            content: bytes | memoryview = b""
        elif "chunked" in headers.get("transfer-encoding", "").lower():
            content = self._chunked(bytes(extra))
        elif "content-length" in headers:
            content = self._exactly(int(headers["content-length"]), extra)
        else:
            raise ValueError("response without content-length")
        if headers.get("connection", "").lower() == "close":
            self.close()
        return RawResponse(status, headers, content)

    def _exactly(self, n: int, extra: memoryview) -> bytes | memoryview:
        if len(extra) > n:
            raise ValueError("more bytes than content-length")
        if n < POOL_MIN_BYTES:
            data = bytearray(extra)
            while len(data) < n:
                chunk = self.sock.recv(n - len(data))
                if not chunk:
                    raise ValueError("connection closed inside the body")
                data += chunk
            return bytes(data)
        view = memoryview(self._buffer(n))[:n]
        view[:len(extra)] = extra
        got = len(extra)
        while got < n:
            r = self.sock.recv_into(view[got:], n - got)
            if not r:
                raise ValueError("connection closed inside the body")
            got += r
        return view

    def _buffer(self, n: int) -> np.ndarray:
        """A byte array of at least n bytes that no earlier answer's arrays still view."""
        for i, arr in enumerate(self._pool):
            if sys.getrefcount(arr) <= 3:  # the pool list, the loop variable, the argument
                if arr.nbytes < n:
                    arr = self._pool[i] = np.empty(n, np.uint8)
                return arr
        arr = np.empty(n, np.uint8)
        if len(self._pool) < 2:
            self._pool.append(arr)
        return arr

    def _chunked(self, data: bytes) -> bytes:
        out = bytearray()
        buf = bytearray(data)
        while True:
            while b"\r\n" not in buf:
                self._more(buf)
            line, _, rest = bytes(buf).partition(b"\r\n")
            size = int(line.split(b";")[0], 16)
            buf = bytearray(rest)
            while len(buf) < size + 2:
                self._more(buf)
            if size == 0:
                return bytes(out)
            out += buf[:size]
            buf = buf[size + 2:]

    def _more(self, buf: bytearray) -> None:
        chunk = self.sock.recv(65536)
        if not chunk:
            raise ValueError("connection closed inside a chunked body")
        buf += chunk


class _IdleClosed(Exception):
    """The server had closed the kept-alive connection before this request."""
