"""The partitions of a model (docs/partitions.md, docs/protocol-partitions.md). Pure, no I/O.

Contract (:func:`plan`): from the model's spec (name -> (shape, dtype)) and a partition size in bytes, Q partitions,
each a tuple of the shard map's pieces (:class:`shared.shards.Piece`), such that every element is in exactly one
piece; the pieces, in partition order, run through the tensors in name order and through each tensor in order; a
tensor larger than the size is cut into slices of at most the size (the shard map's cut) and consecutive pieces are
grouped while the group stays within the size; a size of 0 gives one partition of every tensor whole
(:attr:`Plan.whole`). The PS and every worker compute the same plan from the spec and the size.
:meth:`Plan.split` gives one partition's pieces of a set of tensors as views, keyed by :attr:`Piece.key`.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from functools import cached_property
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

    @cached_property
    def whole(self) -> bool:
        """One partition of every tensor whole: the round is today's (computed once a plan: read per frame)."""
        return self.count == 1 and all(p.whole for p in self.partitions[0])

    @cached_property
    def keys(self) -> tuple[tuple[str, ...], ...]:
        """Per partition, its tensor names (its pieces' keys), sorted: the names of its sum; computed once a plan."""
        return tuple(tuple(sorted(p.key for p in part)) for part in self.partitions)

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
