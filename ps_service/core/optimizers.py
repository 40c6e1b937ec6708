"""Optimizers that live on the PS, in two flavours: TensorFlow 1.x's (the default) and torch.optim's.

A spec is ``{"name", "learning_rate", <hyper-parameters>}``, plus ``"flavor": "torch"`` for torch's formulas
(:mod:`ps_service.core.torch_rules`); docs/protocol.md's optimizer table and docs/torch.md list every formula. The TF1
ones are ``tf.compat.v1.train``'s kernels (``training_ops.cc``, :meth:`Optimizer._tf1`): every constant is a scalar
of the weight's dtype and every operation rounded in it, in the kernels' order, so TF1 training is reproduced bit for
bit in float32 and float64 (given float64 hyper-parameters), but for float32 Adagrad's approximate ``vrsqrtps``
(:func:`rsqrt`, docs/torch.md).

A tensor named ``buffer:...`` (:data:`BUFFER_PREFIX`) is not stepped: it takes the round's aggregate (BatchNorm's
running statistics, docs/torch.md). Slots are arrays of the weights' dtype keyed by (slot, tensor)
(:data:`SLOT_NAMES`, the checkpoint's layout); ``apply`` updates weights and slots in place in a fixed order.

A gradient may come as its entries (:class:`~shared.compression.SparseTensor`, the sum of top-k pushes): TF1's SGD
then updates those entries only, the same bits in O(k); every other rule gets it made dense.
:attr:`Optimizer.touched` says which entries the last apply changed (the weight deltas take them).
"""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np

from ps_service.core import torch_rules
from shared.compression import SparseTensor
from shared.shards import Piece, split
from ps_service.core.errors import CoreError

#: names of tensors that are set to the round's aggregate instead of being stepped
BUFFER_PREFIX = "buffer:"
#: name -> {hyper-parameter: default}, TF1 flavour. learning_rate defaults to 0.01.
HYPERPARAMS: dict[str, dict[str, Any]] = {
    "sgd": {},
    "momentum": {"momentum": 0.9, "nesterov": False},
    "adam": {"beta1": 0.9, "beta2": 0.999, "epsilon": 1e-8},
    "adagrad": {"initial_accumulator_value": 0.1},
}
#: the same for ``"flavor": "torch"`` (torch.optim's defaults, learning_rate included)
TORCH_HYPERPARAMS = torch_rules.HYPERPARAMS
#: optimizer name -> its slots, in either flavour (torch's SGD with momentum is named "momentum")
SLOT_NAMES = {"sgd": (), "momentum": ("accum",), "adam": ("m", "v"), "adamw": ("m", "v"), "adagrad": ("accum",)}
FLAVORS = ("tf1", "torch")


def rsqrt(a: np.ndarray, out: np.ndarray | None = None) -> np.ndarray:
    """``1 / sqrt(a)`` in ``a``'s dtype, both rounded, into ``out`` (``a``'s dtype and shape) or a new array:
    Eigen's scalar ``rsqrt``, which TF1's Adagrad kernel runs on float64 and on the float32 elements after the
    last whole AVX packet (a test swaps in TensorFlow's own to show it is the only difference in float32)."""
    r = np.sqrt(a, out=out)
    return np.divide(a.dtype.type(1), r, out=r)


