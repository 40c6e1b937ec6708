"""One round's gradients and their rank-order sum: the PS's ConditionalAccumulator. Pure, no I/O, no clock.

Contract:

- :func:`validate` says whether a gradient fits the model, before anything changes: exactly the
  model's tensor names, and per tensor exactly its shape and dtype (422 ``tensor_mismatch``
  otherwise; nothing is ever cast), then no NaN/Inf in those very arrays (422
  ``nonfinite_gradient`` under the ``reject`` policy; False under ``skip``).
- :class:`Accumulator` holds the validated gradients of one round, one per worker:
  ``apply(worker_id, rank, grads, pending)``. It owns the arrays it is given: the first one in
  rank order becomes the running sum and is written into (copied first if it is read-only or
  not C-contiguous), the others are read once and released.
- ``take_sum()`` returns their sum in (rank, worker_id) order, ``acc = g[first]; acc += g[next] ...``,
  then ``acc /= n`` under ``aggregation="mean"`` when n > 1: element-wise in that order whatever
  the arrival order, so a run is bit-reproducible. The worker id breaks rank ties (a newcomer can
  reuse the rank of a member that left mid-round).
- Part of the sum is done while the round fills, as arrivals allow: a gradient is folded in once no
  gradient still possible (``pending``) sorts before it. When that is not known (``pending=None``:
  fixed R, whose first R arrivals win) everything waits for ``take_sum()``. Folding early or late
  gives the same bits. The gradients not summed yet wait in a heap by key: O(log K) per gradient.
- One gradient type: owned arrays (dense, or a top-k push's :class:`~shared.compression.SparseTensor`). Whatever
  carried them (a body, a same-host file: its transport copied and checked it into a buffer of the PS's own,
  ps_service/transport/shm.py), the accumulator owns them once they are applied and never reads a sender's memory.
- **What is applied is finite.** Every sum that was added to in place unchecked is read once for NaN/Inf when the
  round ends (``take_sum``): finite gradients can overflow when added (two float32 3e38 make inf). Not finite:
  :attr:`~Accumulator.spoiled` (:attr:`~Accumulator.overflow` names the tensor), the round applies nothing.
- A top-k push's tensors (:class:`~shared.compression.SparseTensor`: k entries, zero elsewhere) are kept as the
  running sum's :class:`Terms` while that tensor's sum came only from such pushes, and added at once when the sum is
  taken (:func:`sparse_sum`: over the union of their indices, the dense sum's bits there, +0.0 elsewhere as the
  dense sum has it; O(k log k), the sums checked as made); ``take_sum`` then gives that tensor as a
  :class:`~shared.compression.SparseTensor` (its support: the entries a round can change), ``take`` as an array.
  A dense push, or a same-host one, makes it dense first.
- NaN/Inf checks (:func:`finite`) are a BLAS dot product of the tensor with itself, chunk by chunk: NaN or Inf
  exactly when an element is (squares are >= 0: nothing cancels), unless the squares overflow (|x| > 1.8e19 in
  float32), where that chunk is checked exactly by a dot product with zeros.
"""
from __future__ import annotations

import heapq
from dataclasses import dataclass, field
from typing import Iterable, Mapping

import numpy as np

from shared.compression import F32, SparseTensor, dense
from ps_service.core.errors import CoreError

Key = tuple[int, str]  # (rank, worker_id): the order of the sum


#: elements read and checked at a time by :func:`read_checked` (a chunk stays in the cache)
CHUNK_ELEMENTS = 1 << 16
#: elements :func:`finite` checks at a time (fewer, larger calls: 0.17 against 0.22 ms for 4 MB)
FINITE_CHUNK = 1 << 18
#: :func:`read_checked` takes tensors up to this size whole, then checks them (they stay in the last-level cache:
#: 0.66 against 0.92 ms for a checked sum of two 4 MB files, process CPU; 14.9 against 14.0 ms at 40 MB)
WHOLE_BYTES = 8 << 20
#: a chunk of zeros per BLAS dtype: the exact check of a chunk whose squares overflow
_ZEROS = {np.dtype(np.float32): np.zeros(FINITE_CHUNK, np.float32),
          np.dtype(np.float64): np.zeros(FINITE_CHUNK, np.float64)}
