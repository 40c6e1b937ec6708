"""Who is in the job: registration, ranks, leases. Pure state, no I/O, no clock of its own.

Contract: docs/protocol.md, register (names, ids, the lowest free rank: none the open round lists, leases, the silence
that holds them). In the module's terms: ``touch`` renews a lease, ``expire(now)`` marks members whose lease ran out
``expired``, ``leave`` is the graceful exit; expired and left members stay listed. A wait on the barrier
(``begin_wait`` .. ``end_wait``, nested) holds its member's lease. Leases are *held* (:attr:`holds`, by reason) from
:meth:`hold` until :meth:`release`: :data:`FOLLOWER`, a sharded PS whose follower does not answer; :data:`SILENCE`, no
worker heard from for :data:`SILENCE_LEASES` of a lease (or :meth:`stalled`), released by the next worker heard from.
When the last hold is released every active member gets a lease and :data:`RECONNECT_SECONDS` from then. Every change
is appended to ``events`` (bounded).

Cost: no call scans the members. ``expire`` pops a heap of lease ends (one entry per member; a renewed lease's entry
is pushed back to its new end when it comes due): O(log K) per lease that ran out or was renewed; the active members,
their count and the ranks taken are kept up to date at every change; a registration steps over the free ranks the
open round lists (O(log K) each). Only :meth:`active` (sorted, once per round) and :meth:`all` / :meth:`export`
(monitoring, checkpoints) walk them.
"""
from __future__ import annotations

import heapq
import secrets
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from ps_service.core.errors import CoreError
from shared import liveness

ACTIVE, EXPIRED, LEFT = "active", "expired", "left"
MAX_NAME_LEN = 128
#: a silence of this many leases (no worker heard from) holds the leases: above the lease/3 in which every live
#: worker renews, below the lease/3 .. lease a member's lease has left when the PS goes silent
SILENCE_LEASES = 0.5
#: what a member's lease lasts beyond ``lease_seconds`` after leases were held: the TCP user timeout
#: (shared/liveness.py), within which a worker notices a connection the outage broke and connects afresh (a connect
#: waits no longer either)
RECONNECT_SECONDS = liveness.USER_TIMEOUT_SECONDS
#: the reasons leases are held (:meth:`Membership.hold`)
FOLLOWER, SILENCE = "follower", "silence"
#: rank -> the worker id the open round lists under it, or None (:meth:`Membership.register`)
Listed = Callable[[int], str | None]


def unlisted(rank: int) -> None:
    """No open round lists ``rank`` (:data:`Listed`)."""
    return None


def refuse_blank(name: object) -> None:
    """400 ``bad_name`` for a name of only whitespace, checked before anything else wrong with it."""
    if isinstance(name, str) and name.isspace():
        raise CoreError("bad_name", "worker name is only whitespace")


@dataclass
class Member:
    worker_id: str
    name: str
    rank: int
    state: str
    registered_at: float
    last_seen: float
    _lease_until: float
    registrations: int = 1
    #: counts of push outcomes, by PushStatus value
    pushes: dict[str, int] = field(default_factory=dict)
    #: step -> first status given for it (the last few steps), for duplicate detection
    recent: dict[int, str] = field(default_factory=dict)
    #: running sums of reported phase seconds, and how many reports
    phase_sums: dict[str, float] = field(default_factory=lambda: {"fetch": 0.0, "compute": 0.0, "push": 0.0})
    phase_reports: int = 0
    last_loss: float | None = None
    #: the lease ends this member is scheduled in (None: not yet handed to a :class:`Membership`)
    _leases: LeaseHeap | None = field(default=None, repr=False, compare=False)

    @property
    def active(self) -> bool:
        return self.state == ACTIVE

    @property
    def lease_until(self) -> float:
        return self._lease_until

    @lease_until.setter
    def lease_until(self, t: float) -> None:
        self._lease_until = t
        if self._leases is not None:
            self._leases.schedule(self)


