"""Single-process reference training: the large-batch run that N synchronous workers must reproduce.

One process holds the weights; each step it computes the gradient of the
concatenated batch of the N shards as the mean of the per-shard gradients
(summed in rank order: float addition is order-sensitive, and this is the
order the PS uses), and applies the same optimizer. With N workers in sync
mode the PS must end with exactly these weights.
"""
from __future__ import annotations

import numpy as np

from ps_service.optimizers import Optimizer
from worker_service.tasks import load_task


def train_reference(task_name: str, workers: int, steps: int, batch_size: int = 32, seed: int = 0,
                    dtype: str = "float64", optimizer: dict | None = None):
    task = load_task(task_name, seed, dtype)
    params = {k: np.array(v) for k, v in sorted(task.init_params().items())}
    opt = Optimizer(optimizer or task.optimizer(), params)
    for step in range(steps):
        grads = None
        for rank in range(workers):
            _, g, _ = task.loss_and_grads(params, task.batch(step, rank, workers, batch_size))
            if grads is None:
                grads = {k: np.array(v, dtype=params[k].dtype) for k, v in g.items()}
            else:
                for k in grads:
                    grads[k] += g[k]
        if workers > 1:
            for k in grads:
                grads[k] /= workers
        opt.apply(params, grads)
    return task, params