#: the largest finite square sum per BLAS dtype
_TOP_SQUARES = {dt: np.finfo(dt).max for dt in _ZEROS}


def finite(g: np.ndarray | SparseTensor) -> bool:
    """No NaN/Inf in ``g``. float32/float64, chunk by chunk: ``dot(c, c)`` (BLAS, at memory speed, no temporary
    array) is NaN or +Inf exactly when an element of ``c`` is, since squares are >= 0 and nothing cancels; when it is
    not finite the chunk is checked exactly (``dot(c, zeros)``, NaN iff an element is NaN/Inf: ``0 * Inf`` is NaN),
    which tells a finite chunk whose squares overflow. Other dtypes: the element-wise check."""
    if isinstance(g, SparseTensor):
        g = g.values  # zero elsewhere
    flat = g.reshape(-1)
    zeros = _ZEROS.get(flat.dtype)
    if zeros is None:
        return bool(np.isfinite(flat).all())
    top, dot = _TOP_SQUARES[flat.dtype], np.dot
    with np.errstate(over="ignore", invalid="ignore"):
        for lo in range(0, flat.size, FINITE_CHUNK):
            c = flat[lo:lo + FINITE_CHUNK]
            if not dot(c, c) <= top and not np.isfinite(dot(c, zeros[:c.size])):  # NaN/Inf, or overflowing squares
                return False
    return True


def read_checked(src: Mapping[str, np.ndarray], out: Mapping[str, np.ndarray]) -> str | None:
    """``out = src``, then ``out`` checked for NaN/Inf while it is in the cache (whole up
    to :data:`WHOLE_BYTES` a tensor, else chunk by chunk): ``src`` is read exactly once and what is checked is
    what is kept, whatever writes into ``src`` meanwhile. The first tensor with a NaN/Inf in ``out`` (from
    ``src``) at which it stopped, or None (``out`` is complete)."""
    for name, o in out.items():
        s, o1 = src[name].reshape(-1), o.reshape(-1)
        if o1.nbytes <= WHOLE_BYTES:  # whole: it stays in the last-level cache for its check
            np.copyto(o1, s)
            if not finite(o1):
                return name
            continue
        zeros, top, dot, isfinite = _ZEROS.get(o1.dtype), _TOP_SQUARES.get(o1.dtype), np.dot, np.isfinite
        for lo in range(0, o1.size, CHUNK_ELEMENTS):
            hi = lo + CHUNK_ELEMENTS
            oc = o1[lo:hi]
            np.copyto(oc, s[lo:hi])
            if zeros is None:
                if not finite(oc):
                    return name
            elif not dot(oc, oc) <= top and not isfinite(dot(oc, zeros[:oc.size])):  # as finite()
                return name
    return None


def _dtype(dt: np.dtype) -> str:
    return dt.name if dt.isnative else dt.str


def validate(weights: Mapping[str, np.ndarray], grads: Mapping[str, np.ndarray],
             nonfinite_policy: str = "reject", check_finite: bool = True) -> bool:
    """Raise 422 unless ``grads`` fits ``weights`` (names, shapes, dtypes); False if it has NaN/Inf under policy
    ``skip``, else True. Reads only. ``check_finite`` False: the values were checked already (by the transport that
    read them: ``PushRequest.finite_checked``): only the layout is checked here."""
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
    return finite_or_refuse(next((name for name, g in grads.items() if not finite(g)), None), nonfinite_policy)


def finite_or_refuse(nonfinite: str | None, nonfinite_policy: str) -> bool:
    """True if ``nonfinite`` is None (no tensor has NaN/Inf); else 422 under policy ``reject``, False under ``skip``."""
    if nonfinite is not None:
        if nonfinite_policy == "reject":
            raise CoreError("nonfinite_gradient", f"tensor {nonfinite!r} has NaN or Inf values")
        return False
    return True


