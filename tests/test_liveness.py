"""A connection whose peer host goes silent ends in seconds, not after its request's timeout (shared/liveness.py).

Every socket between a worker and a PS carries the options (the worker's, the PS's accepted ones, a shard's links);
between emulated hosts (:class:`bench.hosts.Hosts`, ``cut_off``: packets dropped both ways, no reset), a request
waiting for its answer, a request sent into the silence and a connect into it each fail within about the user
timeout, where TCP's defaults took the whole 30 s request timeout (or its doubling retransmission backoff). On
loopback: a peer that reads nothing (its window shut) ends a large request after the user timeout as well, and the
PS ends a connection whose client leaves a large answer unread that long."""
from __future__ import annotations

import asyncio
import contextlib
import fcntl
import os
import re
import shutil
import socket
import subprocess
import struct
import sys
import termios
import threading
import time

import pytest

from bench.hosts import Hosts, available
from cluster.processes import LocalCluster, wait_for
from ps_service.sharding.links import Links
from shared import liveness
from shared.rawhttp import ConnectionLost, RawConnection
from shared.httpxconn import HttpxConnection
from tests.timing import allow

#: named after this process, so that two test runs on one machine never share (and remove) each other's hosts
PREFIX, SUBNET = f"spl{os.getpid() % 10000:04d}", f"10.91.{os.getpid() % 250}"
PORT = 18090
REQUEST_TIMEOUT = 30.0
#: a silence noticed within this: the user timeout, plus keep-alive's idle time and a probe interval, plus slack
NOTICED = liveness.USER_TIMEOUT_SECONDS + liveness.IDLE_SECONDS + liveness.INTERVAL_SECONDS + 2.0
#: a server that accepts, reads, and never answers (a PS whose answer is a long poll's)
MUTE_SERVER = f"""
import socket, threading
s = socket.create_server(("0.0.0.0", {PORT}))
print("listening", flush=True)
def drain(c):
    while c.recv(65536):
        pass
while True:
    threading.Thread(target=drain, args=(s.accept()[0],), daemon=True).start()
"""

needs_hosts = pytest.mark.skipif(not (available(PREFIX) and shutil.which("iptables")),
                                 reason="needs root with ip, tc, iptables and network namespaces")


#: what :func:`_options` reads on a socket that carries the liveness options
OPTIONS = {"keepalive": 1, "user_timeout_ms": int(liveness.USER_TIMEOUT_SECONDS * 1000)}


def _options(sock) -> dict:
    return {"keepalive": sock.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE),
            "user_timeout_ms": sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_USER_TIMEOUT)}


