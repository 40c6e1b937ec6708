"""The PS keeps the memory it frees for its next round (glibc's ``mallopt``; nothing elsewhere).

A round allocates and frees the same temporaries every step: numpy arrays of a few MB (a top-k round's sorted
indices, its gathered values, the SGD and weight-delta entries). glibc's malloc gives such blocks back to the
kernel when they are freed (``munmap`` above its mmap threshold; the heap's top trimmed above its trim threshold),
and the next round faults every page in again, zeroed: on the 2-core AMD EPYC VM a fresh 3.2 MB array costs
2-3 ms of page faults before any arithmetic
(bench/results/2026-12-02-freed-memory-kept-for-the-next-round-and-top-k-s-new-weights.jsonl).

:func:`keep_freed_memory` sets, once at start-up, glibc's documented tunables (``man 3 mallopt``): blocks up to
:data:`MMAP_THRESHOLD` come from the heap, and up to :data:`TRIM_THRESHOLD` of free memory stays mapped. The PS's
peak memory did not move in the runs measured (the same blocks, reused); between rounds it keeps mapped what it
freed, up to that threshold. Larger
blocks (a 1e7 model's 40 MB arrays) are mmapped as before, and the PS's own buffers come from its pool
(``core/buffers.py``) anyway. Not glibc (musl, macOS): nothing is done. ``MALLOC_MMAP_THRESHOLD_`` or
``MALLOC_TRIM_THRESHOLD_`` in the environment (glibc's own variables) win: then this leaves malloc as it is.
"""
from __future__ import annotations

import ctypes
import ctypes.util
import os

#: ``M_TRIM_THRESHOLD`` and ``M_MMAP_THRESHOLD`` (glibc's malloc.h)
M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3
#: the largest mmap threshold glibc accepts on 64-bit (``DEFAULT_MMAP_THRESHOLD_MAX``)
MMAP_THRESHOLD = 32 * 1024 * 1024
TRIM_THRESHOLD = 256 * 1024 * 1024


def keep_freed_memory() -> bool:
    """Set the two thresholds; True if glibc took both."""
    if "MALLOC_MMAP_THRESHOLD_" in os.environ or "MALLOC_TRIM_THRESHOLD_" in os.environ:
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = (ctypes.c_int, ctypes.c_int), ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
