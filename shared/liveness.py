"""How a connection between a worker and a PS (or two shards) notices that the host at its other end went silent
(docs/protocol.md, "Connections", says why and what was measured).

Contract: both ends set, on every connection (Linux; elsewhere what the platform has), ``TCP_USER_TIMEOUT`` of
:data:`USER_TIMEOUT_SECONDS` (data unacknowledged that long ends the connection; a connect waits no longer either:
:func:`connect_timeout`, for all of a host's addresses together, :func:`connect`) and keep-alive probes after
:data:`IDLE_SECONDS` with nothing received, every
:data:`INTERVAL_SECONDS`, so a long poll whose peer host vanished ends after about the user timeout. Probe answers
come from the peer's kernel: a busy or paused peer keeps an idle connection, but one that reads nothing for the user
timeout while data waits (a push larger than the socket buffers to a stopped PS) ends in ``ETIMEDOUT``, and the
client retries on a fresh connection (tests/test_liveness.py, tests/test_pause.py).
"""
from __future__ import annotations

import errno
import os
import selectors
import socket
import time

#: unacknowledged data (or an unanswered connect or probe) for this long ends a connection
USER_TIMEOUT_SECONDS = 5.0
#: keep-alive probes start after this long with nothing received, and repeat this often
IDLE_SECONDS = 2
INTERVAL_SECONDS = 1
#: a connect to a host's next address starts this long after the one before unless that one failed sooner (RFC 8305's
#: Connection Attempt Delay)
STAGGER_SECONDS = 0.25


class NoConnect(OSError):
    """No address of the host took a connection in the connect's time; the message names each and how long it took."""


def socket_options() -> list[tuple[int, int, int]]:
    """``(level, option, value)`` for ``setsockopt``: the options above this platform has."""
    opts = [(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)]
    for name, value in (("TCP_KEEPIDLE", IDLE_SECONDS), ("TCP_KEEPINTVL", INTERVAL_SECONDS),
                        ("TCP_KEEPCNT", int(USER_TIMEOUT_SECONDS / INTERVAL_SECONDS) + 1),
                        ("TCP_USER_TIMEOUT", int(USER_TIMEOUT_SECONDS * 1000))):
        if hasattr(socket, name):
            opts.append((socket.IPPROTO_TCP, getattr(socket, name), value))
    return opts


def apply(sock: socket.socket) -> None:
    """Set :func:`socket_options` on a TCP socket (connected or not); a socket of another kind is left as it is."""
    if sock.family not in (socket.AF_INET, socket.AF_INET6) or sock.type != socket.SOCK_STREAM:
        return
    for level, option, value in socket_options():
        sock.setsockopt(level, option, value)


def connect(host: str, port: int, timeout: float) -> socket.socket:
    """A TCP connection to ``host:port`` with the options set before its first packet, then ``timeout`` bounding each
    socket operation. The connect waits at most :func:`connect_timeout` of ``timeout`` in all: a host's addresses race
    as in happy eyeballs (RFC 8305), in ``getaddrinfo``'s order, each :data:`STAGGER_SECONDS` after the one before or
    at once when it failed; the first connected is kept, the others closed. None: :class:`NoConnect`."""
    addresses = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    said = [f"{_named(a[4])} not tried" for a in addresses]
    start = next_at = time.monotonic()
    deadline, tried = start + connect_timeout(timeout), 0
    with selectors.DefaultSelector() as racing:
        try:
            while (now := time.monotonic()) < deadline and (tried < len(addresses) or racing.get_map()):
                if tried < len(addresses) and now >= next_at:
                    sock, code = _begin(addresses[tried])
                    if sock is not None:
                        racing.register(sock, selectors.EVENT_WRITE, (tried, now))
                        next_at = now + STAGGER_SECONDS
                    else:
                        said[tried], next_at = _said(addresses[tried][4], now, code), now
                    tried += 1
                    continue
                for key, _ in racing.select(min(next_at if tried < len(addresses) else deadline, deadline) - now):
                    racing.unregister(sock := key.fileobj)
                    i, began = key.data
                    if not (code := sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)):
                        sock.settimeout(timeout)
                        return sock
                    sock.close()
                    said[i], next_at = _said(addresses[i][4], began, code), time.monotonic()
        finally:
            for key in list(racing.get_map().values()):
                key.fileobj.close()
                said[key.data[0]] = _said(addresses[key.data[0]][4], key.data[1])
    silent = " (a network outage or the host gone)" if any("no answer" in s for s in said) else ""
    raise NoConnect(f"no connect to {host}:{port} in {time.monotonic() - start:.2f} s: {'; '.join(said)}{silent}")


def _begin(info: tuple) -> tuple[socket.socket | None, int]:
    """A non-blocking connect to one ``getaddrinfo`` entry begun: (its socket, 0 or EINPROGRESS), or (None, the errno
    it failed with at once: refused on loopback, no such address family here...)."""
    family, kind, proto, _, address = info
    try:
        sock = socket.socket(family, kind, proto)
    except OSError as exc:
        return None, exc.errno or errno.EINVAL
    apply(sock)
    sock.setblocking(False)
    if (code := sock.connect_ex(address)) in (0, errno.EINPROGRESS):
        return sock, code
    sock.close()
    return None, code


def _said(address: tuple, began: float, code: int = errno.ETIMEDOUT) -> str:
    """What a connect to ``address`` begun at ``began`` gave: ``code`` (an errno), after how long."""
    took = f"{time.monotonic() - began:.2f} s"
    why = f"no answer in {took}" if code == errno.ETIMEDOUT else f"{os.strerror(code).lower()} after {took}"
    return f"{_named(address)} {why}"


def _named(address: tuple) -> str:
    """``host:port`` of a socket address (``[v6]:port``)."""
    return f"[{address[0]}]:{address[1]}" if ":" in address[0] else f"{address[0]}:{address[1]}"


def connect_timeout(timeout: float) -> float:
    """How long a connect may wait, to all of a host's addresses together (:func:`connect`): ``timeout``, but no
    longer than the user timeout (a SYN unanswered that long is lost; a fresh attempt sends a fresh one at once
    instead of waiting out TCP's doubling backoff)."""
    return min(timeout, USER_TIMEOUT_SECONDS)
