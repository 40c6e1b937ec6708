"""cluster/processes.py: the ports it hands out, and how a cluster stops mid-job."""
from __future__ import annotations

import os
import socket
import time

import httpx

from cluster import processes
from cluster.processes import LocalCluster, free_port, wait_for
from tests.timing import allow


def test_free_ports_are_distinct_bindable_and_below_the_ephemeral_range():
    ports = [free_port() for _ in range(50)]
    assert len(set(ports)) == len(ports)
    ephemeral = processes._ephemeral_range()
    if ephemeral is not None and ephemeral[0] - processes._PORTS_FROM >= 1000:
        # an outgoing connection never takes one of these as its local port (nor connects to itself on it)
        assert all(processes._PORTS_FROM <= p < ephemeral[0] for p in ports)
    for p in ports[:5]:
        with socket.socket() as s:
            s.bind(("127.0.0.1", p))


def test_a_port_held_is_never_handed_out(monkeypatch):
    held = socket.socket()
    held.bind(("127.0.0.1", 0))
    taken = held.getsockname()[1]
    try:
        monkeypatch.setattr(processes, "_ephemeral_range", lambda: (taken + 1, taken + 2))
        monkeypatch.setattr(processes, "_PORTS_FROM", taken + 1 - 1000)  # the range to draw from ends at `taken`
        drawn = {free_port() for _ in range(20)}
        assert taken not in drawn
    finally:
        held.close()


def test_without_a_readable_ephemeral_range_the_kernel_picks(monkeypatch):
    monkeypatch.setattr(processes, "_ephemeral_range", lambda: None)
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


def test_a_cluster_s_own_deadlines_scale_with_the_patience_the_suite_sets(monkeypatch):
    # set as this test started (tests/conftest.py): the scale of the test's allowances, at least 1
    assert 1.0 <= processes.patience() == float(os.environ["SYNCPS_CLUSTER_PATIENCE"])
    monkeypatch.setenv("SYNCPS_CLUSTER_PATIENCE", "4")
    started = []
    monkeypatch.setattr(LocalCluster, "_start_every_ps", lambda self, deadline: started.append(deadline))
    LocalCluster(0).start_ps()
    LocalCluster(0).start_ps(7.0)  # a deadline given is the caller's
    assert started == [120.0, 7.0]
    monkeypatch.setenv("SYNCPS_CLUSTER_PATIENCE", "0.5")
    assert processes.patience() == 1.0
    monkeypatch.delenv("SYNCPS_CLUSTER_PATIENCE")
    assert processes.patience() == 1.0


def test_a_cluster_stopped_mid_job_lets_its_workers_leave_before_its_ps_stops():
    """Workers first: each leaves the running PS and exits 0 (WORKER_STOPPED_EXIT_CODE) before the PS is sent SIGTERM,
    and nothing needs SIGKILL (a PS stopped with them could make each retry its leave until the grace ended: 10 s)."""
    with LocalCluster(2, ps_env={"PS_MAX_STEPS": 1_000_000}, worker_env={"WORKER_TASK": "linear"}) as c:
        wait_for(lambda: c.status()["global_step"] >= 5, allow(30), "training")
        sent: list[tuple[str, list]] = []  # (to whom, the workers' exit codes then)

        def recorded(name: str, proc) -> None:
            send = proc.send_signal
            proc.send_signal = lambda sig: (sent.append((name, [w.poll() for w in c.workers])), send(sig))
        for i, w in enumerate(c.workers):
            recorded(f"worker-{i}", w)
        recorded("ps", c.ps)
        t0 = time.monotonic()
        c.stop()
        took = time.monotonic() - t0
        assert [name for name, _ in sent] == ["worker-0", "worker-1", "ps"] and sent[-1][1] == [0, 0], sent
        assert not c.failed and all("retrying DELETE" not in c.log(f"worker-{i}") for i in range(2)), c.logs()
        assert took < allow(5), f"stopped in {took:.1f} s"


def test_a_killed_ps_s_port_is_held_from_other_processes_until_it_listens_there_again():
    """A PS kill -9'd comes back at its port (a pair's peer, a shard's siblings and the workers know it by it):
    meanwhile another test process's free_port on the same machine must not hand it out (tests/test_standby_crash.py
    failed once: the port was taken before the restart). Held: a plain bind, free_port's check, fails; the PS binds
    beside the hold (SO_REUSEADDR), and once it answers the port is its alone."""
    with LocalCluster(0, ps_env={"PS_MIN_WORKERS": 1}, standby=True) as c:
        assert c._held == {}  # every PS listens
        for proc, port in ((c.ps, c.port), (c.peer, c.peer_port)):
            c.kill(proc)
            assert ("127.0.0.1", port) in c._held and not processes.bindable(port)
        c.start_ps()
        assert c._held == {}
        for url in (c.url, c.peer_url):
            assert httpx.get(f"{url}/healthz", timeout=allow(10)).status_code == 200
        assert not processes.bindable(c.port, reuse_address=True)  # it listens: not even beside it
        c.kill(c.peer)  # killed and never started again: held until the cluster stops
    assert c._held == {}