def _answering_server() -> socket.socket:
    """A local server that answers every request on a connection with an empty 200, and keeps the connection."""
    srv = socket.create_server(("127.0.0.1", 0))

    def serve(peer):
        peer.settimeout(allow(10))
        with peer, contextlib.suppress(OSError):  # the client gone, or idle allow(10) s: this connection is done
            data = b""
            while chunk := peer.recv(65536):
                data += chunk
                while b"\r\n\r\n" in data:
                    data = data.split(b"\r\n\r\n", 1)[1]
                    peer.sendall(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\n\r\n")

    def accept():
        with contextlib.suppress(OSError):
            while True:
                threading.Thread(target=serve, args=(srv.accept()[0],), daemon=True).start()
    threading.Thread(target=accept, daemon=True).start()
    return srv


def test_the_workers_connection_carries_the_options():
    srv = _answering_server()
    try:
        conn = RawConnection(f"http://127.0.0.1:{srv.getsockname()[1]}")  # connects by itself
        assert conn.request("GET", "/v1/status", {}, timeout=REQUEST_TIMEOUT).status_code == 200
        assert _options(conn.sock) == OPTIONS
        assert conn.sock.gettimeout() == REQUEST_TIMEOUT
        conn.close()
    finally:
        srv.close()


def test_the_httpx_clients_carry_the_options_too():
    """The worker's https transport (:class:`HttpxConnection`) and the coordinator's links to its followers
    (:class:`Links`) build their sockets through httpx: the options reach those sockets as well."""
    srv = _answering_server()
    url = f"http://127.0.0.1:{srv.getsockname()[1]}"
    try:
        conn = HttpxConnection(url)
        try:
            resp = conn.request("GET", "/v1/status", {}, timeout=REQUEST_TIMEOUT)
            assert _options(resp.extensions["network_stream"].get_extra_info("socket")) == OPTIONS
        finally:
            conn.close()

        async def through_links() -> dict:
            links = Links([url, url], None)
            try:
                resp = await links.client.get(f"{url}/v1/shard/state")
                return _options(resp.extensions["network_stream"].get_extra_info("socket"))
            finally:
                await links.close()
        assert asyncio.run(through_links()) == OPTIONS
    finally:
        srv.close()


def test_a_peer_that_reads_nothing_for_the_user_timeout_ends_a_large_request():
    """The kernel's half of a paused PS: its host acknowledges everything its buffers take, then keeps the window shut.
    Since Linux's "tcp: fix TCP_USER_TIMEOUT with zero window" (2021) the user timeout ends that connection too, so
    a push larger than the buffers into a stopped PS is retried (tests/test_pause.py), and the message says so."""
    srv = socket.create_server(("127.0.0.1", 0))
    accepted: list = []
    threading.Thread(target=lambda: accepted.append(srv.accept()[0]), daemon=True).start()  # never reads
    try:
        conn = RawConnection(f"http://127.0.0.1:{srv.getsockname()[1]}")
        seconds, why = _request(conn, b"x" * (64 << 20))  # more than any loopback buffers (tcp_rmem/wmem's maxima)
        assert liveness.USER_TIMEOUT_SECONDS - 0.5 < seconds < liveness.USER_TIMEOUT_SECONDS + 3.0, (seconds, why)
        assert "read nothing" in why and "paused" in why, why
    finally:
        srv.close()
        for peer in accepted:
            peer.close()


def _model_answer_after(host: str, port: int, unread: float) -> tuple[int, str | None]:
    """``GET /v1/model`` on a fresh connection with a small receive buffer, nothing read for ``unread`` s, then read
    until the body's announced length: the body bytes received, and the error that ended the connection, if any."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 65536)
    sock.settimeout(REQUEST_TIMEOUT)
    with sock:
        sock.connect((host, port))
        sock.sendall(b"GET /v1/model HTTP/1.1\r\nhost: ps\r\n\r\n")
        start = time.monotonic()
        wait_for(lambda: time.monotonic() - start >= unread, unread + 1, "the unread time", interval=0.1)
        data, length = b"", None
        try:
            while length is None or len(data) < length:
                chunk = sock.recv(1 << 20)
                if not chunk:
                    return len(data), "closed"
                data += chunk
                if length is None and b"\r\n\r\n" in data:
                    head, data = data.split(b"\r\n\r\n", 1)
                    length = int(re.search(rb"(?im)^content-length:\s*(\d+)", head).group(1))
        except ConnectionError as exc:
            return len(data), type(exc).__name__
        return len(data), None


def test_the_ps_ends_a_connection_whose_client_leaves_a_large_answer_unread():
    """docs/protocol.md, Connections: an answer left unread for the user timeout once the buffers are full is not
    delivered (the PS's kernel ends the connection); read sooner, it arrives whole."""
    worker_env = {"WORKER_TASK": "bench.task:params_4000000", "WORKER_SHM_DIR": "", "WORKER_COMPUTE_DELAY_SECONDS": 0.5}
    with LocalCluster(1, ps_env={"PS_MAX_STEPS": 100000}, worker_env=worker_env) as c:
        wait_for(lambda: c.status()["global_step"] >= 1, allow(60), "the model and a first step")
        host, port = c.url.split("//")[1].rsplit(":", 1)
        got, error = _model_answer_after(host, int(port), 1.0)
        assert got > 16_000_000 and error is None, (got, error)  # 4e6 float32 weights, whole
        got, error = _model_answer_after(host, int(port), liveness.USER_TIMEOUT_SECONDS + 3.0)
        assert error == "ConnectionResetError" and got < 16_000_000, (got, error)


@pytest.mark.skipif(shutil.which("ss") is None, reason="needs ss (iproute2)")
def test_the_ps_sets_them_on_the_connections_it_accepts():
    c = LocalCluster(1)
    try:
        c.start_ps()
        port = int(c.url.rsplit(":", 1)[1])
        client = socket.create_connection(("127.0.0.1", port), timeout=allow(10))
        mine = client.getsockname()[1]

        def ps_side() -> str:  # the PS's end of this connection: ss shows its keep-alive timer
            out = subprocess.run(["ss", "-tnoH", "state", "established", f"( sport = :{port} and dport = :{mine} )"],
                                 capture_output=True, text=True, timeout=allow(10)).stdout
            return out if "keepalive" in out else ""
        wait_for(ps_side, allow(10), "the PS's end with its keep-alive timer")
        client.close()
    finally:
        c.stop()


@pytest.fixture(scope="module")
def mute_host():
    """Host 0 runs :data:`MUTE_SERVER`; the test (outside every emulated host) is its client."""
    with Hosts(1, "1gbit", PREFIX, SUBNET) as hosts:
        server = subprocess.Popen([*hosts.exec_prefix(0), sys.executable, "-c", MUTE_SERVER],
                                  stdout=subprocess.PIPE, text=True)
        try:
            assert server.stdout.readline().strip() == "listening"
            yield hosts
        finally:
            server.kill()
            server.wait(allow(10))


def _unacknowledged(sock) -> int:
    """Bytes of ``sock``'s send queue not yet acknowledged (``SIOCOUTQ``)."""
    return struct.unpack("i", fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, b"\0" * 4))[0]


def _request(conn: RawConnection, body: bytes = b"") -> tuple[float, str]:
    """Seconds until the request failed, and why."""
    start = time.monotonic()
    with pytest.raises(ConnectionLost) as err:
        conn.request("POST", "/v1/gradients", {"content-type": "application/octet-stream"}, [body],
                     timeout=REQUEST_TIMEOUT)
    return time.monotonic() - start, str(err.value)


@needs_hosts
def test_a_request_waiting_for_its_answer_notices_the_hosts_silence(mute_host):
    conn = RawConnection(f"http://{mute_host.ip(0)}:{PORT}")
    got: dict = {}
    waiting = threading.Thread(target=lambda: got.update(r=_request(conn)))
    waiting.start()
    # the request sent and acknowledged: the connection is idle in its wait, as in a long poll
    wait_for(lambda: conn.sock is not None and _unacknowledged(conn.sock) == 0, allow(10), "the request acknowledged")
    with mute_host.cut_off(0):
        waiting.join(REQUEST_TIMEOUT + 5)
    seconds, why = got["r"]
    assert seconds < NOTICED, (seconds, why)
    assert "acknowledged nothing" in why


@needs_hosts
def test_a_request_sent_into_the_silence_and_a_connect_fail_in_seconds(mute_host):
    conn = RawConnection(f"http://{mute_host.ip(0)}:{PORT}")
    conn.sock = liveness.connect(mute_host.ip(0), PORT, REQUEST_TIMEOUT)
    conn._idle.since = time.monotonic()  # a kept-alive connection, just used
    with mute_host.cut_off(0):
        seconds, why = _request(conn, b"x" * (1 << 20))
        assert seconds < liveness.USER_TIMEOUT_SECONDS + 2.0, (seconds, why)
        start = time.monotonic()
        with pytest.raises(ConnectionLost, match="no connect to .* no answer in"):
            RawConnection(f"http://{mute_host.ip(0)}:{PORT}").request("GET", "/v1/status", {}, timeout=REQUEST_TIMEOUT)
        assert time.monotonic() - start < liveness.connect_timeout(REQUEST_TIMEOUT) + 1.0
