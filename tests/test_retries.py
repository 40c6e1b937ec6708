"""Exactly-once pushes under retries: the fault-injecting connection, and a sync run through an unreliable
network (10% dropped before the PS, 10% lost after it, 10% duplicated) that ends bit-identical to a clean
one, on each production transport (tensors in request bodies over the raw connection, and through
same-host files)."""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

import numpy as np
import pytest

from cluster.processes import LocalCluster
from tests.timing import allow
from tests.clusters import final_weights
from tests.reference import train_reference
from worker_service.client import PSClient
from shared.rawhttp import ConnectionLost
from worker_service.transport.faults import FaultyConnection


@dataclass
class Answer:
    status_code: int
    headers: dict
    content: bytes

    def json(self):
        return json.loads(self.content)


class CountingConnection:
    """A stand-in for the PS: counts what reaches it."""

    def __init__(self) -> None:
        self.calls: list[bytes] = []

    def request(self, method, target, headers, body=(), timeout=30.0):
        self.calls.append(b"".join(bytes(p) for p in body))
        return Answer(200, {"content-type": "application/json"}, json.dumps({"n": len(self.calls)}).encode())

    def close(self) -> None:
        pass


@pytest.mark.parametrize("kind, reached", [("drop_before", 0), ("drop_after", 1)])
def test_drops_before_and_after_the_server(kind, reached):
    inner = CountingConnection()
    with pytest.raises(ConnectionLost, match="fault injected"):
        FaultyConnection(inner, **{kind: 1.0}).request("POST", "/v1/gradients", {}, [b"x"])
    assert len(inner.calls) == reached


def test_duplicates_reach_the_server_twice_and_the_client_gets_the_first_answer():
    inner = CountingConnection()
    body = [memoryview(b"bo"), b"dy"]
    assert FaultyConnection(inner, duplicate=1.0).request("POST", "/x", {}, body).json() == {"n": 1}
    assert inner.calls == [b"body", b"body"]


def test_fault_rates_are_seeded_and_about_right():
    def pattern(seed):
        t = FaultyConnection(CountingConnection(), 0.1, 0.1, 0.1, seed=seed)
        out = []
        for _ in range(3000):
            try:
                t.request("GET", "/x", {})
                out.append("ok")
            except ConnectionLost as exc:
                out.append(str(exc))
        return out, t.counts

    a, counts = pattern("7:worker-0")
    assert pattern("7:worker-0")[0] == a and pattern("7:worker-1")[0] != a
    for kind in ("drop_before", "drop_after", "duplicate"):
        assert 200 <= counts[kind] <= 400, counts
    with pytest.raises(ValueError):
        FaultyConnection(CountingConnection(), 0.5, 0.4, 0.2)


def test_the_client_retries_through_faults_until_the_server_answers():
    inner = CountingConnection()
    client = PSClient("http://ps", attempts=30, connection=FaultyConnection(inner, drop_before=0.2, drop_after=0.2,
                                                                             seed=1))
    try:
        for _ in range(10):
            client.status()  # never raises: every fault is a lost connection, retried with backoff
    finally:
        client.close()
    assert len(inner.calls) > 10  # drops after the server: it saw some requests more than once


def run_linear(workers: int, steps: int, worker_env: dict) -> tuple[dict, dict, str]:
    ps_env = {"PS_MAX_STEPS": steps, "PS_TOTAL_NUM_REPLICAS": workers}  # PS_MIN_WORKERS = N: fixed membership
    c = LocalCluster(workers, ps_env=ps_env, worker_env={"WORKER_TASK": "linear", "WORKER_DTYPE": "float64",
                                                         **worker_env})
    with c:
        try:
            assert c.wait_workers(allow(120)) == [0] * workers
            st = c.status()
            assert st["state"] == "done" and st["global_step"] == steps
            used = {w["transport"] for w in c.get("/v1/workers").json()["workers"]}
            assert used == {"http" if worker_env.get("WORKER_SHM_DIR") == "" else "shm"}, used
            return final_weights(c), st, c.logs()
        except Exception as exc:
            raise AssertionError(f"{exc}\n{c.logs()}") from exc


@pytest.mark.parametrize("transport", ["shm", "http"])
def test_an_unreliable_network_changes_nothing_in_sync_mode(transport):
    """Tensors in the request bodies (http) or through same-host files (shm): the faults hit every exchange of
    the production connection (RawConnection), whichever tensor transport carries the tensors.
    "Nothing changes": the job ends with the bits of a clean one. A clean float64 job ends with the bits of the
    one-process replay (tests/test_exactness.py proves it, on both transports), so the faulty job is held to the
    replay's bits here instead of to a second live run (which took ~5 s of the test's ~11 s)."""
    workers, steps = 3, 50
    env = {"WORKER_SHM_DIR": ""} if transport == "http" else {}
    _, clean = train_reference("linear", workers, steps)  # the workers' defaults: batch 32, seed 0; float64
    faults = {"WORKER_FAULT_DROP_BEFORE": 0.1, "WORKER_FAULT_DROP_AFTER": 0.1, "WORKER_FAULT_DUPLICATE": 0.1,
              "WORKER_FAULT_SEED": 3, **env}
    faulty, st, logs = run_linear(workers, steps, faults)
    assert (st["shm_bytes_received"] > 0) == (transport == "shm")
    injected = [dict(zip(("drop_before", "drop_after", "duplicate"), map(int, m)))
                for m in re.findall(r"'drop_before': (\d+), 'drop_after': (\d+), 'duplicate': (\d+)", logs)]
    assert len(injected) == workers and all(min(i.values()) > 0 for i in injected), injected
    assert logs.count("faults injected over RawConnection") == workers
    # every gradient was applied exactly once: retried and duplicated pushes were answered `duplicate`
    assert st["pushes"]["accepted"] == workers * steps
    assert st["pushes"]["duplicate"] > 0 and st["pushes"]["stale"] == 0
    assert faulty.keys() == clean.keys()
    for k in clean:
        assert faulty[k].dtype == np.float64 and faulty[k].tobytes() == clean[k].tobytes(), k
    np.testing.assert_allclose(faulty["w"].ravel(), [0.1, 0.2, 0.3], atol=1e-3)
