"""Byte buffers for large request bodies and encoded weights, reused instead of freshly faulted in.

On our VMs a fresh 4 MB buffer costs ~2 ms of page faults (more than copying into it), so
the PS takes its body and snapshot buffers from :data:`POOL`: a buffer is handed out again
once nothing views it any more (every numpy view or memoryview of it is gone). The pool
keeps at most :data:`POOL_BYTES` of buffers; past that, buffers are plain allocations that
are freed as usual, so the pool adds at most that much to the PS's resident memory.
"""
from __future__ import annotations

import sys

import numpy as np

#: most bytes of buffers the pool keeps for reuse
POOL_BYTES = 64 << 20


class BufferPool:
    def __init__(self, limit: int = POOL_BYTES) -> None:
        self.limit = limit
        self._kept: list[np.ndarray] = []

    def take(self, n: int) -> memoryview:
        """A writable view of ``n`` bytes that nothing else uses."""
        for buf in self._kept:
            if buf.nbytes >= n and sys.getrefcount(buf) <= 3:  # the list, the loop variable, the argument
                return memoryview(buf)[:n]
        buf = np.empty(n, np.uint8)
        if sum(b.nbytes for b in self._kept) + n <= self.limit:
            self._kept.append(buf)
        return memoryview(buf)


POOL = BufferPool()
