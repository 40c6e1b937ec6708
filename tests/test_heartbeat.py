"""The worker's heartbeat thread (worker_service/loop.Heartbeat) against a real PS: it renews the lease while the
main loop is quiet (a step that computes longer than the lease), and sends nothing while the main loop's pushes
and pulls renew it often enough (a thousand workers with short steps would otherwise add a thousand requests per
lease/3 to the PS's load), but beats on while a pull with the worker id waits for a slow round (the PS holds the
lease then, but tells its own outage from the others' by whom it hears from); its heartbeats reuse one kept-alive
connection, made again once, without a failure, when the PS had closed it."""
from __future__ import annotations

import socket
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import numpy as np

from cluster.processes import wait_for
from shared import keepalive, liveness
from tests.live_ps import live_ps
from tests.timing import allow
from worker_service.loop import Heartbeat


def test_heartbeats_keep_a_quiet_worker_and_stay_quiet_while_the_main_loop_renews():
    lease = allow(1.0)  # 1 s on a quiet machine: a busy one may hold a heartbeat back for longer than that
    period = 0.3 * lease
    with live_ps(min_workers=1, startup_grace_seconds=0, lease_seconds=lease) as ps:
        c = ps.client()
        wid = c.register("a")["worker_id"]
        renewed = [float("-inf")]
        hb = Heartbeat(c.base_url, wid, period, allow(5.0), None, lambda: renewed[0])
        hb.start()
        try:
            # quiet main loop: the thread keeps the lease for more than 2 leases
            t0 = time.monotonic()
            wait_for(lambda: hb.sent >= 8, 10 * lease, "8 heartbeats")
            assert time.monotonic() - t0 >= 2.0 * lease
            assert ps.rt.core.members.by_id[wid].state == "active"
            # the main loop renews every period / 3: no heartbeat goes out
            sent, end = hb.sent, time.monotonic() + 5 * period
            while time.monotonic() < end:
                renewed[0] = time.monotonic()
                time.sleep(period / 3)  # the main loop's steps, not a synchronisation
            assert hb.sent - sent <= 1  # at most one already under way when the renewals began (or to keep warm)
        finally:
            hb.halt.set()
            hb.join(allow(5))
        c.close()


def test_a_failed_heartbeat_is_logged_as_a_warning(caplog):
    """Heartbeats to a PS that is gone fail; each failure is said at warning level with its count, since a lease that
    runs out while the worker computes starts there (debug level hid it when 27 of 64 workers' leases ran out)."""
    import socket

    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
    hb = Heartbeat(url, "w-1", 0.05, 1.0)
    with caplog.at_level("WARNING", logger="worker"):
        hb.start()
        try:
            wait_for(lambda: hb.failed >= 2, allow(10.0), "2 failed heartbeats")
        finally:
            hb.halt.set()
            hb.join(allow(5))
    assert hb.sent == 0
    said = [r.getMessage() for r in caplog.records if "heartbeat failed" in r.getMessage()]
    assert said and said[0].startswith("heartbeat failed (1 in a row") and "(2 in a row" in said[1]


@contextmanager
def beating(hb: Heartbeat) -> Iterator[Heartbeat]:
    """The thread running for the block, stopped after it."""
    hb.start()
    try:
        yield hb
    finally:
        hb.halt.set()
        hb.join(allow(5))


def counting_connects(monkeypatch) -> list:
    """Every TCP connection the worker's raw connections make from now on, by its local address."""
    made, connect = [], liveness.connect

    def counted(host: str, port: int, timeout: float) -> socket.socket:
        sock = connect(host, port, timeout)
        made.append(sock.getsockname())
        return sock

    monkeypatch.setattr(liveness, "connect", counted)
    return made


def test_heartbeats_reuse_one_kept_connection(monkeypatch):
    """Twenty heartbeats of a quiet main loop go on one TCP connection (the PS keeps it 60 s, the thread reuses it
    for 30)."""
    with live_ps(min_workers=1, startup_grace_seconds=0, http_keepalive_seconds=60) as ps:
        c = ps.client()
        wid = c.register("a")["worker_id"]
        made = counting_connects(monkeypatch)
        with beating(Heartbeat(c.base_url, wid, 0.02, allow(5.0))) as hb:
            wait_for(lambda: hb.sent >= 20, allow(10.0), "20 heartbeats")
        assert len(made) == 1 and hb.failed == 0 and hb.stale == 0
        assert ps.rt.core.members.by_id[wid].state == "active"
        c.close()


def test_heartbeats_go_on_while_a_pull_with_the_worker_id_waits():
    """The PS holds the lease while a pull with the worker id waits for its round, but a wait is no sign of life (a PS
    that hears from no worker for half a lease takes it for its own outage: docs/protocol.md): the thread beats on, a
    pull that waits 20 periods for a round that does not close (2 workers expected, 1 in) seeing about 20 heartbeats
    (at most one at each end before the PS's silence was no silence); the lease holds."""
    with live_ps(min_workers=2, startup_grace_seconds=0, lease_seconds=60) as ps:
        c = ps.client()
        wid = c.register("a")["worker_id"]
        assert c.init_model({"w": np.zeros(4, np.float32)})
        wait = allow(2.0)
        with beating(Heartbeat(c.base_url, wid, wait / 20, allow(5.0), None, lambda: c.lease_renewed)) as hb:
            before = hb.sent
            assert c.pull(0, wid, wait) is None  # the long poll ran out: round 0 has not started
            during = hb.sent - before
        assert during >= 5 and hb.failed == 0
        assert ps.rt.core.members.by_id[wid].state == "active"
        c.close()


def _answer(conn: socket.socket) -> bool:
    """Read one request (no body) from ``conn``; False if the peer closed first."""
    got = b""
    while b"\r\n\r\n" not in got:
        chunk = conn.recv(4096)
        if not chunk:
            return False
        got += chunk
    return True


def test_a_kept_connection_the_ps_closed_is_made_again_once_without_a_failure():
    """A server that answers the first heartbeat (keep-alive 60 s), then reads the second and closes the connection
    without answering (the PS closing an idle connection as the request arrives): the thread sends it again on a new
    connection, which the server answers; no heartbeat counts as failed."""
    ok = (b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\ncontent-type: application/json\r\n"
          + f"{keepalive.HEADER}: {keepalive.header_value(60)}\r\n\r\n{{}}".encode())
    accepted = []
    with socket.create_server(("127.0.0.1", 0)) as server:
        server.settimeout(allow(10))

        def serve() -> None:
            first, _ = server.accept()
            accepted.append(first)
            first.settimeout(allow(10))
            if _answer(first):
                first.sendall(ok)
            if _answer(first):
                first.close()  # the second request is read, never answered
            second, _ = server.accept()
            accepted.append(second)
            second.settimeout(allow(10))
            while _answer(second):
                second.sendall(ok)
            second.close()

        thread = threading.Thread(target=serve, daemon=True)
        thread.start()
        with beating(Heartbeat(f"http://127.0.0.1:{server.getsockname()[1]}", "w-1", 0.02, allow(5.0))) as hb:
            wait_for(lambda: hb.sent >= 3, allow(5.0), "3 heartbeats answered")
        thread.join(allow(5))
    assert hb.failed == 0 and hb.stale == 1 and len(accepted) == 2
