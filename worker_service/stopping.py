"""A stop request that a signal handler may set.

Contract: ``StopFlag`` has the part of ``threading.Event``'s interface the worker uses (``set``, ``is_set``,
``wait``), but ``set`` takes no lock, so SIGTERM's handler may call it at any point of the main thread (a handler's
``Event.set`` waits forever for the lock an interrupted ``Event.wait`` or ``set`` holds: the worker hangs while its
heartbeat keeps its lease). ``wait`` sleeps in ``select`` on a pipe that ``set`` writes one byte to.
"""
from __future__ import annotations

import os
import select


class StopFlag:
    def __init__(self) -> None:
        self._flag = False
        self._pipe: tuple[int, int] | None = None  # made by the first wait (most flags are never waited on)

    def is_set(self) -> bool:
        return self._flag

    def set(self) -> None:
        """Signal-safe: an assignment and, when someone may be waiting, a non-blocking one-byte write."""
        self._flag = True
        pipe = self._pipe
        if pipe is not None:
            try:
                os.write(pipe[1], b"\0")
            except (BlockingIOError, OSError):  # full (already woken) or closed
                pass

    def wait(self, timeout: float | None = None) -> bool:
        """Until set or ``timeout`` seconds passed; returns whether it is set (``threading.Event.wait``)."""
        if self._pipe is None:
            r, w = os.pipe()
            os.set_blocking(w, False)
            self._pipe = (r, w)
        if self._flag:  # after the pipe exists: a set() from now on writes to it
            return True
        select.select([self._pipe[0]], [], [], timeout)
        return self._flag

    def __del__(self) -> None:
        pipe, self._pipe = self._pipe, None
        if pipe is not None:
            for fd in pipe:
                try:
                    os.close(fd)
                except OSError:
                    pass
