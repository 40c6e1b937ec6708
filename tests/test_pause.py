"""A PS that hears from no worker (real PS and worker processes on loopback; docs/protocol.md, "Leases").

- The PS paused (``SIGSTOP``: a stopped container, a VM paused or migrated) for several leases mid-job: it expires
  nobody for a silence it caused itself, so the job ends with the bits of the one-process replay and every push
  accepted (before, every worker was expired on resume and the open round's gradients were lost).
- Every member of the open round killed while another worker waits for the next round: the round cannot close with
  its own members, so it recalls that worker (409 ``not_active``), which registers again, joins it, and the job
  goes on (before, the round and the worker waited for each other for ever).
- The PS paused with pushes larger than the socket buffers on their way: they are ended by the user timeout and sent
  again (shared/liveness.py), each counted once.
"""
from __future__ import annotations

import os
import signal
import time

import numpy as np

from cluster.processes import LocalCluster, wait_for
from shared import liveness
from tests.clusters import closed_rounds, final_weights
from tests.reference import train_reference
from tests.timing import allow

LEASE = 1.0  # on a quiet machine: each test leases allow(LEASE), since a loaded one may hold a heartbeat back


def _events(c: LocalCluster, kind: str) -> list[str]:
    return [e["name"] for e in c.get("/v1/workers").json()["events"] if e["event"] == kind]


def _pause_the_ps_then_finish(c: LocalCluster, pause: float, workers: int, steps: int) -> dict:
    """Stop the PS (``SIGSTOP``) for ``pause`` s, let it go on, wait for the workers; the final status (checked done)."""
    os.kill(c.ps.pid, signal.SIGSTOP)
    try:
        stopped = time.monotonic()
        wait_for(lambda: time.monotonic() - stopped >= pause, pause + 1, "the pause's end", interval=0.2)
    finally:
        os.kill(c.ps.pid, signal.SIGCONT)
    return _finish(c, workers, steps)


def _finish(c: LocalCluster, workers: int, steps: int) -> dict:
    """Wait for the workers (each exits 0); the final status, checked done."""
    assert c.wait_workers(allow(120)) == [0] * workers
    st = c.status()
    assert st["state"] == "done" and st["global_step"] == steps
    return st


def _signal_all(procs, sig: int) -> None:
    for p in procs:
        p.send_signal(sig)


def _retries(c: LocalCluster, workers: int) -> list[int]:
    """How many times each worker has sent a request again because the PS read nothing (shared/liveness.py)."""
    return [c.log(f"worker-{i}").count("the peer read nothing") for i in range(workers)]


def _stop_the_ps_before_the_pushes(c: LocalCluster, workers: int, answered: float, delay: float) -> list[int]:
    """Stop the PS (``SIGSTOP``) when every worker has its round's answer and has not begun to push.

    A worker pushes at least ``delay`` s (its WORKER_COMPUTE_DELAY_SECONDS, which follows the answer) after its
    round opened. So the workers are stopped first, then the PS's status, read while they are stopped, must show
    the round open (from step 2) for less than ``delay`` s and waiting for every push; the PS is stopped, then the
    workers go on. ``answered``: how long after the round's opening its answers are surely read (40 MB each).
    A round the test looked at too late is let go, and the next one is tried. Returns :func:`_retries` as of the
    stop (a PS slowed down by a loaded machine may have made some before)."""
    after = 1
    while True:
        wait_for(lambda: (r := c.status()["round"]) is not None and r["step"] > after and len(r["awaited"]) == workers
                 and r["open_for_seconds"] >= answered, allow(120), f"a round after step {after} answered")
        _signal_all(c.workers, signal.SIGSTOP)
        try:
            r = c.status()["round"]
            if r is not None and len(r["awaited"]) == workers and r["open_for_seconds"] < delay:
                c.ps.send_signal(signal.SIGSTOP)
                return _retries(c, workers)
            after = r["step"] if r is not None else after + 1
        finally:
            _signal_all(c.workers, signal.SIGCONT)


