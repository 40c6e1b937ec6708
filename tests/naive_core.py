"""The oracle of the incremental core: the same :class:`ParameterServerCore` with every piece of incremental
bookkeeping replaced by the plain scan it stands for (the code before issue 17). Lease expiry scans all
members, the lowest free rank and the active set are recomputed, the closing rule lists the live and
awaited members from the round's sets on every call, and the rank-order sum's bound is the minimum of
the pending keys. tests/test_core_oracle.py drives both with the same random sequences of calls.
"""
from __future__ import annotations

from ps_service.core import ParameterServerCore
from ps_service.core.membership import ACTIVE, EXPIRED, LEFT, Member, Membership
from ps_service.core.rounds import Progress, Round


class NaiveMembership(Membership):
    def expire(self, now: float, watch_silence: bool = True) -> list[Member]:
        if self._held_at(now, watch_silence):
            return []
        gone = [m for m in self.by_id.values()
                if m.state == ACTIVE and m.lease_until < now and m.worker_id not in self.waits]
        for m in gone:
            self._set_state(m, EXPIRED)
            self._event(now, "expired", m)
        return gone

    def _is_taken(self, rank: int) -> bool:
        return rank in {m.rank for m in self.by_id.values() if m.state != LEFT}

    def _free_rank(self) -> int:
        rank = 0
        while self._is_taken(rank):
            rank += 1
        return rank

    @property
    def active_count(self) -> int:
        return sum(m.state == ACTIVE for m in self.by_id.values())

    def is_active(self, worker_id: str) -> bool:
        m = self.by_id.get(worker_id)
        return m is not None and m.state == ACTIVE

    def active(self) -> list[Member]:
        return sorted((m for m in self.by_id.values() if m.state == ACTIVE), key=lambda m: m.rank)


class NaiveRound(Round):
    #: the naive core's _progress of this round (NaiveCore._open_round)
    naive_progress = None

    def _first_pending(self, but: str, keep: bool = True):
        return min((self.key(w) for w in self.eligible if w not in self.acc and w not in self.skipped and w != but),
                   default=None)

    def progress(self, rule, now: float | None) -> Progress:
        return self.naive_progress(now)  # where the round stands, by the scans


def naive_progress(rule, r: Round, alive, now: float | None = None, deadline_from: float | None = None) -> Progress:
    """CloseRule.progress before issue 17: lists the live and awaited members on every call (the deadline counts
    from ``deadline_from``, by default the round's opening)."""
    live = [w for w in r.eligible if r.counts(w) and alive(w)]
    awaited = tuple(sorted((w for w in live if w not in r.acc and w not in r.skipped), key=r.key))
    got = len(r.acc)
    done, want = got + len(r.skipped), rule.replicas_to_aggregate
    unreachable = bool(want) and done + len(awaited) < want
    reason = None
    if want and not unreachable:
        needed, effective = max(0, want - done), want
        reason = "full" if needed == 0 else None
    elif want:
        needed, effective = max(len(awaited), rule.quorum - got), done + len(awaited)
        reason = "unreachable" if needed == 0 else None
    else:
        needed, effective = len(awaited), len(live)
        if not awaited and done:
            reason = "full" if done == len(r.eligible) else "membership"  # skipped pushes came too
    if reason is None and now is not None and rule.round_timeout is not None \
            and now - (r.opened_at if deadline_from is None else deadline_from) >= rule.round_timeout \
            and got >= rule.quorum:
        reason = "deadline"
    p = Progress(len(awaited), needed, unreachable, reason, effective)
    p.__dict__["awaited"] = awaited  # the cached property, filled in
    return p


class NaiveCore(ParameterServerCore):
    def __init__(self, config) -> None:
        super().__init__(config)
        self.members = NaiveMembership(config.lease_seconds)

    def _progress(self, r: Round, now: float | None = None, but: str | None = None) -> Progress:
        by_id, ms = self.members.by_id, self.members
        return naive_progress(self.rule, r, lambda w: w != but and by_id[w].state == ACTIVE,
                              None if ms.held else now, max(r.opened_at, ms.released_at))

    def _open_round(self, now: float) -> None:
        super()._open_round(now)
        r = self.round
        if r is not None:
            r.__class__ = NaiveRound
            r.naive_progress = lambda now: self._progress(r, now)
