"""How a connection between a worker and a PS (or two shards) notices that the host at its other end went silent
(docs/protocol.md, "Connections").

A host cut off the network sends no reset and no error: packets just stop. Left to TCP's defaults, a request in
flight is retransmitted with a doubling backoff (0.2 s, 0.4 s, ... 13 s, 26 s, ...), so the job moved again 6.5 s
after a 20 s outage and 10.5 s after a 60 s one (measured between emulated hosts of bench/hosts.py),
and a connection idle in a long poll notices nothing until the request's whole timeout (30 s plus the wait) ran out.

Both ends therefore set, on every connection (Linux; elsewhere what the platform has):

- ``TCP_USER_TIMEOUT`` of :data:`USER_TIMEOUT_SECONDS`: data sent and not acknowledged that long ends the
  connection; a connect waits no longer than that either (:func:`connect_timeout`, given to every client's connect);
- keep-alive probes after :data:`IDLE_SECONDS` with nothing received, every :data:`INTERVAL_SECONDS`: a long
  poll whose PS host vanished ends after about the user timeout, not after its request timeout.

Acknowledgements and probe answers come from the peer's kernel, not from its program: a PS busy for seconds (a
thousand workers, a large model to encode) or paused keeps every idle or waiting connection, so a slow peer is not
taken for a gone one while nothing waits to be sent. Data that waits is another matter: on current Linux (measured
on 6.18; the kernel change "tcp: fix TCP_USER_TIMEOUT with zero window", 2021) the user timeout also ends a
connection whose peer kept its receive window shut that long, i.e. read nothing while its buffers were full. So a
push larger than the socket buffers (a few MB), sent to a PS stopped for more than 5 s (``SIGSTOP``, a paused
container or VM), ends in ``ETIMEDOUT`` just like one sent into a silent network, and so does a large answer to a
client that reads nothing for 5 s. Either way the client retries on a fresh connection (a push whose body had
arrived whole is answered ``duplicate``; a partial one was never counted), each attempt's connect bounded by
:func:`connect_timeout`, so the job moves again within a second or two of the network's (or the PS's) return,
whatever the outage's length (tests/test_liveness.py, tests/test_pause.py).
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
