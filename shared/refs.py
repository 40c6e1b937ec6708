"""Is a pooled buffer free: held by its pool and the caller's loop variable only, with no view of it alive?

Pools hand a buffer out again once nothing views it, and tell that by CPython's reference count (a numpy view or a
memoryview of the buffer holds a reference to it). The count of a free buffer is an implementation detail, so it is
measured here once, in the shape of every caller's check (a loop over the pool, the buffer passed to :func:`free`).
tests/test_refs.py fails if it stops telling a free buffer from a viewed one.
"""
from __future__ import annotations

import sys


def _count(obj: object) -> int:
    """``free``'s count, in a frame of the same shape (one parameter, the call)."""
    return sys.getrefcount(obj)


def _measured() -> int:
    pool = [bytearray(1)]
    for item in pool:
        return _count(item)
    raise AssertionError("unreachable")


#: the count :func:`free` sees for a buffer held by one container and the caller's loop variable
FREE_COUNT = _measured()


def free(obj: object) -> bool:
    """``obj`` (met in a loop over its pool) is referenced by the pool and that loop only: no view of it is alive."""
    return sys.getrefcount(obj) <= FREE_COUNT
