"""A sync round's partitions (issue 53, docs/partitions.md). Pure, no I/O, no clock.

The plan (:func:`shared.partitions.plan`) is the wire's, shared with the workers. A partition's rank-order sum is an
:class:`~ps_service.core.rounds.Accumulator` over :attr:`Plan.keys`, its update ``ModelState.update(...,
pieces=...)``: every rule elementwise, the bits of the whole step. Every sync round is a :class:`RoundParts` of
every partition (one, the default: the whole model, closed with the decision). On a core that decides, partition 0's
accumulator is the :class:`~ps_service.core.rounds.Round`'s, the one its rule counts; a sharded PS's follower is told
the decision (:mod:`ps_service.sharding.parts`). A frame whose sender's rank is not known yet (a follower before the
decision) waits unsummed until the decision names it, and is dropped if it does not; one the round's sum order has
reached (``settled``) is summed at once.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ps_service.core.rounds import Accumulator, Key, RoundRecord
from shared.partitions import Plan


@dataclass
class RoundParts:
    """The partitions of the open round. The *decision* (:meth:`decide`: the contributors C, the mean's divisor, the
    optimizer's iteration) comes from the Round's rule over partition 0, whose close takes that partition's sum (it
    is ``closed`` by then; a frame of q >= 1 comes only from a member whose partition 0 was accepted), or from
    elsewhere (a follower). Frames are summed in rank order once decided; partition q closes when every member of C
    still alive has its frame in (:meth:`drop`)."""
    plan: Plan
    accs: list[Accumulator]  # one a partition
    #: C's keys once decided (None: not yet)
    contributors: dict[str, Key] | None = None
    #: the decision's sum was applied (False: it applied nothing, none of the partitions does)
    applies: bool = True
    missing: list[set[str]] = field(default_factory=list)
    closed: set[int] = field(default_factory=set)
    #: members that will bring no more frames of this round (before its decision: it will not wait for them)
    lost: set[str] = field(default_factory=set)
    #: per partition, the members whose frame came (a second one is a duplicate)
    came: list[set[str]] = field(default_factory=list)
    #: per partition, frames whose sender's rank is not known yet (before the decision), by worker id
    early: list[dict[str, object]] = field(default_factory=list)
    #: this round's update advanced the optimizer's iteration (its first applied partition does)
    advanced: bool = False
    #: a core that decides: the decision's round record, kept for the round's close
    record: RoundRecord | None = None

    def __post_init__(self) -> None:
        self.came = [set() for _ in self.accs]
        self.early = [{} for _ in self.accs]

    @classmethod
    def open(cls, p: Plan, aggregation: str) -> "RoundParts":
        return cls(p, [Accumulator(keys, aggregation) for keys in p.keys])

    @property
    def decided(self) -> bool:
        return self.contributors is not None

    @property
    def done(self) -> bool:
        return self.decided and len(self.closed) == len(self.accs)

    def awaiting(self) -> tuple[str, ...]:
        """The decided contributors a partition not closed still waits for, in rank order (monitoring)."""
        want = set().union(*(m for q, m in enumerate(self.missing) if q not in self.closed))
        return tuple(sorted(want, key=self.contributors.__getitem__))

    def refusal(self, q: int, worker_id: str) -> str | None:
        """Why partition q does not take ``worker_id``'s frame: ``duplicate`` (its frame came), ``late`` (decided, the
        partition does not wait for it: not a contributor, or closed); None: it does (:meth:`frame`)."""
        if worker_id in self.came[q]:
            return "duplicate"
        return "late" if self.decided and worker_id not in self.missing[q] else None

    def frame(self, q: int, worker_id: str, rank: int | None, grads, settled: bool = False) -> list[int]:
        """Take a member of C's validated frame of partition q (its arrays the accumulator's; ``rank`` None: named
        by the decision; ``settled``: no frame still possible sorts before it, so it is summed now); the partitions
        that can close now."""
        self.came[q].add(worker_id)
        if not self.decided:
            if rank is None:
                self.early[q][worker_id] = grads
            else:
                self.accs[q].apply(worker_id, rank, grads, () if settled else None)
            return []
        self.missing[q].discard(worker_id)
        self.accs[q].apply(worker_id, self.contributors[worker_id][0], grads,
                           tuple(self.contributors[w] for w in self.missing[q]))
        return self._closable((q,))

    def decide(self, contributors: Mapping[str, Key], applies: bool) -> list[int]:
        """The round is decided with these contributors (worker id -> key): frames that waited for their sender's rank
        join their partitions (others' are dropped); the partitions that can close now."""
        self.contributors, self.applies = dict(contributors), applies
        qs = range(len(self.accs))
        self.missing = [set() if q in self.closed else set(contributors) - set(self.accs[q].keys) - set(self.early[q])
                        - self.lost for q in qs]
        for q in qs:
            early, self.early[q] = self.early[q], {}
            self.came[q] -= set(early) - set(self.contributors)
            for w in sorted((w for w in early if w in self.contributors), key=self.contributors.__getitem__):
                self.frame(q, w, None, early[w])  # as a frame after the decision (rank order: folds as it goes)
        return self._closable(qs)

    def drop(self, worker_id: str) -> list[int]:
        """A member brings no more frames of this round: the partitions that can close now (none if undecided)."""
        self.lost.add(worker_id)
        if not self.decided or worker_id not in self.contributors:
            return []
        touched = [q for q, missing in enumerate(self.missing) if worker_id in missing]
        for q in touched:
            self.missing[q].discard(worker_id)
        return self._closable(touched)

    def close(self, q: int):
        """(the rank-order sum of partition q or None: nothing to apply, n: the mean's divisor)."""
        self.closed.add(q)
        acc = self.accs[q]
        if not acc.keys:
            return None, 1
        total, n = acc.take_sum()
        return (total if self.applies else None), n

    def _closable(self, qs) -> list[int]:
        return [q for q in qs if q not in self.closed and not self.missing[q]]
