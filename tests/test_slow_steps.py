"""Steps that compute for seconds, as our users' do: they cost only their own time.

- A step slower than the PS's HTTP keep-alive: the worker finds its kept-alive connection closed and
  opens a fresh one at once, instead of sending into the dead one and waiting for its timeout (it used to
  cost ~35 s a step).
- A worker waiting on the barrier longer than its lease (a long-poll pull with its ``worker_id``, without
  heartbeats) stays active, and its next push is accepted (it used to be expired mid-wait and get 409
  ``not_active``).
"""
from __future__ import annotations

import threading
import time

import httpx
import numpy as np

from cluster.processes import LocalCluster, wait_for
from ps_service.core.membership import RECONNECT_SECONDS
from shared import frame
from tests.clusters import closed_rounds
from tests.live_ps import live_ps
from tests.timing import allow

DELAY, KEEPALIVE = 1.0, 0.3


def test_a_step_slower_than_the_keep_alive_costs_no_extra_time():
    steps = 4
    ps_env = {"PS_MAX_STEPS": steps, "PS_HTTP_KEEPALIVE_SECONDS": KEEPALIVE, "PS_TOTAL_NUM_REPLICAS": 2}
    worker_env = {"WORKER_TASK": "linear", "WORKER_COMPUTE_DELAY_SECONDS": DELAY, "WORKER_REQUEST_TIMEOUT_SECONDS": 20}
    with LocalCluster(2, ps_env=ps_env, worker_env=worker_env) as c:
        assert c.wait_workers(allow(60)) == [0, 0], c.logs()
        rounds = closed_rounds(c)
        logs = c.logs()
    assert len(rounds) == steps
    # each round: one compute delay plus the exchange; a stalled request would add the 20 s request timeout (and log)
    assert all(r["duration_seconds"] < DELAY + allow(1.5) for r in rounds), [r["duration_seconds"] for r in rounds]
    assert "retrying" not in logs and "got no answer" not in logs


def test_a_worker_waiting_longer_than_its_lease_stays_active():
    lease = allow(1.0)
    with live_ps(min_workers=1, startup_grace_seconds=0, lease_seconds=lease, tick_seconds=0.05) as ps:
        with ps.http() as h:
            wid = h.post("/v1/workers", json={"name": "a"}).json()["worker_id"]
            w0 = {"w": np.zeros(3, np.float32)}
            body = frame.encode_bytes(w0, {"optimizer": {"name": "sgd", "learning_rate": 0.1}})
            assert h.put("/v1/model", content=body, headers={"content-type": frame.MEDIA_TYPE}).status_code == 201
            wait_for(lambda: h.get("/v1/status").json()["state"] == "training", allow(10), "round 0")
            answer: dict = {}

            def long_poll() -> None:  # round 0 waits for this very worker: the pull times out after 3 leases
                with httpx.Client(base_url=ps.url, timeout=10 * lease) as other:
                    answer["status"] = other.get("/v1/model", params={"min_step": 1, "timeout": 3 * lease,
                                                                      "worker_id": wid}).status_code

            t = threading.Thread(target=long_poll)
            start = time.monotonic()
            t.start()
            states = []
            while t.is_alive() and time.monotonic() - start < 10 * lease:  # watch the lease for the whole wait
                states.append(h.get("/v1/workers").json()["workers"][0]["state"])
            t.join(10 * lease)
            assert answer == {"status": 204} and time.monotonic() - start >= 3 * lease
            assert len(states) > 10 and set(states) == {"active"}, set(states)
            push = frame.encode_bytes({"w": np.ones(3, np.float32)}, {"worker_id": wid, "step": 0})
            r = h.post("/v1/gradients", content=push, headers={"content-type": frame.MEDIA_TYPE})
            assert r.status_code == 200 and r.json()["status"] == "accepted", r.text
            # the lease runs again from the end of the wait: silent now, the worker expires (while the PS hears from
            # another worker: a PS that hears from none holds every lease). The wait without heartbeats was a silence
            # (nobody heard for half a lease): the push that ended it gave every member a lease + RECONNECT_SECONDS
            def expired() -> bool:  # (b registers again and again: its round 1 gets stuck once a expires, and
                assert h.post("/v1/workers", json={"name": "b"}).status_code == 200  # recalls it)
                return h.get("/v1/workers").json()["workers"][0]["state"] == "expired"
            wait_for(expired, 5 * lease + RECONNECT_SECONDS, "the lease to run out")
