"""Byte buffers for large request bodies and encoded weights, reused instead of freshly faulted in.

On our VMs a fresh 4 MB buffer costs ~2 ms of page faults (more than copying into it), so
the PS takes its body and snapshot buffers from :data:`POOL`: a buffer is handed out again
once nothing views it any more (every numpy view or memoryview of it is gone). The pool
keeps at most :data:`POOL_BYTES` of buffers, each at most :data:`POOL_MAX_BUFFER` (bigger
ones are faulted in as huge pages, cheaply, and must go back to the kernel at once to keep
the PS's peak memory bound); the others are plain allocations, freed as usual.
"""
from __future__ import annotations

import sys

import numpy as np

#: most bytes of buffers the pool keeps for reuse
POOL_BYTES = 64 << 20
#: largest buffer the pool keeps
POOL_MAX_BUFFER = 16 << 20
#: smaller buffers are plain bytearrays (not worth a pool slot)
POOL_MIN_BUFFER = 64 << 10


class BufferPool:
    def __init__(self, limit: int = POOL_BYTES, max_buffer: int = POOL_MAX_BUFFER) -> None:
        self.limit = limit
        self.max_buffer = max_buffer
        self._kept: list[np.ndarray] = []

    def take(self, n: int) -> memoryview:
        """A writable view of ``n`` bytes that nothing else uses."""
        if n < POOL_MIN_BUFFER:
            return memoryview(bytearray(n))
        for buf in self._kept:
            if buf.nbytes >= n and sys.getrefcount(buf) <= 3:  # the list, the loop variable, the argument
                return memoryview(buf)[:n]
        buf = np.empty(n, np.uint8)
        if n <= self.max_buffer and sum(b.nbytes for b in self._kept) + n <= self.limit:
            self._kept.append(buf)
        return memoryview(buf)


POOL = BufferPool()
