"""The sans-IO half of a shard: pushes held until a round names them, and the order of a follower's sum of a round.
No I/O, no clock. Contract:

- :func:`passed`: a message of the coordinator, or a worker's hold, about round s is for a round this shard has
  passed (nothing to do) or is at; else 409 ``shard_behind``: every follower's one check of it.
- :class:`Holds` keeps one held push per worker (a later one replaces it) and, on a follower, the open round's sum
  order as the coordinator's :class:`~ps_service.core.rounds.Accumulator` makes it (:meth:`Holds.progress`): the keys
  summed, in order (each an accepted commit: nothing is summed on a guess), whose pushes it awaits next
  (:meth:`Holds.may_read`: a hold of anyone else waits unread) and, fixed R, whose it will not take (``late``: read,
  answered late, kept nowhere) or takes again (``back``).
- :meth:`Holds.fold`: the keys summed next must follow those summed (``order_mismatch``) and be held
  (``missing_gradient``), else 409 and nothing changes; their held pieces go, in that order, to ``into``: the
  follower's round (:func:`ps_service.sharding.parts.fold`), which sums them in rank order, bit for bit, however the
  additions are spread in time. A round's decision folds its contributors so (``whole``: the keys summed so far must
  be the first of them).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Mapping, Sequence

import numpy as np

from shared.errors import ProtocolError

Key = tuple[int, str]  # (rank, worker_id): the sum's order


@dataclass(frozen=True)
class Held:
    step: int
    tensors: Mapping[str, np.ndarray]
    via: str  # the transport it came by ("http" or "shm"): the commit answers through it


def passed(global_step: int, step: int) -> bool:
    """The coordinator, or a worker's hold, speaks of round ``step``: True if this shard is past it (nothing to do);
    409 ``shard_behind`` if it is ahead of this shard (it restarted, or the job went back to a checkpoint)."""
    if step > global_step:
        raise ProtocolError(409, "shard_behind", f"this shard is at step {global_step}, told of round {step}: it "
                                                 "restarted or the job went back to a checkpoint (a worker: register "
                                                 "again)")
    return step < global_step


class Holds:
    def __init__(self, into: Callable[[Key, Mapping[str, np.ndarray]], None] = lambda key, tensors: None) -> None:
        """``into``: where the held pieces of a key summed go (:meth:`fold`)."""
        self.by_worker: dict[str, Held] = {}
        self.into = into
        #: the round the coordinator last spoke of (:meth:`progress`), the keys summed of it in order (and their
        #: workers), and whose pieces may be read now (None: anyone)
        self.step: int | None = None
        self.folded: list[Key] = []
        self.summers: set[str] = set()
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
            self.step, self.folded, self.summers, self.turns, self.late = None, [], set(), frozenset(), set()

    # ---- a follower: the round's sum as the coordinator makes it ---------------------------------------------
    def summed(self, worker_id: str, step: int) -> bool:
        """``worker_id``'s pieces of ``step`` are in the running sum already (a hold of them again keeps nothing)."""
        return self.step == step and worker_id in self.summers

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

    def progress(self, global_step: int, step: int, start: int, keys: Sequence[Key], turns: Sequence[str] | None,
                 late: Iterable[str] = (), back: Iterable[str] = ()) -> bool:
        """The coordinator's round ``step`` summed ``keys`` from its ``start``-th on (those summed here skipped),
        awaits ``turns``, refuses ``late`` and takes ``back`` again: sum, drop, note. False if the round is applied
        here already; 409 and nothing changed if ahead, out of order, or a piece is not held."""
        if passed(global_step, step):
            return False
        self.fold(step, start, keys)
        for w in late:
            self.late.add(w)
            self.discard(w, step)  # read in its turn before R heads came, then refused: never summed
        self.late.difference_update(back)  # its hold waits for its turn again
        self.turns = None if turns is None else frozenset(turns)
        if self.turns:
            self.late -= self.turns
        return True

    def fold(self, step: int, start: int, keys: Sequence[Key], whole: bool = False) -> None:
        """Sum on the held pieces of ``keys`` (from the ``start``-th key of round ``step``'s sum; ``whole``: every key
        summed so far must be among them); 409 and nothing summed if they do not follow the sum or are not held."""
        if self.step != step:
            self.step, self.folded, self.summers, self.late = step, [], set(), set()
        done, keys = len(self.folded), [tuple(k) for k in keys]
        new = keys[done - start:]
        if start > done or self.folded[start:start + len(keys)] != keys[:done - start] or (whole and len(keys) < done) \
                or (new and self.folded and new[0] <= self.folded[-1]):  # (a sum is in (rank, worker_id) order)
            raise ProtocolError(409, "order_mismatch", f"round {step}: keys {keys[:4]} from the {start}-th do not "
                                                       f"follow the {done} summed here")
        missing = [w for _, w in new if self.get(w, step) is None]
        if missing:
            raise ProtocolError(409, "missing_gradient", f"round {step}: no held push of {missing[:4]} here (this "
                                                         "shard restarted since they pushed?)")
        for rank, w in new:
            self.into((rank, w), self.by_worker.pop(w).tensors)  # nothing still possible sorts before it
            self.folded.append((rank, w))
            self.summers.add(w)

