"""Optimizers that live on the PS: SGD, Momentum (optionally Nesterov), Adam, Adagrad.

Formulas are TensorFlow 1.x's (the system syncps replaces), so a model moved
from ``SyncReplicasOptimizer(tf.train.XOptimizer(...))`` trains the same:

- ``sgd``:      w -= lr * g
- ``momentum``: a = m * a + g;  w -= lr * a            (``nesterov``: w -= lr * (g + m * a))
- ``adam``:     t += 1;  lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)
                m = b1 * m + (1 - b1) * g;  v = b2 * v + (1 - b2) * g^2
                w -= lr_t * m / (sqrt(v) + eps)          (eps = 1e-8, "epsilon hat" as in TF1)
- ``adagrad``:  a += g^2;  w -= lr * g / sqrt(a)        (a starts at initial_accumulator_value = 0.1)

Slots are arrays of the weights' dtype keyed by (slot, tensor); ``apply``
updates weights and slots in place. All arithmetic happens in the weights'
dtype, in a fixed order, so a run is bit-reproducible.
"""
from __future__ import annotations

import math
from typing import Any, Mapping

import numpy as np

from shared.errors import unprocessable

#: name -> {hyper-parameter: default}. learning_rate has no default on purpose.
HYPERPARAMS: dict[str, dict[str, Any]] = {
    "sgd": {},
    "momentum": {"momentum": 0.9, "nesterov": False},
    "adam": {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
    "adagrad": {"initial_accumulator_value": 0.1},
}
SLOT_NAMES = {"sgd": (), "momentum": ("accum",), "adam": ("m", "v"), "adagrad": ("accum",)}


def normalize_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A complete, checked optimizer spec (name, learning_rate and every hyper-parameter)."""
    name = spec.get("name", "sgd")
    if name not in HYPERPARAMS:
        raise unprocessable("bad_optimizer", f"optimizer {str(name)[:32]!r} is not one of {sorted(HYPERPARAMS)}")
    out: dict[str, Any] = {"name": name}
    unknown = set(spec) - {"name", "learning_rate"} - set(HYPERPARAMS[name])
    if unknown:
        raise unprocessable("bad_optimizer", f"optimizer {name} has no settings {sorted(map(str, unknown))}")
    lr = spec.get("learning_rate", 0.01)
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise unprocessable("bad_optimizer", "learning_rate must be a finite number > 0")
    out["learning_rate"] = float(lr)
    for key, default in HYPERPARAMS[name].items():
        value = spec.get(key, default)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise unprocessable("bad_optimizer", f"{name}.{key} must be a boolean")
        elif isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
            raise unprocessable("bad_optimizer", f"{name}.{key} must be a finite number >= 0")
        else:
            value = float(value)
        out[key] = value
    if name == "adam" and not (out["beta1"] < 1 and out["beta2"] < 1 and out["epsilon"] > 0):
        raise unprocessable("bad_optimizer", "adam needs beta1, beta2 < 1 and epsilon > 0")
    if name == "adagrad" and out["initial_accumulator_value"] <= 0:
        raise unprocessable("bad_optimizer", "adagrad needs initial_accumulator_value > 0")
    return out


class Optimizer:
    """One optimizer over a fixed set of weights; ``iterations`` counts applies."""

    def __init__(self, spec: Mapping[str, Any], weights: Mapping[str, np.ndarray]) -> None:
        self.spec = normalize_spec(spec)
        self.name: str = self.spec["name"]
        self.iterations = 0
        fill = self.spec.get("initial_accumulator_value", 0.0)
        self.slots: dict[str, dict[str, np.ndarray]] = {
            slot: {k: np.full_like(w, fill if self.name == "adagrad" else 0.0) for k, w in weights.items()}
            for slot in SLOT_NAMES[self.name]
        }

    def apply(self, weights: dict[str, np.ndarray], grads: Mapping[str, np.ndarray], consume: bool = False) -> None:
        """One update of every weight from its (already aggregated) gradient, in place.

        ``consume``: the gradients are scratch buffers of the caller's (the PS's aggregate) and may be
        overwritten, which saves a model-sized temporary per step; the result is bit-identical."""
        self.iterations += 1
        s = self.spec
        for key, w in weights.items():
            g = grads[key]
            dt = w.dtype.type
            lr = dt(s["learning_rate"])
            if self.name == "sgd":
                if consume and g.dtype == w.dtype and g.flags.writeable:
                    np.multiply(g, lr, out=g)
                    w -= g
                else:
                    w -= lr * g
            elif self.name == "momentum":
                a = self.slots["accum"][key]
                m = dt(s["momentum"])
                a *= m
                a += g
                if s["nesterov"]:
                    w -= lr * g + lr * m * a
                else:
                    w -= lr * a
            elif self.name == "adam":
                b1, b2, eps = s["beta1"], s["beta2"], s["epsilon"]
                t = self.iterations
                lr_t = dt(s["learning_rate"] * math.sqrt(1 - b2**t) / (1 - b1**t))
                m, v = self.slots["m"][key], self.slots["v"][key]
                m *= dt(b1)
                m += dt(1 - b1) * g
                v *= dt(b2)
                v += dt(1 - b2) * (g * g)
                w -= lr_t * m / (np.sqrt(v) + dt(eps))
            else:  # adagrad
                a = self.slots["accum"][key]
                a += g * g
                w -= lr * g / np.sqrt(a)

    def state(self) -> dict[str, Any]:
        """What a checkpoint needs to rebuild this optimizer exactly."""
        return {"spec": dict(self.spec), "iterations": self.iterations, "slots": self.slots}

    def load_state(self, iterations: int, slots: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        self.iterations = int(iterations)
        for slot, tensors in slots.items():
            for key, arr in tensors.items():
                np.copyto(self.slots[slot][key], arr)
