"""Read what a running LocalCluster did, for the fault tests: process logs, round records, final weights."""
from __future__ import annotations

import numpy as np

from cluster.processes import LocalCluster
from worker_service.client import PSClient


def logs_of(c: LocalCluster, workers: int) -> str:
    """The tails of the PS's and every worker's log, for a failure message."""
    return "\n".join(f"--- {name}\n{c.log(name)[-4000:]}" for name in ["ps", *(f"worker-{i}" for i in range(workers))])


def closed_rounds(c: LocalCluster, limit: int = 100) -> list[dict]:
    """The last ``limit`` round records (Unix times), oldest first."""
    return c.get("/v1/rounds", params={"limit": limit}).json()["rounds"][::-1]


def final_weights(c: LocalCluster) -> dict[str, np.ndarray]:
    client = PSClient(c.url)
    try:
        return dict(client.pull(0, wait=5.0).tensors)
    finally:
        client.close()
