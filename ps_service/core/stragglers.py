"""Who slowed a round, and by how much: the straggler of a closed round (pure, no I/O, no clock).

Definition (used by ``/v1/rounds``, ``/metrics``, the dashboard and ``make run``):

- If the push that closed the round was the last one it waited for (the close
  time equals the last arrival: an accepted push, or one skipped for NaN/Inf), the
  straggler is that **last contributor**
  (``kind="last_arrival"``). ``waited_seconds`` is what that member alone cost
  the round: its arrival minus the previous arrival (the barrier would have
  closed that much earlier without it).
- If the round closed later than its last arrival, it was waiting for members
  that **never came** (a lease expired, a worker left, or the round deadline
  passed): ``kind="never_arrived"``, the straggler is the lowest-ranked of
  them (all are listed in ``missing``) and ``waited_seconds`` is the close time
  minus the last arrival (or the opening, if nobody pushed).
- A round with a single contributor and nobody missing has no straggler.

Also reported: ``after_seconds`` (straggler's arrival, or the close, after the
round opened), ``behind_first`` and ``behind_median`` (the same instant minus
the first and the median arrival). All times are seconds.
"""
from __future__ import annotations

from dataclasses import dataclass
from statistics import median
from typing import Protocol, Sequence


class Arrived(Protocol):
    name: str
    rank: int
    at: float


@dataclass(frozen=True)
class Straggler:
    name: str
    rank: int
    kind: str  # "last_arrival" | "never_arrived"
    waited_seconds: float
    after_seconds: float
    behind_first: float
    behind_median: float


def straggler(opened_at: float, closed_at: float, arrivals: Sequence[Arrived],
              missing: Sequence[tuple[str, int]]) -> Straggler | None:
    """``arrivals``: (name, rank, at) in arrival order; ``missing``: (name, rank) never pushed."""
    times = [a.at for a in arrivals]
    last = times[-1] if times else opened_at
    if missing and closed_at > last:
        name, rank = min(missing, key=lambda m: m[1])
        at, waited, kind = closed_at, closed_at - last, "never_arrived"
    elif len(arrivals) >= 2:
        name, rank = arrivals[-1].name, arrivals[-1].rank
        at, waited, kind = last, last - times[-2], "last_arrival"
    else:
        return None
    return Straggler(name, rank, kind, waited, at - opened_at,
                     behind_first=at - times[0] if times else at - opened_at,
                     behind_median=at - median(times) if times else at - opened_at)