def test_a_ps_paused_for_longer_than_a_lease_loses_no_gradient():
    workers, steps, lease = 3, 60, allow(LEASE)  # paused at step >= 30: 30 rounds after it to show a lost gradient
    pause = 3 * lease
    ps_env = {"PS_MAX_STEPS": steps, "PS_TOTAL_NUM_REPLICAS": workers, "PS_LEASE_SECONDS": lease}
    # the mlp in float64 (its weights move at every step: a lost gradient shows); steps slowed so that the pause
    # falls mid-job
    worker_env = {"WORKER_TASK": "mlp", "WORKER_DTYPE": "float64", "WORKER_COMPUTE_DELAY_SECONDS": 0.03}
    with LocalCluster(workers, ps_env=ps_env, worker_env=worker_env) as c:
        try:
            wait_for(lambda: c.status()["global_step"] >= 30, allow(60), "step 30")
            st = _pause_the_ps_then_finish(c, pause, workers, steps)
            assert st["pushes"]["accepted"] == workers * steps and _events(c, "expired") == []
            got = final_weights(c)
        except Exception as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from exc
    _, ref = train_reference("mlp", workers, steps)
    for k in ref:
        assert got[k].tobytes() == ref[k].tobytes(), f"{k}: not bit-identical (max diff {np.abs(got[k] - ref[k]).max()})"


def test_pushes_larger_than_the_socket_buffers_into_a_paused_ps_are_sent_again():
    """A stopped PS reads nothing: a 40 MB push fills its buffers, and its host keeps the window shut until the
    connection's user timeout ends it (shared/liveness.py). The worker retries on a fresh connection until the PS is
    back: the job ends with every push accepted once, and the worker's log names the cause. The PS stays stopped
    until every worker logged that (at least the user timeout), however long a loaded machine takes to get there."""
    workers, steps = 2, 6
    answered = allow(0.5)  # a round's 40 MB answers are read within this long of its opening
    delay = answered + 2.0  # then each worker computes for this long: the PS is stopped meanwhile
    ps_env = {"PS_MAX_STEPS": steps, "PS_TOTAL_NUM_REPLICAS": workers, "PS_LEASE_SECONDS": 30}
    # 1e7 float32 parameters over TCP: each push 40 MB, more than loopback's socket buffers take
    worker_env = {"WORKER_TASK": "bench.task:params_10000000", "WORKER_SHM_DIR": "",
                  "WORKER_COMPUTE_DELAY_SECONDS": delay}
    with LocalCluster(workers, ps_env=ps_env, worker_env=worker_env) as c:
        try:
            before = _stop_the_ps_before_the_pushes(c, workers, answered, delay)
            try:
                stopped = time.monotonic()
                wait_for(lambda: all(n > b for n, b in zip(_retries(c, workers), before)),
                         allow(delay + liveness.USER_TIMEOUT_SECONDS + 10), "every worker to send its push again",
                         interval=0.2)
                assert time.monotonic() - stopped >= liveness.USER_TIMEOUT_SECONDS
            finally:
                c.ps.send_signal(signal.SIGCONT)
            st = _finish(c, workers, steps)
            assert st["pushes"] == {"accepted": workers * steps, "stale": 0, "late": 0, "duplicate": 0, "skipped": 0}
            assert [len(r["contributors"]) for r in closed_rounds(c, steps)] == [workers] * steps
        except Exception as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from exc


def test_every_member_of_a_round_killed_recalls_the_worker_waiting_for_the_next():
    steps = 20
    ps_env = {"PS_MAX_STEPS": steps, "PS_MIN_WORKERS": 2, "PS_TOTAL_NUM_REPLICAS": 2, "PS_LEASE_SECONDS": allow(LEASE)}
    # workers 0 and 1 take round 0 and never finish computing it (they heartbeat meanwhile)
    with LocalCluster(2, ps_env=ps_env, worker_env={"WORKER_COMPUTE_DELAY_SECONDS": 3600}) as c:
        try:
            wait_for(lambda: (s := c.status())["state"] == "training" and s["round"]["step"] == 0
                     and len(s["round"]["awaited"]) == 2, allow(30), "round 0 waiting for workers 0 and 1")
            joiner = c.start_worker(2, env={"WORKER_COMPUTE_DELAY_SECONDS": 0})
            wait_for(lambda: c.status()["workers"]["active"] == 3, allow(30), "worker 2 registered (for round 1)")
            for w in c.workers[:2]:
                c.kill(w)
            assert joiner.wait(allow(60)) == 0
            st = c.status()
            assert st["state"] == "done" and st["global_step"] == steps
            assert sorted(_events(c, "expired")) == ["worker-0", "worker-1"] and _events(c, "recalled") == ["worker-2"]
            first = closed_rounds(c, steps)[0]
            assert first["step"] == 0 and [a["name"] for a in first["contributors"]] == ["worker-2"]
        except Exception as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from exc
