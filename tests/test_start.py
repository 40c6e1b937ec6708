"""Step 0 waits for the workers the job was deployed with (ps_service/core: expected_workers, deploy; the runtime's
PS_WORKERS_DNS): an expected count (N, else R, or the deployment's) holds the first round until that many are in or
PS_START_TIMEOUT_SECONDS passed since min_workers were; /v1/status says what it waits for. By simulation (the core)
and with a live PS that resolves a real name."""
from __future__ import annotations

import socket

import numpy as np
import pytest

from cluster.processes import wait_for
from ps_service.core import ParameterServerCore
from shared.protocol import ModelInit
from tests.configs import core_config
from tests.live_ps import live_ps
from tests.timing import allow

W0 = {"w": np.zeros(2, np.float32)}


def core_with(**cfg) -> ParameterServerCore:
    core = ParameterServerCore(core_config(**{"startup_grace_seconds": 2.0, "start_timeout_seconds": 60.0,
                                              "lease_seconds": 600.0, **cfg}))
    core.init_model(ModelInit({"w": W0["w"].copy()}, {"name": "sgd", "learning_rate": 1.0}), 0.0)
    return core


@pytest.mark.parametrize("cfg, deployed", [({"total_num_replicas": 3}, None), ({"replicas_to_aggregate": 3}, None),
                                           ({}, 3), ({"total_num_replicas": 2}, 3)])
def test_step_0_waits_for_the_expected_workers_up_to_the_start_timeout(cfg, deployed):
    core = core_with(**cfg)
    core.deploy(deployed)
    assert core.expected_workers() == 3
    for i in range(2):
        core.register(f"w{i}", 1.0)
    core.tick(30.0)  # far past the 2 s grace: still waiting, and it says for whom
    assert not core.started and core.state().value == "waiting_for_workers"
    reason = core.wait_reason(30.0)
    assert reason.startswith("waiting for workers: 2 of 3 expected") and "in 31.0 s at the latest" in reason
    core.register("w2", 31.0)  # the third: step 0 at once
    assert core.started and core.round is not None and len(core.round.eligible) == 3


def test_at_the_start_timeout_step_0_starts_with_the_workers_there():
    core = core_with(total_num_replicas=4, min_workers=2)
    core.register("w0", 0.0)
    core.tick(100.0)
    assert not core.started  # min_workers not there: the timeout does not run
    core.register("w1", 100.0)
    core.tick(159.9)
    assert not core.started
    # what /v1/status says before the tick is what the tick does: one decision (ParameterServerCore.decide)
    assert core.wait_reason(160.0) == "step 0 starts with 2 of 4 expected workers" and not core.started
    core.tick(160.0)
    assert core.started and len(core.round.eligible) == 2


def test_without_an_expected_count_the_grace_applies_as_before():
    core = core_with()
    core.deploy(None)
    core.register("w0", 0.0)
    core.tick(1.9)
    assert not core.started and core.wait_reason(1.9).startswith("start-up grace")
    core.tick(2.0)
    assert core.started


def test_a_live_ps_counts_the_addresses_of_ps_workers_dns_and_waits_for_that_many():
    """PS_WORKERS_DNS=localhost: the PS resolves it (as compose's `worker`), expects one worker per address and
    holds step 0 until they are all in, far past the grace; /v1/status says so."""
    addresses = len({info[4][0] for info in socket.getaddrinfo("localhost", None, type=socket.SOCK_STREAM)})
    with live_ps(workers_dns="localhost", startup_grace_seconds=0, start_timeout_seconds=600, shm_dir="") as ps:
        core = ps.rt.core
        wait_for(lambda: core.deployed == addresses, allow(20), "the PS to resolve localhost")
        clients = [ps.client() for _ in range(addresses)]
        ids = [c.register(f"w{i}")["worker_id"] for i, c in enumerate(clients)]
        assert clients[0].init_model(W0, {"name": "sgd", "learning_rate": 0.5})
        if addresses > 1:
            status = ps.http().get("/v1/status").json()
            assert not core.started and "expected (the deployment's workers, PS_WORKERS_DNS)" in status["wait_reason"]
        wait_for(lambda: core.started, allow(20), "step 0 once every deployed worker is in")
        assert len(core.round.eligible) == addresses == len(ids)
        for c in clients:
            c.close()


def test_a_deployment_count_still_growing_holds_step_0_until_it_held_for_the_grace():
    """Compose starts its worker containers one after another and each adds its address as it starts: a count that
    changed less than PS_STARTUP_GRACE_SECONDS ago is not taken yet, so the first worker up does not start the job
    alone (the compose test's failure: `the deployment runs 1 workers`, then 400 steps by one worker)."""
    core = core_with()
    core.deploy(1, 0.0)
    core.register("w0", 0.5)  # one of one resolved so far: the count has held 0.5 of 2 s
    assert not core.started and core.wait_reason(0.5).startswith("waiting for the deployment's worker count to settle")
    core.deploy(3, 1.0)  # more containers started
    core.register("w1", 1.2)
    core.register("w2", 1.4)
    core.tick(2.9)
    assert not core.started  # 3 of 3 in, but the count changed 1.9 s ago
    core.tick(3.0)
    assert core.started and len(core.round.eligible) == 3


def test_a_deployment_count_no_larger_than_n_needs_no_settling():
    core = core_with(total_num_replicas=2)
    core.deploy(2, 0.0)
    core.register("w0", 0.1)
    core.register("w1", 0.2)  # N = 2 says as much: step 0 at once
    assert core.started and len(core.round.eligible) == 2
