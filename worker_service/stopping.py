"""A stop request that a signal handler may set.

Contract: ``StopFlag`` has the part of ``threading.Event``'s interface the worker uses (``set``, ``is_set``,
``wait``), but ``set`` takes no lock, so SIGTERM's handler may call it at any point of the main thread.

Why not ``threading.Event``: a Python signal handler runs in the main thread between two bytecodes. If that
thread is inside ``Event.wait`` (the worker's ``WORKER_COMPUTE_DELAY_SECONDS``) or ``Event.set`` at that moment,
it holds the event's internal lock, and the handler's ``Event.set`` waits for that lock forever: the worker
hangs without a word while its heartbeat thread keeps its lease, so the barrier waits for it forever (seen in
CI, tests/test_shards.py, 2026-12-01). ``wait`` here sleeps in ``select`` on a pipe that ``set`` writes one
byte to: no lock anywhere, and a waiting thread wakes at once.
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
