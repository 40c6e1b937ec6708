"""What the core checks of a gradient before it takes it. Pure, no I/O.

Contract:
- :func:`validate` says whether a gradient fits the model, before anything changes: exactly the model's tensor
  names, per tensor exactly its shape and dtype (422 ``tensor_mismatch``; nothing is cast), then no NaN/Inf in those
  very arrays (422 ``nonfinite_gradient`` under the ``reject`` policy; False under ``skip``).
- NaN/Inf checks (:func:`finite`) are numpy's ``isfinite``. The round's sum is checked so too.
- :func:`read_checked` copies memory another process may write (a same-host worker's file) into the PS's own and
  checks the copy: what is checked is what is kept.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from shared.compression import SparseTensor
from ps_service.core.errors import CoreError



def finite(g: np.ndarray | SparseTensor) -> bool:
    """No NaN/Inf in ``g``."""
    if isinstance(g, SparseTensor):
        g = g.values  # zero elsewhere
    return bool(np.isfinite(g).all())


def read_checked(src: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray]) -> str | None:
    """``out = src`` tensor by tensor, each copy then checked for NaN/Inf: ``src`` is read once and what is checked
    is what is kept. The first tensor with a NaN/Inf, where it stopped, or None (``out`` is complete)."""
    for name, o in out.items():
        np.copyto(o.reshape(-1), src[name].reshape(-1))
        if not finite(o):
            return name
    return None


def _dtype(dt: np.dtype) -> str:
    return dt.name if dt.isnative else dt.str


def validate(weights: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray],
             nonfinite_policy: str = "reject", check_finite: bool = True) -> bool:
    """Raise 422 unless ``grads`` fits ``weights`` (names, shapes, dtypes); False if it has NaN/Inf under policy
    ``skip``, else True. ``check_finite`` False: the transport checked the values (``PushRequest.finite_checked``)."""
    missing, extra = weights.keys() - grads.keys(), grads.keys() - weights.keys()
    if missing or extra:
        name = sorted(missing or extra)[0]
        raise CoreError("tensor_mismatch", f"tensor {name!r} is {'missing' if missing else 'not in the model'}")
    for name, w in weights.items():
        g = grads[name]
        if not isinstance(g, (np.ndarray, SparseTensor)) or g.dtype != w.dtype:
            got = _dtype(g.dtype) if isinstance(g, (np.ndarray, SparseTensor)) else type(g).__name__
            raise CoreError("tensor_mismatch", f"tensor {name!r} is {got}, the model's is {_dtype(w.dtype)}: "
                                                   "a gradient must have its weight's dtype")
        if g.shape != w.shape:
            raise CoreError("tensor_mismatch",
                                f"tensor {name!r} has shape {list(g.shape)}, the model has {list(w.shape)}")
    if not check_finite:
        return True
    nonfinite = next((name for name, g in grads.items() if not finite(g)), None)
    if nonfinite is not None and nonfinite_policy == "reject":
        raise CoreError("nonfinite_gradient", f"tensor {nonfinite!r} has NaN or Inf values")
    return nonfinite is None
