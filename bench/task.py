"""The benchmark workload as a worker task: the anchors' linear regression at P parameters.

Same workload as ``../shared/bench`` (TensorFlow SyncReplicasOptimizer, torch
gloo all-reduce): ``y = x @ w + b`` with ``w: [d, k]``, ``b: [k]`` split by
:func:`model_dims` (``(d + 1) * k ~= P``), ``x ~ randn(32, d)`` drawn fresh by
each worker each step from its own generator, ``y = x @ w_true + 0.4`` with a
fixed ``w_true = 0.1 * randn(d, k)``, loss ``mean((x @ w + b - y)^2)``, plain
SGD with learning rate 0.5, weights starting at zero. ``batch`` draws a step's
``(x, y)`` (its data and labels) from a generator seeded by (seed, shard, step): a
function of its arguments, so the worker may draw it ahead (WORKER_PREFETCH) while
the round is out; the anchors draw the same in their step.

Load it in a worker with ``WORKER_TASK=bench.task:params_<P>`` (for example
``bench.task:params_1000000``): the module resolves ``params_<P>`` to a factory
taking ``(seed, dtype)``, the :class:`worker_service.tasks.Task` interface.
Gradient buffers are reused from step to step (the worker loop pushes them
before it computes the next step); on the same-host transport they are the worker's gradient file
(``out``), so a push copies nothing.
"""
from __future__ import annotations

import math
from typing import Any, Callable, Mapping

import numpy as np

LEARNING_RATE = 0.5
BIAS_TRUE = 0.4


def model_dims(params: int) -> tuple[int, int]:
    """(d, k) for a budget of P parameters, exactly as the anchors' ``common.model_dims``."""
    params = int(params)
    if params < 2:
        raise ValueError("params must be >= 2")
    if params < 1000:
        return params - 1, 1
    k = max(1, int(round(math.sqrt(params))))
    d = max(1, params // k - 1)
    return d, k


def actual_params(params: int) -> int:
    d, k = model_dims(params)
    return (d + 1) * k


class BenchLinearTask:
    """The anchors' linear regression; one generator per (shard, step), so each worker draws its own x."""

    def __init__(self, params: int, seed: int = 0, dtype: str = "float32") -> None:
        self.name = f"bench-linear-{params}"
        self.dtype = np.dtype(dtype)
        self.d, self.k = model_dims(params)
        self.seed = seed
        self.w_true = (0.1 * np.random.default_rng([seed, 12]).standard_normal((self.d, self.k))).astype(self.dtype)
        self._gw = np.empty((self.d, self.k), self.dtype)
        self._gb = np.empty((self.k,), self.dtype)

    def init_params(self) -> dict[str, np.ndarray]:
        return {"w": np.zeros((self.d, self.k), self.dtype), "b": np.zeros((self.k,), self.dtype)}

    def optimizer(self) -> dict[str, Any]:
        return {"name": "sgd", "learning_rate": LEARNING_RATE}

    def batch(self, step: int, shard_index: int, shard_count: int,
              batch_size: int) -> tuple[np.ndarray, np.ndarray]:
        """``(x, y)``: ``x ~ randn(batch_size, d)`` from the generator of (seed, shard, step), ``y = x @ w_true + 0.4``."""
        rng = np.random.default_rng([self.seed, 1000 + shard_index, step])
        x = rng.standard_normal((batch_size, self.d), dtype=self.dtype) if self.dtype.itemsize in (4, 8) \
            else rng.standard_normal((batch_size, self.d)).astype(self.dtype)
        y = x @ self.w_true
        y += self.dtype.type(BIAS_TRUE)
        return x, y

    def loss_and_grads(self, params: Mapping[str, np.ndarray], batch: tuple[np.ndarray, np.ndarray],
                       out: Mapping[str, np.ndarray] | None = None) -> tuple[float, dict[str, np.ndarray], int]:
        """``out``: arrays to write the gradients into (the same-host gradient file), else this task's own."""
        x, y = batch
        err = x @ params["w"]
        err += params["b"]
        err -= y
        n = len(x)
        scale = self.dtype.type(2.0 / (n * self.k))
        gw, gb = (self._gw, self._gb) if out is None else (out["w"], out["b"])
        np.matmul(x.T, err, out=gw)
        gw *= scale
        np.sum(err, axis=0, out=gb)
        gb *= scale
        return float(np.mean(err * err)), {"w": gw, "b": gb}, n

    def evaluate(self, params: Mapping[str, np.ndarray]) -> dict[str, float]:
        return {"max_abs_error_w": float(np.abs(params["w"] - self.w_true).max()),
                "max_abs_error_b": float(np.abs(params["b"] - BIAS_TRUE).max())}


def task_workload(task: str, params: int) -> tuple[int, tuple[int | None, int | None], str]:
    """(parameter count, (d, k), WORKER_TASK) of a benchmark task: ``linear`` (this module's, at ``params``)
    or ``cnn`` (the torch task of syncps.cnn.py, whose size is fixed)."""
    if task == "cnn":
        from syncps.cnn import PARAMS

        return PARAMS, (None, None), "cnn"
    return actual_params(params), model_dims(params), f"bench.task:params_{int(params)}"


def factory(params: int) -> Callable[..., BenchLinearTask]:
    def make(seed: int = 0, dtype: str = "float32") -> BenchLinearTask:
        return BenchLinearTask(params, seed, dtype)
    return make


def __getattr__(name: str) -> Callable[..., BenchLinearTask]:
    """``params_<P>`` -> a task factory for P parameters (what ``WORKER_TASK`` names)."""
    prefix = "params_"
    if name.startswith(prefix) and name[len(prefix):].isdigit():
        return factory(int(name[len(prefix):]))
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
