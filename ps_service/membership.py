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
        m.last_seen, m.lease_until = now, now + self.lease_seconds
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
        m.last_seen, m.lease_until = now, now + self.lease_seconds
        return m

    def leave(self, worker_id: str, now: float) -> Member:
        m = self.get(worker_id)
        if m.state != LEFT:
            m.state = LEFT
            m.last_seen = now
            self._event(now, "left", m)
        return m

    def expire(self, now: float) -> list[Member]:
        gone = [m for m in self.by_id.values() if m.state == ACTIVE and m.lease_until < now]
        for m in gone:
            m.state = EXPIRED
            self._event(now, "expired", m)
        return gone

    def active(self) -> list[Member]:
        return sorted((m for m in self.by_id.values() if m.state == ACTIVE), key=lambda m: m.rank)

    def all(self) -> list[Member]:
        return sorted(self.by_id.values(), key=lambda m: m.rank)
