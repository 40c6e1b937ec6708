"""Which pushes' tensors the PS may read now: what it holds of a round stays flat in the worker count.

A push's head (worker id, step) comes before its tensors: the rest of a request body, a same-host worker's file.
The transport reads the tensors of a large push only once :meth:`Intake.claim` says so; until then they stay where
they are (in the kernel's socket buffers and the worker's memory, or in the worker's file), and the transport waits
for a turn (:meth:`Intake.readers` names who may read next).

- **Sync, elastic** (R unset): the round sums in rank order as gradients arrive (:mod:`ps_service.core.rounds`),
  so the push next in rank order (:meth:`~ps_service.core.rounds.Round.turns`: the lowest key still pending; a member
  that expired, left or came back mid-round is passed) joins the running sum at once: it may be read. While the
  round holds no gradient yet, the one after it may be read too (both then make the first sum). Every other push of
  the round waits. So the PS holds at most two gradients of a round at once, the running sum and the push being
  read, whatever N; the sum is the same rank-order sum, bit for bit.
- **Async / SSP**: each gradient is applied on arrival: one push read at a time (the transport wakes the
  longest-waiting first).
- **Fixed R** (backup workers): a push counts at its head (:meth:`~ps_service.core.rounds.Round.head`: asking for its
  claim, or reaching the core unclaimed), so the round's contributors are the first R heads of fresh pushes, known
  before any body is read; they are read in rank order as above (the lowest key that may still contribute: while
  fewer than R heads came, a member yet to push may still sort first). A push whose head comes after R others' is
  ``late`` (known from its head). Late, stale and duplicate pushes are read one at a time (:meth:`claim_late`): every
  round of a fixed-R job has N - R of them, and read at once they would hold N - R gradients' bodies. So the PS holds
  the running sum, the push being read (two while nothing is summed) and one push being refused, whatever N (with
  ``min_replicas`` q above 2, q: the first q gradients wait unsummed, as a stuck round may still take any rank). A
  head whose push fails (:meth:`release` before the core took it) gives its place back
  (:meth:`~ps_service.core.rounds.Round.unhead`).
- A push waits for its turn at most a lease (the transport's patience: by then a member ahead of it that is gone
  has expired and passed its turn); then it is read out of turn (``overdue``), held like any gradient that came
  early: a round held up by a slow member holds more, as it would without the gate; steady rounds do not.
- Elastic: a push that would not be accepted now (stale, late, duplicate; a worker the core refuses) is read at once
  and answered as before; so is a push of a worker whose other body is being read (its turn waits for that read).

A claim ends when the core takes that push (:meth:`ParameterServerCore.push`) or the transport gives it back
(:meth:`release`: the read failed or was refused); either way the next turn may begin. Pure, no I/O, no clock.
"""
from __future__ import annotations

from typing import Callable


class Intake:
    def __init__(self) -> None:
        #: workers whose push's tensors are being read (claimed, not yet taken by the core or released)
        self.reading: set[str] = set()
        #: claims refused so far (monitoring, tests: the pushes that waited for their turn)
        self.deferred = 0
        #: pushes read out of turn, having waited their transport's patience (a round held up by a slow or gone
        #: member): each is a gradient held beyond the bound
        self.overdue = 0
        #: fixed R: workers whose late, stale or duplicate push is being read (one at a time, :meth:`claim_late`), and
        #: those waiting to be, in arrival order
        self.refusing: set[str] = set()
        self.queued: dict[str, None] = {}

    def claim(self, worker_id: str, turns: Callable[[], tuple[str, ...] | None], overdue: bool = False) -> bool:
        """May ``worker_id``'s push (one the round would accept) be read now? ``turns()``: who may (None: anyone,
        one at a time). Yes: it counts as being read until :meth:`release`. ``overdue``: yes, in turn or not."""
        if overdue:
            self.overdue += 1
        elif worker_id in self.reading:
            return self._defer()
        else:
            allowed = turns()
            if allowed is None:  # anyone, one at a time
                ok = not self.reading
            else:  # the next in order always; the one after it only beside that one
                ok = bool(allowed) and (worker_id == allowed[0]
                                        or (worker_id in allowed and self.reading <= set(allowed)))
            if not ok:
                return self._defer()
        self.queued.pop(worker_id, None)  # (fixed R: it waited as late, then took a place that came free)
        self.reading.add(worker_id)
        return True

    def claim_late(self, worker_id: str, overdue: bool = False) -> bool:
        """May ``worker_id``'s push that the round will not take (late, stale, duplicate) be read now? One at a time
        (fixed R: N - R of them a round); ``overdue``: yes."""
        if overdue:
            self.overdue += 1
        elif self.refusing or worker_id in self.reading:
            self.queued[worker_id] = None
            return self._defer()
        self.queued.pop(worker_id, None)
        self.refusing.add(worker_id)
        return True

    def late_readers(self) -> tuple[str, ...]:
        """The pushes :meth:`claim_late` would let be read now: every one waiting while none is read (the first to ask
        wins; a name whose push went away meanwhile wakes nobody)."""
        return () if self.refusing else tuple(self.queued)

    def _defer(self) -> bool:
        self.deferred += 1
        return False

    def release(self, worker_id: str) -> bool:
        """The claim of ``worker_id`` ends (its push taken, or its read failed); True if it had one."""
        if worker_id in self.reading or worker_id in self.refusing:
            self.reading.discard(worker_id)
            self.refusing.discard(worker_id)
            return True
        return False
