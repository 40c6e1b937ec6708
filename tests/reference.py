"""Single-process reference training: the large-batch run that N synchronous workers must reproduce.

One process holds the weights; each step it computes the gradient of the
concatenated batch of the N shards as the mean of the per-shard gradients
(summed in rank order: float addition is order-sensitive, and this is the
order the PS uses), and applies the same optimizer. With N workers in sync
mode the PS must end with exactly these weights.
"""
from __future__ import annotations

import functools

import numpy as np

from ps_service.core.optimizers import Optimizer
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


def train_torch_reference(task_name: str, workers: int, steps: int, batch_size: int = 32, seed: int = 0,
                          dtype: str = "float32", concatenated: bool = False) -> dict[str, np.ndarray]:
    """The same large-batch training in one torch process, with the task's own ``torch.optim`` optimizer
    stepping the model (a task whose factory returns a :class:`syncps.job.TorchJob`, e.g. ``cnn``).

    Each step the gradient of the concatenated batch of the N shards is the mean of the per-shard
    gradients, summed in rank order as the PS sums them; with ``concatenated`` it is instead one
    backward pass over the concatenated batch (the same number, rounded differently). Returns the
    final parameters by their PS names."""
    import torch

    task = load_task(task_name, seed, dtype)
    job, params = task.job, task.tensors.params

    for step in range(steps):
        shards = [task.batch(step, rank, workers, batch_size) for rank in range(workers)]
        if concatenated:
            *inputs, target = (torch.cat(column) for column in zip(*shards))
            job.optimizer.zero_grad(set_to_none=True)
            job.loss_fn(job.model(*inputs), target).backward()
        else:
            grads = [task.loss_and_grads({}, shard)[1] for shard in shards]  # views of each backward's p.grad
            for k, p in params.items():
                total = functools.reduce(np.add, [g[k] for g in grads])  # ((g0 + g1) + g2) + ..., as the PS
                p.grad = torch.from_numpy(total / workers if workers > 1 else total)
        job.optimizer.step()
    return {k: p.detach().numpy().copy() for k, p in params.items()}
