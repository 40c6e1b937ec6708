"""What a ``WORKER_TASK=package.module:factory`` factory may return to train a torch model with the stock worker
(docs/torch.md, "Task adapter"): a :class:`TorchJob`, which the worker wraps into the task interface
(:meth:`TorchJob.task`: ``syncps/task.py``). A batch of ``dataset`` is a tuple whose last item is the target, the
others the model's inputs. Build the model from ``seed`` so every worker starts from the same weights.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable


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

    def task(self, dtype: str = "float32", name: str | None = None):
        """This job as the stock worker's task (:class:`syncps.task.TorchTask`; imports torch)."""
        from syncps.task import TorchTask

        return TorchTask(self, dtype, name)
