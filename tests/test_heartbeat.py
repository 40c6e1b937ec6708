"""The worker's heartbeat thread (worker_service/loop.Heartbeat) against a real PS: it renews the lease while the
main loop is quiet (a step that computes longer than the lease), and sends nothing while the main loop's pushes
and pulls renew it often enough (a thousand workers with short steps would otherwise add a thousand requests per
lease/3 to the PS's load)."""
from __future__ import annotations

import time

from cluster.processes import wait_for
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
        hb = Heartbeat(c.base_url, wid, period, 5.0, None, lambda: renewed[0])
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
            assert hb.sent - sent <= 1  # at most one already under way when the renewals began
        finally:
            hb.halt.set()
            hb.join(5)
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
            wait_for(lambda: hb.failed >= 2, 10.0, "2 failed heartbeats")
        finally:
            hb.halt.set()
            hb.join(5)
    assert hb.sent == 0
    said = [r.getMessage() for r in caplog.records if "heartbeat failed" in r.getMessage()]
    assert said and said[0].startswith("heartbeat failed (1 in a row") and "(2 in a row" in said[1]