class LeaseHeap:
    """Lease ends by time, lazily: at most one live entry per member (its time in ``due``), never
    later than its lease end. Renewing (a later end) costs nothing; an earlier end adds an entry."""

    def __init__(self) -> None:
        self.heap: list[tuple[float, str]] = []
        self.due: dict[str, float] = {}  # worker_id -> time of its live entry

    def schedule(self, m: Member) -> None:
        due = self.due.get(m.worker_id)
        if due is None or m.lease_until < due:
            self.due[m.worker_id] = m.lease_until
            heapq.heappush(self.heap, (m.lease_until, m.worker_id))

    def pop_before(self, now: float):
        """The worker ids whose entry is due before ``now``, each entry dropped (re-``schedule`` to keep one)."""
        heap, due = self.heap, self.due
        while heap and heap[0][0] < now:
            t, wid = heapq.heappop(heap)
            if due.get(wid) == t:
                del due[wid]
                yield wid


class Membership:
    def __init__(self, lease_seconds: float, max_events: int = 1000) -> None:
        self.lease_seconds = lease_seconds
        #: a silence: no worker heard from for this long; a stall (:meth:`stalled`): the PS's clock read that late
        self.stall_seconds = SILENCE_LEASES * lease_seconds
        self.by_id: dict[str, Member] = {}
        self.by_name: dict[str, Member] = {}
        self.events: deque[dict] = deque(maxlen=max_events)
        self.changes = 0
        #: worker_id -> waits in flight (long-poll pulls); never expired while there is one
        self.waits: dict[str, int] = {}
        self.leases = LeaseHeap()
        #: the active members, by worker id
        self.active_by_id: dict[str, Member] = {}
        #: rank -> present (not left) members holding it; free ranks below ``_top`` (lazy: some may be taken)
        self._taken: dict[int, int] = {}
        self._free: list[int] = []
        self._top = 0  # every rank from here on is free
        self._order: dict[str, int] = {}  # worker_id -> position in by_id (registration order)
        #: reason (:data:`FOLLOWER`, :data:`SILENCE`) -> since when it holds the leases (:meth:`hold`)
        self.holds: dict[str, float] = {}
        #: when a worker's request last renewed a lease (None: never)
        self.heard_at: float | None = None
        #: when leases last ran again after their holds (a round's deadline counts from then at the earliest)
        self.released_at = float("-inf")

    def _event(self, now: float, kind: str, m: Member) -> None:
        self.changes += 1
        self.events.append({"time": now, "event": kind, "worker_id": m.worker_id, "name": m.name, "rank": m.rank})

    @property
    def held(self) -> bool:
        """No lease runs out now: held for some reason (:meth:`hold`)."""
        return bool(self.holds)

    @property
    def active_count(self) -> int:
        return len(self.active_by_id)

    def is_active(self, worker_id: str) -> bool:
        return worker_id in self.active_by_id

    def _free_rank(self, listed: Listed = unlisted) -> int:
        """The lowest rank no present member holds and ``listed`` gives no worker (:meth:`register`); the free ranks
        listed below it are skipped, not dropped: O(log K) each."""
        free, taken, skipped = self._free, self._taken, []
        while free and (free[0] in taken or listed(free[0]) is not None):
            r = heapq.heappop(free)
            if r not in taken:
                skipped.append(r)
        rank = free[0] if free else self._top
        for r in skipped:
            heapq.heappush(free, r)
        return rank

    def _hold(self, rank: int) -> None:
        for r in range(self._top, rank):
            if r not in self._taken:
                heapq.heappush(self._free, r)
        self._top = max(self._top, rank + 1)
        self._taken[rank] = self._taken.get(rank, 0) + 1

    def _release(self, rank: int) -> None:
        n = self._taken.pop(rank) - 1
        if n:
            self._taken[rank] = n
        else:
            heapq.heappush(self._free, rank)

    def _add(self, m: Member) -> None:
        self._order[m.worker_id] = len(self._order)
        self.by_id[m.worker_id] = m
        self.by_name[m.name] = m
        if m.state != LEFT:
            self._hold(m.rank)
        if m.state == ACTIVE:
            self.active_by_id[m.worker_id] = m
        m._leases = self.leases
        self.leases.schedule(m)

    def _set_state(self, m: Member, state: str) -> None:
        if (m.state == LEFT) != (state == LEFT):
            (self._release if state == LEFT else self._hold)(m.rank)
        if state == ACTIVE:
            self.active_by_id[m.worker_id] = m
        else:
            self.active_by_id.pop(m.worker_id, None)
        m.state = state

    def register(self, name: str, now: float, listed: Listed = unlisted) -> tuple[Member, bool]:
        """(member, rejoined): the member for ``name``, now active with a fresh lease. ``listed(rank)``: the worker id
        the open round lists under ``rank`` (None: none), a rank given to no other worker until that round closes (a
        member that left gave it back): a newcomer gets the lowest rank neither held nor listed, a member that left
        its old rank unless another holds it or the round lists it for another."""
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_LEN:
            raise CoreError("bad_name", f"worker name must be a non-empty string of at most {MAX_NAME_LEN} chars")
        m = self.by_name.get(name)
        if m is None:
            m = Member(secrets.token_hex(8), name, self._free_rank(listed), ACTIVE, now, now, now + self.lease_seconds)
            self._add(m)
            self._event(now, "joined", m)
            self._heard(now)
            return m, False
        if m.state == LEFT and (m.rank in self._taken or listed(m.rank) not in (None, m.worker_id)):
            m.rank = self._free_rank(listed)
        self._set_state(m, ACTIVE)
        m.registrations += 1
        self.renew(m, now)
        self._event(now, "rejoined", m)
        return m, True

    def get(self, worker_id: str) -> Member:
        m = self.by_id.get(worker_id) if isinstance(worker_id, str) else None
        if m is None:
            raise CoreError("unknown_worker", "no worker with this id; register again (POST /v1/workers)")
        return m

    def touch(self, worker_id: str, now: float) -> Member:
        """Renew the lease of an active member; a non-active one must register again (409)."""
        m = self.active_member(worker_id)
        self.renew(m, now)
        return m

    def active_member(self, worker_id: str) -> Member:
        """The member, if active: 404 ``unknown_worker``, 409 ``not_active`` (it must register again) otherwise."""
        m = self.get(worker_id)
        if m.state != ACTIVE:
            raise CoreError("not_active", f"worker {m.name!r} is {m.state}; register again (POST /v1/workers)")
        return m

    def renew(self, m: Member, now: float) -> None:
        """Renew the lease of ``m``, an active member (as :meth:`touch`, for a caller that holds it): heard from."""
        m.last_seen, m.lease_until = now, now + self.lease_seconds
        self._heard(now)

    def _held_at(self, now: float, watch_silence: bool) -> bool:
        """:attr:`held` at ``now`` (for :meth:`expire`), a silence noticed first: no worker heard from for
        :data:`SILENCE_LEASES` of a lease while members are active, waiting on the barrier or not. A wait is no sign of
        life: its worker's host may be cut off with the PS's (a live worker is heard at least every lease/3, its
        heartbeats going on while it waits). Not watched, a silence ends unheard."""
        if not watch_silence:
            self.holds.pop(SILENCE, None)
        elif self.active_by_id and now - self.heard_at >= self.stall_seconds:  # (heard: at every registration)
            self.hold(SILENCE, self.heard_at)
        return self.held

    def _heard(self, now: float) -> None:
        self.heard_at = now
        self.release(SILENCE, now)

    def stalled(self, since: float, now: float) -> None:
        """The PS itself did not run from ``since`` to ``now`` (its ticker's two readings of the clock): a stall
        of :data:`SILENCE_LEASES` of a lease or more is a silence from ``since`` (if members are active), ended by the
        next worker heard from. Called before any request read since reaches the core."""
        if now - since >= self.stall_seconds and self.active_by_id:
            self.hold(SILENCE, since)

    def begin_wait(self, worker_id: str, now: float) -> Member:
        """A wait on the barrier starts: renew the lease (as :meth:`touch`, 404/409) and hold it while waiting."""
        m = self.touch(worker_id, now)
        self.waits[worker_id] = self.waits.get(worker_id, 0) + 1
        return m

    def end_wait(self, worker_id: str, now: float) -> None:
        """A wait started by :meth:`begin_wait` ends: the lease runs from ``now`` (if still active). Never raises."""
        n = self.waits.pop(worker_id, 0) - 1
        if n > 0:
            self.waits[worker_id] = n
        m = self.by_id.get(worker_id)
        if m is not None and m.state == ACTIVE:
            m.last_seen, m.lease_until = now, now + self.lease_seconds  # not heard: the PS ended the wait

    def leave(self, worker_id: str, now: float) -> Member:
        m = self.get(worker_id)
        if m.state != LEFT:
            self._set_state(m, LEFT)
            m.last_seen = now
            self._event(now, "left", m)
        self._heard(now)
        return m

    def hold(self, reason: str, since: float) -> None:
        """No lease runs out, and no round closes by its deadline (the core's ``_rule_now``), from ``since`` until
        :meth:`release` of ``reason`` (held already for it: held since then)."""
        self.holds.setdefault(reason, since)

    def release(self, reason: str, now: float) -> None:
        """The hold for ``reason`` ends (none: nothing happens). The last one ends: leases run again, every active
        member's lease lasting at least ``lease_seconds`` + :data:`RECONNECT_SECONDS` from ``now``."""
        if self.holds.pop(reason, None) is None or self.holds:
            return
        self.released_at, until = now, now + self.lease_seconds + RECONNECT_SECONDS
        for m in self.active_by_id.values():
            if m.lease_until < until:
                m.lease_until = until

    def expire(self, now: float, watch_silence: bool = True) -> list[Member]:
        """Expire the active members whose lease ended before ``now`` and that wait on nothing (registration
        order); none while leases are held, or in a silence (``watch_silence``: the caller's choice; off, a silence
        ends unheard)."""
        if self._held_at(now, watch_silence):
            return []
        gone = []
        for wid in list(self.leases.pop_before(now)):
            m = self.by_id[wid]
            if m.state != ACTIVE or wid in self.waits:
                continue  # registering again or ending the wait renews the lease, and schedules it
            if m.lease_until < now:
                gone.append(m)
            else:
                self.leases.schedule(m)
        return self._expire(gone, now)

    def recall(self, m: Member, now: float) -> None:
        """Expire an active member at once, waiting or not (``recalled``): a stuck round needs it to register again."""
        self._expire([m], now, "recalled")

    def expire_all(self, now: float) -> list[Member]:
        """Expire every active member at once, waiting or not (a live rollback: each must register again)."""
        return self._expire(list(self.active_by_id.values()), now)

    def _expire(self, gone: list[Member], now: float, event: str = "expired") -> list[Member]:
        """Expire ``gone``, in registration order."""
        gone.sort(key=lambda m: self._order[m.worker_id])
        for m in gone:
            self._set_state(m, EXPIRED)
            self._event(now, event, m)
        return gone

    def export(self) -> list[dict]:
        """Checkpoint data: every member's id, name, rank, state and registrations."""
        return [{"worker_id": m.worker_id, "name": m.name, "rank": m.rank, "state": m.state,
                 "registrations": m.registrations} for m in self.all()]

    def load(self, records: list[dict], now: float) -> int:
        """:meth:`export`'s data, members back as expired (left ones stay left). How many were active."""
        for rec in records:
            state = LEFT if rec["state"] == LEFT else EXPIRED
            m = Member(str(rec["worker_id"]), str(rec["name"]), int(rec["rank"]), state, now, now, now,
                       registrations=int(rec.get("registrations", 1)))
            self._add(m)
        return sum(1 for rec in records if rec["state"] == ACTIVE)

    def active(self) -> list[Member]:
        """The active members in rank order (sorts them: once per round, not per request)."""
        return sorted(self.active_by_id.values(), key=lambda m: m.rank)

    def all(self) -> list[Member]:
        return sorted(self.by_id.values(), key=lambda m: m.rank)
