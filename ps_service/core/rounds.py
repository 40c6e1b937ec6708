"""A barrier round: the open round's state, the rank-order sum of its gradients, the rule that closes it, and the
frozen record it leaves (with its straggler). Pure, no I/O, no clock: who is alive and what time it is are arguments.

The open :class:`Round` ``g`` has a fixed *eligible* set (worker_id -> rank), grown only when the round cannot close
without a newcomer. An eligible member counts unless it came back mid-round (``gone``). Its *contributions* are the
accepted gradients (its :class:`Accumulator`) plus the pushes skipped for NaN/Inf (``skipped``); *awaited* are the
live counted members that contributed nothing yet.

Closing rule: :meth:`CloseRule.progress`, checked after every change (its reasons ``full``, ``membership``,
``unreachable``, ``deadline``: docs/protocol.md, "The barrier"). *Stuck* (:attr:`Progress.stuck`): its own members
cannot close it (only a deadline could); a worker that registers then joins the open round instead of the next one.

Fixed R (docs/protocol.md, "The barrier"): a push counts at its *head* (:meth:`Round.head`, before its tensors are
read: :mod:`ps_service.core.intake`); the contributors are the first R heads (``heads``), a head whose push fails or
whose member goes gives its place back (:meth:`Round.unhead`). A later head (a claim read as late, a sharded PS's
hold, a push taken unclaimed) is late, its member done with the round (:meth:`Round.lose`, the one record of it:
``lost``; listed in ``refused``, in ``back`` too if it registers again into the stuck round).

Cost: the counts (``live``, ``waiting``) follow every mutator and :meth:`Round.member_changed`, so the rule's decision
is O(1) per push; the sorted eligible keys' frontier (below it every key contributed) makes the lowest pending key,
which bounds the early sum, amortised O(1). Opening a round and :attr:`Progress.awaited` are O(K).

The round's sum (:class:`Accumulator`, the PS's ConditionalAccumulator):

- It owns the validated gradients it is given, one per worker: the first in rank order becomes the running sum
  (copied first if read-only or not C-contiguous), the others are read once and released.
- ``take_sum()`` sums them in (rank, worker_id) order, ``acc = g[first]; acc += g[next] ...``, then ``acc /= n`` under
  ``aggregation="mean"`` when n > 1: whatever the arrival order, a run is bit-reproducible (a round's ranks are
  distinct: :meth:`Round.listed`).
- A gradient is folded in as soon as no gradient still possible (``pending``) sorts before it (elastic: a live
  member's yet to come; fixed R, once R heads came: theirs only); ``pending=None`` (fixed R below ``min_replicas``,
  where a stuck round may take any rank): it waits. The same bits either way; a heap by key, O(log K) a gradient.
- One gradient type: owned arrays (dense, or a top-k push's :class:`~shared.compression.SparseTensor`); the sum never
  reads a sender's memory (a same-host push was copied into a buffer of the PS's: ps_service/transport/shm.py).
- **What is applied is finite.** A sum added to in place unchecked is read once for NaN/Inf by ``take_sum`` (two
  float32 3e38 make inf); not finite: :attr:`~Accumulator.spoiled` (:attr:`~Accumulator.overflow` names the tensor),
  and the round applies nothing.
- Top-k tensors are kept as the sum's :class:`Terms` while that tensor's sum came only from them, and added at once
  (:func:`sparse_sum`) when the sum is taken, which gives it as a SparseTensor (its support: the entries a round can
  change). A dense push, or a same-host one, makes it dense first.

The straggler of a closed round (:func:`straggler`; its fields: docs/guides/monitoring.md, "Straggler"): the last
contributor when its push closed the round, else the lowest-ranked member that never came; none for a single
contributor with nobody missing.
"""
from __future__ import annotations

import bisect
import heapq
import math
from dataclasses import dataclass, field
from functools import cached_property
from statistics import median
from typing import Callable, Iterable, Literal, Mapping, Sequence

import numpy as np

from ps_service.core import checks
from shared.compression import F32, SparseTensor, dense

Key = tuple[int, str]  # (rank, worker_id): the order of the sum

CLOSE_REASONS = ("full", "membership", "deadline", "unreachable")


def _doc(text: str):
    """A field described in the answers' schema (pydantic reads ``description``: /v1/rounds, /openapi.json)."""
    return field(metadata={"description": text})


