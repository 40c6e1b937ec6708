"""Byte buffers for large request bodies, same-host gradient copies and weights frames, reused instead of faulted in.

The kernel zeroes every page of fresh memory at its first write: a fresh 4 MB buffer costs ~2 ms of page faults on
our VMs, and at 1e7 parameters over TCP zeroing the 40 MB bodies' pages was 17 % of the PS's CPU
(bench/results/2026-12-01-body-buffers-reused-at-every-size-eleventh-session.jsonl).

Contract:
- :meth:`BufferPool.take` gives a writable view of ``n`` bytes that nothing else uses: the smallest kept buffer that
  fits and that nothing views any more, else a new one. A kept buffer serves sizes from half its own up.
- Sizes from :data:`ROUND_BYTES` up are rounded up to a multiple of it (a model's bodies and frames share buffers).
- A new buffer is kept while the pool keeps fewer than :data:`KEEP_BUFFERS` within :data:`POOL_BYTES`, unless its
  size comes once (``keep=False``: a model's upload). A new buffer is made only when every kept one of its size is in
  use, so the pool keeps the PS's memory at its peak, never past it.
- Below :data:`POOL_MIN_BUFFER` a plain ``bytearray``.
"""
from __future__ import annotations

import numpy as np

from shared import refs

#: most bytes of buffers the pool keeps for reuse
POOL_BYTES = 2 << 30
#: most buffers the pool keeps (a round's bodies, the weights' frame and the one an answer still sends, with room)
KEEP_BUFFERS = 16
#: smaller buffers are plain bytearrays (not worth a pool slot)
POOL_MIN_BUFFER = 64 << 10
#: sizes from this up are rounded up to a multiple of it
ROUND_BYTES = 1 << 20


class BufferPool:
    def __init__(self, limit: int = POOL_BYTES, keep: int = KEEP_BUFFERS) -> None:
        self.limit = limit
        self.keep = keep
        self._kept: list[np.ndarray] = []
        #: buffers made (kept or not): tests
        self.made = 0

    def take(self, n: int, keep: bool = True) -> memoryview:
        """A writable view of ``n`` bytes that nothing else uses; ``keep`` False: a buffer made for it is not kept."""
        if n < POOL_MIN_BUFFER:
            return memoryview(bytearray(n))
        best = None
        for buf in self._kept:
            if n <= buf.nbytes <= 2 * n and (best is None or buf.nbytes < best.nbytes) \
                    and refs.free(buf):
                best = buf
        if best is not None:
            return memoryview(best)[:n]
        size = -(-n // ROUND_BYTES) * ROUND_BYTES if n >= ROUND_BYTES else n
        buf = np.empty(size, np.uint8)
        self.made += 1
        if keep and len(self._kept) < self.keep and self.kept_bytes + size <= self.limit:
            self._kept.append(buf)
        return memoryview(buf)[:n]

    def array(self, n: int) -> np.ndarray:
        """:meth:`take` as a uint8 array (a weights frame, a decoded gradient)."""
        return np.frombuffer(self.take(n), np.uint8)

    @property
    def kept_bytes(self) -> int:
        return sum(b.nbytes for b in self._kept)


POOL = BufferPool()
