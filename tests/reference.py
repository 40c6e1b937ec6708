"""Single-process reference training: the large-batch run that N synchronous workers must reproduce.

One process holds the weights; each step it computes the gradient of the
concatenated batch of the N shards as the mean of the per-shard gradients
(summed in rank order: float addition is order-sensitive, and this is the
order the PS uses), and applies the same optimizer. With N workers in sync
mode the PS must end with exactly these weights.

Exact given the same per-shard gradients: the replay computes each one with the BLAS threads of the stock worker
(:func:`worker_blas_threads`), whatever this process's own BLAS uses. OpenBLAS splits one matrix product between
its threads once M*N*K reaches 2 * 262,144 (bench.task's linear from ~33k parameters: the 16 x d x k products)
and the split rounds differently (float64 at 1e5 parameters: as two partial sums over halves of K); with the
pytest process's 2 threads (one per core) against the workers' 1, most weights of such a job differ in their last
bits from step 1 on (1e5 float64, 2 workers, 3 steps: 76,546 of 99,540, median 2 ulp, at most 3.1e-16 of the
largest weight; float32: 3.5e-7).
"""
from __future__ import annotations

import functools
import os

import numpy as np
from threadpoolctl import threadpool_limits

from ps_service.core.optimizers import Optimizer
from worker_service.tasks import load_task
from worker_service.threads import one_thread_unless_set


def worker_blas_threads(environ=os.environ) -> int:
    """The BLAS threads of a stock worker started with ``environ``: ``OPENBLAS_NUM_THREADS``, 1 unless set
    (worker_service/threads.py)."""
    env = dict(environ)
    one_thread_unless_set(env)
    return int(env["OPENBLAS_NUM_THREADS"])


def train_reference(task_name: str, workers: int, steps: int, batch_size: int = 32, seed: int = 0,
                    dtype: str = "float64", optimizer: dict | None = None, blas_threads: int | None = None):
    """``blas_threads``: the workers' (default: a stock worker's started from this process's environment)."""
    with threadpool_limits(blas_threads or worker_blas_threads(), "blas"):
        return _train_reference(task_name, workers, steps, batch_size, seed, dtype, optimizer)


def _train_reference(task_name, workers, steps, batch_size, seed, dtype, optimizer):
    task = load_task(task_name, seed, dtype)
    params = {k: np.array(v) for k, v in sorted(task.init_params().items())}
    opt = Optimizer(optimizer or task.optimizer(), params)
    for step in range(steps):
        opt.apply(params, large_batch_gradient(task, params, step, workers, batch_size))
    return task, params


def large_batch_gradient(task, params: dict[str, np.ndarray], step: int, workers: int,
                         batch_size: int) -> dict[str, np.ndarray]:
    """Step ``step``'s gradient of the concatenated batch at ``params``: the per-shard gradients summed in rank order,
    divided by their count (the caller sets the BLAS threads)."""
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
    return grads


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
