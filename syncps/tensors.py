"""A torch module's tensors as the PS names them, and the zero-copy moves between the two (docs/torch.md, "What goes
to the PS" and "Buffers").

Contract: parameters that require grad are PS tensors under their ``named_parameters()`` names (frozen ones stay on
the worker); with ``buffers="mean"`` every persistent floating-point buffer is a PS tensor ``"buffer:" + name``
(``shared.compression.BUFFER_PREFIX``), pushed as its value; ``buffers="local"``: none. :meth:`ModelTensors.grads`
gives numpy views of the gradients (a copy only for a tensor that is not contiguous on the CPU), a missing ``.grad``
left out unless ``allow_unused`` (zeros). :meth:`ModelTensors.load` copies PS tensors into the module in place;
:class:`ModelMismatch` for a shape (or, :meth:`ModelTensors.check`, tensor names) that differs.
"""
from __future__ import annotations

import warnings
from typing import Mapping

import numpy as np
import torch

from shared.compression import BUFFER_PREFIX

BUFFER_RULES = ("mean", "local")


class ModelMismatch(ValueError):
    """The PS's model and this worker's module disagree on a tensor."""


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A numpy view of ``t``'s memory (a copy when it is not a contiguous CPU tensor)."""
    t = t.detach().cpu().contiguous()  # each returns the tensor itself when it is so already: no copy
    if t.dtype == torch.bfloat16:
        raise TypeError("bfloat16 tensors cannot travel to the PS (no numpy dtype): use float16 or float32")
    return t.numpy()


class ModelTensors:
    def __init__(self, model: torch.nn.Module, buffers: str = "mean") -> None:
        if buffers not in BUFFER_RULES:
            raise ValueError(f"buffers must be one of {BUFFER_RULES}, not {buffers!r}")
        self.params: dict[str, torch.Tensor] = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if not self.params:
            raise ValueError("the model has no parameter that requires grad: nothing to train")
        persistent = set(model.state_dict())
        self.buffers: dict[str, torch.Tensor] = {
            BUFFER_PREFIX + n: b for n, b in model.named_buffers()
            if buffers == "mean" and n in persistent and b.is_floating_point()}
        self.all = {**self.params, **self.buffers}

    def init_tensors(self) -> dict[str, np.ndarray]:
        """The tensors the PS is initialised with (views of the module's memory)."""
        return {name: as_numpy(t) for name, t in self.all.items()}

    def grads(self, allow_unused: bool = False) -> dict[str, np.ndarray]:
        """The push: each parameter's gradient and each buffer's value, as numpy views."""
        out: dict[str, np.ndarray] = {}
        for name, p in self.params.items():
            if p.grad is not None:
                out[name] = as_numpy(p.grad)
            elif allow_unused:
                out[name] = np.zeros(tuple(p.shape), as_numpy(torch.empty(0, dtype=p.dtype)).dtype)
        for name, b in self.buffers.items():
            out[name] = as_numpy(b)
        return out

    def check(self, tensors: Mapping[str, np.ndarray]) -> None:
        """:class:`ModelMismatch` unless ``tensors`` (a whole model pulled from the PS) are this module's, by name."""
        if tensors.keys() != self.all.keys():  # a PS initialised (or restored) for another model
            lacks, extra = sorted(self.all.keys() - tensors.keys()), sorted(tensors.keys() - self.all.keys())
            raise ModelMismatch(
                f"the PS holds another model than this module (it lacks {lacks[:5] or 'none'}; it holds "
                f"{extra[:5] or 'none'}, which this module lacks): it was initialised, or restored from its "
                "checkpoint, for another model. Start the job afresh (no checkpoint), or connect the model it holds.")

    def load(self, tensors: Mapping[str, np.ndarray]) -> None:
        """Copy the PS's tensors into the module's parameters and buffers, in place."""
        with torch.no_grad(), warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # from_numpy of a read-only view: we only read it
            for name, t in self.all.items():
                arr = tensors.get(name)
                if arr is None:
                    continue
                if tuple(arr.shape) != tuple(t.shape):
                    raise ModelMismatch(f"the PS holds {name!r} with shape {list(arr.shape)}, "
                                        f"this model has {list(t.shape)}")
                t.copy_(torch.from_numpy(arr))
