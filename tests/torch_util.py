"""Torch worker processes for the tests without paying ``import torch`` (several seconds of CPU) in each one.

:func:`run_forked_job` trains a job with a real PS (uvicorn in this process, tests/live_ps.py) and N
worker processes on loopback, forked from one ``multiprocessing`` forkserver that imported torch and
the worker service once for the whole session (:data:`PRELOAD`). Each worker is still its own process
running the stock worker's ``main`` (``python -m worker_service``'s) with its ``WORKER_*`` environment
and its own log; only the interpreter's start-up and imports are shared. ``bench.ddp_cnn``'s DDP
processes come from the same forkserver. The test process computes its torch references on one thread
(:func:`one_thread`), as the workers do, so that results depend on nothing but the arithmetic.
"""
from __future__ import annotations

import multiprocessing
import os
import runpy
import sys
import tempfile
from pathlib import Path

from cluster.processes import wait_for
from tests.timing import allow
from tests.clusters import JobResult
from tests.live_ps import live_ps

#: what the forkserver imports once (torch._dynamo: what constructing a torch.optim optimizer imports)
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.nn.parallel", "sklearn.datasets",
           "worker_service.__main__", "syncps.job", "syncps.cnn", "syncps.torch",
           "bench.ddp_cnn", "tests.torch_tasks"]


def context():
    """The forkserver context (its server imports :data:`PRELOAD` when it first starts)."""
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)
    return ctx


def one_thread() -> None:
    import torch

    torch.set_num_threads(1)


def _worker_main(env: dict, log_path: str, script: str | None) -> None:
    fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    os.environ.update(env)
    if script is not None:  # `python script`
        runpy.run_path(script, run_name="__main__")
        return
    from worker_service.__main__ import main

    sys.exit(main())


def start_workers(n: int, url: str, worker_env: dict, log_dir: Path, script: str | None = None
                  ) -> list[multiprocessing.Process]:
    """N processes running the stock worker (or ``script``) with ``WORKER_PS_URL=url``, names worker-0..."""
    procs = []
    for i in range(n):
        env = {"WORKER_PS_URL": url, "WORKER_NAME": f"worker-{i}", "PYTHONUNBUFFERED": "1",
               **{k: str(v) for k, v in worker_env.items()}}
        procs.append(context().Process(target=_worker_main, args=(env, str(log_dir / f"worker-{i}.log"), script),
                                       daemon=True))
        procs[-1].start()
    return procs


def logs(log_dir: Path, tail: int = 3000) -> str:
    return "\n".join(f"--- {p.stem}\n{p.read_text(errors='replace')[-tail:]}" for p in sorted(log_dir.glob("*.log")))


def run_forked_job(workers: int, ps_settings: dict, worker_env: dict, deadline: float = 120.0) -> JobResult:
    """Train to ``max_steps`` (:func:`tests.clusters.run_job` with forked workers and an in-process PS; ``deadline``
    as there)."""
    from tests.clusters import final_weights

    with tempfile.TemporaryDirectory(prefix="syncps-torch-") as tmp, \
            live_ps(min_workers=workers, startup_grace_seconds=0, **ps_settings) as ps:
        procs = start_workers(workers, ps.url, worker_env, Path(tmp))
        try:
            wait_for(lambda: all(p.exitcode is not None for p in procs), allow(deadline), "the workers to exit", 0.1)
            with ps.http() as http:
                wait_for(lambda: http.get("/v1/status").json()["state"] == "done", allow(10), "the PS to report done")
                status, members = http.get("/v1/status").json(), http.get("/v1/workers").json()["workers"]
            return JobResult(final_weights(ps), status, members, [p.exitcode for p in procs])
        except Exception:
            raise AssertionError(f"job failed; logs:\n{logs(Path(tmp))}")
        finally:
            for p in procs:
                if p.exitcode is None:
                    p.kill()
                    p.join(allow(10))
