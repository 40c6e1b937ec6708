"""How a connection between a worker and a PS (or two shards) notices that the host at its other end went silent
(docs/protocol.md, "Connections", says why and what was measured).

Contract: both ends set, on every connection (Linux; elsewhere what the platform has), ``TCP_USER_TIMEOUT`` of
:data:`USER_TIMEOUT_SECONDS` (data unacknowledged that long ends the connection; a connect waits no longer either:
:func:`connect_timeout`) and keep-alive probes after :data:`IDLE_SECONDS` with nothing received, every
:data:`INTERVAL_SECONDS`, so a long poll whose peer host vanished ends after about the user timeout. Probe answers
come from the peer's kernel: a busy or paused peer keeps an idle connection, but one that reads nothing for the user
timeout while data waits (a push larger than the socket buffers to a stopped PS) ends in ``ETIMEDOUT``, and the
client retries on a fresh connection (tests/test_liveness.py, tests/test_pause.py).
"""
from __future__ import annotations

import socket

#: unacknowledged data (or an unanswered connect or probe) for this long ends a connection
USER_TIMEOUT_SECONDS = 5.0
#: keep-alive probes start after this long with nothing received, and repeat this often
IDLE_SECONDS = 2
INTERVAL_SECONDS = 1


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
    """A TCP connection to ``host:port`` with the options set before its first packet; the connect waits at most
    :func:`connect_timeout` of ``timeout``, then ``timeout`` bounds each later socket operation."""
    err: OSError | None = None
    for family, kind, proto, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
        sock = socket.socket(family, kind, proto)
        try:
            apply(sock)
            sock.settimeout(connect_timeout(timeout))
            sock.connect(address)
            sock.settimeout(timeout)
            return sock
        except OSError as exc:
            err = exc
            sock.close()
    raise err if err is not None else OSError(f"no address for {host}:{port}")


def connect_timeout(timeout: float) -> float:
    """How long one connect may wait: ``timeout``, but no longer than the user timeout (a SYN unanswered that long
    is lost; a fresh attempt sends a fresh one at once instead of waiting out TCP's doubling backoff)."""
    return min(timeout, USER_TIMEOUT_SECONDS)
