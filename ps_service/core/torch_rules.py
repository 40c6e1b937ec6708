"""torch.optim's update rules on the PS (``"flavor": "torch"``), in numpy, without torch.

Each rule is torch's single-tensor CPU implementation (``torch/optim/*.py``, ``foreach=False``), operation by
operation, in the weight's dtype: docs/torch.md's table has every formula. Slots: ``sgd`` / ``momentum``
(torch.optim.SGD, "momentum" when momentum > 0) its buffer as ``accum``; ``adam`` / ``adamw`` ``m`` (exp_avg) and
``v`` (exp_avg_sq); ``adagrad`` ``accum`` (sum).

Scalars are computed as torch does (Python floats), then rounded to the weight's dtype; ``fma`` is a fused
multiply-add (:mod:`ps_service.core.fma`), as torch's CPU kernels use for ``add(alpha=)``, ``lerp`` and ``addcmul``.
SGD is bit-identical to torch, and Adam, AdamW and Adagrad but for the square root: :data:`sqrt` is correctly
rounded, torch's CPU ``sqrt`` (MKL's VML, refined from the approximate ``rsqrtps``) is 1 ulp off on some inputs, with
bits that depend on the CPU (docs/torch.md has the measurements).
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ps_service.core.fma import fma

#: the square root the rules use (correctly rounded; a test swaps in torch's to show it is the only difference)
sqrt = np.sqrt

_SGD = {"learning_rate": 1e-3, "momentum": 0.0, "dampening": 0.0, "nesterov": False, "weight_decay": 0.0}
_ADAM = {"learning_rate": 1e-3, "beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8, "weight_decay": 0.0}
#: name -> {hyper-parameter: default}, torch.optim's defaults
HYPERPARAMS: dict[str, dict[str, Any]] = {
    "sgd": _SGD,
    "momentum": _SGD,
    "adam": _ADAM,
    "adamw": {**_ADAM, "weight_decay": 1e-2},
    "adagrad": {"learning_rate": 1e-2, "lr_decay": 0.0, "weight_decay": 0.0, "initial_accumulator_value": 0.0,
                "epsilon": 1e-10},
}


def apply(spec: Mapping[str, Any], t: int, w: np.ndarray, g: np.ndarray, slots: Mapping[str, np.ndarray]) -> None:
    """Step ``t`` (from 1) of one weight ``w`` with its gradient ``g``, in place (``g`` is not written)."""
    f = w.dtype.type
    name, lr, wd = spec["name"], spec["learning_rate"], spec["weight_decay"]
    if wd and name != "adamw":
        g = fma(w, f(wd), g)
    if name in ("sgd", "momentum"):
        if name == "momentum":
            buf = slots["accum"]
            momentum = spec["momentum"]
            if t == 1:
                np.copyto(buf, g)
            else:
                fma(g, f(1 - spec["dampening"]), buf * f(momentum), out=buf)
            g = fma(buf, f(momentum), g) if spec["nesterov"] else buf
        fma(g, f(-lr), w, out=w)
    elif name in ("adam", "adamw"):
        b1, b2 = spec["beta1"], spec["beta2"]
        if wd and name == "adamw":
            w *= f(1 - lr * wd)
        m, v = slots["m"], slots["v"]
        weight = f(1 - b1)
        if abs(weight) < 0.5:
            fma(weight, g - m, m, out=m)
        else:
            fma(weight - f(1), g - m, g, out=m)
        v *= f(b2)
        fma(f(1 - b2) * g, g, v, out=v)
        step_size = lr / (1 - b1 ** t)
        denom = sqrt(v)
        denom /= f((1 - b2 ** t) ** 0.5)
        denom += f(spec["epsilon"])
        w += (f(-step_size) * m) / denom
    else:  # adagrad
        a = slots["accum"]
        clr = lr / (1 + (t - 1) * spec["lr_decay"])
        fma(g, g, a, out=a)
        std = sqrt(a)
        std += f(spec["epsilon"])
        w += (f(-clr) * g) / std
