"""Bounded staleness: the async and SSP modes' state machine (``PS_MODE=async|ssp``). Pure: no I/O, no clock.

Who is live comes in as events (:meth:`BoundedStaleness.join`, :meth:`drop`); time as ``now``, the global step as an
argument. The caller does what the :class:`Verdict` says: one optimizer step when it ``applies`` (``accepted``), and
``global_step += 1`` when it ``advances`` (``accepted`` or ``skipped``), so ``global_step`` counts the iterations.

Contract: the rules of docs/protocol.md, "Modes"; async (``bound=None``) and ssp (``bound=s``) differ only in
:meth:`may_pull`. Also:

- a clock moves only once its iteration's update is in the weights, so a read granted at clock c sees the updates of
  every live worker's iterations at clocks below ``c - s`` (Petuum's SSP read guarantee);
- the floor (the slowest live clock; with nobody live, where the last one left it) never goes down; ``max_spread``
  (fastest - slowest live clock, after each push and join): ssp keeps it <= s + 1;
- :meth:`load` brings :meth:`export`'s clocks back with nobody live, no duplicate memory and no statistics;
- cost: push and pull decisions O(1); a join or a drop O(min(spread, distinct clocks)).
"""
from __future__ import annotations

from dataclasses import dataclass

from shared.protocol import PushStatus

MODES = ("sync", "async", "ssp")


@dataclass(frozen=True)
class Verdict:
    """What to do with one push."""
    status: PushStatus  # accepted, stale, duplicate or skipped
    staleness: int  # global_step - step (recorded for accepted pushes only)
    clock: int  # the worker's clock after this push

    @property
    def applies(self) -> bool:
        """Apply this gradient now (one optimizer step)."""
        return self.status is PushStatus.ACCEPTED

    @property
    def advances(self) -> bool:
        """An iteration completed: ``global_step += 1`` (after applying, if it applies)."""
        return self.status in (PushStatus.ACCEPTED, PushStatus.SKIPPED)


@dataclass
class WorkerClock:
    """One worker's standing (kept after it leaves, for monitoring and for its return)."""
    clock: int
    live: bool
    since: float  # core time it reached this clock (or joined)
    last_step: int = -1  # highest step it pushed (anything up to it is a duplicate)
    applied: int = 0  # its gradients applied
    staleness_sum: int = 0
    staleness_max: int = 0
    last_staleness: int | None = None

    @property
    def mean_staleness(self) -> float | None:
        return self.staleness_sum / self.applied if self.applied else None


@dataclass(frozen=True)
class Wait:
    """Why a worker may not pull yet (SSP): it waits until the slowest live clock reaches ``needs``."""
    clock: int  # its clock
    needs: int  # clock - bound
    slowest: int  # the slowest live clock now
    stragglers: tuple[tuple[str, float], ...]  # (worker_id, seconds at that clock) of the live workers at it