def _number(name: str, key: str, value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value < 0:
        raise CoreError("bad_optimizer", f"{name}.{key} must be a finite number >= 0")
    return float(value)


def normalize_spec(spec: Mapping[str, Any]) -> dict[str, Any]:
    """A complete, checked optimizer spec (``flavor`` only when it is torch). Idempotent."""
    flavor = spec.get("flavor", "tf1")
    if flavor not in FLAVORS:
        raise CoreError("bad_optimizer", f"flavor {str(flavor)[:32]!r} is not one of {list(FLAVORS)}")
    table = TORCH_HYPERPARAMS if flavor == "torch" else HYPERPARAMS
    name = spec.get("name", "sgd")
    if name not in table:
        raise CoreError("bad_optimizer", f"optimizer {str(name)[:32]!r} is not one of {sorted(table)}"
                                             f" (flavor {flavor})")
    if flavor == "torch" and name in ("sgd", "momentum"):  # one torch optimizer, named after its slots as in TF1
        momentum = spec.get("momentum", 0.0)
        name = "momentum" if isinstance(momentum, (int, float)) and not isinstance(momentum, bool) and momentum > 0 \
            else "sgd"
    defaults = table[name]
    unknown = set(spec) - {"name", "learning_rate", "flavor"} - set(defaults)
    if unknown:
        raise CoreError("bad_optimizer", f"optimizer {name} ({flavor}) has no settings {sorted(map(str, unknown))}")
    out: dict[str, Any] = {"name": name, **({"flavor": "torch"} if flavor == "torch" else {})}
    lr = spec.get("learning_rate", defaults.get("learning_rate", 0.01))
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not math.isfinite(lr) or lr <= 0:
        raise CoreError("bad_optimizer", "learning_rate must be a finite number > 0")
    out["learning_rate"] = float(lr)
    for key, default in defaults.items():
        if key == "learning_rate":
            continue
        value = spec.get(key, default)
        if isinstance(default, bool):
            if not isinstance(value, bool):
                raise CoreError("bad_optimizer", f"{name}.{key} must be a boolean")
            out[key] = value
        else:
            out[key] = _number(name, key, value)
    _check(out)
    return out


def _check(s: dict[str, Any]) -> None:
    name = s["name"]
    if name in ("adam", "adamw") and not (s["beta1"] < 1 and s["beta2"] < 1):
        raise CoreError("bad_optimizer", f"{name} needs beta1, beta2 < 1")
    if name == "adam" and "flavor" not in s and s["epsilon"] <= 0:
        raise CoreError("bad_optimizer", "adam needs epsilon > 0")
    if name == "adagrad" and "flavor" not in s and s["initial_accumulator_value"] <= 0:
        raise CoreError("bad_optimizer", "adagrad needs initial_accumulator_value > 0")
    if "flavor" in s and s.get("nesterov") and (s["momentum"] <= 0 or s["dampening"] != 0):
        raise CoreError("bad_optimizer", "nesterov needs a momentum > 0 and dampening 0 (as torch.optim.SGD)")


def _fusable(w: np.ndarray, g: np.ndarray) -> bool:
    return g.dtype == w.dtype and g.flags.writeable and g.flags.c_contiguous and w.flags.c_contiguous


def _sgd_mean(w: np.ndarray, g: np.ndarray, n: int, lr) -> None:
    """``g /= n; g *= lr; w -= g`` (TF1's SGD on the mean), in place."""
    np.divide(g, n, out=g)
    np.multiply(g, lr, out=g)
    np.subtract(w, g, out=w)


def _sgd_entries(w: np.ndarray, g: SparseTensor, n: int, lr) -> tuple[np.ndarray, np.ndarray]:
    """TF1's SGD (on the mean of ``n`` when n > 1) of the entries ``g`` holds, writing into its values, as
    :func:`_sgd_mean` computes each element; off them the dense update leaves ``w`` as it is (``w - 0.0``): the same
    bits in O(k). The flat indices (strictly increasing) whose bits changed and their new values."""
    v, wf, idx = g.values, w.reshape(-1), g.indices
    if n > 1:
        np.divide(v, n, out=v)
    np.multiply(v, lr, out=v)
    old = wf[idx]
    new = np.subtract(old, v, out=v)
    moved = old.view(np.uint32) != new.view(np.uint32)  # float32: a SparseTensor's dtype
    changed, values = idx[moved], new[moved]
    wf[changed] = values
    return changed, values


_SERIALS = itertools.count()


@dataclass(frozen=True)
class Touched:
    """What the optimizer's apply number ``iterations`` changed: ``entries[name]``, the flat indices (increasing)
    whose bits it changed in the tensors it updated as entries, ``values[name]`` what it wrote there (any other
    tensor may have changed anywhere); ``entries`` None: unknown. ``serial`` names the optimizer."""
    serial: int
    iterations: int
    entries: Mapping[str, np.ndarray] | None = None
    values: Mapping[str, np.ndarray] = field(default_factory=dict)


class Optimizer:
    """One optimizer over a fixed set of weights; ``iterations`` counts applies."""

    def __init__(self, spec: Mapping[str, Any], weights: Mapping[str, np.ndarray]) -> None:
        self.spec = normalize_spec(spec)
        self.name: str = self.spec["name"]
        self.torch = self.spec.get("flavor") == "torch"
        odd = [k for k, w in weights.items() if self.torch and w.dtype not in (np.float32, np.float64)]
        if odd:
            raise CoreError("bad_optimizer", f"torch's formulas run on float32 and float64 tensors, "
                                                 f"not {weights[odd[0]].dtype} ({odd[0]!r})")
        self.iterations = 0
        fill = self.spec.get("initial_accumulator_value", 0.0) if self.name == "adagrad" else 0.0
        self.slots: dict[str, dict[str, np.ndarray]] = {
            slot: {k: np.full_like(w, fill) for k, w in weights.items()} for slot in SLOT_NAMES[self.name]
        }
        self._powers: dict[np.dtype, tuple[int, Any, Any]] = {}  # TF1 adam: dtype -> (t, b1^t, b2^t)
        self.serial = next(_SERIALS)
        #: the entries the last apply changed (:class:`Touched`)
        self.touched = Touched(self.serial, self.iterations)

    def apply(self, weights: dict[str, np.ndarray], grads: Mapping[str, np.ndarray], consume: bool = False,
              mean_of: int = 1, pieces: Sequence[Piece] | None = None, advance: bool = True) -> None:
        """One update of every weight from its (already aggregated) gradient, in place; buffers
        (:data:`BUFFER_PREFIX`) take the aggregate as it is.

        ``consume``: the gradients are the caller's scratch (the PS's aggregate) and may be overwritten (no
        model-sized temporary a step; the same bits). ``mean_of`` n > 1 (with ``consume``): each gradient is a sum of
        n, divided by n first (SGD divides and updates in place, :func:`_sgd_mean`: the same bits). A
        :class:`~shared.compression.SparseTensor` gradient (with ``consume``): TF1's SGD updates its entries only
        (:func:`_sgd_entries`, recorded in :attr:`touched`); any other rule takes it made dense.

        ``pieces``: one partition of a round (:mod:`ps_service.core.partitions`): only those pieces of the weights and
        slots, as views, ``grads`` keyed by :attr:`Piece.key`; every rule is elementwise, so the bits are the whole
        step's. ``advance`` False: a later partition of the same step (the iteration count and the first
        partition's :attr:`touched` stay)."""
        slots = self.slots
        if pieces is not None:
            weights = split(weights, pieces)
            slots = {s: split(t, pieces) for s, t in slots.items()}
        if advance:
            self.iterations += 1
            self.touched = Touched(self.serial, self.iterations, {}, {})
        touched = self.touched.entries
        tf1_sgd_in_place = self.name == "sgd" and not self.torch and consume  # the fused and the O(k) updates
        for key, w in weights.items():
            g = grads[key]
            stepped = tf1_sgd_in_place and not key.startswith(BUFFER_PREFIX)
            if isinstance(g, SparseTensor) and pieces is not None:  # the entries of a slice: not a tensor's
                g = g.dense()
            if isinstance(g, SparseTensor):
                if stepped and g.dtype == w.dtype and w.flags.c_contiguous:
                    touched[key], self.touched.values[key] = _sgd_entries(w, g, mean_of,
                                                                          w.dtype.type(self.spec["learning_rate"]))
                    continue
                g = g.dense()
            if mean_of > 1 and stepped and _fusable(w, g):
                _sgd_mean(w, g, mean_of, w.dtype.type(self.spec["learning_rate"]))
                continue
            if mean_of > 1:
                g /= mean_of
            if key.startswith(BUFFER_PREFIX):
                np.copyto(w, g)
            elif self.torch:
                torch_rules.apply(self.spec, self.iterations, w, g, {s: t[key] for s, t in slots.items()})
            else:
                self._tf1(w, g, consume, {s: t[key] for s, t in slots.items()})

    def _tf1(self, w: np.ndarray, g: np.ndarray, consume: bool, slots: Mapping[str, np.ndarray]) -> None:
        s = self.spec
        dt = w.dtype.type
        lr = dt(s["learning_rate"])
        scratch = consume and g.dtype == w.dtype and g.flags.writeable  # g may be overwritten
        if self.name == "sgd":
            if scratch:
                np.multiply(g, lr, out=g)
                w -= g
            else:
                w -= g * lr
        elif self.name == "momentum":
            a = slots["accum"]
            m = dt(s["momentum"])
            a *= m
            a += g
            if s["nesterov"]:
                w -= g * lr + a * m * lr
            else:
                w -= a * lr
        elif self.name == "adam":
            p1, p2 = self._beta_powers(w.dtype)
            one = dt(1)
            alpha = lr * np.sqrt(one - p2) / (one - p1)
            m, v = slots["m"], slots["v"]
            m += (g - m) * (one - dt(s["beta1"]))
            v += (g * g - v) * (one - dt(s["beta2"]))
            w -= m * alpha / (np.sqrt(v) + dt(s["epsilon"]))
        else:  # adagrad
            a = slots["accum"]
            r = np.square(g)
            a += r
            rsqrt(a, out=r)
            step = np.multiply(g, lr, out=g if scratch else None)
            step *= r  # (g * lr) * rsqrt(a)
            w -= step

    def _beta_powers(self, dtype: np.dtype) -> tuple[Any, Any]:
        """b1^t and b2^t as TF1 keeps them: running products in the weights' dtype, one factor per step."""
        t = self.iterations
        done, p1, p2 = self._powers.get(dtype, (0, None, None))
        if done > t:  # never happens in a run; a restore starts over
            done = 0
        b1, b2 = dtype.type(self.spec["beta1"]), dtype.type(self.spec["beta2"])
        for i in range(done, t):
            p1, p2 = (b1, b2) if i == 0 else (p1 * b1, p2 * b2)
        self._powers[dtype] = (t, p1, p2)
        return p1, p2

    def state(self) -> dict[str, Any]:
        """What a checkpoint needs to rebuild this optimizer exactly."""
        return {"spec": dict(self.spec), "iterations": self.iterations, "slots": self.slots}

    def load_state(self, iterations: int, slots: Mapping[str, Mapping[str, np.ndarray]]) -> None:
        self.iterations = int(iterations)
        self.touched = Touched(self.serial, self.iterations)
        self._powers.clear()
        for slot, tensors in slots.items():
            for key, arr in tensors.items():
                np.copyto(self.slots[slot][key], arr)
