"""The later partitions of a partitioned round (issue 53, docs/partitions.md). Pure, no I/O, no clock.

The plan (:func:`shared.partitions.plan`: which pieces each partition holds) is the wire's, shared with the workers.
A partition's rank-order sum is an :class:`~ps_service.core.rounds.Accumulator` over :meth:`Plan.keys`, and its
update ``ModelState.update(..., pieces=...)``: every rule elementwise, the bits of the whole step.

:class:`RoundParts` holds a round's partitions after the first (the core's :class:`~ps_service.core.rounds.Round`
holds partition 0, whose close decides the round): one rank-order accumulator each, which member's frame came,
which of the decided contributors each still waits for, and which closed.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from ps_service.core.rounds import Accumulator, Key
from shared.partitions import Plan


@dataclass
class RoundParts:
    """Partitions 1..Q-1 of the open round. Partition 0 is the :class:`~ps_service.core.rounds.Round`'s own
    accumulator, and its close is the round's *decision*: the contributors C (its accepted gradients), the mean's
    divisor and the optimizer's iteration. A frame of partition q >= 1 comes only from a member whose partition 0
    was accepted (so it is in C); it is summed in rank order once the decision says who else may come (before it,
    nothing is folded). Partition q closes when every member of C still alive has its frame in (:meth:`drop`: one
    that expired or left is not waited for)."""
    plan: Plan
    accs: list[Accumulator | None]  # [None, partition 1's, ...]
    #: C's keys once decided (None: not yet)
    contributors: dict[str, Key] | None = None
    #: the decision's sum was applied (False: it applied nothing, none of the partitions does)
    applies: bool = True
    missing: list[set[str]] = field(default_factory=list)
    closed: set[int] = field(default_factory=set)
    #: members that will bring no more frames of this round, dropped before its decision
    lost: set[str] = field(default_factory=set)
    #: per partition, the members whose frame came (a second one is a duplicate)
    came: list[set[str]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.came = [set() for _ in self.accs]

    @classmethod
    def open(cls, p: Plan, aggregation: str) -> "RoundParts":
        return cls(p, [None, *(Accumulator(p.keys(q), aggregation) for q in range(1, p.count))])

    @property
    def decided(self) -> bool:
        return self.contributors is not None

    @property
    def done(self) -> bool:
        return self.decided and len(self.closed) == self.plan.count - 1

    def has(self, q: int, worker_id: str) -> bool:
        """``worker_id``'s frame of partition q came."""
        return worker_id in self.came[q]

    def frame(self, q: int, worker_id: str, rank: int, grads) -> list[int]:
        """Take a member of C's frame of partition q (validated; its arrays are the accumulator's from now on); the
        partitions that can close now."""
        self.came[q].add(worker_id)
        if not self.decided:
            self.accs[q].apply(worker_id, rank, grads, None)
            return []
        self.missing[q].discard(worker_id)
        self.accs[q].apply(worker_id, rank, grads, tuple(self.contributors[w] for w in self.missing[q]))
        return self._closable((q,))

    def decide(self, contributors: Mapping[str, Key], applies: bool) -> list[int]:
        """The round is decided (partition 0 closed) with these contributors; the partitions that can close now."""
        self.contributors, self.applies = dict(contributors), applies
        self.missing = [set()] + [set(contributors) - set(self.accs[q].keys) - self.lost
                                  for q in range(1, self.plan.count)]
        return self._closable(range(1, self.plan.count))

    def drop(self, worker_id: str) -> list[int]:
        """A member will bring no more frames of this round (expired, left, came back): the partitions that can close
        now (before the decision: none; the decision will not wait for its frames)."""
        if not self.decided:
            self.lost.add(worker_id)
            return []
        if worker_id not in self.contributors:
            return []
        touched = [q for q in range(1, self.plan.count) if worker_id in self.missing[q]]
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
