"""One round's gradients and their rank-order sum: the PS's ConditionalAccumulator. Pure, no I/O, no clock.

Contract:

- :func:`validate` says whether a gradient fits the model, before anything changes: exactly the
  model's tensor names, and per tensor exactly its shape and dtype (422 ``tensor_mismatch``
  otherwise; nothing is ever cast), then no NaN/Inf in those very arrays (422
  ``nonfinite_gradient`` under the ``reject`` policy; ``False`` under ``skip``).
- :class:`Accumulator` holds the validated gradients of one round, one per worker:
  ``apply(worker_id, rank, grads, pending)``. It owns the arrays it is given: the first one in
  rank order becomes the running sum and is written into (copied first if it is read-only or
  not C-contiguous), the others are read once and released.
- ``take()`` returns their sum in (rank, worker_id) order, ``acc = g[first]; acc += g[next] ...``,
  then ``acc /= n`` under ``aggregation="mean"`` when n > 1: element-wise in that order whatever
  the arrival order, so a run is bit-reproducible. The worker id breaks rank ties (a newcomer can
  reuse the rank of a member that left mid-round).
- Part of the sum is done while the round fills, as arrivals allow: a gradient is folded in once no
  gradient still possible (``pending``) sorts before it. When that is not known (``pending=None``:
  fixed R, whose first R arrivals win) everything waits for ``take()``. Folding early or late
  gives the same bits.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from shared.errors import unprocessable

Key = tuple[int, str]  # (rank, worker_id): the order of the sum


def _all_finite(g: np.ndarray) -> bool:
    """No NaN/Inf in ``g``. A finite sum proves it (NaN and Inf propagate) without a temporary
    array; only an overflowing or non-finite sum takes the element-wise check."""
    with np.errstate(all="ignore"):
        if g.dtype.itemsize >= 4 and np.isfinite(g.sum(dtype=g.dtype)):
            return True
    return bool(np.isfinite(g).all())


#: elements copied and checked at a time by :func:`copy_checked` (a chunk stays in the cache between the two)
CHUNK_ELEMENTS = 1 << 16


def copy_checked(read, layout, buf: np.ndarray) -> str | None:
    """Fill ``buf`` (a frame's data part, laid out as ``layout``) chunk by chunk with ``read(offset, chunk)``,
    checking each chunk of the *copy* for NaN/Inf while it is in the cache: one pass over the memory instead
    of a copy and a check. The name of the first tensor whose copy has NaN/Inf, or None. The caller then
    owns ``buf``, which is what it validated."""
    bad = None
    for spec in layout.tensors:
        step = CHUNK_ELEMENTS * spec.dtype.itemsize
        for lo in range(spec.offset, spec.offset + spec.nbytes, step):
            hi = min(lo + step, spec.offset + spec.nbytes)
            read(lo, memoryview(buf[lo:hi]))
            if bad is None and not _all_finite(buf[lo:hi].view(spec.dtype)):
                bad = spec.name
    return bad


def _dtype(dt: np.dtype) -> str:
    return dt.name if dt.isnative else dt.str


def validate(weights: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray],
             nonfinite_policy: str = "reject", nonfinite: str | None | bool = False) -> bool:
    """Raise 422 unless ``grads`` fits ``weights`` (names, shapes, dtypes); False if it has NaN/Inf under
    policy ``skip``. Reads only. ``nonfinite``: False when unknown (the arrays are checked here), else what
    :func:`copy_checked` found when it made these very arrays (None: all finite, or the first bad name)."""
    missing, extra = weights.keys() - grads.keys(), grads.keys() - weights.keys()
    if missing or extra:
        name = sorted(missing or extra)[0]
        raise unprocessable("tensor_mismatch", f"tensor {name!r} is {'missing' if missing else 'not in the model'}")
    for name, w in weights.items():
        g = grads[name]
        if not isinstance(g, np.ndarray) or g.dtype != w.dtype:
            got = _dtype(g.dtype) if isinstance(g, np.ndarray) else type(g).__name__
            raise unprocessable("tensor_mismatch", f"tensor {name!r} is {got}, the model's is {_dtype(w.dtype)}: "
                                                   "a gradient must have its weight's dtype")
        if g.shape != w.shape:
            raise unprocessable("tensor_mismatch",
                                f"tensor {name!r} has shape {list(g.shape)}, the model has {list(w.shape)}")
    if nonfinite is False:
        nonfinite = next((name for name, g in grads.items() if not _all_finite(g)), None)
    if nonfinite is not None:
        if nonfinite_policy == "reject":
            raise unprocessable("nonfinite_gradient", f"tensor {nonfinite!r} has NaN or Inf values")
        return False
    return True


def _writable(g: np.ndarray) -> np.ndarray:
    """``g`` itself to sum into, or a C-contiguous copy when it cannot be written in place."""
    return g if g.flags.writeable and g.flags.c_contiguous else np.array(g, order="C", copy=True)


@dataclass
class Accumulator:
    names: tuple[str, ...]  # the model's tensors, in the order of the sum's dict
    aggregation: str = "mean"
    #: every contributor's sort key, in arrival order
    keys: dict[str, Key] = field(default_factory=dict)
    #: gradients not summed yet, by worker id
    waiting: dict[str, Mapping[str, np.ndarray]] = field(default_factory=dict)
    #: the rank-order prefix of ``keys`` already summed into ``acc``
    folded: list[Key] = field(default_factory=list)
    acc: dict[str, np.ndarray] | None = None

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self.keys

    def apply(self, worker_id: str, rank: int, grads: Mapping[str, np.ndarray],
              pending: Iterable[Key] | None = None) -> None:
        """Take ``worker_id``'s validated gradient; fold in what sorts before every key in ``pending``
        (the gradients still possible; None: unknown, fold nothing yet)."""
        key = (rank, worker_id)
        if worker_id in self.keys or (self.folded and key < self.folded[-1]):
            raise AssertionError(f"gradient {key} is a repeat or sorts before the summed prefix {self.folded}")
        self.keys[worker_id] = key
        self.waiting[worker_id] = grads
        if pending is not None:
            self._fold(min(pending, default=None))

    def take(self) -> dict[str, np.ndarray]:
        """The rank-order sum (mean) of every gradient applied; the accumulator is empty afterwards."""
        if not self.keys:
            raise AssertionError("nothing to take")
        self._fold(None)
        out, n = self.acc, len(self.keys)
        self.keys, self.folded, self.acc = {}, [], None
        if self.aggregation == "mean" and n > 1:
            for acc in out.values():
                acc /= n
        return out

    def _fold(self, bound: Key | None) -> None:
        """Sum the waiting gradients in key order, up to (not including) ``bound``."""
        for key in sorted(self.keys[w] for w in self.waiting):
            if bound is not None and key > bound:
                return
            grads = self.waiting.pop(key[1])
            if self.acc is None:
                self.acc = {name: _writable(grads[name]) for name in self.names}
            else:
                for name, acc in self.acc.items():
                    np.add(acc, grads[name], out=acc)
            self.folded.append(key)
