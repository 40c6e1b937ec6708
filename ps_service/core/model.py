"""The model half of the PS core: weights, optimizer, global step, and their checkpoint data. Pure, no I/O.

Contract:
- The model is initialised once: the first ``init_model`` wins, later ones get 409 (they must
  pull). Weights must be floating point; the core keeps copies, sorted by name.
- The optimizer the PS runs is the one the initialiser brought with the PS's settings on top
  (``optimizer_spec``); another optimizer name in the settings drops the brought hyper-parameters.
- ``restore`` loads checkpointed weights, optimizer slots and global step; ``model_state`` is the
  same data as plain copies (safe to encode off the event loop).
- ``version`` bumps on every change a waiting pull may care about (``_changed``); ``tick`` is
  the core's hook to advance time once the model is there.
- The weights live in the model's :class:`~ps_service.core.store.WeightsStore` once an answer was made of them
  (the frame of the dense answers). They change in place only through :meth:`update` (and a rewind,
  ``core.rewind``), each of which calls :meth:`before_change` first: the store moves them out of a frame an answer
  may still be sending (copy on write) and counts the change (``store.changes``). The core calls nothing outside
  its package for it: the transports read the store, never the other way.
"""
from __future__ import annotations

from typing import Any, Mapping

import numpy as np

from ps_service.core.store import WeightsStore
from ps_service.core.optimizers import HYPERPARAMS, TORCH_HYPERPARAMS, Optimizer, normalize_spec
from shared.codec import FLOAT_DTYPES, dtype_name
from ps_service.core.errors import CoreError
from shared.protocol import ModelInit


def check_weights(tensors: Mapping[str, np.ndarray]) -> None:
    """A brought model's tensors, each floating point (else 422 ``bad_dtype``) and finite: a NaN or Inf weight
    would make every update of it NaN (else 422 ``nonfinite_weights``)."""
    for name, arr in tensors.items():
        if dtype_name(arr.dtype) not in FLOAT_DTYPES:
            raise CoreError("bad_dtype", f"tensor {name!r}: model weights must be floating point")
    for name, arr in tensors.items():
        if not np.isfinite(arr).all():
            raise CoreError("nonfinite_weights", f"tensor {name!r}: initial weights must be finite (no NaN or Inf)")


class ModelState:
    def __init__(self, optimizer_overrides: Mapping[str, Any]) -> None:
        self.optimizer_overrides = dict(optimizer_overrides)
        self.weights: dict[str, np.ndarray] | None = None
        self.optimizer: Optimizer | None = None
        self.global_step = 0
        self.version = 0
        #: after a restore: how many members the checkpoint had active (start at once when they are back)
        self.resume_expected: int | None = None
        #: the workers the deployment runs (``PS_WORKERS_DNS``, told by the runtime): step 0 waits for them
        self.deployed: int | None = None
        #: where the weights live for their answers (copy on write while an answer still sends them)
        self.store = WeightsStore()

    @property
    def initialized(self) -> bool:
        return self.weights is not None

    def optimizer_spec(self, brought: Mapping[str, Any]) -> dict[str, Any]:
        """The spec the PS runs: what the initialiser brought, PS settings on top."""
        spec = dict(brought)
        overrides = self.optimizer_overrides
        if "name" in overrides and overrides["name"] != spec.get("name"):
            spec = {}  # another optimizer: the brought hyper-parameters do not apply
        spec.update(overrides)
        table = TORCH_HYPERPARAMS if spec.get("flavor") == "torch" else HYPERPARAMS
        allowed = {"name", "learning_rate", *table.get(spec.get("name", "sgd"), {})}
        return normalize_spec({k: v for k, v in spec.items() if k in allowed or k not in overrides})

    def resumed_spec(self, saved: Mapping[str, Any]) -> dict[str, Any]:
        """The spec a job resumed from a checkpoint runs: the checkpoint's, with the PS settings' hyper-parameters on
        top (a learning rate set for this start applies, as on a fresh job). Another optimizer than the checkpoint's
        (its name, or torch's SGD gaining or losing momentum) is refused, ``optimizer_changed``: its slots do not
        carry over."""
        overrides = self.optimizer_overrides
        table = TORCH_HYPERPARAMS if saved.get("flavor") == "torch" else HYPERPARAMS
        allowed = {"learning_rate", *table.get(saved.get("name"), {})}
        spec = normalize_spec({**saved, **{k: v for k, v in overrides.items() if k in allowed}})
        if overrides.get("name", saved.get("name")) != saved.get("name") or spec["name"] != saved.get("name"):
            raise CoreError("optimizer_changed", f"the checkpoint trains {saved.get('name')}; the settings ask for "
                            f"{overrides.get('name', spec['name'])}: an optimizer's kind cannot change on a resumed "
                            "job (its slots do not carry over). Unset PS_OPTIMIZER (or the hyper-parameter that "
                            "changes it), or start a fresh job (an empty PS_CHECKPOINT_DIR: docker compose down -v)")
        return spec

    def init_model(self, init: ModelInit, now: float) -> None:
        """First caller wins; later ones get 409 and must pull."""
        self.refuse_init()
        check_weights(init.tensors)
        spec = self.optimizer_spec(init.optimizer)
        weights = {k: np.array(v, copy=True) for k, v in sorted(init.tensors.items())}
        self.optimizer = Optimizer(spec, weights)
        self.weights = weights
        self._changed()
        self.tick(now)

    def refuse_init(self) -> None:
        """409 ``already_initialized`` once a model is in (the transport may ask before it reads a model's body)."""
        if self.initialized:
            raise CoreError("already_initialized", f"the model is initialised (global step {self.global_step}); pull it")

    def restore(self, weights: dict[str, np.ndarray], spec: Mapping[str, Any], iterations: int,
                slots: Mapping[str, Mapping[str, np.ndarray]], global_step: int) -> None:
        """Load a checkpointed model (before any worker talks to this PS)."""
        self.weights = {k: np.array(v, copy=True) for k, v in sorted(weights.items())}
        self.optimizer = Optimizer(spec, self.weights)
        self.optimizer.load_state(iterations, slots)
        self.global_step = int(global_step)
        self._changed()

    def before_change(self) -> None:
        """The weights are about to change in place (:meth:`update`, a rewind)."""
        self.store.before_change()

    def update(self, grads: Mapping[str, np.ndarray], consume: bool = False, mean_of: int = 1) -> None:
        """One optimizer step of the weights, in place (:meth:`Optimizer.apply`), after ``before_change``."""
        self.before_change()
        self.optimizer.apply(self.weights, grads, consume=consume, mean_of=mean_of)

    def model_state(self) -> dict[str, Any]:
        """global_step, weights and optimizer (spec, iterations, slots), arrays copied."""
        if not self.initialized:
            raise CoreError("not_initialized", "nothing to checkpoint before the model is initialised")
        opt = self.optimizer
        return {
            "global_step": self.global_step,
            "weights": {k: v.copy() for k, v in self.weights.items()},
            "optimizer": {"spec": dict(opt.spec), "iterations": opt.iterations,
                          "slots": {s: {k: v.copy() for k, v in t.items()} for s, t in opt.slots.items()}},
        }

    def tick(self, now: float) -> bool:
        """Advance time (the core overrides it: leases, start-up, rounds)."""
        return False

    def _changed(self) -> None:
        self.version += 1

