"""Which pushes' tensors the PS may read now: what it holds of a round stays flat in the worker count.

A push's head (worker id, step) comes before its tensors (the rest of a body, a same-host worker's file). The
transport reads a large push's tensors only once :meth:`Intake.claim` says so, else waits for a turn
(:meth:`Intake.readers`); a claim ends when the core takes the push or the transport gives it back (:meth:`release`).

- **Sync, elastic**: the push next in rank order (:meth:`~ps_service.core.rounds.Round.turns`) may be read, the one
  after it too while the round holds no gradient: at most two gradients of a round held, the sum the same bits.
- **Async / SSP**: one push read at a time (the transport wakes the longest-waiting first).
- **Fixed R**: a push counts at its head, so the contributors are known before any body is read; they are read in rank
  order as above; late, stale and duplicate pushes (N - R a round) one at a time (:meth:`claim`'s ``late``). So the
  PS holds the running sum, the push being read (two while nothing is summed) and one being refused (with
  ``min_replicas`` q > 2, the first q gradients wait unsummed). A head whose push fails gives its place back, to a
  push claimed later: one read as late stays late (taken, it would wait unsummed for a lower rank's: three gradients
  of the round held), as the round records (``Round.lose``: who is late is the round's, not the intake's).
- A push waits for its turn at most a lease (by then a member ahead of it that is gone has expired), then is read out
  of turn (``overdue``). Elastic: a push that would not be accepted now, or of a worker whose other body is being
  read, is read at once. Pure, no I/O, no clock.
"""
from __future__ import annotations

from typing import Callable


class Intake:
    def __init__(self) -> None:
        #: workers whose push's tensors are being read (claimed, not yet taken by the core or released)
        self.reading: set[str] = set()
        #: claims refused so far (monitoring, tests: the pushes that waited for their turn)
        self.deferred = 0
        #: pushes read out of turn, having waited their transport's patience: each a gradient held beyond the bound
        self.overdue = 0
        #: fixed R: the worker whose late, stale or duplicate push is being read (``claim(late=True)``), those waiting
        #: (the round records who is late: ``Round.lose``)
        self.refusing: set[str] = set()
        self.queued: dict[str, None] = {}

    def claim(self, worker_id: str, turns: Callable[[], tuple[str, ...] | None] = lambda: None,
              overdue: bool = False, late: bool = False) -> bool:
        """May ``worker_id``'s push be read now? One the round would accept: ``turns()`` says who may (None: anyone,
        one at a time); fixed R, one it will not take (``late``: late, stale, duplicate): one at a time, the others
        queued. Yes: it counts as being read until :meth:`release`. ``overdue``: yes, in turn or not."""
        if overdue:
            self.overdue += 1
        elif worker_id in self.reading or (self.refusing if late else not self._in_turn(worker_id, turns())):
            if late:
                self.queued[worker_id] = None
            self.deferred += 1
            return False
        self.queued.pop(worker_id, None)  # (fixed R: it waited as late, then took a place that came free)
        (self.refusing if late else self.reading).add(worker_id)
        return True

    def _in_turn(self, worker_id: str, allowed: tuple[str, ...] | None) -> bool:
        """The next in order always; the one after it only beside that one (``allowed`` None: one at a time)."""
        if allowed is None:
            return not self.reading
        return bool(allowed) and (worker_id == allowed[0] or (worker_id in allowed and self.reading <= set(allowed)))

    def late_readers(self) -> tuple[str, ...]:
        """The late pushes :meth:`claim` would let be read now: every one waiting while none is read."""
        return () if self.refusing else tuple(self.queued)

    def release(self, worker_id: str) -> bool:
        """The claim of ``worker_id`` ends (its push taken, or its read failed); True if it had one."""
        if worker_id in self.reading or worker_id in self.refusing:
            self.reading.discard(worker_id)
            self.refusing.discard(worker_id)
            return True
        return False
