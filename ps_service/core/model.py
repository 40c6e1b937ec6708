"""The model half of the PS core: weights, optimizer, global step, and their checkpoint data. Pure, no I/O.

Contract:
- The model is initialised once: the first ``init_model`` wins, later ones get 409 (they must pull). Weights must be
  floating point; the core keeps copies, sorted by name.
- The optimizer the PS runs is the one the initialiser brought with the PS's settings on top (``optimizer_spec``);
  another optimizer name in the settings drops the brought hyper-parameters.
- ``restore`` loads checkpointed weights, optimizer slots and global step; ``model_state`` is the same data as plain
  copies (safe to encode off the event loop). ``version`` bumps on every change a waiting pull may care about.
- The weights live in :class:`WeightsStore`'s frame, copy on write (docs/performance.md, "Weights out"). They change
  in place only through :meth:`update` (and ``core.rewind``), each calling :meth:`~WeightsStore.before_change` first
  (counted: ``store.changes``). The transports read the store, never the other way.

The store's rule keeps every answer's bytes fixed: :meth:`answer` gives each answer its own ``memoryview`` of
:attr:`_answer`, whose reference count counts the answers not yet written out; :meth:`~WeightsStore.before_change`
moves the weights to a fresh pooled buffer first while an answer holds the current one; a new header is written in
place only under the same rule. :meth:`answer` gives None when the weights cannot live here (not plain arrays the PS
owns): the seam copies them then; it ``claim``-s the same-host file's arrays (``TensorSeam._file_current``).
"""
from __future__ import annotations

import sys
from typing import Any, Hashable, Mapping, Sequence

import numpy as np

from ps_service.core.buffers import POOL
from ps_service.core.optimizers import HYPERPARAMS, TORCH_HYPERPARAMS, Optimizer, normalize_spec
from shared import frame
from shared.codec import FLOAT_DTYPES, dtype_name
from ps_service.core.errors import CoreError
from shared.protocol import ModelInit
from shared.shards import Piece


def check_weights(tensors: Mapping[str, np.ndarray]) -> None:
    """A brought model's tensors, each floating point (else 422 ``bad_dtype``) and finite (else 422
    ``nonfinite_weights``: a NaN or Inf weight would make every update of it NaN)."""
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
        #: when that count last changed (None: given without a time, taken as settled)
        self.deployed_since: float | None = None
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
        """The spec a job resumed from a checkpoint runs: the checkpoint's, the PS settings' hyper-parameters on top.
        Another optimizer (its name, or torch's SGD gaining or losing momentum) is refused, ``optimizer_changed``."""
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
            raise CoreError("already_initialized",
                            f"the model is initialised (global step {self.global_step}); pull it")

    def restore(self, state: Mapping[str, Any], spec: Mapping[str, Any]) -> None:
        """Load a checkpointed model (:meth:`model_state`'s data) with the optimizer ``spec``."""
        opt = state["optimizer"]
        self.weights = {k: np.array(v, copy=True) for k, v in sorted(state["weights"].items())}
        self.optimizer = Optimizer(spec, self.weights)
        self.optimizer.load_state(opt["iterations"], opt["slots"])
        self.global_step = int(state["global_step"])
        self._changed()

    def update(self, grads: Mapping[str, np.ndarray], consume: bool = False, mean_of: int = 1,
               pieces: Sequence[Piece] | None = None, advance: bool = True) -> None:
        """One optimizer step of the weights, in place (:meth:`Optimizer.apply`), after the store's ``before_change``;
        ``pieces``: one partition's, ``advance`` False after its step's first."""
        self.store.before_change()
        self.optimizer.apply(self.weights, grads, consume=consume, mean_of=mean_of, pieces=pieces, advance=advance)

    def model_state(self) -> dict[str, Any]:
        """global_step, weights and optimizer (spec, iterations, slots), arrays copied."""
        if not self.initialized:
            raise CoreError("not_initialized", "nothing to checkpoint before the model is initialised")
        opt = self.optimizer.state()
        return {"global_step": self.global_step, "weights": {k: v.copy() for k, v in self.weights.items()},
                "optimizer": {**opt, "slots": {s: {k: v.copy() for k, v in t.items()}
                                               for s, t in opt["slots"].items()}}}

    def tick(self, now: float) -> bool:
        """Advance time (the core overrides it: leases, start-up, rounds)."""
        return False

    def _changed(self) -> None:
        self.version += 1