def _writable(g: np.ndarray | SparseTensor) -> np.ndarray:
    """``g`` itself to sum into, or a C-contiguous copy when it cannot be written in place (a sparse one: dense)."""
    if isinstance(g, SparseTensor):
        return dense(g)
    return g if g.flags.writeable and g.flags.c_contiguous else np.array(g, order="C", copy=True)


class Terms(list):
    """The top-k pushes of one tensor of the running sum, in rank order, not yet added (:func:`sparse_sum` adds
    them at once when the sum is taken)."""


def _owned(g: np.ndarray | SparseTensor) -> np.ndarray | Terms:
    """The running sum's start from a gradient: a sparse one as the first of its :class:`Terms`, a dense one
    :func:`_writable`."""
    return Terms([g]) if isinstance(g, SparseTensor) else _writable(g)


def sparse_sum(terms: list[SparseTensor]) -> SparseTensor:
    """The rank-order sum ``dense(t0) + dense(t1) + ...`` of top-k tensors (indices strictly increasing) as
    entries, bit for bit: over the union of their indices, each entry's values added in rank order (the same
    additions as the dense sum's, which adds +0.0 for every term that holds none there: that changes only a -0.0,
    to +0.0, so an entry not held by every term has +0.0 added at the end); off the union the dense sum is +0.0,
    which no entry stands for. One stable sort of all their indices (O(k log k) for k entries in all), then a pass
    per term an entry can hold."""
    first = terms[0]
    if len(terms) == 1:
        return SparseTensor(first.shape, first.indices, np.array(first.values, F32, copy=True))
    both = np.concatenate([t.indices for t in terms])
    order = np.argsort(both, kind="stable")  # equal indices stay in rank order
    where, values = both[order], np.concatenate([t.values for t in terms])[order]
    if not where.size:
        return SparseTensor(first.shape, where, values)
    starts = np.empty(where.size, bool)
    starts[0] = True
    np.not_equal(where[1:], where[:-1], out=starts[1:])
    firsts = np.flatnonzero(starts)
    held = np.diff(firsts, append=where.size)  # how many terms hold each entry
    out = values[firsts]
    for j in range(1, int(held.max())):
        more = np.flatnonzero(held > j)
        out[more] += values[firsts[more] + j]
    out[held < len(terms)] += np.float32(0)
    return SparseTensor(first.shape, where[firsts], out)


