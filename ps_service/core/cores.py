"""Element-wise numpy work on a large array, split over the machine's cores.

A round ends on the PS's one event-loop thread: the last push folded into the sum, then the optimizer over every
weight, while the workers wait for the answer and the machine's other cores idle. numpy's element-wise loops use one
core (its BLAS calls may use more) but release the GIL, so :func:`split` cuts a range into pieces that the caller
and helper threads take in turn.

Contract: ``split(fn, size)`` calls ``fn(lo, hi)`` on disjoint ranges that cover ``[0, size)`` (pieces that the
caller and up to ``parts() - 1`` helper threads take in turn as each comes free) and returns when every call has;
with fewer than :data:`MIN_ELEMENTS` elements, or one core, it calls ``fn(0, size)`` alone. ``fn`` must touch
only its range (element-wise work then gives the same bits however it is split). Each call runs under the
caller's numpy error state (``np.errstate`` is per thread). A helper that has not started by the time the pieces
are gone is not waited for, and one that has is finishing its last piece (on a loaded machine the split waits at
most a piece for a busy core: at worst the work is serial, as before). An exception in any piece is raised here,
once every piece is over.
"""
from __future__ import annotations

import itertools
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

import numpy as np

#: ranges shorter than this are done by the caller alone: at 1e6 float32 elements (4 MB) splitting lost 2-11 % of a
#: TCP 1e6 x 2 job's steps/s on a 2-core VM (thread hand-offs and the GIL); at 1e7 it gained (docs/performance.md)
MIN_ELEMENTS = 1 << 21
#: at most this many parts (memory bandwidth, not cores, bounds element-wise work beyond a few)
MAX_PARTS = 4
#: range boundaries are multiples of this (cache lines and SIMD blocks stay whole)
ALIGN_ELEMENTS = 1 << 12
#: pieces per part: threads take the next piece as they come free, so a helper that starts late (its core busy
#: with a worker) costs the caller at most the piece it is finishing
PIECES_PER_PART = 4

_pool: ThreadPoolExecutor | None = None


def parts() -> int:
    """How many parts a large range is cut into: the cores this process may run on, up to :data:`MAX_PARTS`."""
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        cores = os.cpu_count() or 1
    return max(1, min(MAX_PARTS, cores))


def split(fn: Callable[[int, int], None], size: int) -> None:
    n = parts() if size >= MIN_ELEMENTS else 1
    if n == 1:
        fn(0, size)
        return
    global _pool
    if _pool is None:
        _pool = ThreadPoolExecutor(max_workers=MAX_PARTS - 1, thread_name_prefix="ps-cores")
    step = max(ALIGN_ELEMENTS, -(-size // (PIECES_PER_PART * n) // ALIGN_ELEMENTS) * ALIGN_ELEMENTS)
    pieces = [(lo, min(size, lo + step)) for lo in range(0, size, step)]
    taken = itertools.count()  # next() is atomic under the GIL: each piece goes to one thread
    err = np.geterr()

    def work() -> None:
        for i in taken:
            if i >= len(pieces):
                return
            fn(*pieces[i])

    def helper() -> None:
        with np.errstate(**err):
            work()
    futures = [_pool.submit(helper) for _ in range(n - 1)]
    try:
        work()
    finally:
        for f in futures:
            if not f.cancel():  # started: it is finishing its last piece
                f.exception()  # waits: no piece outlives the call (fn's arrays may go after it)
    for f in futures:
        if not f.cancelled() and f.exception() is not None:
            raise f.exception()
