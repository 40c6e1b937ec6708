"""A torch model in the stock worker (docs/torch.md, "Task adapter"): what a ``WORKER_TASK=package.module:factory``
factory may return (:class:`TorchJob`), and the task interface (:class:`worker_service.tasks.Task`) over it that the
worker trains (:class:`TorchTask`, :meth:`TorchJob.task`). A batch of ``dataset`` is a tuple whose last item is the
target, the others the model's inputs. Build the model from ``seed`` so every worker starts from the same weights.

The task casts the model to ``WORKER_DTYPE`` and names its tensors as :mod:`syncps.tensors` says; each step loads the
PS's weights in place, runs the forward and backward pass on this worker's shard (:func:`syncps.sampling.round_batch`)
and returns numpy views of the gradients. torch computes on one thread unless ``OMP_NUM_THREADS`` says otherwise
(:func:`worker_service.threads.torch_threads`).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, Callable, Mapping

import numpy as np
import torch

from syncps.sampling import round_batch
from syncps.spec import optimizer_spec
from syncps.tensors import ModelTensors
from worker_service.threads import torch_threads

log = logging.getLogger("syncps")

#: examples per forward pass when evaluating
EVAL_CHUNK = 4096


@dataclass
class TorchJob:
    #: the torch.nn.Module to train (CPU)
    model: Any
    #: training examples: a map-style Dataset (TensorDataset is indexed without per-example Python) or a
    #: tuple of tensors (inputs..., target) with the examples along the first dimension
    dataset: Any
    #: loss_fn(output, target) -> the batch's mean loss (a scalar tensor)
    loss_fn: Callable[[Any, Any], Any]
    #: a torch.optim optimizer over model.parameters() (its hyper-parameters run on the PS) or a PS spec
    optimizer: Any
    #: held-out examples for evaluate (same form as dataset), or None
    eval_dataset: Any = None
    #: metrics(model, eval_dataset) -> {name: float}; None: mean loss and, for class logits, accuracy
    metrics: Callable[[Any, Any], dict[str, float]] | None = None
    #: the sampling stream's shuffle and seed (syncps.sampling)
    shuffle: bool = True
    seed: int = 0
    #: "mean" (buffers averaged at each round) or "local" (syncps.tensors)
    buffers: str = "mean"
    #: push zeros for parameters whose .grad is None instead of letting the PS refuse the push
    allow_unused: bool = False

    def task(self, dtype: str = "float32", name: str | None = None) -> "TorchTask":
        """This job as the stock worker's task (:class:`TorchTask`)."""
        return TorchTask(self, dtype, name)


def take(dataset: Any, idx: np.ndarray, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """Examples ``idx`` of ``dataset`` as a tuple of batched tensors, floating ones in ``dtype``."""
    columns = dataset.tensors if isinstance(dataset, torch.utils.data.TensorDataset) else dataset
    if isinstance(columns, (tuple, list)) and all(isinstance(t, torch.Tensor) for t in columns):
        rows = torch.from_numpy(idx)
        batch = tuple(t[rows] for t in columns)
    else:
        batch = tuple(torch.utils.data.default_collate([dataset[int(i)] for i in idx]))
    return tuple(t.to(dtype) if t.is_floating_point() else t for t in batch)


def _length(dataset: Any) -> int:
    return len(dataset[0] if isinstance(dataset, (tuple, list)) else dataset)


class TorchTask:
    def __init__(self, job: TorchJob, dtype: str = "float32", name: str | None = None) -> None:
        log.info(torch_threads(torch))
        self.job = job
        self.name = name or f"torch:{type(job.model).__name__}"
        self.dtype = getattr(torch, dtype)
        job.model.to(self.dtype)
        self.tensors = ModelTensors(job.model, job.buffers)
        self.spec = dict(job.optimizer) if isinstance(job.optimizer, Mapping) else optimizer_spec(job.optimizer)
        self.n = _length(job.dataset)

    def init_params(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in self.tensors.init_tensors().items()}

    def optimizer(self) -> dict[str, Any]:
        return self.spec

    def batch(self, step: int, shard_index: int, shard_count: int, batch_size: int) -> tuple[torch.Tensor, ...]:
        idx = round_batch(self.n, step, shard_index, shard_count, batch_size, self.job.seed, self.job.shuffle)
        return take(self.job.dataset, idx, self.dtype)

    def loss_and_grads(self, params: Mapping[str, np.ndarray], batch: tuple[torch.Tensor, ...]
                       ) -> tuple[float, dict[str, np.ndarray], int]:
        model = self.job.model
        self.tensors.load(params)
        model.train()
        model.zero_grad(set_to_none=True)
        *inputs, target = batch
        loss = self.job.loss_fn(model(*inputs), target)
        loss.backward()
        return float(loss.detach()), self.tensors.grads(self.job.allow_unused), len(target)

    def evaluate(self, params: Mapping[str, np.ndarray]) -> dict[str, float]:
        job = self.job
        if job.eval_dataset is None:
            return {}
        self.tensors.load(params)
        job.model.eval()
        with torch.no_grad():
            if job.metrics is not None:
                return {k: float(v) for k, v in job.metrics(job.model, job.eval_dataset).items()}
            return self._default_metrics()

    def _default_metrics(self) -> dict[str, float]:
        job, n = self.job, _length(self.job.eval_dataset)
        loss = correct = 0.0
        classes = True
        for lo in range(0, n, EVAL_CHUNK):
            *inputs, target = take(job.eval_dataset, np.arange(lo, min(n, lo + EVAL_CHUNK)), self.dtype)
            out = job.model(*inputs)
            loss += float(job.loss_fn(out, target)) * len(target)
            classes = classes and out.dim() == 2 and target.dim() == 1 and not target.is_floating_point()
            if classes:
                correct += float((out.argmax(1) == target).sum())
        return {"loss": loss / n, **({"accuracy": correct / n} if classes else {})}
