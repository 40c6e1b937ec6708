"""The PS's side of weight deltas (docs/protocol.md, "Weight deltas"): which entries of the weights changed since the
step whose weights were last served, computed once per step, not per worker.

:class:`WeightDeltas` keeps one snapshot of the tracked tensors (the float32 tensors the job compresses) at ``step``;
:meth:`observe`, called with the weights of every body answer, notices a new step and compares the weights with the
snapshot bit for bit: the tensors with few changed entries (``shared.weight_deltas.worth_sparse``) keep them (the
answer's sparse tensors), and the snapshot takes the new values. ``base`` is the step the changes are from. When the
new step is one optimizer apply past the previous one and that apply updated a tensor as entries
(``ps_service.core.optimizers.Touched``: SGD on top-k pushes), those entries are taken as they are (O(k), the same
bits), and that tensor's snapshot is dropped; a step that is not such an apply sends it dense once and takes a new
snapshot.

``lineage`` (docs/protocol.md) is drawn again when a step comes again with other weights (gone back, re-applied).
"""
from __future__ import annotations

import secrets
from typing import TYPE_CHECKING, Callable, Mapping

import numpy as np

from shared import weight_deltas as wd
from shared.compression import U32

if TYPE_CHECKING:
    from ps_service.core.optimizers import Touched


class WeightDeltas:
    def __init__(self, tracked: Callable[[str, np.dtype], bool]) -> None:
        #: whether a tensor (name, dtype) may travel as changed entries
        self.tracked = tracked
        self.lineage = secrets.token_hex(8)
        self.step: int | None = None
        self._iterations: int | None = None
        self._serial: int | None = None  # the optimizer the snapshot's iterations count the applies of
        #: the tracked tensors at ``step``; None: dropped (behind by the entries last taken from the optimizer)
        self._snapshot: dict[str, np.ndarray | None] = {}
        #: the step ``changes`` are from (None: no delta to offer)
        self.base: int | None = None
        #: name -> uint32 [2, k]: the tracked tensors sent as changed entries from ``base`` to ``step``
        self.changes: dict[str, np.ndarray] = {}

    def observe(self, step: int, iterations: int, weights: Mapping[str, np.ndarray],
                touched: Touched | None = None) -> None:
        """The weights about to be served are ``step``'s (after ``iterations`` applies; ``touched``: the last one's):
        at a new step, find what changed."""
        serial, self._serial = self._serial, None if touched is None else touched.serial
        if step == self.step and iterations == self._iterations and serial == self._serial:
            return
        if self.step is None or step <= self.step:  # first sight, or the weights of a step changed
            if self.step is not None:
                self.lineage = secrets.token_hex(8)
            self._snapshot = {k: np.array(v, order="C") for k, v in weights.items() if self.tracked(k, v.dtype)}
            self.base, self.changes = None, {}
        else:
            self.base, self.changes = self.step, {}
            one_apply = touched is not None and serial == touched.serial and step == self.step + 1 \
                and touched.iterations == iterations == self._iterations + 1
            entries = touched.entries if one_apply else None  # exactly the entries that differ, per tensor
            for name, snap in self._snapshot.items():
                now = weights[name]
                known = None if entries is None else entries.get(name)
                if known is not None:  # no compare, and the snapshot is not needed while every step is such an apply
                    self._snapshot[name] = None
                    if wd.worth_sparse(known.size, now.size):
                        self.changes[name] = wd.pack(known.astype(U32), now, touched.values.get(name))
                elif snap is None:  # dropped: this tensor goes dense once, and is compared again from now on
                    self._snapshot[name] = np.array(now, order="C")
                elif (idx := wd.changed_indices(snap, now, limit=wd.sparse_limit(snap.size))) is not None:
                    wire = self.changes[name] = wd.pack(idx, now)
                    snap.reshape(-1).view(U32)[idx] = wire[1]  # now the snapshot is ``now``: nothing else changed
                else:
                    np.copyto(snap, now)
        self.step, self._iterations = step, iterations

    def offers(self, since: int | None) -> bool:
        """Whether a worker holding the weights of ``since`` (this lineage) can be answered with changes."""
        return since is not None and since == self.base and bool(self.changes)
