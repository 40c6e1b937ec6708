"""The next step's batch, drawn while this step's push and round are out (``WORKER_PREFETCH``).

Contract: as a step's push gets under way (its ``on_way``) the worker calls :meth:`BatchAhead.ahead` with its guess of
the next step's place (step ``s + 1``, the same position among as many ranks); the batch is drawn in one background
thread while the worker waits for the round. :meth:`BatchAhead.get` hands it over when the step about to be computed
is the one guessed; otherwise the guess is dropped and the batch drawn again for the real place, so a task sees
exactly the batches it would see without prefetching. The task's ``batch`` therefore runs in another thread (never
at the same time as another call of the task) and may be called for a step that is then not computed: it must be a
function of its arguments, or the task sets ``prefetch = False`` (``WORKER_PREFETCH=0``: every task). A used guess's
error is raised by ``get``, as the direct call's would be; a dropped guess's is logged and forgotten.
"""
from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

log = logging.getLogger("worker")

#: where a step's batch comes from: (step, position among the round's ranks, their count)
Place = tuple[int, int, int]


class BatchAhead:
    """Draws ``task.batch(step, position, count, batch_size)`` for a guessed place in one background thread."""

    def __init__(self, task: Any, batch_size: int, enabled: bool = True) -> None:
        self.task, self.batch_size = task, batch_size
        on = enabled and getattr(task, "prefetch", True)  # the setting allows it and the task does not opt out
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="prefetch") if on else None
        self._guess: tuple[Place, Future] | None = None
        self.used = self.dropped = 0  # guesses handed over / drawn again (for logs and tests)

    def ahead(self, step: int, position: int, count: int) -> None:
        """Start drawing the batch of ``(step, position, count)`` (a no-op when disabled or a guess is out)."""
        if self._pool is None or self._guess is not None:
            return
        self._guess = ((step, position, count),
                       self._pool.submit(self.task.batch, step, position, count, self.batch_size))

    def get(self, step: int, position: int, count: int) -> Any:
        """The batch of ``(step, position, count)``: the guess when it is that place, else drawn here and now."""
        guess, self._guess = self._guess, None
        if guess is not None:
            place, future = guess
            if place == (step, position, count):
                self.used += 1
                return future.result()  # its error, if any, is the direct call's
            self.dropped += 1
            if future.exception() is not None:  # waits for it: the task's batch never runs twice at once
                log.debug("a dropped prefetch of %s failed: %s", place, future.exception())
        return self.task.batch(step, position, count, self.batch_size)

    def close(self) -> None:
        """Wait for a guess still running (the task may be used once this returns) and stop the thread."""
        self._guess = None
        if self._pool is not None:
            self._pool.shutdown(wait=True)
