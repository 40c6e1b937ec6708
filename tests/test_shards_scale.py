"""Issue 14's scale target: 64 workers, as local processes, train 100 rounds of a 1e5-parameter model on a
2-shard PS, exact (0 ulp against the one-process replay) and with no 5xx.

The PS is two real ``python -m ps_service`` processes (:class:`~cluster.processes.LocalCluster`,
``shards=2``). The 64 workers are real OS processes, each running the stock ``python -m worker_service``
entry point (:func:`worker_service.__main__.main`: settings from its own environment, the training loop, its
own log file), but forked (``os.fork``) by one helper process that imported numpy, httpx, pydantic and the
worker once (:func:`fork_workers`): 64 fresh interpreters would spend minutes importing on 2 cores.

The model is :class:`WideTask` (``tests.test_shards_scale:WideTask``): 99 999 + 1 float64 parameters with a
gradient that costs a few passes over them, so the test measures the PS and the wire, not the workers' maths.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import traceback
from typing import Mapping

import numpy as np
import pytest

from cluster.processes import LocalCluster, wait_for
from tests.clusters import closed_rounds, final_weights, settled
from tests.reference import train_reference
from tests.timing import allow
from worker_service.tasks import shard_batch_indices

WORKERS, STEPS, PARAMS = 64, 100, 100_000
TASK_SPEC = f"{__name__}:WideTask"


class WideTask:
    """loss = mean_i ||w + b - y_i u||^2 / P over the batch's targets y_i (u: a fixed ramp); SGD lr 0.5."""
    name = "wide"

    def __init__(self, seed: int = 0, dtype: str = "float64", size: int = PARAMS) -> None:
        self.dtype = np.dtype(dtype)
        self.u = np.linspace(-1.0, 1.0, size - 1).astype(self.dtype)
        self.y = np.random.default_rng(seed).standard_normal(1000).astype(self.dtype)
        self.scale = self.dtype.type(2.0 / size)

    def init_params(self) -> dict[str, np.ndarray]:
        return {"w": np.zeros(len(self.u), self.dtype), "b": np.zeros(1, self.dtype)}

    def optimizer(self) -> dict:
        return {"name": "sgd", "learning_rate": 0.5}

    def batch(self, step: int, shard_index: int, shard_count: int, batch_size: int) -> np.ndarray:
        return self.y[shard_batch_indices(len(self.y), step, shard_index, shard_count, batch_size)]

    def loss_and_grads(self, params: Mapping[str, np.ndarray], batch) -> tuple[float, dict[str, np.ndarray], int]:
        r = params["w"] + params["b"] - batch.mean() * self.u
        gw = self.scale * r
        return float((r * r).sum()) / len(r), {"w": gw, "b": np.array([gw.sum()], self.dtype)}, len(batch)  # no BLAS

    def evaluate(self, params: Mapping[str, np.ndarray]) -> dict[str, float]:
        r = params["w"] + params["b"] - self.y.mean() * self.u
        return {"loss": float((r * r).sum()) / len(r)}


def fork_workers(spec: str) -> int:
    """``python -c 'fork_workers(spec)'``: fork one ``python -m worker_service`` per (env, log file) of the JSON
    ``spec``, wait for them all and print their exit codes (``EXIT_CODES [...]``); 0 if every one exited 0."""
    from worker_service.__main__ import main  # imported once, before forking (no thread runs yet)

    pids = []
    for env, log_path in json.loads(spec):
        pid = os.fork()
        if pid == 0:  # the worker: its own environment and log, the stock entry point
            code = 1
            try:
                os.environ.update(env)
                fd = os.open(log_path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
                code = main()
            except BaseException:
                traceback.print_exc()
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    codes = [os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) for pid in pids]
    print("EXIT_CODES " + json.dumps(codes), flush=True)
    return 0 if codes == [0] * len(codes) else 1


@pytest.mark.slow
def test_64_worker_processes_train_100_rounds_of_1e5_params_on_two_shards_exactly():
    t0 = time.monotonic()
    ps_env = {"PS_MAX_STEPS": STEPS, "PS_MIN_WORKERS": WORKERS, "PS_SHARD_SPLIT_ELEMENTS": PARAMS // 4,
              "PS_LOG_LEVEL": "warning"}
    worker_env = {"WORKER_TASK": TASK_SPEC, "WORKER_DTYPE": "float64", "WORKER_SEED": 7, "WORKER_BATCH_SIZE": 4,
                  "WORKER_LOG_EVERY_SECONDS": 60}
    with LocalCluster(0, ps_env=ps_env, worker_env=worker_env, shards=2) as c:
        up = time.monotonic() - t0
        try:
            spec = [({**c.worker_env, "WORKER_NAME": f"worker-{i}", "PYTHONUNBUFFERED": "1"},
                     str(c.log_dir / f"worker-{i}.log")) for i in range(WORKERS)]
            started = time.monotonic()
            forker = subprocess.run([sys.executable, "-c", f"import sys; from {__name__} import fork_workers; "
                                     "sys.exit(fork_workers(sys.argv[1]))", json.dumps(spec)],
                                    env={**os.environ, "OPENBLAS_NUM_THREADS": "1"},  # 64 workers, 2 cores
                                    capture_output=True, text=True, timeout=allow(240))
            trained = time.monotonic() - started
            assert forker.returncode == 0, forker.stdout + forker.stderr
            t1 = time.monotonic()
            wait_for(lambda: settled(c.status()), allow(10), "the PS to report done, every shard at its step")
            status, rounds = c.status(), closed_rounds(c, STEPS)
            got = final_weights(c)
            logs = {p.name: p.read_text(errors="replace") for p in c.log_dir.glob("*.log")}
        except BaseException:
            c.mark_failed()
            raise AssertionError(f"job failed; logs in {c.log_dir}:\n{c.logs(1500)}")
    t2 = time.monotonic()
    assert status["global_step"] == STEPS
    assert [r["step"] for r in status["shard"]["shards"]] == [STEPS, STEPS]
    assert all(r["error"] is None for r in status["shard"]["shards"])
    # every round had all 64 contributors, and every worker's 100 pushes were accepted
    assert [r["step"] for r in rounds] == list(range(STEPS))
    assert all(len(r["contributors"]) == WORKERS and not r["missing"] for r in rounds)
    summaries = [line for text in logs.values() for line in text.splitlines() if line.startswith("SUMMARY ")]
    assert len(summaries) == WORKERS and all(f'"accepted": {STEPS}' in s for s in summaries)
    # no 5xx, no lost connection: a worker logs every retry (worker_service/retry.py), a PS every error
    assert not [n for n, t in logs.items() if "retrying" in t], "a worker retried a call"
    assert not [n for n, t in logs.items() if n.startswith("ps") and ("ERROR" in t or "Traceback" in t)]
    # exact: bit-identical to the one-process replay (64 shards of the batch summed in rank order)
    t3 = time.monotonic()
    _, ref = train_reference(TASK_SPEC, WORKERS, STEPS, batch_size=4, seed=7, dtype="float64")
    replay = time.monotonic() - t3
    assert got.keys() == ref.keys()
    assert all(got[k].tobytes() == ref[k].tobytes() for k in ref), "not bit-identical (0 ulp)"
    print(f"\n{WORKERS} workers x {STEPS} rounds: PS up {up:.1f} s, training {trained:.1f} s, reading and stopping "
          f"{t2 - t1:.1f} s, replay {replay:.1f} s, {time.monotonic() - t0:.1f} s in all; load {os.getloadavg()}")
