"""Exactly-once pushes under retries: the fault-injecting transport, and a sync run through an unreliable
network (10% dropped before the PS, 10% lost after it, 10% duplicated) that ends bit-identical to a clean one."""
from __future__ import annotations

import re

import httpx
import numpy as np
import pytest

from cluster.processes import LocalCluster
from tests.clusters import final_weights
from worker_service.client import PSClient
from worker_service.faults import FaultTransport


def counting_server():
    calls = []

    def handle(request: httpx.Request) -> httpx.Response:
        calls.append(request.content)
        return httpx.Response(200, json={"n": len(calls)})

    return calls, httpx.MockTransport(handle)


@pytest.mark.parametrize("kind, error, reached", [("drop_before", httpx.ConnectError, 0),
                                                   ("drop_after", httpx.ReadError, 1)])
def test_drops_before_and_after_the_server(kind, error, reached):
    calls, inner = counting_server()
    with httpx.Client(transport=FaultTransport(**{kind: 1.0}, inner=inner), base_url="http://ps") as http:
        with pytest.raises(error):
            http.post("/v1/gradients", content=b"x")
    assert len(calls) == reached


def test_duplicates_reach_the_server_twice_and_the_client_gets_the_first_answer():
    calls, inner = counting_server()
    with httpx.Client(transport=FaultTransport(duplicate=1.0, inner=inner), base_url="http://ps") as http:
        assert http.post("/v1/gradients", content=b"body").json() == {"n": 1}
    assert calls == [b"body", b"body"]


def test_fault_rates_are_seeded_and_about_right():
    def pattern(seed):
        t = FaultTransport(0.1, 0.1, 0.1, seed=seed, inner=httpx.MockTransport(lambda r: httpx.Response(204)))
        out = []
        for _ in range(3000):
            try:
                t.handle_request(httpx.Request("GET", "http://ps/x"))
                out.append("ok")
            except httpx.TransportError as exc:
                out.append(type(exc).__name__)
        return out, t.counts

    a, counts = pattern("7:worker-0")
    assert pattern("7:worker-0")[0] == a and pattern("7:worker-1")[0] != a
    for kind in ("drop_before", "drop_after", "duplicate"):
        assert 200 <= counts[kind] <= 400, counts
    with pytest.raises(ValueError):
        FaultTransport(0.5, 0.4, 0.2)


def test_the_client_retries_through_faults_until_the_server_answers():
    calls, inner = counting_server()
    client = PSClient("http://ps", attempts=30,
                      transport=FaultTransport(drop_before=0.2, drop_after=0.2, seed=1, inner=inner))
    try:
        for _ in range(10):
            client.status()  # never raises: every fault is a transport error, retried with backoff
    finally:
        client.close()
    assert len(calls) > 10  # drops after the server: it saw some requests more than once


def run_linear(workers: int, steps: int, worker_env: dict) -> tuple[dict, dict, str]:
    ps_env = {"PS_MAX_STEPS": steps, "PS_TOTAL_NUM_REPLICAS": workers}  # PS_MIN_WORKERS = N: fixed membership
    c = LocalCluster(workers, ps_env=ps_env, worker_env={"WORKER_TASK": "linear", **worker_env})
    with c:
        try:
            assert c.wait_workers(120) == [0] * workers
            st = c.status()
            assert st["state"] == "done" and st["global_step"] == steps
            return final_weights(c), st, c.logs()
        except Exception as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from exc


@pytest.mark.parametrize("transport", ["shm", "http"])
def test_an_unreliable_network_changes_nothing_in_sync_mode(transport):
    """Tensors in the request bodies (http) or through same-host files (shm): the faults hit the HTTP calls."""
    workers, steps = 3, 50
    env = {"WORKER_SHM_DIR": ""} if transport == "http" else {}
    clean, clean_st, _ = run_linear(workers, steps, env)
    faults = {"WORKER_FAULT_DROP_BEFORE": 0.1, "WORKER_FAULT_DROP_AFTER": 0.1, "WORKER_FAULT_DUPLICATE": 0.1,
              "WORKER_FAULT_SEED": 3, **env}
    faulty, st, logs = run_linear(workers, steps, faults)
    assert (st["shm_bytes_received"] > 0) == (transport == "shm")
    injected = [dict(zip(("drop_before", "drop_after", "duplicate"), map(int, m)))
                for m in re.findall(r"'drop_before': (\d+), 'drop_after': (\d+), 'duplicate': (\d+)", logs)]
    assert len(injected) == workers and all(min(i.values()) > 0 for i in injected), injected
    # every gradient was applied exactly once: retried and duplicated pushes were answered `duplicate`
    assert st["pushes"]["accepted"] == clean_st["pushes"]["accepted"] == workers * steps
    assert st["pushes"]["duplicate"] > 0 and st["pushes"]["stale"] == 0
    for k in clean:
        assert faulty[k].tobytes() == clean[k].tobytes(), k
    np.testing.assert_allclose(faulty["w"].ravel(), [0.1, 0.2, 0.3], atol=1e-3)
