"""Run a whole local training job (real PS + worker processes), and read what a running LocalCluster
did (round records, final weights) for the tests to assert on."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.processes import LocalCluster, wait_for
from tests.timing import allow
from worker_service.client import PSClient


def closed_rounds(c: LocalCluster, limit: int = 100) -> list[dict]:
    """The last ``limit`` round records (Unix times), oldest first."""
    return c.get("/v1/rounds", params={"limit": limit}).json()["rounds"][::-1]


def final_weights(c: LocalCluster) -> dict[str, np.ndarray]:
    client = PSClient(c.url)
    try:
        client.attach_reader()  # a sharded PS: the pieces of every shard
        return dict(client.pull(0, wait=allow(5.0)).tensors)
    finally:
        client.close()


@dataclass
class JobResult:
    tensors: dict[str, np.ndarray]
    status: dict
    workers: list[dict]
    exit_codes: list[int]


def settled(status: dict) -> bool:
    """The job is done and, on a sharded PS, every follower's row shows the last step: the rows are what the
    coordinator last heard (docs/protocol-shards.md), so a follower's answer to the last apply may come after done."""
    rows = (status.get("shard") or {}).get("shards") or []
    return status["state"] == "done" and all(r["step"] == status["global_step"] for r in rows)


def run_job(workers: int, ps_env: dict, worker_env: dict, deadline: float = 120.0, shards: int = 1) -> JobResult:
    """Train to PS_MAX_STEPS (on ``shards`` PS processes) within ``deadline`` s on a quiet machine (an allowance:
    tests/timing.py); fails with the process logs if anything goes wrong."""
    with LocalCluster(workers, ps_env=ps_env, worker_env=worker_env, shards=shards) as c:
        try:
            codes = c.wait_workers(allow(deadline))
            wait_for(lambda: settled(c.status()), allow(10), "the PS to report done, every shard at its step")
            return JobResult(final_weights(c), c.status(), c.get("/v1/workers").json()["workers"], codes)
        except Exception:
            raise AssertionError(f"job failed; logs:\n{c.logs()}")
