"""The worker's heartbeat thread (worker_service/loop.Heartbeat) against a real PS: it renews the lease while the
main loop is quiet (a step that computes longer than the lease), and sends nothing while the main loop's pushes
and pulls renew it often enough (a thousand workers with short steps would otherwise add a thousand requests per
lease/3 to the PS's load)."""
from __future__ import annotations

import time

from cluster.processes import wait_for
from tests.live_ps import live_ps
from worker_service.loop import Heartbeat


def test_heartbeats_keep_a_quiet_worker_and_stay_quiet_while_the_main_loop_renews():
    with live_ps(min_workers=1, startup_grace_seconds=0, lease_seconds=1.0) as ps:
        c = ps.client()
        wid = c.register("a")["worker_id"]
        renewed = [float("-inf")]
        hb = Heartbeat(c.base_url, wid, 0.3, 5.0, None, lambda: renewed[0])
        hb.start()
        try:
            # quiet main loop: the thread keeps the 1 s lease for 3 s
            t0 = time.monotonic()
            wait_for(lambda: hb.sent >= 8, 10.0, "8 heartbeats")
            assert time.monotonic() - t0 >= 2.0
            assert ps.rt.core.members.by_id[wid].state == "active"
            # the main loop renews every 0.1 s: no heartbeat goes out
            sent, end = hb.sent, time.monotonic() + 1.5
            while time.monotonic() < end:
                renewed[0] = time.monotonic()
                time.sleep(0.1)
            assert hb.sent - sent <= 1  # at most one already under way when the renewals began
        finally:
            hb.halt.set()
            hb.join(5)
        c.close()
