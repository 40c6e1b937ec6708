"""Who is in the job: registration, ranks, leases. Pure state, no I/O, no clock of its own.

Contract:
- A worker registers by ``name``. A new name gets a fresh random ``worker_id``
  and the lowest rank no other *present* member holds (present = active or
  expired; a member that left gracefully gives its rank back). The same name
  registering again (a restarted container) gets the same ``worker_id`` and
  rank, and becomes active again.
- Every request from a worker renews its lease (``touch``); ``expire(now)``
  marks members whose lease ran out as ``expired``. ``leave`` is the graceful
  exit. Expired and left members stay listed, for monitoring.
- A worker waiting on the barrier (a long-poll pull) is alive for as long as it
  waits: ``begin_wait`` renews its lease and counts one wait in flight, ``expire``
  never expires a member with a wait in flight, ``end_wait`` ends one and renews
  the lease from then. Waits are counted per member, so overlapping ones nest.
- Every change is appended to ``events`` (bounded) with its time.
"""
from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass, field

from shared.errors import ProtocolError

ACTIVE, EXPIRED, LEFT = "active", "expired", "left"
MAX_NAME_LEN = 128


@dataclass
class Member:
    worker_id: str
    name: str
    rank: int
    state: str
    registered_at: float
    last_seen: float
    lease_until: float
    registrations: int = 1
    #: counts of push outcomes, by PushStatus value
    pushes: dict[str, int] = field(default_factory=dict)
    #: step -> first status given for it (the last few steps), for duplicate detection
    recent: dict[int, str] = field(default_factory=dict)
    #: running sums of reported phase seconds, and how many reports
    phase_sums: dict[str, float] = field(default_factory=lambda: {"fetch": 0.0, "compute": 0.0, "push": 0.0})
    phase_reports: int = 0
    last_loss: float | None = None

    @property
    def active(self) -> bool:
        return self.state == ACTIVE


class Membership:
    def __init__(self, lease_seconds: float, max_events: int = 1000) -> None:
        self.lease_seconds = lease_seconds
        self.by_id: dict[str, Member] = {}
        self.by_name: dict[str, Member] = {}
        self.events: deque[dict] = deque(maxlen=max_events)
        self.changes = 0
        #: worker_id -> waits in flight (long-poll pulls); never expired while there is one
        self.waits: dict[str, int] = {}

    def _event(self, now: float, kind: str, m: Member) -> None:
        self.changes += 1
        self.events.append({"time": now, "event": kind, "worker_id": m.worker_id, "name": m.name, "rank": m.rank})

    def _free_rank(self) -> int:
        taken = {m.rank for m in self.by_id.values() if m.state != LEFT}
        rank = 0
        while rank in taken:
            rank += 1
        return rank

    def register(self, name: str, now: float) -> tuple[Member, bool]:
        """(member, rejoined): the member for ``name``, now active with a fresh lease."""
        if not isinstance(name, str) or not name.strip() or len(name) > MAX_NAME_LEN:
            raise ProtocolError(400, "bad_name", f"worker name must be a non-empty string of at most {MAX_NAME_LEN} chars")
        m = self.by_name.get(name)
        if m is None:
            m = Member(secrets.token_hex(8), name, self._free_rank(), ACTIVE, now, now, now + self.lease_seconds)
            self.by_id[m.worker_id] = m
            self.by_name[name] = m
            self._event(now, "joined", m)
            return m, False
        if m.state == LEFT:
            taken = {o.rank for o in self.by_id.values() if o.state != LEFT and o is not m}
            if m.rank in taken:
                m.rank = self._free_rank()
        m.state = ACTIVE
        m.registrations += 1
        self._renew(m, now)
        self._event(now, "rejoined", m)
        return m, True

    def get(self, worker_id: str) -> Member:
        m = self.by_id.get(worker_id) if isinstance(worker_id, str) else None
        if m is None:
            raise ProtocolError(404, "unknown_worker", "no worker with this id; register again (POST /v1/workers)")
        return m

    def touch(self, worker_id: str, now: float) -> Member:
        """Renew the lease of an active member; a non-active one must register again (409)."""
        m = self.get(worker_id)
        if m.state != ACTIVE:
            raise ProtocolError(409, "not_active", f"worker {m.name!r} is {m.state}; register again (POST /v1/workers)")
        self._renew(m, now)
        return m

    def _renew(self, m: Member, now: float) -> None:
        m.last_seen, m.lease_until = now, now + self.lease_seconds

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
            self._renew(m, now)

    def leave(self, worker_id: str, now: float) -> Member:
        m = self.get(worker_id)
        if m.state != LEFT:
            m.state = LEFT
            m.last_seen = now
            self._event(now, "left", m)
        return m

    def expire(self, now: float) -> list[Member]:
        gone = [m for m in self.by_id.values()
                if m.state == ACTIVE and m.lease_until < now and m.worker_id not in self.waits]
        for m in gone:
            m.state = EXPIRED
            self._event(now, "expired", m)
        return gone

    def export(self) -> list[dict]:
        """Checkpoint data: every member's id, name, rank, state and registrations."""
        return [{"worker_id": m.worker_id, "name": m.name, "rank": m.rank, "state": m.state,
                 "registrations": m.registrations} for m in self.all()]

    def load(self, records: list[dict], now: float) -> int:
        """:meth:`export`'s data, members back as expired (left ones stay left): each registers again
        under its name and gets its id and rank back. How many were active."""
        for rec in records:
            state = LEFT if rec["state"] == LEFT else EXPIRED
            m = Member(str(rec["worker_id"]), str(rec["name"]), int(rec["rank"]), state, now, now, now,
                       registrations=int(rec.get("registrations", 1)))
            self.by_id[m.worker_id] = m
            self.by_name[m.name] = m
        return sum(1 for rec in records if rec["state"] == ACTIVE)

    def active(self) -> list[Member]:
        return sorted((m for m in self.by_id.values() if m.state == ACTIVE), key=lambda m: m.rank)

    def all(self) -> list[Member]:
        return sorted(self.by_id.values(), key=lambda m: m.rank)
