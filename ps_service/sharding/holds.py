"""The sans-IO half of a shard: pushes held until a round names them, and a follower's rank-order sum of a round.
No I/O, no clock. Contract:

- :func:`passed`: a message of the coordinator about round s is for a round this shard has passed (nothing to do) or
  is at; else 409 ``shard_behind``.
- :class:`Holds` keeps one held push per worker (a later one replaces it) and, on a follower, the open round's
  running sum as the coordinator's :class:`~ps_service.core.rounds.Accumulator` makes it (:meth:`Holds.progress`):
  the keys it summed, in order (each an accepted commit: nothing is summed on a guess), whose pushes it awaits next
  (:meth:`Holds.may_read`: a hold of anyone else waits unread) and, fixed R, whose it will not take (``late``: read,
  answered late, kept nowhere) or takes again (``back``).
- :func:`apply_round` ("apply round s with contributors C"): the keys summed so far must be the first of C; the rest
  of C's held pieces are summed on in (rank, worker_id) order, the optimizer is stepped once with the coordinator's
  ``mean_of``, and every hold of step <= s dropped: ``acc = g[c0]; acc += g[c1] ...``, bit for bit, however the
  additions were spread in time. A repeat is answered done; one ahead of the shard, naming a gradient not held, or
  not following the keys summed is 409 and changes nothing. No contributors (the coordinator's sum overflowed) or a
  sum that overflows here: nothing applied here (logged).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Iterable, Mapping, Sequence

import numpy as np

from ps_service.core.rounds import Accumulator
from shared.errors import ProtocolError

log = logging.getLogger("ps_service")
Key = tuple[int, str]  # (rank, worker_id): the sum's order


@dataclass(frozen=True)
class Held:
    step: int
    tensors: Mapping[str, np.ndarray]
    via: str  # the transport it came by ("http" or "shm"): the commit answers through it


def passed(global_step: int, step: int) -> bool:
    """The coordinator speaks of round ``step``: True if this shard is past it (nothing to do); 409 ``shard_behind`` if
    it is ahead of this shard (the shard restarted from an older state than the coordinator)."""
    if step > global_step:
        raise ProtocolError(409, "shard_behind", f"this shard is at step {global_step}, told of round {step}: it "
                                                 "restarted from an older state than the coordinator")
    return step < global_step


class Holds:
    def __init__(self) -> None:
        self.by_worker: dict[str, Held] = {}
        #: the round the coordinator last spoke of (:meth:`progress`), the keys summed of it in order, its running
        #: sum, and whose pieces may be read now (None: anyone)
        self.step: int | None = None
        self.folded: list[Key] = []
        self.sum: Accumulator | None = None
        self.turns: frozenset[str] | None = frozenset()
        #: of that round, the workers whose pushes it will not take (fixed R), unless named in ``turns`` since
        self.late: set[str] = set()

    def __len__(self) -> int:
        return len(self.by_worker)

    def put(self, worker_id: str, held: Held) -> None:
        self.by_worker[worker_id] = held

    def get(self, worker_id: str, step: int) -> Held | None:
        h = self.by_worker.get(worker_id)
        return h if h is not None and h.step == step else None

    def discard(self, worker_id: str, step: int) -> None:
        if self.get(worker_id, step) is not None:
            del self.by_worker[worker_id]

    def drop_through(self, step: int) -> None:
        """Forget every hold of a round that is over (step <= ``step``), and its sum."""
        for w in [w for w, h in self.by_worker.items() if h.step <= step]:
            del self.by_worker[w]
        if self.step is not None and self.step <= step:
            self.step, self.folded, self.sum, self.turns, self.late = None, [], None, frozenset(), set()

    # ---- a follower: the round's sum as the coordinator makes it ---------------------------------------------
    def summed(self, worker_id: str, step: int) -> bool:
        """``worker_id``'s pieces of ``step`` are in the running sum already (a hold of them again keeps nothing)."""
        return self.step == step and self.sum is not None and worker_id in self.sum

    def may_read(self, worker_id: str, step: int, global_step: int) -> bool:
        """May a hold of (``worker_id``, ``step``) be read now: not of the open round, or awaited next (or any), or
        summed (a retry) or late (both answered, kept nowhere)."""
        if step != global_step:
            return True
        if self.step != step:  # the coordinator has not spoken of this round yet
            return False
        return self.turns is None or worker_id in self.turns or self.summed(worker_id, step) or worker_id in self.late

    def late_for(self, worker_id: str, step: int) -> bool:
        """The coordinator's round ``step`` will not take ``worker_id``'s push (fixed R: its hold there came after R
        heads): a hold of it is answered late and kept nowhere."""
        return self.step == step and worker_id in self.late

    def progress(self, names: Iterable[str], global_step: int, step: int, start: int, keys: Sequence[Key],
                 turns: Sequence[str] | None, late: Iterable[str] = (), back: Iterable[str] = ()) -> bool:
        """The coordinator's round ``step`` summed ``keys`` from its ``start``-th on (those summed here skipped),
        awaits ``turns``, refuses ``late`` and takes ``back`` again: sum, drop, note. False if the round is applied
        here already; 409 and nothing changed if ahead, out of order, or a piece is not held."""
        if passed(global_step, step):
            return False
        self._fold(names, step, start, keys)
        for w in late:
            self.late.add(w)
            self.discard(w, step)  # read in its turn before R heads came, then refused: never summed
        self.late.difference_update(back)  # its hold waits for its turn again
        self.turns = None if turns is None else frozenset(turns)
        if self.turns:
            self.late -= self.turns
        return True

    def take(self, names: Iterable[str], step: int, contributors: Sequence[Key]) -> tuple[dict | None, int]:
        """(The rank-order sum of round ``step`` over ``contributors``, None if it overflows; their count):
        :func:`apply_round`'s sum, the keys summed so far being the first of ``contributors``."""
        if not contributors:  # the round applies nothing (its sum overflowed on the coordinator), whatever was summed
            return None, 0
        self._fold(names, step, 0, contributors, whole=True)
        total, _ = self.sum.take_sum()  # None: this shard's pieces of the round overflow when summed
        return total, len(contributors)

    def _fold(self, names: Iterable[str], step: int, start: int, keys: Sequence[Key], whole: bool = False) -> None:
        """Sum on the held pieces of ``keys`` (from the ``start``-th key of round ``step``'s sum; ``whole``: every key
        summed so far must be among them); 409 and nothing summed if they do not follow the sum or are not held."""
        if self.step != step:
            self.step, self.folded, self.sum, self.late = step, [], None, set()
        done, keys = len(self.folded), [tuple(k) for k in keys]
        if start > done or self.folded[start:start + len(keys)] != keys[:done - start] or (whole and len(keys) < done):
            raise ProtocolError(409, "order_mismatch", f"round {step}: keys {keys[:4]} from the {start}-th do not "
                                                       f"follow the {done} summed here")
        new = keys[done - start:]
        missing = [w for _, w in new if self.get(w, step) is None]
        if missing:
            raise ProtocolError(409, "missing_gradient", f"round {step}: no held push of {missing[:4]} here (this "
                                                         "shard restarted since they pushed?)")
        if new and self.sum is None:
            self.sum = Accumulator(tuple(names), "sum")
        for rank, w in new:
            self.sum.apply(w, rank, self.by_worker.pop(w).tensors, ())  # nothing still possible sorts before it
            self.folded.append((rank, w))


def apply_round(core, holds: Holds, step: int, contributors: Sequence[Key], mean_of: int) -> bool:
    """Apply round ``step`` with ``contributors`` on a follower's ``core``: True, or False if it was already."""
    if passed(core.global_step, step):
        return False
    if mean_of < 1:
        raise ProtocolError(400, "bad_field", "mean_of must be >= 1")
    total, n = holds.take(tuple(core.weights), step, contributors)
    if total is None and n:
        log.warning("round %d: the sum of this shard's pieces of its %d contributors overflows: nothing applied here "
                    "(the other shards apply theirs)", step, n)
    holds.drop_through(step)
    core.apply_round(total, mean_of, n)
    return True
