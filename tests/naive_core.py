"""The oracle of the incremental core: the same :class:`ParameterServerCore` with every piece of incremental
bookkeeping replaced by the plain scan it stands for (the code before issue 17). Lease expiry scans all
members, the lowest free rank (neither held nor listed by the open round: scans) and the active set are
recomputed, the closing rule (:class:`NaiveRule`, which the core and its round both ask) lists the live and awaited
members from the round's sets on every call, and the lowest key that may still bring a gradient (the rank-order sum's
bound, whose push is read next) is found by a scan of every eligible member, with no frontier.
tests/test_core_oracle.py drives both with the same random sequences of calls, and checks that every method
overridden here is one the core calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ps_service.core import ParameterServerCore
from ps_service.core.membership import ACTIVE, EXPIRED, LEFT, Listed, Member, Membership, unlisted
from ps_service.core.rounds import CloseRule, Progress, Round


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

    def _free_rank(self, listed: Listed = unlisted) -> int:
        rank = 0
        while self._is_taken(rank) or listed(rank) is not None:
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
    """The round without its frontier or its kept order: the lowest key that may still bring a gradient (the bound of
    the early rank-order sum, and whose push is read next) is found by a scan of every eligible member, and the ranks
    are sorted afresh."""
    #: no frontier: every scan starts at the lowest key (what Round writes to it is dropped)
    frontier = property(lambda self: 0, lambda self, value: None)

    @property
    def ranks(self) -> tuple[int, ...]:
        return tuple(sorted(self.eligible.values()))

    def listed(self, rank: int) -> str | None:
        return next((w for w, r in self.eligible.items() if r == rank), None)

    def _pending_at(self, i: int, but: str | None) -> int:
        keys = sorted(self.key(w) for w in self.eligible)
        assert keys == self.order, (keys, self.order)  # the kept order is the eligible keys, sorted
        floor = self.acc.folded[-1] if self.acc.folded else None

        def may_bring(key) -> bool:  # the definition, Round._pending_at's docstring
            w = key[1]
            if w in self.acc.keys or w in self.skipped or w == but or not self.alive(w) or w in self.gone:
                return False
            return self.replicas is None or (
                w not in self.lost and (w in self.heads or len(self.heads) < self.replicas)
                and (floor is None or key >= floor))

        return next((j for j in range(i, len(keys)) if may_bring(keys[j])), len(keys))


def naive_progress(rule, r: Round, alive, now: float | None = None, deadline_from: float | None = None) -> Progress:
    """CloseRule.progress before issue 17: lists the live and awaited members on every call (the deadline counts
    from ``deadline_from``, by default the round's opening)."""
    live = [w for w in r.eligible if r.counts(w) and alive(w)]
    awaited = tuple(sorted((w for w in live if w not in r.acc and w not in r.skipped and w not in r.lost), key=r.key))
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


@dataclass(frozen=True)
class NaiveRule(CloseRule):
    """The closing rule by :func:`naive_progress`: the round's members listed on every call (its deadline from the
    round's opening or the leases' release, by the membership; ``now`` is None while leases are held)."""
    members: Membership | None = field(default=None, compare=False)

    def progress(self, r: Round, now: float | None = None, but: str | None = None) -> Progress:
        by_id = self.members.by_id
        return naive_progress(self, r, lambda w: w != but and by_id[w].state == ACTIVE, now,
                              max(r.opened_at, self.members.released_at))


class NaiveCore(ParameterServerCore):
    """The core with the naive membership, rule and rounds: the rule decides wherever the core or its round asks it
    (the core's ``progress``, :meth:`Round.accept`)."""

    def __init__(self, config) -> None:
        super().__init__(config)
        self.members = NaiveMembership(config.lease_seconds)
        rule = self.rule
        self.rule = NaiveRule(rule.replicas_to_aggregate, rule.min_replicas, rule.round_timeout, self.members)

    def _open_round(self, now: float) -> None:
        super()._open_round(now)
        if self.round is not None:
            self.round.__class__ = NaiveRound