@dataclass(frozen=True)
class Straggler:
    name: str
    rank: int
    kind: Literal["last_arrival", "never_arrived"] = _doc(
        "last_arrival: the last contributor closed the round; never_arrived: the round waited for members that never "
        "pushed (lease expiry, leave, deadline) and closed without them.")
    waited_seconds: float = _doc("What it cost the round: last arrival minus the previous one (last_arrival), or close "
                                 "minus the last arrival (never_arrived).")
    after_seconds: float = _doc("Its arrival (or the close) after the round opened.")
    behind_first: float = _doc("Seconds behind the first arrival.")
    behind_median: float = _doc("Seconds behind the median arrival.")


def straggler(opened_at: float, closed_at: float, arrivals: Sequence[Arrival],
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


@dataclass(frozen=True)
class Arrival:
    """One push of a round, accepted or late."""
    worker_id: str
    name: str
    rank: int
    at: float  # core time of the push


@dataclass(frozen=True)
class RoundRecord:
    """A closed round (core times, monotonic seconds). Frozen, but for the late pushes that come after its close."""
    step: int
    opened_at: float
    closed_at: float
    reason: str  # one of CLOSE_REASONS
    aggregated: int  # gradients applied
    eligible: int  # members the round counted
    contributors: tuple[Arrival, ...]  # accepted pushes, arrival order
    missing: tuple[str, ...]  # names of eligible members whose gradient is not in (and whose push was not skipped)
    straggler: Straggler | None
    loss: float | None  # example-weighted mean of the reported losses
    examples: int
    late: Sequence[Arrival] = ()  # late pushes for this round: the Round's own list (:attr:`Round.late`)
    replicas_to_aggregate: int | None = None  # the R it aimed at (None: elastic)
    skipped: tuple[Arrival, ...] = ()  # pushes skipped (NaN/Inf, PS_NONFINITE_POLICY=skip), arrival order

    @property
    def duration(self) -> float:
        return self.closed_at - self.opened_at


@dataclass  # not frozen: made at every push and tick, and a frozen dataclass's __init__ costs a setattr per field
class Progress:
    """Where the open round stands (a value: read it, never change it)."""
    waiting: int  # live counted members with no contribution yet
    needed: int  # gradients it still waits for before it closes
    unreachable: bool  # fixed R that the round's members can no longer meet
    reason: str | None  # why it closes now; None: it waits
    effective: int  # contributions it closes with (R; R out of reach or elastic: what its live members bring)
    round: Round | None = field(default=None, repr=False, compare=False)
    but: str | None = field(default=None, repr=False, compare=False)  # a member taken as not alive
    #: the push that this progress follows closed the round: :meth:`Round.close`'s (record, sum, n)
    closed: tuple | None = field(default=None, repr=False, compare=False)

    @cached_property
    def awaited(self) -> tuple[str, ...]:
        """The waiting members' ids in rank order: listed (O(K)) on first access, for monitoring."""
        return () if self.round is None else self.round.awaited(self.but)

    @property
    def stuck(self) -> bool:
        """Its own members cannot close it: a worker that registers joins it at once."""
        return self.reason is None and not self.waiting


@dataclass
class Round:
    step: int
    opened_at: float
    eligible: dict[str, int]  # worker_id -> rank; read-only outside (:meth:`join` changes it)
    acc: Accumulator
    #: alive(worker_id): an active member (the round's counts follow :meth:`member_changed`)
    alive: Callable[[str], bool] = field(repr=False, compare=False)
    #: name_of(worker_id): a member's name (the record's ``missing``)
    name_of: Callable[[str], str] = field(repr=False, compare=False)
    arrivals: list[Arrival] = field(default_factory=list)
    late: list[Arrival] = field(default_factory=list)
    losses: list[tuple[float, int]] = field(default_factory=list)  # (loss, examples)
    gone: set[str] = field(default_factory=set)  # came back mid-round: not waited for
    skipped: dict[str, Arrival] = field(default_factory=dict)  # NaN/Inf under policy skip (their pushes, in order)
    examples: int = 0
    #: the round timeout counts from here: its opening, or when held leases were released (a silent shard)
    deadline_from: float = field(default=0.0, init=False)
    live: int = field(default=0, init=False)  # counted members alive
    waiting: int = field(default=0, init=False)  # of them, those with no contribution yet
    #: the eligible keys in sum order, and the index before which every key has contributed
    order: list[Key] = field(default_factory=list, init=False, repr=False)
    frontier: int = field(default=0, init=False, repr=False)
    #: R (fixed R; None: elastic)
    replicas: int | None = None
    #: fixed R: the members whose push counted at its head (at most R), and those done without contributing (late)
    heads: dict[str, None] = field(default_factory=dict, repr=False)
    lost: set[str] = field(default_factory=set, repr=False)
    #: fixed R: the members whose head came after R heads (:meth:`lose`), in order (a sharded PS's followers' late)
    refused: list[str] = field(default_factory=list, repr=False)
    #: of them, those it took back (they registered again into the stuck round, :meth:`join`), in order
    back: list[str] = field(default_factory=list, repr=False)

    def __post_init__(self) -> None:
        self.deadline_from = self.opened_at
        self.order = sorted((rank, w) for w, rank in self.eligible.items())
        for w in self.eligible:
            self._count(w, (False, False))

    def key(self, worker_id: str) -> Key:
        return self.eligible[worker_id], worker_id

    def counts(self, worker_id: str) -> bool:
        """An eligible member the round counts (not come back mid-round)."""
        return worker_id in self.eligible and worker_id not in self.gone

    @cached_property
    def ranks(self) -> tuple[int, ...]:
        """The eligible members' ranks, sorted (forgotten when :meth:`join` changes them)."""
        return tuple(rank for rank, _ in self.order)

    def listed(self, rank: int) -> str | None:
        """The eligible member listed under ``rank`` (None: none), O(log K): membership gives the rank to nobody else
        while the round is open (:meth:`ps_service.core.membership.Membership.register`)."""
        i = bisect.bisect_left(self.order, (rank, ""))
        return self.order[i][1] if i < len(self.order) and self.order[i][0] == rank else None

    def standing(self, worker_id: str, alive: bool | None = None) -> tuple[bool, bool]:
        """(live, waiting) of a member: counted and alive; and with no contribution yet."""
        live = self.counts(worker_id) and (self.alive(worker_id) if alive is None else alive)
        return live, live and worker_id not in self.acc.keys and worker_id not in self.skipped \
            and worker_id not in self.lost

    def _count(self, worker_id: str, before: tuple[bool, bool], alive: bool | None = None) -> None:
        live, waiting = self.standing(worker_id, alive)
        self.live += live - before[0]
        self.waiting += waiting - before[1]

    def member_changed(self, worker_id: str, was_alive: bool, is_alive: bool) -> None:
        """A member became alive or not (registered, left, expired): keep the counts."""
        if worker_id in self.eligible:
            self._count(worker_id, self.standing(worker_id, was_alive), is_alive)
            if not is_alive:  # fixed R: its push can no longer count (its place goes back, as a failed push's)
                self.unhead(worker_id)

    def awaited(self, but: str | None = None) -> tuple[str, ...]:
        """The waiting members' ids in rank order (O(K): monitoring); ``but`` is taken as not alive."""
        return tuple(w for _, w in self.order if w != but and self.standing(w)[1])

    def _pending_at(self, i: int, but: str | None) -> int:
        """The index of the first key from ``i`` on that may still bring a gradient (len(order): none): a waiting
        member's (:meth:`standing`) other than ``but``; fixed R, one whose push may still count (:meth:`may_head`: it
        did, or fewer than R heads came and it sorts after the sum made). A key passed stays passed but for
        ``unhead``, ``join``."""
        order, fixed = self.order, self.replicas is not None
        while i < len(order) and (order[i][1] == but or not self.standing(order[i][1])[1]
                                  or (fixed and not self.may_head(order[i][1]))):
            i += 1
        return i

    def turns(self) -> tuple[str, ...]:
        """Whose push may be read now, elastic (:mod:`ps_service.core.intake`): the lowest key still pending, and
        the one after it too while the round holds no gradient (both then join the first sum at once)."""
        order = self.order
        i = self._pending_at(self.frontier, None)
        if i == len(order):
            return ()
        if self.acc.acc is not None or self.acc.waiting:
            return (order[i][1],)
        j = self._pending_at(i + 1, None)
        return (order[i][1],) if j == len(order) else (order[i][1], order[j][1])

    def may_head(self, worker_id: str) -> bool:
        """Fixed R: would this counted member's push count (it did, or < R heads came and it sorts after the sum)?"""
        if worker_id in self.heads:
            return True
        folded = self.acc.folded
        return len(self.heads) < self.replicas and worker_id not in self.lost \
            and not (folded and self.key(worker_id) < folded[-1])

    def head(self, worker_id: str) -> bool:
        """Fixed R: a push of this counted member came (its head); True if it counts now and did not before (elastic:
        nothing counts at a head, False)."""
        if self.replicas is None or worker_id in self.heads or not self.may_head(worker_id):
            return False
        self.heads[worker_id] = None
        return True

    def unhead(self, worker_id: str) -> bool:
        """Fixed R: a head's push failed before the round took it: its place goes back. True if it had one."""
        if worker_id not in self.heads or worker_id in self.acc.keys or worker_id in self.skipped:
            return False
        del self.heads[worker_id]
        folded = self.acc.folded
        self.frontier = bisect.bisect_right(self.order, folded[-1]) if folded else 0
        return True

    def lose(self, worker_id: str) -> bool:
        """Fixed R: a counted member's head came after R heads: it is done with the round, its push late (a retry's
        too, until it registers again into the stuck round: :meth:`join`). True if it was not already."""
        if self.replicas is None or not self.counts(worker_id) or worker_id in self.lost:
            return False
        before = self.standing(worker_id)
        self.lost.add(worker_id)
        self.refused.append(worker_id)
        self._count(worker_id, before)
        return True

    def accept(self, arrival: Arrival, grads, loss: float | None, examples: int | None, rule: CloseRule,
               now: float | None) -> Progress:
        """An accepted gradient (``grads`` None: a push skipped for NaN/Inf under policy skip, its part in the round
        over, not waited for), and where the round stands then (:meth:`progress` at ``now``; when the rule says it
        closes, the progress's ``closed`` is :meth:`close`'s at the arrival's time)."""
        wid = arrival.worker_id
        before = self.standing(wid, True)  # an active member: its push was just admitted
        self.head(wid)  # fixed R: a push that reached the core unclaimed counts here
        if grads is None:
            self.skipped[wid] = arrival
        else:
            pending = None  # fixed R below the quorum: what may sort before it is not known
            if not self.replicas or len(self.acc.keys) + 1 >= rule.quorum:  # the lowest key that may still bring one
                i = self.frontier = self._pending_at(self.frontier, wid)  # (wid brings its own now)
                pending = self.order[i:i + 1]
            self.acc.apply(wid, self.eligible[wid], grads, pending)
            self.arrivals.append(arrival)
            if loss is not None:
                self.losses.append((loss, examples or 1))
            self.examples += examples or 0
        self._count(wid, before, True)
        p = rule.progress(self, now)
        if p.reason is not None:
            p.closed = self.close(arrival.at, p.reason)
        return p

    def drop(self, worker_id: str) -> None:
        """An eligible member came back mid-round: the round does not wait for it again."""
        before = self.standing(worker_id)
        self.unhead(worker_id)
        self.gone.add(worker_id)
        self._count(worker_id, before)

    def join(self, worker_id: str, rank: int) -> None:
        """A member joins this open round (it is stuck without it), under ``rank``: one it lists already comes back
        under the rank it is listed under (no other worker is given that rank meanwhile: :meth:`listed`)."""
        before = self.standing(worker_id)
        self.gone.discard(worker_id)
        if worker_id in self.lost:  # (a refused one: :meth:`lose`)
            self.back.append(worker_id)
        self.lost.discard(worker_id)
        i = bisect.bisect_left(self.order, (rank, worker_id))
        if worker_id not in self.eligible:
            self.order.insert(i, (rank, worker_id))
            self.__dict__.pop("ranks", None)
            self.eligible[worker_id] = rank
        self.frontier = min(self.frontier, i)  # pending again
        self._count(worker_id, before)

    def mean_loss(self) -> float | None:
        total = sum(n for _, n in self.losses)
        loss = sum(v * n for v, n in self.losses) / total if total else None
        return loss if loss is not None and math.isfinite(loss) else None  # huge losses can overflow the mean

    def close(self, now: float, reason: str):
        """(its :class:`RoundRecord`, the rank-order sum or None, n: sum / n is the mean); a sum that overflows
        applies none of the gradients, and the record says so."""
        keys = self.acc.keys
        total, n = self.acc.take_sum() if keys else (None, 1)
        applied = keys if total is not None else {}
        missing = [(self.name_of(w), rank) for w, rank in self.eligible.items()
                   if w not in applied and w not in self.skipped]
        came = sorted([*self.arrivals, *self.skipped.values()], key=lambda a: a.at) if self.skipped else self.arrivals
        return RoundRecord(
            self.step, self.opened_at, now, reason, len(applied), len(self.eligible),
            tuple(a for a in self.arrivals if a.worker_id in applied),
            tuple(n for n, _ in missing), straggler(self.opened_at, now, came, missing),
            self.mean_loss(), self.examples, self.late, self.replicas, tuple(self.skipped.values())), total, n


@dataclass(frozen=True)
class CloseRule:
    replicas_to_aggregate: int | None = None  # R; None: elastic
    min_replicas: int = 1
    round_timeout: float | None = None

    @property
    def quorum(self) -> int:
        return max(1, self.min_replicas)

    def progress(self, r: Round, now: float | None = None, but: str | None = None) -> Progress:
        """The round's standing from its counts, O(1); ``now`` None: no deadline; ``but``: a member taken as dead."""
        live, waiting = r.live, r.waiting
        if but is not None:
            out = r.standing(but)
            live, waiting = live - out[0], waiting - out[1]
        got = len(r.acc.keys)
        done, want = got + len(r.skipped), self.replicas_to_aggregate
        unreachable = bool(want) and done + waiting < want
        reason = None
        if want and not unreachable:
            needed, effective = max(0, want - done), want
            reason = "full" if needed == 0 else None
        elif want:
            needed, effective = max(waiting, self.quorum - got), done + waiting
            reason = "unreachable" if needed == 0 else None
        else:
            needed, effective = waiting, live
            if not waiting and done:
                reason = "full" if done == len(r.eligible) else "membership"  # skipped pushes came too
        if reason is None and now is not None and self.round_timeout is not None \
                and now - r.deadline_from >= self.round_timeout and got >= self.quorum:
            reason = "deadline"
        return Progress(waiting, needed, unreachable, reason, effective, r, but)


# ---- the round's rank-order sum -----------------------------------------------------------------------------
class Terms(list):
    """The top-k pushes of one tensor of the running sum, in rank order, added at once by :func:`sparse_sum`."""


def _owned(g: np.ndarray | SparseTensor) -> np.ndarray | Terms:
    """The running sum's start: a sparse gradient as :class:`Terms`, a dense one itself or its C-contiguous copy."""
    if isinstance(g, SparseTensor):
        return Terms([g])
    return g if g.flags.writeable and g.flags.c_contiguous else np.array(g, order="C", copy=True)


def sparse_sum(terms: list[SparseTensor]) -> SparseTensor:
    """The rank-order sum ``dense(t0) + dense(t1) + ...`` of top-k tensors (indices strictly increasing) as entries, bit
    for bit: over the union of their indices each entry's values added in rank order; the dense sum adds +0.0 for a
    term that holds none there, which changes only a -0.0 (to +0.0): added at the end to an entry not every term holds.
    One stable sort of all their indices (O(k log k)), then a pass per term an entry can hold."""
    first = terms[0]
    if len(terms) == 1:
        return SparseTensor(first.shape, first.indices, np.array(first.values, F32, copy=True))
    both = np.concatenate([t.indices for t in terms])
    order = np.argsort(both, kind="stable")  # equal indices stay in rank order
    where, values = both[order], np.concatenate([t.values for t in terms])[order]
    if not where.size:
        return SparseTensor(first.shape, where, values)
    starts = np.empty(where.size, bool)
    starts[0] = True
    np.not_equal(where[1:], where[:-1], out=starts[1:])
    firsts = np.flatnonzero(starts)
    held = np.diff(firsts, append=where.size)  # how many terms hold each entry
    out = values[firsts]
    for j in range(1, int(held.max())):
        more = np.flatnonzero(held > j)
        out[more] += values[firsts[more] + j]
    out[held < len(terms)] += np.float32(0)
    return SparseTensor(first.shape, where[firsts], out)


def mean_of(aggregation: str, n: int) -> int:
    """The divisor of a round's sum of ``n`` gradients: n under ``aggregation="mean"`` when n > 1, else 1."""
    return n if aggregation == "mean" and n > 1 else 1


@dataclass
class Accumulator:
    """One round's gradients and their rank-order sum (the module's contract)."""
    names: tuple[str, ...]  # the model's tensors, in the order of the sum's dict
    aggregation: str = "mean"
    #: every contributor's sort key, in arrival order
    keys: dict[str, Key] = field(default_factory=dict)
    #: gradients not summed yet, by worker id, and their keys as a heap (the next one to sum first)
    waiting: dict[str, Mapping[str, np.ndarray | SparseTensor]] = field(default_factory=dict)
    queue: list[Key] = field(default_factory=list)
    #: the rank-order prefix of ``keys`` already summed into ``acc``
    folded: list[Key] = field(default_factory=list)
    acc: dict[str, np.ndarray | Terms] | None = None
    #: the sum is not finite (finite gradients that overflow when added): it is not applied
    spoiled: bool = False
    #: the first tensor of the final sum found not finite, None if none
    overflow: str | None = None
    #: the running sum is known finite; False once something was added in place unchecked (:meth:`_check_sum`)
    _finite: bool = field(default=True, repr=False)

    def __len__(self) -> int:
        return len(self.keys)

    def __contains__(self, worker_id: object) -> bool:
        return worker_id in self.keys

    def apply(self, worker_id: str, rank: int, grads: Mapping[str, np.ndarray | SparseTensor],
              pending: Iterable[Key] | None = None) -> None:
        """Take ``worker_id``'s validated gradient (its arrays are the accumulator's from now on); fold in what
        sorts before every key in ``pending`` (the gradients still possible; None: unknown, fold nothing yet)."""
        key = (rank, worker_id)
        if worker_id in self.keys or (self.folded and key < self.folded[-1]):
            raise AssertionError(f"gradient {key} is a repeat or sorts before the summed prefix {self.folded}")
        self.keys[worker_id] = key
        self.waiting[worker_id] = grads
        heapq.heappush(self.queue, key)
        if pending is not None:
            self._fold(min(pending, default=None))

    def take_sum(self) -> tuple[dict[str, np.ndarray | SparseTensor] | None, int]:
        """(the rank-order sum, or None if :attr:`spoiled`; n, the caller's update divides by it: 1 under
        ``aggregation="sum"``), every waiting gradient summed and checked first; the accumulator is empty afterwards.
        A tensor summed only from top-k pushes comes as a SparseTensor (its values the caller's)."""
        if not self.keys:
            raise AssertionError("nothing to take")
        self._fold(None)
        self._check_sum()
        out, n = (None, 0) if self.spoiled else (self.acc, len(self.keys))
        self.keys, self.folded, self.acc = {}, [], None
        self._finite = True
        return out, mean_of(self.aggregation, n)

    def _check_sum(self) -> None:
        """Every :class:`Terms` added; then, unless known finite, the sum read once for NaN/Inf (:attr:`spoiled`)."""
        if self.acc is not None and any(isinstance(a, Terms) for a in self.acc.values()):
            self.acc = {name: self._summed(name, a) for name, a in self.acc.items()}
        if self.acc is None or self.spoiled or self._finite:
            return
        self._finite = True
        self.overflow = next((name for name, a in self.acc.items() if not checks.finite(a)), None)
        self.spoiled = self.overflow is not None

    def _fold(self, bound: Key | None) -> None:
        """Sum the waiting gradients in key order, up to (not including) ``bound``."""
        queue, waiting = self.queue, self.waiting
        while queue and (bound is None or queue[0] < bound):
            key = heapq.heappop(queue)
            grads = waiting.pop(key[1])
            self.folded.append(key)
            if self.acc is None:
                self.acc = {name: _owned(grads[name]) for name in self.names}  # validated: finite
                self._finite = True
            else:
                self._fold_owned(grads)

    def _fold_owned(self, grads: Mapping[str, np.ndarray | SparseTensor]) -> None:
        """``acc += grads``: a sparse tensor onto :class:`Terms`; else in place, dense, unchecked (``_check_sum``)."""
        with np.errstate(over="ignore", invalid="ignore"):  # an overflowing sum is found by the check, not warned about
            for name, acc in self.acc.items():
                g = grads[name]
                if isinstance(acc, Terms) and isinstance(g, SparseTensor):
                    acc.append(g)
                else:
                    acc = self.acc[name] = dense(self._summed(name, acc))
                    np.add(acc, dense(g), out=acc)
                    self._finite = False

    def _summed(self, name: str, acc: np.ndarray | Terms) -> np.ndarray | SparseTensor:
        """``acc`` with its :class:`Terms` added (:func:`sparse_sum`), checked as made (not finite: :attr:`spoiled`)."""
        if not isinstance(acc, Terms):
            return acc
        with np.errstate(over="ignore", invalid="ignore"):
            total = sparse_sum(acc)
            if not np.isfinite(total.values).all():
                self.spoiled, self.overflow = True, self.overflow or name
        return total
