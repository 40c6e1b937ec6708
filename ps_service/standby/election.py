"""Who takes the pair's next term when the primary and its standby lost each other: the workers vote. Pure, no I/O.

Contract:
- An :class:`Election` is for one term (the pair's term + 1) on one PS, with the *rosters* it knows: the names of the
  job's active members as the primary last replicated them (the primary knows the last roster its standby
  acknowledged and those of the messages not acknowledged yet, one of which the standby holds; the standby knows the
  one it applied; a primary restarted alone with a term kept, the members of its checkpoint that had not left, and it
  is no incumbent).
- A worker votes at most once per term, for the PS it can reach (its client keeps the ballot:
  :mod:`worker_service.transport.endpoint`); a vote counts only if its name is on a roster.
- The *incumbent* (the primary of the term that ends) wins with at least half of every roster it knows, the standby
  with more than half of its own: two PS processes can never both win a term (their votes would need more than
  every worker), and a tie goes to the incumbent, which holds every round the workers saw. An empty roster: the
  incumbent wins at once, the standby never (no worker can have seen it closing a round).
"""
from __future__ import annotations

from dataclasses import dataclass, field


def roster(members: list[dict] | None, kept: bool = False) -> frozenset[str]:
    """The names of the active members of a membership export (:meth:`Membership.export`); ``kept``: of every member
    that has not left (a restored checkpoint's members are all back as expired)."""
    return frozenset(m["name"] for m in members or ()
                     if (m.get("state") != "left" if kept else m.get("state") == "active"))


@dataclass
class Election:
    term: int
    rosters: tuple[frozenset[str], ...]
    incumbent: bool
    votes: set[str] = field(default_factory=set)

    def vote(self, name: str) -> bool:
        """Count ``name``'s vote (if on a roster); whether this PS has won."""
        if any(name in r for r in self.rosters):
            self.votes.add(name)
        return self.won

    def _missing(self, r: frozenset[str]) -> int:
        """Votes roster ``r`` still lacks: the incumbent wants half of it (rounded up), the standby more than half."""
        return ((len(r) + 1) // 2 if self.incumbent else len(r) // 2 + 1) - len(r & self.votes)

    @property
    def won(self) -> bool:
        return all(self._missing(r) <= 0 for r in self.rosters)

    @property
    def needed(self) -> int:
        """Votes still needed on the largest roster (for humans)."""
        return max(0, self._missing(max(self.rosters, key=len, default=frozenset())))
