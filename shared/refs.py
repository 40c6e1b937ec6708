"""Is a pooled buffer free: held by its pool and the caller's loop variable only, with no view of it alive?

Pools (request bodies, same-host copies, the worker's answer buffers, a sharded worker's assembled weights) hand a
buffer out again once nothing views it, and tell that by CPython's reference count: a numpy view or a memoryview
of the buffer holds a reference to it. The count a free buffer has is an implementation detail (a Python that
borrows references on the stack counts fewer), so it is measured here once, in the shape of every caller's check (a
``for`` loop or generator over the pool, the buffer passed to :func:`free`), not assumed. tests/test_refs.py fails
if it stops telling a free buffer from a viewed one.
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