class WeightsStore:
    def __init__(self) -> None:
        self._buf: np.ndarray | None = None      # the frame's storage
        self._answer: np.ndarray | None = None   # the view every answer's memoryview is made from (its count)
        self._idle_refs = 0                      # its reference count with no answer alive
        self._layout: frame.Layout | None = None
        self._data_start = 0
        self._key: Hashable = None
        self._dict: dict[str, np.ndarray] | None = None  # the core's weights dict, holding ...
        self._views: dict[str, np.ndarray] = {}          # ... these arrays of the frame
        #: weights moved into a fresh frame (the first answer, a new layout, or copy on write): monitoring, tests
        self.moves = 0
        #: changes of the weights in place so far (:meth:`before_change`): what names their values, with the dict
        self.changes = 0

    def holds(self, weights: dict[str, np.ndarray] | None) -> bool:
        """The core's weights are this frame's arrays (a restore replaces the dict, the same-host file its arrays)."""
        if weights is None or weights is not self._dict or not self._views:
            return False
        first = next(iter(self._views))
        return weights.get(first) is self._views[first] and len(weights) == len(self._views)

    def in_flight(self) -> bool:
        """An answer still holds the frame (a memoryview of :attr:`_answer` is alive)."""
        return self._answer is not None and sys.getrefcount(self._answer) > self._idle_refs

    def answer(self, weights: dict[str, np.ndarray], key: Hashable, head: dict[str, Any],
               claim: bool = False) -> memoryview | None:
        """A frame of ``weights`` with ``head`` (the same ``key``, the same bytes), moving the weights in first; None
        when they live elsewhere. ``claim``: move them in even from elsewhere (the same-host file: it keeps a copy)."""
        if not self.holds(weights):
            if not (claim or _movable(weights)):
                self._forget()
                return None
            self._move(weights, head)
        elif key != self._key:
            prefix = frame.header(self._layout, head)
            if len(prefix) == self._data_start and not self.in_flight():
                self._answer[:len(prefix)] = np.frombuffer(prefix, np.uint8)
            else:
                self._move(weights, head)
        self._key = key
        return memoryview(self._answer)

    def before_change(self) -> None:
        """The weights are about to change in place: out of the frame first if an answer still sends it."""
        self.changes += 1
        if self._answer is None:
            return
        if not self.holds(self._dict):  # they live elsewhere now (a restore, the same-host file): let the frame go
            self._forget()
        elif self.in_flight():
            buf = POOL.array(self._buf.nbytes)
            np.copyto(buf, self._buf)
            self._adopt(buf, self._dict)

    def _move(self, weights: dict[str, np.ndarray], head: dict[str, Any]) -> None:
        layout = frame.Layout.of(weights, sorted(weights))
        buf = POOL.array(frame.frame_bytes(layout, head))  # the weights' own memory from now on
        frame.write_into(memoryview(buf), weights, head, layout)
        self._layout, self._data_start = layout, buf.nbytes - layout.data_bytes
        self._adopt(buf, weights)

    def _adopt(self, buf: np.ndarray, weights: dict[str, np.ndarray]) -> None:
        views = self._layout.views(buf[self._data_start:])
        for name, view in views.items():
            weights[name] = view  # the optimizer updates the frame from now on
        self._buf, self._answer, self._dict, self._views = buf, buf[:], weights, views
        self._idle_refs = sys.getrefcount(self._answer)  # measured, not assumed: the count is CPython's detail
        self.moves += 1

    def _forget(self) -> None:
        self._buf = self._answer = self._layout = self._dict = self._key = None
        self._views = {}


def _movable(weights: dict[str, np.ndarray]) -> bool:
    """Plain arrays of the PS's own (owning their memory): not views of a file or of another buffer."""
    return bool(weights) and all(isinstance(a, np.ndarray) and a.base is None for a in weights.values())
