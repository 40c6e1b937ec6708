"""A barrier round: the open round's state, the rule that closes it, and the frozen record it leaves.

Pure, no I/O, no clock: who is alive and what time it is are arguments.

The open :class:`Round` ``g`` has a fixed *eligible* set (worker_id -> rank, chosen when it opens;
it grows only when the round cannot close without a newcomer). An eligible member counts unless it
came back mid-round (``gone``: it registered again; the round does not wait for it again). Its
*contributions* are the accepted gradients (in its :class:`~ps_service.accumulator.Accumulator`)
plus the pushes skipped for NaN/Inf (``skipped``: done, nothing applied). *Awaited* are the live
counted members that have contributed nothing yet.

Closing rule (:meth:`CloseRule.progress`), checked after every change:

- elastic (R unset): when nobody is awaited and something came in. Reason ``full`` when every
  eligible member's gradient is in, else ``membership`` (one expired, left or came back).
- fixed R, reachable (contributions + awaited >= R): at the R-th contribution, reason ``full``.
- fixed R, **unreachable** (contributions + awaited < R: members left or expired): R can no
  longer be met, so the round waits for the members still awaited and then closes with what it
  has, reason ``unreachable``, provided at least ``min_replicas`` (>= 1) gradients are in. Below
  that (none in, say) it is *stuck*: it waits for a worker to register, who joins it at once.
- either mode, deadline: open ``round_timeout`` seconds with at least ``min_replicas`` gradients
  in, reason ``deadline``.

*Stuck* (:attr:`Progress.stuck`): the round cannot close with its own members (only a deadline
could close it); a worker that registers then joins the open round instead of the next one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable

from ps_service.accumulator import Accumulator, Key
from ps_service.stragglers import Straggler, straggler

CLOSE_REASONS = ("full", "membership", "deadline", "unreachable")


@dataclass(frozen=True)
class Arrival:
    """One push of a round, accepted or late."""
    worker_id: str
    name: str
    rank: int
    at: float  # core time of the push


@dataclass(frozen=True)
class RoundRecord:
    """A closed round (core times, monotonic seconds). Immutable: a late push for it replaces the record."""
    step: int
    opened_at: float
    closed_at: float
    reason: str  # one of CLOSE_REASONS
    aggregated: int  # gradients applied
    eligible: int  # members the round counted
    contributors: tuple[Arrival, ...]  # accepted pushes, arrival order
    missing: tuple[str, ...]  # names of eligible members whose gradient is not in
    straggler: Straggler | None
    loss: float | None  # example-weighted mean of the reported losses
    examples: int
    late: tuple[Arrival, ...] = ()  # late pushes for this round (they may come after the close)
    replicas_to_aggregate: int | None = None  # the R it aimed at (None: elastic)

    @property
    def duration(self) -> float:
        return self.closed_at - self.opened_at


@dataclass(frozen=True)
class Progress:
    """Where the open round stands."""
    awaited: tuple[str, ...]  # live counted members with no contribution yet, in rank order
    needed: int  # gradients it still waits for before it closes
    unreachable: bool  # fixed R that the round's members can no longer meet
    reason: str | None  # why it closes now; None: it waits
    effective: int  # contributions it closes with (R; R out of reach or elastic: what its live members bring)

    @property
    def stuck(self) -> bool:
        """Its own members cannot close it: a worker that registers joins it at once."""
        return self.reason is None and not self.awaited


@dataclass
class Round:
    step: int
    opened_at: float
    eligible: dict[str, int]  # worker_id -> rank
    acc: Accumulator
    arrivals: list[Arrival] = field(default_factory=list)
    late: list[Arrival] = field(default_factory=list)
    losses: list[tuple[float, int]] = field(default_factory=list)  # (loss, examples)
    gone: set[str] = field(default_factory=set)  # came back mid-round: not waited for
    skipped: set[str] = field(default_factory=set)  # NaN/Inf under policy skip: done, nothing applied
    examples: int = 0

    def key(self, worker_id: str) -> Key:
        return self.eligible[worker_id], worker_id

    def counts(self, worker_id: str) -> bool:
        """An eligible member the round counts (not come back mid-round)."""
        return worker_id in self.eligible and worker_id not in self.gone

    def accept(self, arrival: Arrival, grads, loss: float | None, examples: int | None, eager: bool) -> None:
        """An accepted gradient; ``eager``: every eligible member may still push (elastic), so the
        sum can start on the lowest ranks before they all are in."""
        wid = arrival.worker_id
        pending = [self.key(w) for w in self.eligible if w not in self.acc and w not in self.skipped and w != wid] \
            if eager else None
        self.acc.apply(wid, self.eligible[wid], grads, pending)
        self.arrivals.append(arrival)
        if loss is not None:
            self.losses.append((loss, examples or 1))
        self.examples += examples or 0

    def mean_loss(self) -> float | None:
        total = sum(n for _, n in self.losses)
        loss = sum(v * n for v, n in self.losses) / total if total else None
        return loss if loss is not None and math.isfinite(loss) else None  # huge losses can overflow the mean

    def record(self, now: float, reason: str, name_of: Callable[[str], str], replicas: int | None) -> RoundRecord:
        missing = [(name_of(w), rank) for w, rank in self.eligible.items() if w not in self.acc]
        return RoundRecord(
            self.step, self.opened_at, now, reason, len(self.acc), len(self.eligible), tuple(self.arrivals),
            tuple(n for n, _ in missing), straggler(self.opened_at, now, self.arrivals, missing),
            self.mean_loss(), self.examples, tuple(self.late), replicas)


@dataclass(frozen=True)
class CloseRule:
    replicas_to_aggregate: int | None = None  # R; None: elastic
    min_replicas: int = 1
    round_timeout: float | None = None

    @property
    def quorum(self) -> int:
        return max(1, self.min_replicas)

    def progress(self, r: Round, alive: Callable[[str], bool], now: float | None = None) -> Progress:
        """The round's standing; ``alive(worker_id)``: an active member; ``now`` None: ignore the deadline."""
        live = [w for w in r.eligible if r.counts(w) and alive(w)]
        awaited = tuple(sorted((w for w in live if w not in r.acc and w not in r.skipped), key=r.key))
        got = len(r.acc)
        done, want = got + len(r.skipped), self.replicas_to_aggregate
        unreachable = bool(want) and done + len(awaited) < want
        reason = None
        if want and not unreachable:
            needed, effective = max(0, want - done), want
            reason = "full" if needed == 0 else None
        elif want:
            needed, effective = max(len(awaited), self.quorum - got), done + len(awaited)
            reason = "unreachable" if needed == 0 else None
        else:
            needed, effective = len(awaited), len(live)
            if not awaited and done:
                reason = "full" if got == len(r.eligible) else "membership"
        if reason is None and now is not None and self.round_timeout is not None \
                and now - r.opened_at >= self.round_timeout and got >= self.quorum:
            reason = "deadline"
        return Progress(awaited, needed, unreachable, reason, effective)
