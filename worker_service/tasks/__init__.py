"""Training tasks: a model, its data and its gradients, in numpy.

A task is any object with the small interface of :class:`Task`; the worker loads a built-in one by name or yours by
``package.module:factory`` (a callable taking ``(seed, dtype)``). The factory may also return a
:class:`syncps.job.TorchJob`, which the worker turns into a task with its ``task(dtype, name)`` (the built-in ``cnn``
is ``syncps.cnn:CNNTask``). The worker imports no ``syncps`` module itself: ``syncps`` builds on it.
"""
from __future__ import annotations

import importlib
import inspect
from typing import Any, Mapping, Protocol

import numpy as np


class Task(Protocol):
    name: str

    def init_params(self) -> dict[str, np.ndarray]:
        """Initial weights (the same on every worker: derived from the seed)."""

    def optimizer(self) -> dict[str, Any]:
        """The optimizer spec the task brings to the PS (PS settings win). Optional: one that takes ``mode`` (the
        job's: "sync", "async", "ssp") brings a spec for that mode (:func:`optimizer_for`)."""

    def batch(self, step: int, shard_index: int, shard_count: int, batch_size: int) -> Any:
        """This worker's examples for ``step``: shard ``shard_index`` of ``shard_count``."""

    def loss_and_grads(self, params: Mapping[str, np.ndarray], batch: Any) -> tuple[float, dict[str, np.ndarray], int]:
        """(mean loss, gradient per tensor in the params' dtype, number of examples).

        Optional: a task whose ``loss_and_grads`` also takes ``out`` (None, or a dict of arrays shaped and typed as
        the params) writes each gradient into ``out[name]`` and returns those very arrays: on the same-host
        transport they are the worker's gradient file, and the push copies nothing (:func:`writes_into`)."""

    def evaluate(self, params: Mapping[str, np.ndarray]) -> dict[str, float]:
        """Metrics of final weights (for logs and tests)."""


def _takes(fn: Any, parameter: str) -> bool:
    try:
        return parameter in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # no signature to read (a builtin): it does not
        return False


def optimizer_for(task: Task, mode: str) -> dict[str, Any]:
    """The spec ``task`` brings for a job in ``mode``: ``task.optimizer(mode=mode)`` when it takes the mode, else
    ``task.optimizer()``."""
    return task.optimizer(mode=mode) if _takes(task.optimizer, "mode") else task.optimizer()


def writes_into(task: Task) -> bool:
    """Does ``task.loss_and_grads`` take ``out`` (the gradients computed into given arrays)?"""
    return _takes(task.loss_and_grads, "out")


def shard_batch_indices(n: int, step: int, shard_index: int, shard_count: int, batch_size: int) -> np.ndarray:
    """Rows of a dataset of ``n`` for one worker's step: shard = rows i with
    i % shard_count == shard_index; the batch walks that shard cyclically by step."""
    shard = np.arange(shard_index, n, shard_count)
    return shard[(step * batch_size + np.arange(batch_size)) % len(shard)]


#: the built-in tasks, loaded by name as a ``package.module:factory`` is (cnn: the layer above's, syncps with torch)
BY_NAME = {"linear": "worker_service.tasks.linear:LinearTask", "mlp": "worker_service.tasks.mlp:MLPTask",
           "cnn": "syncps.cnn:CNNTask"}


def load_task(spec: str, seed: int = 0, dtype: str = "float32") -> Task:
    """A built-in task by name, or what ``package.module:factory`` returns: a task, or a
    :class:`syncps.job.TorchJob` (anything without ``loss_and_grads``), wrapped into a task."""
    if ":" not in spec and spec not in BY_NAME:
        raise ValueError(f"unknown task {spec!r}: use one of {sorted(BY_NAME)} or 'package.module:factory'")
    module, attr = BY_NAME.get(spec, spec).split(":", 1)
    task = getattr(importlib.import_module(module), attr)(seed=seed, dtype=dtype)
    if not hasattr(task, "loss_and_grads"):
        task = task.task(dtype, name=spec)  # a syncps.job.TorchJob
    return task
