"""Scans of a large flat array for the few entries that pass a test. Pure numpy; no I/O.

A top-k push (shared/compression.py) looks for the ~1 % of a gradient's entries of largest magnitude, and the PS for
the weights that changed in a step (shared/weight_deltas.py). :func:`magnitude_at_least` runs its test chunk by chunk
into buffers that stay in the L2 cache, not into full-size temporaries (docs/performance.md); :func:`bits_differ`
counts before it makes indices, so a step that changed most weights costs the compare and the count.

Contract: both return exactly the indices ``np.flatnonzero`` of the whole test would (ascending, ``np.intp``), or
``None`` when :func:`magnitude_at_least` meets a NaN or an Inf (the caller takes its whole-array path) or
:func:`bits_differ` finds more than ``limit`` entries.
"""
from __future__ import annotations

import numpy as np

#: elements per chunk: 512 KB of float32 and its 128 KB mask stay in a 1 MB L2
CHUNK = 1 << 17


def ranges(n: int):
    """The chunks of ``range(n)``: ``(lo, hi)`` pairs of :data:`CHUNK` elements (the last one shorter)."""
    for lo in range(0, n, CHUNK):
        yield lo, min(n, lo + CHUNK)


def magnitude_at_least(flat: np.ndarray, t) -> np.ndarray | None:
    """``np.flatnonzero(np.abs(flat) >= t)`` of a 1-D float array, or None if ``flat`` holds a NaN or an Inf."""
    mag, mask = np.empty(min(flat.size, CHUNK), flat.dtype), np.empty(min(flat.size, CHUNK), bool)
    found = []
    for lo, hi in ranges(flat.size):
        m = np.abs(flat[lo:hi], out=mag[:hi - lo])
        if not np.isfinite(m.max()):
            return None
        found.append(np.flatnonzero(np.greater_equal(m, t, out=mask[:hi - lo])) + lo)
    return np.concatenate(found) if found else np.empty(0, np.intp)


def bits_differ(old: np.ndarray, new: np.ndarray, limit: int | None = None) -> np.ndarray | None:
    """``np.flatnonzero(old != new)`` of two 1-D arrays of one unsigned integer dtype (bit patterns), or None if
    more than ``limit`` differ (counted before any index is made). Whole, not chunked: it reads two arrays to
    write one mask, which stays in the L3 cache for the count and the indices; chunks were 10 % slower here."""
    differ = np.not_equal(old, new)
    if limit is not None and np.count_nonzero(differ) > limit:
        return None
    return np.flatnonzero(differ)
