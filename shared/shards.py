"""The shard map: which shard of a sharded PS owns which part of which tensor. Pure, no I/O.

Contract: :func:`plan` makes docs/protocol-shards.md's map ("The shard map") from the model's spec, the shard count S
and the split bound B (elements): each tensor whole or cut into ``ceil(n / B)`` contiguous flat slices, the pieces
placed largest first on the least-loaded shard (fewer pieces than shards: ``ValueError``). Workers and shards compute
it alike and check they agree by :attr:`ShardMap.digest`. On a shard a piece is a tensor of its own
(:attr:`Piece.key`); every optimizer is elementwise, so S shards step the bits one PS would. :func:`split` cuts
tensors into one shard's pieces (views); :func:`place` copies one shard's slices into :func:`split_memory` as its
answer arrives, and :func:`gathered` returns the whole tensors once every shard's are in.
"""
from __future__ import annotations

import hashlib
import heapq
import json
import math
from dataclasses import dataclass
from functools import cached_property
from typing import Mapping, Sequence

import numpy as np

Spec = Mapping[str, tuple[tuple[int, ...], str]]  # name -> (shape, dtype name)


@dataclass(frozen=True, order=True)
class Piece:
    name: str  # the model tensor
    start: int  # flat element range [start, stop)
    stop: int
    whole: bool  # the piece is the whole tensor (it keeps its name and shape)

    @property
    def key(self) -> str:
        """The piece's tensor name on its shard."""
        return self.name if self.whole else f"{self.name}[{self.start}:{self.stop}]"

    size = property(lambda self: self.stop - self.start)


@dataclass(frozen=True)
class ShardMap:
    spec: dict[str, tuple[tuple[int, ...], str]]
    shards: int
    split_elements: int
    pieces: tuple[tuple[Piece, ...], ...]  # per shard, sorted by key

    @cached_property
    def digest(self) -> str:
        """sha256 of the map's canonical JSON (computed once: every hold names it, every shard checks it)."""
        body = {"spec": {k: [list(s), d] for k, (s, d) in sorted(self.spec.items())}, "shards": self.shards,
                "split_elements": self.split_elements,
                "pieces": [[[p.name, p.start, p.stop] for p in ps] for ps in self.pieces]}
        return hashlib.sha256(json.dumps(body, sort_keys=True, separators=(",", ":")).encode()).hexdigest()

    @property
    def split_names(self) -> list[str]:
        """The tensors cut into pieces on several shards (the others are whole on one shard)."""
        return sorted({p.name for ps in self.pieces for p in ps if not p.whole})

    def bytes_owned(self, index: int) -> int:
        return sum(p.size * np.dtype(self.spec[p.name][1]).itemsize for p in self.pieces[index])

    def to_wire(self) -> dict:
        """The spec as JSON (name -> {"shape", "dtype"}), S and B: what :func:`from_wire` plans from again."""
        return {"spec": {k: {"shape": list(s), "dtype": d} for k, (s, d) in sorted(self.spec.items())},
                "shards": self.shards, "split_elements": self.split_elements, "digest": self.digest}


def spec_of(tensors: Mapping[str, np.ndarray]) -> dict[str, tuple[tuple[int, ...], str]]:
    return {k: (tuple(int(n) for n in v.shape), v.dtype.name) for k, v in tensors.items()}


def from_wire(obj: Mapping) -> ShardMap:
    """:func:`plan` of a :meth:`ShardMap.to_wire` answer; ``ValueError`` if its digest is not what this code makes
    of it (a peer running another version, or other settings)."""
    spec = {k: (tuple(v["shape"]), v["dtype"]) for k, v in obj["spec"].items()}
    m = plan(spec, obj["shards"], obj["split_elements"])
    if m.digest != obj.get("digest"):
        raise ValueError(f"shard map digest {obj.get('digest')} is not this code's {m.digest}")
    return m


def plan(spec: Spec, shards: int, split_elements: int) -> ShardMap:
    if shards < 1 or split_elements < 1:
        raise ValueError("shards and split_elements must be >= 1")
    spec = {k: (tuple(int(n) for n in s), str(d)) for k, (s, d) in spec.items()}
    pieces: list[tuple[int, Piece]] = []  # (bytes, piece)
    for name, (shape, dtype) in sorted(spec.items()):
        n, item = math.prod(shape), np.dtype(dtype).itemsize
        k = max(1, math.ceil(n / split_elements))
        bounds = [i * n // k for i in range(k + 1)]  # k slices, sizes differing by at most one
        for lo, hi in zip(bounds, bounds[1:]):
            pieces.append(((hi - lo) * item, Piece(name, lo, hi, k == 1)))
    if len(pieces) < shards:
        raise ValueError(f"the model has {len(pieces)} piece(s) for {shards} shards: lower PS_SHARDS or "
                         "PS_SHARD_SPLIT_ELEMENTS")
    pieces.sort(key=lambda bp: (-bp[0], bp[1].name, bp[1].start))
    loads = [(0, 0, i) for i in range(shards)]  # a heap of (bytes, pieces, index): the least loaded first
    owned: list[list[Piece]] = [[] for _ in range(shards)]
    for nbytes, piece in pieces:
        load, count, i = heapq.heappop(loads)
        owned[i].append(piece)
        heapq.heappush(loads, (load + nbytes, count + 1, i))
    return ShardMap(spec, shards, split_elements, tuple(tuple(sorted(o, key=lambda p: p.key)) for o in owned))


def split(tensors: Mapping[str, np.ndarray], pieces: Sequence[Piece]) -> dict[str, np.ndarray]:
    """One shard's pieces of ``tensors`` (a whole tensor as it is; a slice a view of the flattened tensor when
    it is C-contiguous, else a copy)."""
    out = {}
    for p in pieces:
        t = tensors[p.name]
        out[p.key] = t if p.whole else t.reshape(-1)[p.start:p.stop]
    return out


def split_memory(m: ShardMap) -> dict[str, np.ndarray]:
    """New (uninitialised) arrays for the split tensors of ``m``: what :func:`place` fills."""
    return {name: np.empty(m.spec[name][0], m.spec[name][1]) for name in m.split_names}


def place(m: ShardMap, index: int, tensors: Mapping[str, np.ndarray], into: Mapping[str, np.ndarray]) -> None:
    """Copy shard ``index``'s slices of the split tensors (``tensors``: its pieces by key) into ``into`` (arrays
    shaped as :func:`split_memory`'s). Shards write disjoint ranges: one call per shard may run in its own thread."""
    for p in m.pieces[index]:
        if not p.whole:
            dst, src = into[p.name].reshape(-1)[p.start:p.stop], tensors[p.key].reshape(-1)
            if src.__array_interface__["data"][0] != dst.__array_interface__["data"][0]:  # (joined there already)
                dst[...] = src


def gathered(m: ShardMap, parts: Sequence[Mapping[str, np.ndarray]],
             into: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The whole tensors: each whole piece as it is in ``parts`` (no copy), each split tensor ``into``'s (every shard
    :func:`place`-d there)."""
    out = {name: into[name] for name in m.split_names}
    for i, ps in enumerate(m.pieces):
        for p in ps:
            if p.whole:
                out[p.name] = parts[i][p.key]
    return dict(sorted(out.items()))

