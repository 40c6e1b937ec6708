"""Exact weight deltas PS -> worker (docs/protocol.md, "Weight deltas"): the layout of one tensor's changed entries,
how the PS finds them and how a worker applies them. Pure numpy; no I/O.

A float32 tensor that changed in ``k`` of its ``n`` entries travels as shared/compression.py's top-k layout, row 1 the
**new** values' bits; "changed" compares bit patterns, so the old tensor with the entries applied is the new one bit
for bit. Worth sending so only while ``2 * k < n``.
"""
from __future__ import annotations

import numpy as np

from shared import scan
from shared.compression import F32, U32, check_topk, pack_topk


def changed_indices(old: np.ndarray, new: np.ndarray, limit: int | None = None) -> np.ndarray | None:
    """The flat indices (ascending, uint32) where ``new``'s float32 bits differ from ``old``'s, or None if more
    than ``limit`` differ."""
    idx = scan.bits_differ(old.reshape(-1).view(U32), new.reshape(-1).view(U32), limit)
    return None if idx is None else idx.astype(U32)


def worth_sparse(k: int, n: int) -> bool:
    """Whether ``k`` changed entries of ``n`` travel smaller as entries than as the dense tensor."""
    return 2 * k < n


def sparse_limit(n: int) -> int:
    """The most changed entries of ``n`` that are :func:`worth_sparse` (a scan stops past it)."""
    return (n - 1) // 2


def pack(indices: np.ndarray, new: np.ndarray, values: np.ndarray | None = None) -> np.ndarray:
    """The wire form: uint32 ``[2, k]`` of ``indices`` and ``new``'s bits there (``values``, float32: those bits,
    known already: no gather)."""
    return pack_topk(indices, new.reshape(-1).view(U32)[indices].view(F32) if values is None else values)


def apply(held: np.ndarray, wire: np.ndarray, name: str) -> None:
    """Write a delta's new values into ``held`` (float32, C-contiguous, writable) in place; 422 bad_encoding
    (nothing written) if ``wire`` is not the layout for ``held``."""
    if held.dtype != F32 or not held.flags.c_contiguous or not held.flags.writeable:
        raise ValueError(f"tensor {name!r}: a delta applies to a writable C-contiguous float32 array")
    idx = check_topk(wire, held.size, name)
    held.reshape(-1).view(U32)[idx] = wire[1]