class BoundedStaleness:
    def __init__(self, bound: int | None = None, max_staleness: int | None = None) -> None:
        if bound is not None and bound < 0 or max_staleness is not None and max_staleness < 0:
            raise ValueError("bound and max_staleness must be >= 0 (None: unbounded)")
        self.bound = bound  # s; None: async, pulls never wait
        self.max_staleness = max_staleness  # older gradients are refused stale; None: no limit
        self.workers: dict[str, WorkerClock] = {}
        self.floor = 0  # the slowest live clock (kept when nobody is live); never decreases
        self.fastest = 0  # the fastest live clock (meaningful while someone is live)
        self._at: dict[int, set[str]] = {}  # clock -> live workers at it
        #: the largest spread (fastest - slowest live clock) ever seen: SSP keeps it <= bound + 1
        self.max_spread = 0
        #: staleness -> accepted pushes with it (the exact distribution: histograms and percentiles)
        self.staleness_counts: dict[int, int] = {}

    @classmethod
    def for_mode(cls, mode: str, ssp_bound: int, max_staleness: int | None) -> BoundedStaleness | None:
        """The machine of ``PS_MODE`` (None for sync: the barrier does the job)."""
        if mode not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        return None if mode == "sync" else cls(ssp_bound if mode == "ssp" else None, max_staleness)

    # ---- membership events -------------------------------------------------------------
    def join(self, worker_id: str, now: float) -> int:
        """A worker registered (new, or back after leaving or expiring): live from now; its clock."""
        w = self.workers.get(worker_id)
        if w is None:
            w = self.workers[worker_id] = WorkerClock(self.floor, False, now)
        if not w.live:
            if w.clock < self.floor:
                w.clock, w.since = self.floor, now
            w.live = True
            self._add(worker_id, w.clock)
            self.max_spread = max(self.max_spread, self.spread)
        return w.clock

    def drop(self, worker_id: str, now: float) -> None:
        """A worker left or its lease expired: out of the minimum at once. Unknown or not live: nothing."""
        w = self.workers.get(worker_id)
        if w is not None and w.live:
            w.live = False
            self._remove(worker_id, w.clock)

    # ---- pushes ------------------------------------------------------------------------
    def push(self, worker_id: str, step: int, global_step: int, finite: bool, now: float) -> Verdict:
        """Classify a live worker's push computed on step ``step``; the caller applies it iff ``applies``."""
        w = self.workers.get(worker_id)
        if w is None or not w.live:
            raise KeyError(f"worker {worker_id!r} is not live here: join it first")
        if not 0 <= step <= global_step:
            raise ValueError(f"step {step} outside [0, global step {global_step}]")
        staleness = global_step - step
        if step <= w.last_step:
            return Verdict(PushStatus.DUPLICATE, staleness, w.clock)
        w.last_step = step
        if not finite:
            status = PushStatus.SKIPPED
        elif self.max_staleness is not None and staleness > self.max_staleness:
            return Verdict(PushStatus.STALE, staleness, w.clock)
        else:
            status = PushStatus.ACCEPTED
            w.applied += 1
            w.staleness_sum += staleness
            w.staleness_max = max(w.staleness_max, staleness)
            w.last_staleness = staleness
            self.staleness_counts[staleness] = self.staleness_counts.get(staleness, 0) + 1
        self._add(worker_id, w.clock + 1)  # before the removal: the new minimum is found at once
        self._remove(worker_id, w.clock)
        w.clock += 1
        w.since = now
        self.max_spread = max(self.max_spread, self.spread)
        return Verdict(status, staleness, w.clock)

    # ---- pulls -------------------------------------------------------------------------
    def may_pull(self, worker_id: str) -> bool:
        """May this worker pull its next weights? Always in async; in SSP when the slowest live clock is >= its
        clock - s. A worker not live here is not gated (the core refuses it anyway)."""
        w = self.workers.get(worker_id)
        return self.bound is None or w is None or not w.live or self.floor >= w.clock - self.bound

    def wait(self, worker_id: str, now: float) -> Wait | None:
        """What a worker that may not pull waits for (None: it may). O(live workers at the minimum)."""
        if self.may_pull(worker_id):
            return None
        clock = self.workers[worker_id].clock
        at = sorted(self._at[self.floor])
        return Wait(clock, clock - self.bound, self.floor, tuple((w, now - self.workers[w].since) for w in at))

    # ---- monitoring --------------------------------------------------------------------
    @property
    def spread(self) -> int:
        """Fastest minus slowest live clock (0 when nobody is live)."""
        return self.fastest - self.floor if self._at else 0

    def live_count(self) -> int:
        return sum(len(s) for s in self._at.values())

    def applied(self) -> int:
        """Gradients accepted (and so applied) since this machine was made."""
        return sum(self.staleness_counts.values())

    def percentile(self, q: float) -> int | None:
        """Nearest-rank q-th percentile (0 < q <= 100) of the applied gradients' staleness (None: none yet)."""
        total = self.applied()
        if not total:
            return None
        rank, seen = max(1, -(-q * total // 100)), 0
        for value in sorted(self.staleness_counts):
            seen += self.staleness_counts[value]
            if seen >= rank:
                return value
        return max(self.staleness_counts)

    # ---- checkpoint --------------------------------------------------------------------
    def export(self) -> dict:
        """Checkpoint data: every worker's clock, and the floor."""
        return {"floor": self.floor, "clocks": {w: rec.clock for w, rec in self.workers.items()}}

    def load(self, data: dict, now: float) -> None:
        """:meth:`export`'s data: the clocks come back, nobody live, no duplicate memory, no statistics."""
        self.floor = self.fastest = int(data["floor"])
        self.workers = {str(w): WorkerClock(int(c), False, now) for w, c in data["clocks"].items()}
        self._at.clear()
        self.staleness_counts.clear()

    # ---- the live clocks: a bucket per clock value, the minimum (floor) and maximum kept ----
    def _add(self, worker_id: str, clock: int) -> None:
        if not self._at:
            self.floor = self.fastest = clock
        self._at.setdefault(clock, set()).add(worker_id)
        self.fastest = max(self.fastest, clock)
        self.floor = min(self.floor, clock)  # never lower in practice: joins come in at the floor or above

    def _remove(self, worker_id: str, clock: int) -> None:
        bucket = self._at[clock]
        bucket.discard(worker_id)
        if bucket:
            return
        del self._at[clock]
        if not self._at:
            return  # the floor stays where the last live worker left it
        if clock == self.floor:
            self.floor = self._seek(clock, +1)
        elif clock == self.fastest:
            self.fastest = self._seek(clock, -1)

    def _seek(self, clock: int, direction: int) -> int:
        """The nearest occupied clock beyond ``clock``: a walk of at most as many values as are occupied."""
        for _ in range(len(self._at)):
            clock += direction
            if clock in self._at:
                return clock
        return min(self._at) if direction > 0 else max(self._at)
