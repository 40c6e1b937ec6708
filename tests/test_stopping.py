"""worker_service/stopping.py: a stop flag SIGTERM's handler may set at any point of the main thread.

- set() from every call boundary inside wait() returns (the profile hook runs exactly where a signal handler
  can: between two bytecodes of the main thread); the same harness hangs threading.Event, which is how a
  SIGTERM hung a worker in CI;
- wait() wakes at once when another thread sets the flag, and times out with False;
- live: a worker in a long compute (WORKER_COMPUTE_DELAY_SECONDS) stopped with SIGTERM leaves the cluster
  and exits 0 at once, and the PS's barrier stops waiting for it.
"""
from __future__ import annotations

import signal
import subprocess
import sys
import textwrap
import threading
import time

import httpx

from cluster.processes import LocalCluster, wait_for
from tests.timing import allow
from worker_service.stopping import StopFlag

HARNESS = textwrap.dedent("""
    import sys, threading
    from worker_service.stopping import StopFlag

    def boundaries(make):
        # how many call/return events one wait() has, then set() at each one in turn, like a signal handler
        events = []
        flag = make()
        sys.setprofile(lambda frame, event, arg: events.append(event))
        flag.wait(0.001)
        sys.setprofile(None)
        for k in range(len(events)):
            flag, seen = make(), [0]
            def hook(frame, event, arg, flag=flag, seen=seen):
                seen[0] += 1
                if seen[0] == k + 1:
                    sys.setprofile(None)
                    flag.set()
            sys.setprofile(hook)
            flag.wait(0.001)
            sys.setprofile(None)
        return len(events)

    n = boundaries(StopFlag if sys.argv[1] == "stopflag" else threading.Event)
    print("returned at all", n, "boundaries", flush=True)
""")


def run_harness(kind: str, timeout: float) -> subprocess.CompletedProcess | None:
    try:
        return subprocess.run([sys.executable, "-c", HARNESS, kind], capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return None


def test_set_at_every_boundary_of_a_wait_returns():
    done = run_harness("stopflag", allow(60))
    assert done is not None and done.returncode == 0, done and done.stderr
    assert "returned at all" in done.stdout


def test_the_harness_hangs_a_threading_event():
    # the bug the flag exists for: Event.set() in the main thread while that thread holds the event's lock
    assert run_harness("event", 3) is None


def test_wait_wakes_when_another_thread_sets_and_times_out_otherwise():
    flag = StopFlag()
    t0 = time.monotonic()
    assert flag.wait(0.05) is False and time.monotonic() - t0 >= 0.04
    timer = threading.Timer(0.05, flag.set)
    timer.start()
    t0 = time.monotonic()
    assert flag.wait(allow(30)) is True and time.monotonic() - t0 < 10
    assert flag.is_set() and flag.wait(0) is True
    timer.join(allow(10))


def test_a_worker_stopped_during_a_long_compute_leaves_at_once():
    with LocalCluster(2, ps_env={"PS_MAX_STEPS": 1000, "PS_LEASE_SECONDS": 600},
                      worker_env={"WORKER_TASK": "linear", "WORKER_COMPUTE_DELAY_SECONDS": 600}) as c:
        wait_for(lambda: len(c.get("/v1/workers").json()["workers"]) == 2, allow(60), "two workers")
        wait_for(lambda: c.status()["global_step"] == 0 and all(
            w["state"] == "active" for w in c.get("/v1/workers").json()["workers"]), allow(60), "both active")
        for p in c.workers:
            p.send_signal(signal.SIGTERM)  # both are in their 600 s compute of step 0
        t0 = time.monotonic()
        assert c.wait_workers(allow(60)) == [0, 0]
        assert time.monotonic() - t0 < 30  # the compute's wait woke: not 600 s, nor a lease
        left = httpx.get(f"{c.url}/v1/workers", timeout=allow(10)).json()["workers"]
        assert all(w["state"] == "left" for w in left), left
        assert c.logs().count("stop requested (SIGTERM or SIGINT): leaving the cluster") == 2
