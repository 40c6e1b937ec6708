"""The partitions of a model (issue 53, docs/partitions.md, docs/protocol-partitions.md). Pure, no I/O.

Contract (:func:`plan`): from the model's spec (name -> (shape, dtype)) and a partition size in bytes, Q partitions,
each a tuple of the shard map's pieces (:class:`shared.shards.Piece`: a whole tensor, or a contiguous slice of its
flattened elements), such that:

- every element of every tensor is in exactly one piece of one partition, and the partitions' pieces, taken in
  partition order, run through the tensors in name order (the order of the PS's weights) and through each tensor
  from its first element to its last;
- a tensor larger than the size is cut into slices of at most the size (the shard map's cut, sizes differing by at
  most one element), and consecutive pieces are grouped into one partition while the group stays within the size;
- a size of 0 gives Q = 1: one partition of every tensor whole, today's round (:attr:`Plan.whole`).

The plan is a function of the spec and the size only, so the PS and every worker compute the same one.
:meth:`Plan.split` gives one partition's pieces of a set of tensors as views (no copy), keyed by
:attr:`~shared.shards.Piece.key`: a partition's gradient (a worker's push frame), weights or slots (the PS's update).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping

import numpy as np

from shared import shards
from shared.shards import Piece, Spec


@dataclass(frozen=True)
class Plan:
    partitions: tuple[tuple[Piece, ...], ...]

    @property
    def count(self) -> int:
        """Q, the partitions of a round."""
        return len(self.partitions)

    @property
    def whole(self) -> bool:
        """One partition of every tensor whole: the round is today's."""
        return self.count == 1 and all(p.whole for p in self.partitions[0])

    def keys(self, q: int) -> tuple[str, ...]:
        """Partition ``q``'s tensor names (its pieces' keys), sorted: the names of its sum."""
        return tuple(sorted(p.key for p in self.partitions[q]))

    def split(self, tensors: Mapping[str, np.ndarray], q: int) -> dict[str, np.ndarray]:
        """Partition ``q``'s pieces of ``tensors`` (the whole model's), views where the tensors are C-contiguous."""
        return shards.split(tensors, self.partitions[q])


def plan(spec: Spec, partition_bytes: int) -> Plan:
    """The partitions of a model of ``spec`` at ``partition_bytes`` each (0: one partition, the whole model)."""
    if partition_bytes < 0:
        raise ValueError("partition_bytes must be >= 0")
    if not spec:
        raise ValueError("a model has at least one tensor")
    items = {name: np.dtype(dtype).itemsize for name, (_, dtype) in spec.items()}
    if partition_bytes == 0:
        return Plan((tuple(Piece(name, 0, math.prod(shape), True) for name, (shape, _) in sorted(spec.items())),))
    pieces = [p for name in sorted(spec)  # each tensor cut at the size in its own dtype
              for p in sorted(shards.plan({name: spec[name]}, 1, max(1, partition_bytes // items[name])).pieces[0],
                              key=lambda p: p.start)]
    groups: list[list[Piece]] = []
    size = 0
    for p in pieces:
        nbytes = p.size * items[p.name]
        if not groups or size + nbytes > partition_bytes:
            groups.append([])
            size = 0
        groups[-1].append(p)
        size += nbytes
    return Plan(tuple(tuple(g) for g in groups))
