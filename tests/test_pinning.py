"""Workers pinned to CPUs: ``WORKER_CPUS`` (worker_service/__main__.py, worker_service/settings.py) and the local
cluster's choice of one CPU per worker when they fit (cluster/processes.py, ``LocalCluster.worker_cpu``)."""
from __future__ import annotations

import os

import pytest
from pydantic import ValidationError

from cluster.processes import LocalCluster, wait_for
from tests.timing import allow
from worker_service.settings import WorkerSettings, cpu_list

pytestmark = pytest.mark.skipif(not hasattr(os, "sched_getaffinity"), reason="no CPU affinity on this OS")
CPUS = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else []
LONG_JOB = {"PS_MAX_STEPS": 100000}


def test_a_cpu_list_is_read_as_linux_writes_it_and_anything_else_is_refused():
    assert cpu_list("3") == {3} and cpu_list("0-3,6") == {0, 1, 2, 3, 6} and cpu_list(" 1 , 2 ") == {1, 2}
    assert cpu_list("") == set() and WorkerSettings(cpus="").cpus == ""
    for bad in ("x", "3-1", "1-", "-1", "1.5", "0-3;6"):
        with pytest.raises(ValueError, match="not a CPU list"):
            cpu_list(bad)
    with pytest.raises(ValidationError, match="not a CPU list"):
        WorkerSettings(cpus="two")


def allowed(pid: int) -> set[int]:
    return set(os.sched_getaffinity(pid))


def test_a_local_cluster_gives_each_worker_a_cpu_of_its_own_when_they_fit():
    """As many workers as CPUs (2 on our machines): worker i runs on the i-th CPU, all its threads (the heartbeat's
    too), and says so; the PS is not pinned."""
    n = min(2, len(CPUS))
    with LocalCluster(n, ps_env=LONG_JOB) as c:
        assert c.pinned == {i: CPUS[i] for i in range(n)}
        for i, w in enumerate(c.workers):
            wait_for(lambda i=i: f"running on CPU {CPUS[i]} (WORKER_CPUS)" in c.log(f"worker-{i}"), allow(60),
                     f"worker {i} to pin itself")
            wait_for(lambda w=w: len(os.listdir(f"/proc/{w.pid}/task")) >= 2, allow(60), "the heartbeat thread")
            assert all(allowed(int(t)) == {CPUS[i]} for t in os.listdir(f"/proc/{w.pid}/task"))
        assert allowed(c.ps.pid) == set(CPUS)


def test_more_workers_than_cpus_or_a_given_worker_cpus_are_left_alone():
    """One worker more than CPUs: none is pinned (two would share a CPU). WORKER_CPUS given: it wins."""
    with LocalCluster(len(CPUS) + 1, ps_env=LONG_JOB) as c:
        assert c.pinned == {}
        wait_for(lambda: "registered as" in c.log("worker-0"), allow(60), "worker 0 to register")
        assert all(allowed(w.pid) == set(CPUS) for w in c.workers)
    with LocalCluster(1, ps_env=LONG_JOB, worker_env={"WORKER_CPUS": str(CPUS[-1])}) as c:
        assert c.pinned == {}
        wait_for(lambda: "registered as" in c.log("worker-0"), allow(60), "worker 0 to register")
        assert allowed(c.workers[0].pid) == {CPUS[-1]}
    with LocalCluster(1, ps_env=LONG_JOB, pin_workers=False) as c:
        assert c.pinned == {}


def test_a_worker_told_to_run_on_cpus_it_cannot_use_stops_and_says_why():
    with LocalCluster(1, ps_env=LONG_JOB, worker_env={"WORKER_CPUS": "4096"}) as c:
        assert c.wait_workers(allow(60)) != [0]
        assert "WORKER_CPUS=4096: cannot run on those CPUs" in c.log("worker-0")