@dataclass
class Accumulator:
    names: tuple[str, ...]  # the model's tensors, in the order of the sum's dict
    aggregation: str = "mean"
    #: every contributor's sort key, in arrival order
    keys: dict[str, Key] = field(default_factory=dict)
    #: gradients not summed yet, by worker id, and their keys as a heap (the next one to sum first)
    waiting: dict[str, Mapping[str, np.ndarray | SparseTensor]] = field(default_factory=dict)
    queue: list[Key] = field(default_factory=list)
    #: the rank-order prefix of ``keys`` already summed into ``acc``
    folded: list[Key] = field(default_factory=list)
    acc: dict[str, np.ndarray | Terms] | None = None
    #: the sum is not finite (finite gradients that overflow when added): it is not applied
    spoiled: bool = False
    #: the first tensor of the final sum found not finite, None if none
    overflow: str | None = None
    #: the running sum is known finite (one checked gradient, or a sum checked as made); False once something was
    #: added in place unchecked, and then :meth:`_check_sum` reads it once when the round ends
    _finite: bool = field(default=True, repr=False)

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self.keys

    def apply(self, worker_id: str, rank: int, grads: Mapping[str, np.ndarray | SparseTensor],
              pending: Iterable[Key] | None = None) -> None:
        """Take ``worker_id``'s validated gradient (its arrays are the accumulator's from now on); fold in what
        sorts before every key in ``pending`` (the gradients still possible; None: unknown, fold nothing yet)."""
        key = (rank, worker_id)
        if worker_id in self.keys or (self.folded and key < self.folded[-1]):
            raise AssertionError(f"gradient {key} is a repeat or sorts before the summed prefix {self.folded}")
        self.keys[worker_id] = key
        self.waiting[worker_id] = grads
        heapq.heappush(self.queue, key)
        if pending is not None:
            self._fold(min(pending, default=None))

    def take_sum(self) -> tuple[dict[str, np.ndarray | SparseTensor] | None, int]:
        """(the rank-order sum of every gradient applied, n): ``sum / n`` is the mean (n is 1 under
        ``aggregation="sum"``), the division left to the caller's update; None if the sum is :attr:`spoiled`. Every
        waiting gradient is summed and the sum checked first; the accumulator is empty afterwards. A tensor summed
        only from top-k pushes comes as a :class:`~shared.compression.SparseTensor` (+0.0 off its entries; the caller
        may write into its values)."""
        if not self.keys:
            raise AssertionError("nothing to take")
        self._fold(None)
        self._check_sum()
        out, n = (None, 0) if self.spoiled else (self.acc, len(self.keys))
        self.keys, self.folded, self.acc = {}, [], None
        self._finite = True
        return out, n if self.aggregation == "mean" and n > 1 else 1

    def _check_sum(self) -> None:
        """The sum is what gets applied: unless it is known finite, read it once for NaN/Inf (finite
        gradients can overflow when added); not finite: :attr:`spoiled`, the round applies nothing."""
        self._sparse_summed()
        if self.acc is None or self.spoiled or self._finite:
            return
        self._finite = True
        self.overflow = next((name for name, a in self.acc.items() if not finite(a)), None)
        self.spoiled = self.overflow is not None

    def _fold(self, bound: Key | None) -> None:
        """Sum the waiting gradients in key order, up to (not including) ``bound``."""
        queue, waiting = self.queue, self.waiting
        while queue and (bound is None or queue[0] < bound):
            key = heapq.heappop(queue)
            grads = waiting.pop(key[1])
            self.folded.append(key)
            if self.acc is None:
                self.acc = {name: _owned(grads[name]) for name in self.names}  # validated: finite
                self._finite = True
            else:
                self._fold_owned(grads)

    def _fold_owned(self, grads: Mapping[str, np.ndarray | SparseTensor]) -> None:
        """``acc += grads``: a sparse tensor onto a sum of such (:class:`Terms`, added when the sum is taken); else in
        place, the sum made dense first, unchecked: the whole sum is checked once, :meth:`_check_sum`."""
        with np.errstate(over="ignore", invalid="ignore"):  # an overflowing sum is found by the check, not warned about
            for name, acc in self.acc.items():
                g = grads[name]
                if isinstance(acc, Terms) and isinstance(g, SparseTensor):
                    acc.append(g)
                else:
                    acc = self.acc[name] = dense(self._summed(name, acc))
                    np.add(acc, dense(g), out=acc)
                    self._finite = False

    def _summed(self, name: str, acc: np.ndarray | Terms) -> np.ndarray | SparseTensor:
        """``acc`` with its :class:`Terms` added (:func:`sparse_sum`), their sums checked as made: not finite (finite
        values can overflow when added), the sum is :attr:`spoiled`."""
        if not isinstance(acc, Terms):
            return acc
        with np.errstate(over="ignore", invalid="ignore"):
            total = sparse_sum(acc)
            if not np.isfinite(total.values).all():
                self.spoiled, self.overflow = True, self.overflow or name
        return total

    def _sparse_summed(self) -> None:
        """Every :class:`Terms` of the running sum added (its tensors then arrays or entries)."""
        if self.acc is not None and any(isinstance(a, Terms) for a in self.acc.values()):
            self.acc = {name: self._summed(name, a) for name, a in self.acc.items()}
