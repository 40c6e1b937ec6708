"""Run a whole local training job (real PS + worker processes) and collect what tests assert on."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cluster.processes import LocalCluster, wait_for
from worker_service.client import PSClient


@dataclass
class JobResult:
    tensors: dict[str, np.ndarray]
    status: dict
    workers: list[dict]
    exit_codes: list[int]


def run_job(workers: int, ps_env: dict, worker_env: dict, deadline: float = 120.0) -> JobResult:
    """Train to PS_MAX_STEPS; fails with the process logs if anything goes wrong."""
    with LocalCluster(workers, ps_env=ps_env, worker_env=worker_env) as c:
        try:
            codes = c.wait_workers(deadline)
            wait_for(lambda: c.status()["state"] == "done", 10, "the PS to report done")
            client = PSClient(c.url)
            final = client.pull(0, wait=5.0)
            client.close()
            return JobResult(dict(final.tensors), c.status(), c.get("/v1/workers").json()["workers"], codes)
        except Exception:
            logs = "\n".join(f"--- {n}\n{c.log(n)[-3000:]}" for n in ["ps", *(f"worker-{i}" for i in range(workers))])
            raise AssertionError(f"job failed; logs:\n{logs}")
