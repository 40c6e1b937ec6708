"""The PS's sans-IO core: the state machine that composes membership, rounds, the accumulator and the optimizer.

Nothing here does I/O or reads a clock: every entry point takes ``now`` (seconds, monotonic) and returns what
happened; the routes are thin drivers and the tests drive it by simulation. Cost (issue 17), K members: a push,
heartbeat or wait does amortised O(log K) work, a tick O(log K) per lease that ended or was renewed; only opening and
closing a round, a newcomer joining a stuck round, and the monitoring views walk the members.

Contract: docs/protocol.md's "The barrier" (TensorFlow's SyncReplicasOptimizer, done right: elastic and fixed R, out
of reach, recall, deadline, close, start, end) and its push statuses ("POST /v1/gradients"). In the core's terms:

- A round ``g`` is open while ``global_step == g``; its *eligible* set is the active members when it opens. Joins
  take effect at the next boundary, unless the round is *stuck* (its own members cannot close it): then a member that
  registers joins it at once, and the active members it does not count, or whose push for it was late, are recalled
  (:meth:`_recall`). A member that registers again under its name keeps its id and rank and counts as a join.
- A push's status (:meth:`classify`): a repeat of (w, s) ``duplicate``; s == g from an eligible w ``accepted``
  (``skipped`` if not finite under policy skip); from another w, or s == g-1 from a member of round g-1 that missed it,
  ``late``; older ``stale``. Every check (:func:`validate`) comes before any state changes; the core owns the arrays.
- Start: round 0 opens once the model is initialised and ``min_workers`` are active, after the grace (a restored
  checkpoint's members, or the deployment's count, :meth:`deploy`); at ``max_steps`` the job is done. The start and
  the round's rule are one decision (:meth:`decide`): :meth:`tick` acts on it, :meth:`wait_reason` is its why.

Modes (``config.mode``): the above is ``sync``. In ``async`` and ``ssp`` no round opens: each accepted gradient is
applied on arrival (:mod:`ps_service.core.on_arrival`); the clocks, the SSP bound and the staleness records are
``self.modes`` (:class:`ps_service.core.staleness.BoundedStaleness`); :meth:`may_pull` is the SSP gate of a pull.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol

import numpy as np

from ps_service.core import on_arrival
from ps_service.core.checks import validate
from ps_service.core.config import CoreConfig
from ps_service.core.intake import Intake
from ps_service.core.membership import SILENCE, Member, Membership, unlisted
from ps_service.core.model import ModelState
from ps_service.core.partitions import RoundParts
from ps_service.core.rates import RateMeter
from ps_service.core.rounds import Arrival, Progress, Round, RoundRecord
from ps_service.core.staleness import BoundedStaleness
from ps_service.core.errors import CoreError
from shared.protocol import MAX_INT, JobState, PushRequest, PushStatus
from shared.partitions import Plan, plan as partition_plan
from shared.shards import spec_of

RECENT_STEPS = 16  # per-worker memory of pushed steps, for duplicate detection
RATE_WINDOW_SECONDS = 10.0
LOSS_KEPT = 10_000  # the newest closed rounds' losses kept (GET /v1/loss)


#: what :meth:`ParameterServerCore.tick` does now (:class:`Decision`)
WAIT, START, CLOSE, RECALL = "wait", "start", "close", "recall"


@dataclass(frozen=True)
class Decision:
    """What the core does now (:meth:`ParameterServerCore.decide`): ``action`` for the tick, ``why()`` for humans
    (formatted only when asked: a tick stays O(log K))."""
    action: str
    why: Callable[[], str | None]
    close_reason: str | None = None  # CLOSE: the round's rule's reason (full, membership, unreachable, deadline)


@dataclass(frozen=True)
class Decided:
    """Told (:attr:`ParameterServerCore.told`): round ``record.step`` is decided, before its update; ``lost``: its
    contributors that already bring no more frames of it (partitioned rounds), in the order they came."""
    record: RoundRecord
    lost: tuple[str, ...] = ()


@dataclass(frozen=True)
class Lost:
    """Told (:attr:`ParameterServerCore.told`): contributor ``worker_id`` of decided round ``step`` brings no more
    frames of it, before its partitions close without it."""
    step: int
    worker_id: str


class Replica(Protocol):
    """A way out of the core (docs/architecture.md; the other: :attr:`ParameterServerCore.on_partition`): a copy of
    this core's steps kept elsewhere (a hot standby's primary, ``ps_service/standby``), given each step's input as
    :meth:`ParameterServerCore.apply_round` takes it, before the core's update consumes it: the replica copies it
    then (told after the call, the core would have to keep a model-sized copy of every step)."""

    def on_step(self, total: Mapping[str, Any] | None, mean_of: int, contributors: int) -> None: ...


@dataclass(frozen=True)
class PushResult:
    status: PushStatus
    step: int  # the PS's global step after the push
    closed: bool = False  # this push closed a round


class ParameterServerCore(ModelState):
    def __init__(self, config: CoreConfig) -> None:
        super().__init__(config.optimizer_overrides)
        self.config = config
        self.rule = config.rule
        self.members = Membership(config.lease_seconds)
        self.started = False
        self.round: Round | None = None
        self.last_round: Round | None = None
        #: the open sync round's partitions (partition 0's accumulator the Round's) and, once decided, its decision;
        #: a sharded follower's round (:meth:`followed_round`)
        self.parts: RoundParts | None = None
        self._plan: Plan | None = None  # :attr:`plan`, once the model is in
        #: sync rounds close partition by partition, of about this many bytes each (docs/partitions.md); 0: one
        self.partition_bytes = 0  # (PS_PARTITION_BYTES: the runtime sets it before the model)
        self.rounds: deque[RoundRecord] = deque(maxlen=config.max_rounds_kept)
        self.rounds_closed = 0  # since this process started
        self.gradients_applied = 0  # since this process started, every mode
        self.rates = RateMeter(RATE_WINDOW_SECONDS)  # samples (rounds_closed, examples, gradients_applied) at ticks
        #: async/ssp: clocks, the SSP bound, staleness records (None: sync)
        self.modes = BoundedStaleness.for_mode(config.mode, config.ssp_staleness, config.max_staleness)
        self._ranks: tuple[int, tuple[int, ...]] = (-1, ())  # (members.changes, active ranks) cache
        self._end_ranks: tuple[int, ...] | None = None  # the ranks once the job is done and a worker registered
        self.push_counts = {s.value: 0 for s in PushStatus} | {"skipped": 0}
        self.loss_history: deque[tuple[int, float]] = deque(maxlen=LOSS_KEPT)
        self.examples = 0
        self._ready_since: float | None = None
        self.started_at: float | None = None
        #: live rollbacks to a checkpoint (:meth:`rewind`): waits in flight answer at once when it moves
        self.rewinds = 0
        #: members recalled into a stuck round (:meth:`tick`): waits in flight look again when it moves
        self.recalls = 0
        self.leaves = 0  # graceful leaves since start (a waiting long poll of the leaver ends at once)
        #: what the core tells the layer above, in order, for it to read once the call returns (None: nobody reads
        #: it; a sharded coordinator sets a list and takes what is in it after every call): :class:`Decided`,
        #: :class:`Lost`
        self.told: list[Decided | Lost] | None = None
        #: the copy of each step's input (:class:`Replica`; None: none)
        self.replica: Replica | None = None
        #: hook: on_partition(): after a call that closed partitions (the last one's after the step advanced:
        #: transport/streamed.py)
        self.on_partition: Callable[[], None] | None = None
        #: whose push's tensors are being read, and whose may be next (:meth:`claim`)
        self.intake = Intake()

    @property
    def done(self) -> bool:
        return self.global_step >= (MAX_INT if self.config.max_steps is None else self.config.max_steps)

    def export_state(self) -> dict[str, Any]:
        """What a checkpoint keeps, as plain data with copied arrays: weights, optimizer, global step, members,
        config; in async/ssp the clocks too (``staleness``)."""
        if self.deciding:
            raise AssertionError("a checkpoint between a round's partitions: weights of two steps")
        extra = {} if self.modes is None else {"staleness": self.modes.export()}
        return {**self.model_state(), "members": self.members.export(), **extra,
                "config": {f: dict(v) if isinstance(v, Mapping) else v for f, v in vars(self.config).items()}}

    def import_state(self, state: Mapping[str, Any], now: float) -> None:
        """Load :meth:`export_state`'s data before any worker talks to this PS, this start's optimizer settings on top
        (:meth:`~ps_service.core.model.ModelState.resumed_spec`); members come back expired (left ones stay left)."""
        # the settings' hyper-parameters apply; another optimizer is refused
        self.restore(state, self.resumed_spec(state["optimizer"]["spec"]))
        self._load_members(state, now)

    def _load_members(self, state: Mapping[str, Any], now: float) -> None:
        """``state``'s members, back as expired, and its async/ssp clocks."""
        self.resume_expected = self.members.load(list(state.get("members") or ()), now) or None
        if self.modes is not None and state.get("staleness") is not None:
            self.modes.load(state["staleness"], now)
        self._changed()

    def rewind(self, state: Mapping[str, Any], now: float) -> list[Member]:
        """Go back *live* to a checkpoint's model (a sharded PS's rollback): weights, optimizer and step become
        ``state``'s; the open round is dropped; every active member is expired (409 ``not_active``), its pushed steps
        forgotten; records and losses of steps >= the checkpoint's are dropped, the counters keep counting. The
        expired members, in registration order."""
        live = self.weights
        self.restore(state, state["optimizer"]["spec"])
        if live is not None and live.keys() == self.weights.keys() and all(
                live[k].shape == w.shape and live[k].dtype == w.dtype for k, w in self.weights.items()):
            self.store.before_change()
            for k, w in self.weights.items():  # into the arrays the weights were in (a same-host weights file)
                np.copyto(live[k], w)
            self.weights = live
        gone = self.members.expire_all(now)
        for m in self.members.by_id.values():
            m.recent.clear()
        if self.modes is not None:
            for m in gone:
                self.modes.drop(m.worker_id, now)
            if state.get("staleness") is not None:
                self.modes.load(state["staleness"], now)
        self.resume_expected = len(gone) or self.resume_expected
        self.round = self.last_round = None
        self.parts = self._end_ranks = None
        self.started, self._ready_since = False, None
        while self.rounds and self.rounds[-1].step >= self.global_step:
            self.rounds.pop()
        while self.loss_history and self.loss_history[-1][0] >= self.global_step:
            self.loss_history.pop()
        self.rewinds += 1
        self._changed()
        return gone

    # ---- membership --------------------------------------------------------------------
    def register(self, name: str, now: float) -> tuple[Member, int]:
        """(member, start_step: the step whose weights the worker should pull first). A member coming back keeps its
        id and rank and joins at the next boundary, unless the open round is stuck without it; one registering again
        while active stays in the round if it still owes it a push (its old process's frames are not waited for)."""
        if self.done and self._end_ranks is None:
            self._end_ranks = self.ranks()  # a worker registering after the end trains no step: not in the ranks
        prev = self.members.by_name.get(name)
        returning = prev is None or not prev.active
        r = self.round
        m, _ = self.members.register(name, now, r.listed if r is not None else unlisted)  # r's ranks: nobody else's
        wid, start = m.worker_id, self.global_step
        if self.modes is not None:
            self.modes.join(wid, now)
        if r is not None:
            r.member_changed(wid, not returning, True)
            deciding = self.deciding  # (read first: its partitions may close now)
            if prev is not None:  # a member of the round that registers again brings no more frames of it
                self._lose(now, (wid,))
            if deciding or wid in r.acc:
                start += 1  # the round's partitions still close, or its gradient for this round is in: the next one
            elif returning or not r.counts(wid) or wid in r.lost:
                if self.progress(now, but=wid).stuck:  # nobody else can close it: join it now
                    r.join(wid, m.rank)
                    if wid not in r.skipped:  # a push it made for this round before joining it was not counted
                        m.recent.pop(start, None)
                else:  # joins at the next round boundary; this round does not wait for it
                    if wid in r.eligible:
                        r.drop(wid)
                    start += 1
        self._changed()
        self.tick(now)
        return m, start

    def leave(self, worker_id: str, now: float) -> Member:
        was_alive = self.members.is_active(worker_id)
        m = self.members.leave(worker_id, now)
        self.leaves += 1  # the runtime's barrier: the worker's own long poll ends now
        self._out(now, (m.worker_id,), was_alive)
        self._changed()
        self.tick(now)
        return m

    def _out(self, now: float, worker_ids, was_alive: bool = True) -> None:
        """Members no longer active: the round, the clocks and the partitions waiting for them stop counting them."""
        for w in worker_ids:
            if self.round is not None:
                self.round.member_changed(w, was_alive, False)
            if self.modes is not None:
                self.modes.drop(w, now)
        if worker_ids and self.parts is not None:
            self._lose(now, worker_ids)

    # ---- the barrier -------------------------------------------------------------------
    def state(self) -> JobState:
        if not self.initialized:
            return JobState.WAITING_FOR_MODEL
        if self.done:
            return JobState.DONE
        return JobState.TRAINING if self.started else JobState.WAITING_FOR_WORKERS

    def expected_workers(self) -> int | None:
        """The workers step 0 waits for: N (else R), or the deployment's count when larger; None when nothing says."""
        counts = [c for c in (self.config.total_num_replicas or self.config.replicas_to_aggregate, self.deployed) if c]
        return max(counts, default=None)

    def deploy(self, count: int | None, now: float | None = None) -> None:
        """The deployment runs ``count`` workers (``PS_WORKERS_DNS`` resolved at ``now``; None or 0: not known)."""
        if (count or None) != self.deployed:
            self.deployed, self.deployed_since = count or None, now
            self._changed()

    def _deployment_settling(self, now: float) -> bool:
        """Step 0 expects the deployment's count, which changed less than ``startup_grace_seconds`` ago."""
        n, r = self.config.total_num_replicas, self.config.replicas_to_aggregate
        return bool(self.deployed and self.deployed > (n or r or 0) and self.deployed_since is not None
                    and now - self.deployed_since < self.config.startup_grace_seconds)

    def _rule_now(self, r: Round, now: float | None) -> float | None:
        """``now`` for the round's rule; None while held leases hold its deadline (counted from their release)."""
        if r.deadline_from < self.members.released_at:
            r.deadline_from = self.members.released_at
        if now is not None and self.rule.round_timeout is not None and self.members.held:
            return None
        return now

    def may_pull(self, worker_id: str | None) -> bool:
        """May this worker pull its next weights now? Only SSP's bound says no; a pull without a worker id: yes."""
        return self.modes is None or worker_id is None or self.modes.may_pull(worker_id)

    @property
    def pull_floor(self) -> int | None:
        """What an SSP pull waits on besides the step: the slowest live clock (None: no SSP)."""
        return None if self.modes is None or self.modes.bound is None else self.modes.floor

    def ranks(self) -> tuple[int, ...]:
        """The ranks a pull names (sharding), sorted: the open round's, else the active members' (cached per
        membership change); once the job is done, those of before the first registration after the end."""
        if self.round is not None:
            return self.round.ranks
        if self._end_ranks is not None and self.done:
            return self._end_ranks
        if self._ranks[0] != self.members.changes:
            self._ranks = (self.members.changes, tuple(sorted(m.rank for m in self.members.active_by_id.values())))
        return self._ranks[1]

    def progress(self, now: float | None = None, but: str | None = None) -> Progress | None:
        """Where the open round stands (None: no round open), member ``but`` taken as gone; O(1), its ``awaited``
        names O(K) on first use."""
        r = self.round
        return None if r is None else self.rule.progress(r, self._rule_now(r, now), but)

    def wait_reason(self, now: float) -> str | None:
        """What the job waits for right now, for humans (None when done): :meth:`decide`'s why."""
        return self.decide(now).why()

    def decide(self, now: float) -> Decision:
        """What :meth:`tick` does now, after the leases, and why (:meth:`wait_reason`): the start rule, then the open
        round's rule. One decision for both, so the reason a user reads is the tick's."""
        if not self.initialized:
            return Decision(WAIT, lambda: "waiting for a worker to initialise the model")
        if self.done:
            return Decision(WAIT, lambda: None)
        if not self.started:
            return self._start_decision(now)
        decision, silent = self._round_decision(now), self.members.holds.get(SILENCE)
        if decision.action == WAIT and silent is not None:
            return Decision(WAIT, lambda: f"no worker heard from for {now - silent:.1f} s (every worker stopped, or "
                            "this PS was cut off from them or paused): no lease runs out and no round closes by its "
                            "deadline until one is")
        return decision

    def _ready_at(self, now: float) -> float | None:
        """Since when round 0 may start (the model in, ``min_workers`` active: the start's clocks count from then);
        None: not yet. :meth:`tick` keeps it in ``_ready_since``."""
        if not self.initialized or self.members.active_count < max(1, self.config.min_workers):
            return None
        return now if self._ready_since is None else self._ready_since

    def _start_decision(self, now: float) -> Decision:
        """Round 0 starts (the module docstring's Start) or waits, once ready (:meth:`_ready_at`)."""
        active, config, since = self.members.active_count, self.config, self._ready_at(now)
        if since is None:
            want = max(1, config.min_workers)
            return Decision(WAIT, lambda: f"waiting for workers: {active} of min_workers {want} registered")
        expected, waited = self.expected_workers(), now - since
        if expected:  # N, R or the deployment's count (once settled): wait for them, up to the start timeout
            settling = active >= expected and self._deployment_settling(now)
            if waited >= config.start_timeout_seconds or (active >= expected and not settling):
                return Decision(START, lambda: f"step 0 starts with {active} of {expected} expected workers")
            if settling:
                return Decision(WAIT, lambda: f"waiting for the deployment's worker count to settle: {self.deployed} "
                                f"resolved (PS_WORKERS_DNS), unchanged for {now - self.deployed_since:.1f} of "
                                f"{config.startup_grace_seconds:g} s (PS_STARTUP_GRACE_SECONDS)")
            source = "the deployment's workers, PS_WORKERS_DNS" if expected == self.deployed else \
                "PS_TOTAL_NUM_REPLICAS" if config.total_num_replicas else "PS_REPLICAS_TO_AGGREGATE"
            return Decision(WAIT, lambda: f"waiting for workers: {active} of {expected} expected ({source}) "
                            f"registered; step 0 starts with those there in {config.start_timeout_seconds - waited:.1f}"
                            " s at the latest (PS_START_TIMEOUT_SECONDS)")
        # a restored checkpoint's members, back at once; else the grace for more
        if (self.resume_expected and active >= self.resume_expected) or waited >= config.startup_grace_seconds:
            return Decision(START, lambda: f"step 0 starts with {active} worker(s)")
        return Decision(WAIT, lambda: "start-up grace: waiting for more workers before step 0")

    def _round_decision(self, now: float) -> Decision:
        """The started job: the open round closes (its rule's reason), recalls (stuck, with active members it does not
        count or that are done without a gradient: :meth:`_recall`) or waits; async/ssp and a decided round's later
        partitions wait."""
        if self.modes is not None:
            return Decision(WAIT, lambda: on_arrival.wait_reason(self, now))
        parts, r = self.parts, self.round
        if self.deciding:
            return Decision(WAIT, lambda: f"step {self.global_step} is decided: waiting for its contributors' "
                            f"partitions {[q for q in range(parts.plan.count) if q not in parts.closed]}")
        if r is None:
            return Decision(WAIT, lambda: "following another PS's rounds")  # (:meth:`follow`)
        rule_now = self._rule_now(r, now)
        p = self.rule.progress(r, rule_now)
        if p.reason is not None:
            return Decision(CLOSE, lambda: f"round {r.step} closes now ({p.reason})", p.reason)
        got, quorum, want = len(r.acc), self.rule.quorum, self.rule.replicas_to_aggregate
        if p.stuck:
            recalls = self.members.active_count > r.live or any(self.members.is_active(w) for w in r.lost)
            action = RECALL if recalls else WAIT
            if not got and not r.live:
                return Decision(action, lambda: "no live member in this round: waiting for a worker to (re)register")
            return Decision(action, lambda: f"R={want} is out of reach: {got} gradient(s) in, below min_replicas "
                            f"{quorum}: waiting for a worker to (re)register")
        timeout = self.rule.round_timeout
        if rule_now is not None and timeout is not None and now - r.deadline_from >= timeout:  # (below the quorum)
            return Decision(WAIT, lambda: f"round deadline passed {now - r.deadline_from - timeout:.1f} s ago but "
                            f"below the quorum: {got} of min_replicas {quorum} gradients")

        def waiting() -> str:
            names = [self.members.by_id[w].name for w in p.awaited]
            return (f"waiting for {p.needed} more gradient(s)" + (f" from {', '.join(names)}" if names else "")
                    + (f" (R={want} is out of reach: the round closes with what they bring)" if p.unreachable else ""))
        return Decision(WAIT, waiting)

    def tick(self, now: float) -> bool:
        """Advance time: the leases, then what :meth:`decide` says (start, close the round, recall). True if anything
        changed."""
        gone = self.members.expire(now, watch_silence=self.started and not self.done)
        self._out(now, [m.worker_id for m in gone])
        changed = bool(gone)
        if not self.started:
            self._ready_since = self._ready_at(now)
        decision = self.decide(now)
        if decision.action == START:
            self.started, self.started_at = True, now
            if self.modes is None:
                self._open_round(now)
            changed, decision = True, self.decide(now)  # the round just opened, under its rule in this tick too
        if decision.action == CLOSE:
            self._decided(now, *self.round.close(now, decision.close_reason))
            changed = True
        elif decision.action == RECALL:
            changed |= self._recall(now)
        if self.started:
            self.rates.sample(now, (self.rounds_closed, self.examples, self.gradients_applied))
        if changed:
            self._changed()
        return changed

    def _recall(self, now: float) -> bool:
        """The stuck round's recall (the module docstring): expire the active members it does not count, or done
        without contributing, to register again into it. O(K), only then."""
        r = self.round
        recalled = [m for m in self.members.active() if not r.counts(m.worker_id) or m.worker_id in r.lost]
        for m in recalled:
            self.members.recall(m, now)
            r.member_changed(m.worker_id, True, False)
        self.recalls += bool(recalled)
        return bool(recalled)

    def _open_round(self, now: float) -> None:
        if self.done:
            self.round = self.parts = None
            return
        eligible = {m.worker_id: m.rank for m in self.members.active()}
        self.parts = RoundParts.open(self.plan, self.config.aggregation)
        self.round = Round(self.global_step, now, eligible, self.parts.accs[0], self.members.is_active,
                           lambda w: self.members.by_id[w].name, replicas=self.rule.replicas_to_aggregate)

    def followed_round(self) -> RoundParts:
        """The round a sharded follower is told of (:mod:`ps_service.sharding.parts`): open, or opened now (the
        coordinator decides it)."""
        if self.parts is None:
            self.parts = RoundParts.open(self.plan, self.config.aggregation)
        return self.parts

    @property
    def plan(self) -> Plan | None:
        """A sync round's partitions (:attr:`partition_bytes`; one partition: the whole model, as in async/ssp); None
        before the model."""
        if self._plan is None and self.weights is not None:
            self._plan = partition_plan(spec_of(self.weights), self.partition_bytes if self.modes is None else 0)
        return self._plan

    @property
    def partitions(self) -> Plan | None:
        """The partitions of a sync round, None: one, the whole model (async/ssp: always)."""
        p = self.plan
        return None if p is None or p.whole else p

    @property
    def deciding(self) -> bool:
        """The open round is decided (its partition 0 closed) and its later partitions are still closing."""
        return self.parts is not None and self.parts.contributors is not None  # (parts.decided inline: 2 moves fewer)

    def _decided(self, now: float, rec: RoundRecord, total, n: int) -> None:
        """The open round's rule is met (:meth:`Round.close`: its record, and partition 0's sum taken with it, None
        when every push was skipped, NaN/Inf, or the sum overflows; the mean's n): it is decided, partition 0 closes
        at once (:meth:`_apply`: no call out of this file between the push and its update) and the others as their
        frames are in, the round with its last (:meth:`close_parts`)."""
        r, parts = self.round, self.parts
        if self.told is not None:
            self.told.append(Decided(rec, tuple(a.worker_id for a in rec.contributors if a.worker_id in parts.lost)
                                     if parts.lost else ()))
        parts.record = rec
        parts.closed.add(0)
        self._apply(parts, 0, total, n)
        contributors = {a.worker_id: (r.eligible[a.worker_id], a.worker_id) for a in rec.contributors}  # their keys
        self.close_parts(now, parts.decide(contributors, total is not None))

    def _lose(self, now: float, worker_ids) -> None:
        """Members that will bring no more frames of the open round (expired, left, came back): the partitions that
        waited for them close without them; a contributor of the decided round is told first (:class:`Lost`)."""
        parts = self.parts
        if parts.decided and self.told is not None:
            for w in worker_ids:
                if w in parts.contributors and w not in parts.lost:
                    self.told.append(Lost(self.global_step, w))
        self.close_parts(now, [q for w in worker_ids for q in parts.drop(w)])

    def close_parts(self, now: float, qs) -> None:
        """Close the open round's partitions ``qs`` once it is decided (:meth:`_apply`); the round closes with its
        last: ``global_step += 1``, and for this core's own round its record and the next round (:meth:`_finish`; a
        round it follows: sharding/parts.py). ``on_partition`` after a call that leaves a round of several
        partitions decided or closed, or a followed one."""
        parts = self.parts
        for q in dict.fromkeys(qs):
            if q not in parts.closed:
                self._apply(parts, q, *parts.close(q))
        if parts.done:
            self.parts = None
            self._stepped(len(parts.contributors))
            if self.round is not None:  # (None: followed)
                self._finish(now, self.round, parts.record)
        if self.on_partition is not None and parts.decided and (not parts.plan.whole or self.round is None):
            self.on_partition()

    def _apply(self, parts: RoundParts, q: int, total, n: int) -> None:
        """Partition ``q`` of the round decided (:attr:`RoundParts.record`) closed with ``total`` (None: nothing to
        apply) / ``n``: given to the :class:`Replica` (a primary's rounds, of one partition: a standby of a
        partitioned PS is not built), then the update of its pieces (the round's first advances the iteration)."""
        if self.replica is not None:
            self.replica.on_step(total, n, parts.record.aggregated)
        if total is not None:
            self.update(total, consume=True, mean_of=n, advance=not parts.advanced,
                        pieces=None if parts.plan.whole else parts.plan.partitions[q])  # (whole: sparse kept)
            parts.advanced = True

    def _finish(self, now: float, r: Round, rec: RoundRecord) -> None:
        """The round closed and stepped: its record, the next round."""
        if rec.loss is not None:
            self.loss_history.append((r.step, rec.loss))
        self.rounds.append(rec)
        self.last_round = r
        self._open_round(now)
        # the counters moved: sampled here too, not only at the ticker's ticks (at most every 0.1 s: core/rates.py)
        self.rates.sample(now, (self.rounds_closed, self.examples, self.gradients_applied))

    # ---- pushes ------------------------------------------------------------------------
    def admit(self, worker_id: str | None) -> Member | None:
        """The refusals before a push's tensors are read (docs/protocol.md's order): ``not_initialized``,
        ``unknown_worker``, ``not_active``; ``worker_id`` None: the model only (a sharded PS's held pieces). The
        active member (None: ``worker_id`` None)."""
        if self.weights is None:  # (not self.initialized)
            raise CoreError("not_initialized", "the model is not initialised yet (PUT /v1/model)")
        if worker_id is None:
            return None  # (the dict first: a push's path calls into membership only to refuse)
        return self.members.active_by_id.get(worker_id) or self.members.active_member(worker_id)

    def claim(self, worker_id: str, step: int, overdue: bool = False) -> bool:
        """May the tensors of ``worker_id``'s push for ``step`` be read now (:mod:`ps_service.core.intake`)? True: read
        them, then :meth:`push` (or :meth:`release`); False: wait until :meth:`readers` names the worker. ``overdue``:
        read it now, out of turn if need be. Fixed R: the push counts here, at its head (:meth:`_head`), or is late
        from here once read on the late lane (``Round.lose``: it stays late, a retry too)."""
        m = self.members.active_by_id.get(worker_id)
        if m is None or self.weights is None:
            return True  # refused once read, as ever
        if self.modes is not None:
            return self.intake.claim(worker_id, overdue=overdue)  # no order: one push read at a time
        if self.round is None:
            return True
        status = self._head(m, step)
        if status is PushStatus.ACCEPTED:
            return self.intake.claim(worker_id, self.round.turns, overdue)
        # elastic: read at once; fixed R: on the late lane (late, stale or duplicate)
        read = not self.round.replicas or self.intake.claim(worker_id, overdue=overdue, late=True)
        if read and status is PushStatus.LATE and step == self.global_step and self.round.lose(worker_id):
            self._changed()
        return read

    def hold(self, worker_id: str, step: int) -> bool:
        """A sharded PS's coordinator read the pieces ``worker_id`` holds for ``step``: keep them (True) or not (False:
        late). Fixed R: the hold is the push's head (:meth:`_head`); after R heads it is late (``Round.lose``).
        Elastic, or not the open round: kept, nothing counted."""
        r, m = self.round, self.members.active_by_id.get(worker_id)
        if r is None or r.replicas is None or m is None or step != self.global_step:
            return True
        if self._head(m, step) is not PushStatus.LATE:
            return True  # its head counts; or a retry of a push the round took (duplicate): as before
        if r.lose(worker_id):
            self._changed()
        return False

    def _head(self, m: Member, step: int) -> PushStatus:
        """What a push of ``step`` by ``m`` is now (sync, a round open); fixed R, one the round accepts counts at its
        head from here (a place of R: :meth:`Round.head`), given back by :meth:`release` if it fails."""
        status = self.classify(m, step, True)
        if status is PushStatus.ACCEPTED and self.round.head(m.worker_id):
            self._changed()  # the turns may have moved (R heads came: who else may be read is known)
        return status

    def readers(self) -> tuple[str, ...] | None:
        """The workers whose waiting push :meth:`claim` would let be read now (None: the longest waiting; async/ssp)."""
        if self.modes is not None:
            return () if self.intake.reading else None
        r = self.round
        turns = () if r is None or self.deciding else r.turns()
        return turns + self.intake.late_readers() if self.rule.replicas_to_aggregate else turns

    def release(self, worker_id: str) -> None:
        """The claim of ``worker_id``'s push ends (taken, or its read failed): the next may begin. Fixed R: a head whose
        push the round did not take gives its place back."""
        released = self.intake.release(worker_id)
        r = self.round  # (its counts, hence its close, do not depend on the heads: only who may be read next does)
        if (r is not None and r.unhead(worker_id)) or released:
            self._changed()

    def withdraw(self, worker_id: str) -> None:
        """A push's wait for its turn ended unclaimed: fixed R, its head gives its place back (unless being read)."""
        self.intake.queued.pop(worker_id, None)
        if worker_id not in self.intake.reading and worker_id not in self.intake.refusing:
            self.release(worker_id)

    def push(self, req: PushRequest, now: float) -> PushResult:
        """Check, classify, count and (if accepted) take a push; its tensors are the core's from now on."""
        m = self.admit(req.worker_id)
        if req.step > self.global_step:
            raise CoreError("future_step", f"step {req.step} is ahead of the global step {self.global_step}")
        if req.partition:
            return self._frame(m, req, now)
        if self.modes is None and req.step == self.global_step and self.round is None and not self.done:
            raise CoreError("not_started", "training has not started (waiting for workers)")
        p = self.partitions
        finite = validate(self.weights if p is None else p.split(self.weights, 0), req.tensors,  # every check first
                          self.config.nonfinite_policy, check_finite=not req.finite_checked)
        if self.modes is not None:  # async/ssp: classify; applied below
            verdict, grads = on_arrival.classify(self, m, req, finite, now)
            status = verdict.status
        else:
            status, grads = self.classify(m, req.step, finite), req.tensors
        self.members.renew(m, now)  # active: checked above
        m.phase_reports += 1
        for k in m.phase_sums:
            m.phase_sums[k] += getattr(req.timings, k)
        if req.loss is not None:
            m.last_loss = req.loss
        value = status.value
        self.push_counts[value] += 1
        m.pushes[value] = m.pushes.get(value, 0) + 1
        if status is not PushStatus.DUPLICATE:
            m.recent[req.step] = value
            if len(m.recent) > RECENT_STEPS:
                del m.recent[min(m.recent)]
        before = self.global_step
        if self.modes is not None:
            on_arrival.take(self, req, verdict, grads)
        else:
            self._take(m, req, status, now, grads)
        self._changed()
        return PushResult(status, self.global_step, self.global_step != before)

    def _frame(self, m: Member, req: PushRequest, now: float) -> PushResult:
        """A later partition's frame of a push (docs/partitions.md), checked as a push is: it joins its partition when
        the push's partition 0 was accepted and the partition waits for it; else dropped with the push's status."""
        p, parts, g, q = self.partitions, self.parts, self.global_step, req.partition
        if p is None or not 0 < q < p.count:
            raise CoreError("tensor_mismatch", f"partition {q}: the model has {1 if p is None else p.count}")
        seen = m.recent.get(req.step)
        if seen is None:
            raise CoreError("not_started", f"partition {q} of step {req.step} came before the push's partition 0")
        if not validate(p.split(self.weights, q), req.tensors, self.config.nonfinite_policy,
                        check_finite=not req.finite_checked):
            raise CoreError("nonfinite_gradient", f"partition {q} of step {req.step} is not finite, its partition 0 "
                            "was: a push is skipped whole or not at all")
        self.members.renew(m, now)
        status = PushStatus(seen)
        if status is PushStatus.ACCEPTED:
            if req.step != g or parts is None:
                status = PushStatus.STALE  # its round closed without this partition (the member was lost)
            elif (refusal := parts.refusal(q, m.worker_id)) is not None:
                status = PushStatus(refusal)  # duplicate, or late: the partition does not wait for it
            else:  # (summed now, or once the round is decided)
                self.close_parts(now, parts.frame(q, m.worker_id, self.round.eligible[m.worker_id], req.tensors))
        self._changed()
        return PushResult(status, self.global_step, self.global_step != g)

    def classify(self, m: Member, step: int, finite: bool) -> PushStatus:
        """What a push of ``step`` by active member ``m`` would be now (sync; ``finite``: its values are), changing
        nothing."""
        g, wid = self.global_step, m.worker_id
        if step in m.recent:
            return PushStatus.DUPLICATE
        if step == g and self.done:  # PS_MAX_STEPS reached: no round will take it
            return PushStatus.STALE
        if step == g and self.deciding:  # decided: its contributors are fixed
            return PushStatus.LATE
        r = self.round  # (r.counts(wid), read inline: 2 moves between files fewer a push, tests/test_trace.py)
        if step == g and wid in r.eligible and wid not in r.gone and (r.replicas is None or r.may_head(wid)):
            return PushStatus.ACCEPTED if finite else PushStatus.SKIPPED  # NaN/Inf under policy skip: skipped
        if step == g or (step == g - 1 and self.last_round is not None and wid in self.last_round.eligible):
            return PushStatus.LATE
        return PushStatus.STALE

    def apply_round(self, total: Mapping[str, np.ndarray] | None, mean_of: int, contributors: int) -> None:
        """Apply a round decided and summed elsewhere (a hot standby: its primary's, :class:`Replica`): one optimizer
        step with ``total`` (None: it overflowed, nothing applied) / ``mean_of``, then ``global_step += 1`` and the
        counters."""
        if total is not None:
            self.update(total, consume=True, mean_of=mean_of)
        self._stepped(contributors)

    def _stepped(self, contributors: int) -> None:
        """A round is applied (closed here: :meth:`close_parts`; or decided elsewhere): ``global_step += 1`` and the
        counters."""
        self.global_step += 1
        self.rounds_closed += 1
        self.gradients_applied += contributors
        self._changed()

    def follow(self) -> None:
        """This core follows another's decisions (a sharded follower, a hot standby): no membership, no start-up."""
        self.started = True

    def adopt(self, state: Mapping[str, Any], now: float) -> None:
        """Become ``state`` (:meth:`export_state` data) live, as a PS restored from it would start (a hot standby's
        state transfer, its takeover): model, optimizer and step exactly the state's (:meth:`rewind`), its members
        back as expired, its async/ssp clocks; not started."""
        self.rewind(state, now)
        self.members = Membership(self.config.lease_seconds)
        self.modes = BoundedStaleness.for_mode(self.config.mode, self.config.ssp_staleness, self.config.max_staleness)
        self._ranks = (-1, ())
        self._load_members(state, now)

    def _take(self, m: Member, req: PushRequest, status: PushStatus, now: float, grads) -> None:
        r, wid, at = self.round, m.worker_id, Arrival(m.worker_id, m.name, m.rank, now)
        accepted, g = status is PushStatus.ACCEPTED, self.global_step
        # skipped (NaN/Inf): its part in the round is over, the round does not wait for it
        if accepted or (status is PushStatus.SKIPPED and req.step == g and wid in r.eligible and wid not in r.acc):
            if accepted:  # (a member that came back and joined a stuck round: its frames)
                self.parts.lost.discard(wid)
            # the round's rule then (leases and start-up are the tick's)
            p = r.accept(at, grads if accepted else None, req.loss, req.num_examples, self.rule, self._rule_now(r, now))
            if accepted:
                self.examples += req.num_examples or 0
        else:
            if status is PushStatus.LATE:  # its round lists it: the open one, or the one that just closed (its record)
                (r if req.step == g else self.last_round).late.append(at)
                if req.step == g:
                    r.lose(wid)  # fixed R: it came after R heads (a push not claimed: here is its head)
            return
        if p.closed is not None:  # the round's rule closed it (Round.accept)
            self._decided(now, *p.closed)
        elif p.stuck:
            self.tick(now)  # recalls
