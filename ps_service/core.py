"""The PS's sans-IO core: model, optimizer, sync barrier and membership in one state machine.

Nothing here does I/O or reads a clock: every entry point takes ``now`` (seconds,
monotonic) and returns what happened; the FastAPI routes in ``app.py`` are thin
drivers and the tests drive it by simulation.

Barrier semantics (TensorFlow's SyncReplicasOptimizer, done right; docs/protocol.md):

- A round ``g`` is open while ``global_step == g``. Its *eligible* set is fixed
  when it opens: the active members at that moment (joins take effect at the
  next boundary; a member that registers while the open round has nobody alive
  to wait for becomes eligible at once). A member that expired or left and
  registers again under its name keeps its id and rank and counts as a join: the
  round it dropped out of does not wait for it again.
- Leases: a member silent for ``lease_seconds`` is expired by ``tick`` and stops
  being waited for at once (round record reason ``membership``).
- ``replicas_to_aggregate`` R unset (elastic, the default): the round closes when
  every eligible member that is still active has pushed. R set: it closes at the
  first R accepted gradients; with more workers than R (backups, N > R) the others
  get ``late``. A round past ``round_timeout`` closes with what it has if that is at
  least ``min_replicas``.
- Push classification for worker w and step s: a second push of (w, s) is
  ``duplicate``; s == g from an eligible w is ``accepted``; s == g from a
  non-eligible w, or s == g-1 from a member of round g-1 that missed it, is
  ``late``; anything older is ``stale``. Only ``accepted`` gradients are applied.
- A gradient with NaN/Inf is refused (422), or under ``nonfinite_policy="skip"`` answered
  ``skipped``: counted, never applied, and the round stops waiting for that worker (a round
  with only skipped pushes closes without an update).
- Closing: gradients summed in rank order (bit-reproducible whatever the arrival
  order), divided by their count (``aggregation="mean"``) or not (``"sum"``), one
  optimizer step, ``global_step += 1``, next round opens.
- Start: round 0 opens once the model is initialised and ``min_workers`` are
  active, after ``startup_grace_seconds`` (at once when the expected number,
  N or R, is reached). ``max_steps``: at that step the job is done.
"""
from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, Mapping

import numpy as np

from ps_service.membership import ACTIVE, EXPIRED, LEFT, Member, Membership
from ps_service.optimizers import HYPERPARAMS, Optimizer, normalize_spec
from ps_service.stragglers import straggler
from shared.codec import FLOAT_DTYPES, dtype_name
from shared.errors import ProtocolError, unprocessable
from shared.protocol import JobState, ModelInit, PushRequest, PushStatus

RECENT_STEPS = 16  # per-worker memory of pushed steps, for duplicate detection
FOLDED: Mapping[str, np.ndarray] = MappingProxyType({})  # a gradient already summed into its round's acc


def _all_finite(g: np.ndarray) -> bool:
    """No NaN/Inf in ``g``. A finite sum proves it (NaN and Inf propagate) without a temporary
    array; only an overflowing or non-finite sum takes the element-wise check."""
    with np.errstate(all="ignore"):
        if g.dtype.itemsize >= 4 and np.isfinite(g.sum(dtype=g.dtype)):
            return True
    return bool(np.isfinite(g).all())


@dataclass(frozen=True)
class CoreConfig:
    replicas_to_aggregate: int | None = None
    total_num_replicas: int | None = None
    min_workers: int = 1
    startup_grace_seconds: float = 2.0
    max_steps: int | None = None
    aggregation: str = "mean"
    lease_seconds: float = 10.0
    round_timeout_seconds: float | None = None
    min_replicas: int = 1
    #: optimizer settings given to the PS; they win over what the model's initialiser brings
    optimizer_overrides: Mapping[str, Any] = field(default_factory=dict)
    #: "reject" (422) or "skip" (counted, not applied) for NaN/Inf gradients
    nonfinite_policy: str = "reject"
    max_rounds_kept: int = 1000


@dataclass
class Round:
    step: int
    opened_at: float
    eligible: dict[str, int]  # worker_id -> rank
    grads: dict[str, Mapping[str, np.ndarray]] = field(default_factory=dict)  # by worker_id, arrival order
    arrivals: list[dict] = field(default_factory=list)
    late: list[dict] = field(default_factory=list)
    losses: list[tuple[float, int]] = field(default_factory=list)
    #: eligible members that came back (re-registered) mid-round: not waited for, they rejoin at the next boundary
    gone: set[str] = field(default_factory=set)
    #: eligible members whose push was skipped (NaN/Inf, policy skip): done for this round, nothing applied
    skipped: set[str] = field(default_factory=set)
    examples: int = 0  # examples behind the accepted gradients
    #: the rank-order prefix of ``grads`` already summed into ``acc``; their arrays are released (FOLDED)
    folded: list[str] = field(default_factory=list)
    acc: dict[str, np.ndarray] | None = None
    #: workers whose gradient buffers belong to the core (a fresh request body): summed into in place
    owned: set[str] = field(default_factory=set)


@dataclass(frozen=True)
class PushResult:
    status: PushStatus
    step: int  # the PS's global step after the push
    closed: bool = False  # this push closed a round


class ParameterServerCore:
    def __init__(self, config: CoreConfig) -> None:
        self.config = config
        self.members = Membership(config.lease_seconds)
        self.weights: dict[str, np.ndarray] | None = None
        self.optimizer: Optimizer | None = None
        self.global_step = 0
        self.started = False
        self.round: Round | None = None
        self.last_round: Round | None = None
        self.rounds: deque[dict] = deque(maxlen=config.max_rounds_kept)
        self.push_counts = {s.value: 0 for s in PushStatus} | {"skipped": 0}
        self.loss_history: deque[tuple[int, float]] = deque(maxlen=10000)
        self.examples = 0
        self.version = 0  # bumps on every change a waiting pull may care about
        self._ready_since: float | None = None
        self.started_at: float | None = None
        #: after a restore: how many members the checkpoint had active (start at once when they are back)
        self.resume_expected: int | None = None

    # ---- model -------------------------------------------------------------------------
    @property
    def initialized(self) -> bool:
        return self.weights is not None

    @property
    def done(self) -> bool:
        return self.config.max_steps is not None and self.global_step >= self.config.max_steps

    def optimizer_spec(self, brought: Mapping[str, Any]) -> dict[str, Any]:
        """The spec the PS runs: what the initialiser brought, PS settings on top."""
        spec = dict(brought)
        overrides = dict(self.config.optimizer_overrides)
        if "name" in overrides and overrides["name"] != spec.get("name"):
            spec = {}  # another optimizer: the brought hyper-parameters do not apply
        spec.update(overrides)
        allowed = {"name", "learning_rate", *HYPERPARAMS.get(spec.get("name", "sgd"), {})}
        return normalize_spec({k: v for k, v in spec.items() if k in allowed or k not in overrides})

    def init_model(self, init: ModelInit, now: float) -> None:
        """First caller wins; later ones get 409 and must pull."""
        if self.initialized:
            raise ProtocolError(409, "already_initialized", f"the model is initialised (global step {self.global_step}); pull it")
        for name, arr in init.tensors.items():
            if dtype_name(arr.dtype) not in FLOAT_DTYPES:
                raise unprocessable("bad_dtype", f"tensor {name!r}: model weights must be floating point")
        spec = self.optimizer_spec(init.optimizer)
        weights = {k: np.array(v, copy=True) for k, v in sorted(init.tensors.items())}
        self.optimizer = Optimizer(spec, weights)
        self.weights = weights
        self._changed()
        self.tick(now)

    def restore(self, weights: dict[str, np.ndarray], spec: Mapping[str, Any], iterations: int,
                slots: Mapping[str, Mapping[str, np.ndarray]], global_step: int) -> None:
        """Load a checkpointed model (before any worker talks to this PS)."""
        self.weights = {k: np.array(v, copy=True) for k, v in sorted(weights.items())}
        self.optimizer = Optimizer(spec, self.weights)
        self.optimizer.load_state(iterations, slots)
        self.global_step = int(global_step)
        self._changed()

    def export_state(self) -> dict[str, Any]:
        """What a checkpoint keeps, as plain data with copied arrays (safe to encode off the event loop):
        weights, optimizer (spec, iterations, slots), global step, members (ids, names, ranks), config."""
        if not self.initialized:
            raise ProtocolError(409, "not_initialized", "nothing to checkpoint before the model is initialised")
        opt = self.optimizer
        return {
            "global_step": self.global_step,
            "weights": {k: v.copy() for k, v in self.weights.items()},
            "optimizer": {"spec": dict(opt.spec), "iterations": opt.iterations,
                          "slots": {s: {k: v.copy() for k, v in t.items()} for s, t in opt.slots.items()}},
            "members": [{"worker_id": m.worker_id, "name": m.name, "rank": m.rank, "state": m.state,
                         "registrations": m.registrations} for m in self.members.all()],
            "config": {f: dict(v) if isinstance(v, Mapping) else v for f, v in vars(self.config).items()},
        }

    def import_state(self, state: Mapping[str, Any], now: float) -> None:
        """Load :meth:`export_state`'s data (before any worker talks to this PS). The model counts as
        initialised (``PUT /v1/model`` gets 409); members come back expired (left ones stay left), so
        each worker registers again under its name, gets its id and rank back, and pulls."""
        opt = state["optimizer"]
        self.restore(state["weights"], opt["spec"], opt["iterations"], opt["slots"], state["global_step"])
        for rec in state["members"]:
            state_ = LEFT if rec["state"] == LEFT else EXPIRED
            m = Member(str(rec["worker_id"]), str(rec["name"]), int(rec["rank"]), state_, now, now, now,
                       registrations=int(rec.get("registrations", 1)))
            self.members.by_id[m.worker_id] = m
            self.members.by_name[m.name] = m
        self.resume_expected = sum(1 for rec in state["members"] if rec["state"] == ACTIVE) or None
        self._changed()

    # ---- membership --------------------------------------------------------------------
    def register(self, name: str, now: float) -> tuple[Member, int]:
        """(member, start_step): the step whose weights the worker should pull first.

        A member coming back (it had expired or left: a restarted process) keeps its
        id and rank and rejoins at the next round boundary, like a newcomer: the open
        round does not wait for it again.
        """
        prev = self.members.by_name.get(name)
        returning = prev is None or not prev.active
        m, _ = self.members.register(name, now)
        wid, start = m.worker_id, self.global_step
        r = self.round
        if r is not None:
            if returning and wid in r.eligible and wid not in r.grads and self._alive_eligible(r, but=wid):
                r.gone.add(wid)  # came back mid-round: the round does not wait for it again
            if wid in r.grads:
                start = self.global_step + 1  # its gradient for this round is in
            elif wid not in r.eligible or wid in r.gone:
                if self._alive_eligible(r, but=wid):
                    start = self.global_step + 1  # joins at the next round boundary
                else:  # nobody alive to wait for: join this round
                    r.gone.discard(wid)
                    r.eligible[wid] = m.rank
        self._changed()
        self.tick(now)
        return m, start

    def leave(self, worker_id: str, now: float) -> Member:
        m = self.members.leave(worker_id, now)
        self._changed()
        self.tick(now)
        return m

    def heartbeat(self, worker_id: str, now: float) -> Member:
        return self.members.touch(worker_id, now)

    def _alive_eligible(self, r: Round, but: str | None = None) -> list[str]:
        """Eligible members the round still counts: active, not come back mid-round (and not ``but``)."""
        return [w for w in r.eligible if w != but and w not in r.gone and self.members.by_id[w].state == ACTIVE]

    # ---- the barrier -------------------------------------------------------------------
    def state(self) -> JobState:
        if not self.initialized:
            return JobState.WAITING_FOR_MODEL
        if self.done:
            return JobState.DONE
        return JobState.TRAINING if self.started else JobState.WAITING_FOR_WORKERS

    def expected_workers(self) -> int | None:
        return self.config.total_num_replicas or self.config.replicas_to_aggregate

    def needed(self, r: Round) -> int:
        """Gradients the open round still waits for before it closes."""
        if self.config.replicas_to_aggregate:
            return max(0, self.config.replicas_to_aggregate - len(r.grads) - len(r.skipped))
        return sum(1 for w in self._alive_eligible(r) if w not in r.grads and w not in r.skipped)

    def wait_reason(self, now: float) -> str | None:
        """What the job waits for right now, for humans (None when done): e.g. why a round waits below its quorum."""
        if not self.initialized:
            return "waiting for a worker to initialise the model"
        if self.done:
            return None
        if not self.started:
            active = len(self.members.active())
            want = max(1, self.config.min_workers)
            if active < want:
                return f"waiting for workers: {active} of min_workers {want} registered"
            return "start-up grace: waiting for more workers before step 0"
        r = self.round
        pushed, quorum = len(r.grads), max(1, self.config.min_replicas)
        alive = self._alive_eligible(r)
        if not alive and not pushed:
            return "no live member in this round: waiting for a worker to (re)register"
        timeout = self.config.round_timeout_seconds
        if timeout is not None and now - r.opened_at >= timeout and pushed < quorum:
            return (f"round deadline passed {now - r.opened_at - timeout:.1f} s ago but below the quorum: "
                    f"{pushed} of min_replicas {quorum} gradients")
        names = sorted(self.members.by_id[w].name for w in alive if w not in r.grads)
        return f"waiting for {self.needed(r)} more gradient(s)" + (f" from {', '.join(names)}" if names else "")

    def tick(self, now: float) -> bool:
        """Advance time: leases, start-up, round deadline. True if anything changed."""
        changed = bool(self.members.expire(now))
        if not self.started and self.initialized and not self.done:
            active = len(self.members.active())
            if active >= max(1, self.config.min_workers):
                if self._ready_since is None:
                    self._ready_since = now
                expected = self.expected_workers() or self.resume_expected
                if (expected and active >= expected) or now - self._ready_since >= self.config.startup_grace_seconds:
                    self.started = True
                    self.started_at = now
                    self._open_round(now)
                    changed = True
            else:
                self._ready_since = None
        r = self.round
        if r is not None:
            if (r.grads or r.skipped) and self.needed(r) == 0:
                everyone = self.config.replicas_to_aggregate or len(r.grads) == len(r.eligible)
                self._close(now, "full" if everyone else "membership")  # membership: an eligible one expired or left
                changed = True
            elif (self.config.round_timeout_seconds is not None and now - r.opened_at >= self.config.round_timeout_seconds
                  and len(r.grads) >= max(1, self.config.min_replicas)):
                self._close(now, "deadline")
                changed = True
        if changed:
            self._changed()
        return changed

    def _open_round(self, now: float) -> None:
        if self.done:
            self.round = None
            return
        self.round = Round(self.global_step, now, {m.worker_id: m.rank for m in self.members.active()})

    def validate_gradients(self, grads: Mapping[str, np.ndarray]) -> bool:
        """Raise 422 unless ``grads`` matches the model; False if non-finite and policy is skip."""
        assert self.weights is not None
        missing = self.weights.keys() - grads.keys()
        extra = grads.keys() - self.weights.keys()
        if missing or extra:
            name = sorted(missing or extra)[0]
            what = "missing" if missing else "not in the model"
            raise unprocessable("tensor_mismatch", f"tensor {name!r} is {what}")
        finite = True
        for name, g in grads.items():
            w = self.weights[name]
            if g.shape != w.shape:
                raise unprocessable("tensor_mismatch", f"tensor {name!r} has shape {list(g.shape)}, the model has {list(w.shape)}")
            if dtype_name(g.dtype) not in FLOAT_DTYPES:
                raise unprocessable("tensor_mismatch", f"tensor {name!r}: gradients must be floating point")
            if finite and not _all_finite(g):
                finite = False
                if self.config.nonfinite_policy == "reject":
                    raise unprocessable("nonfinite_gradient", f"tensor {name!r} has NaN or Inf values")
        return finite

    def push(self, req: PushRequest, now: float, owned: bool = False) -> PushResult:
        """Classify and count a push; ``owned``: its tensors are the core's to overwrite (aggregation in place)."""
        if not self.initialized:
            raise ProtocolError(409, "not_initialized", "the model is not initialised yet (PUT /v1/model)")
        m = self.members.get(req.worker_id)
        if m.state != ACTIVE:
            raise ProtocolError(409, "not_active", f"worker {m.name!r} is {m.state}; register again (POST /v1/workers)")
        if req.step > self.global_step:
            raise unprocessable("future_step", f"step {req.step} is ahead of the global step {self.global_step}")
        if req.step == self.global_step and self.round is None:
            raise ProtocolError(409, "not_started", "no round is open (waiting for workers, or done)")
        finite = self.validate_gradients(req.tensors)  # all checks before any state changes
        self.members.touch(req.worker_id, now)
        m.phase_reports += 1
        for k in ("fetch", "compute", "push"):
            m.phase_sums[k] += getattr(req.timings, k)
        if req.loss is not None:
            m.last_loss = req.loss
        if req.step in m.recent:
            status = PushStatus.DUPLICATE
        elif not finite:
            status = PushStatus.SKIPPED
        elif req.step == self.global_step and m.worker_id in self.round.eligible and m.worker_id not in self.round.gone:
            status = PushStatus.ACCEPTED
        elif req.step == self.global_step or (
            req.step == self.global_step - 1 and self.last_round is not None and m.worker_id in self.last_round.eligible
        ):
            status = PushStatus.LATE
        else:
            status = PushStatus.STALE
        label = status.value
        self.push_counts[label] += 1
        m.pushes[label] = m.pushes.get(label, 0) + 1
        if status is not PushStatus.DUPLICATE:
            m.recent[req.step] = label
            if len(m.recent) > RECENT_STEPS:
                del m.recent[min(m.recent)]
        entry = {"worker_id": m.worker_id, "name": m.name, "rank": m.rank, "at": now}
        closed = False
        if status is PushStatus.ACCEPTED:
            r = self.round
            r.grads[m.worker_id] = req.tensors
            if owned:
                r.owned.add(m.worker_id)
            self._fold(r)
            r.arrivals.append(entry)
            if req.loss is not None:
                r.losses.append((req.loss, req.num_examples or 1))
            self.examples += req.num_examples or 0
            r.examples += req.num_examples or 0
            before = self.global_step
            self.tick(now)
            closed = self.global_step != before
        elif status is PushStatus.LATE:
            target = self.round if req.step == self.global_step else self.last_round
            if target is not None:
                target.late.append(entry)
        elif status is PushStatus.SKIPPED and req.step == self.global_step and m.worker_id in self.round.eligible \
                and m.worker_id not in self.round.grads:
            self.round.skipped.add(m.worker_id)  # its part in the round is over: do not wait for it
            before = self.global_step
            self.tick(now)
            closed = self.global_step != before
        self._changed()
        return PushResult(status, self.global_step, closed)

    def aggregate(self, r: Round) -> dict[str, np.ndarray]:
        """Sum (then mean) the round's gradients in rank order, in the weights' dtype.

        ``acc = g[first]; acc += g[next] ...; acc /= n`` element-wise in that order whatever
        the arrival order, so the result is bit-reproducible; part of the sum may already be
        done (:meth:`_fold`). Consumes the round's gradients."""
        order = sorted(r.grads, key=self._rank_order(r))
        if order[:len(r.folded)] != r.folded:
            raise AssertionError(f"round {r.step}: summed {r.folded} is not a rank-order prefix of {order}")
        for wid in order[len(r.folded):]:
            self._add(r, wid)
        out, r.acc = r.acc, None
        if self.config.aggregation == "mean" and len(order) > 1:
            for acc in out.values():
                acc /= len(order)
        return out

    @staticmethod
    def _rank_order(r: Round):
        """Sort key of the round's members: rank, then id (a newcomer can reuse the rank of a
        member that left mid-round, so ranks alone may tie)."""
        return lambda wid: (r.eligible[wid], wid)

    def _fold(self, r: Round) -> None:
        """Sum the gradients already in while the round fills: the longest run of eligible ranks,
        lowest first, that have all pushed, and release their buffers (elastic mode: the accepted
        set is then a superset of the run, in the same order; with R set, it is not known yet)."""
        if self.config.replicas_to_aggregate:
            return
        for wid in sorted(r.eligible, key=self._rank_order(r))[len(r.folded):]:
            if wid not in r.grads:
                return
            self._add(r, wid)

    def _add(self, r: Round, wid: str) -> None:
        grads = r.grads[wid]
        if r.acc is None:
            r.acc = {name: self._own(grads[name], w.dtype, wid in r.owned) for name, w in self.weights.items()}
        else:
            for name, acc in r.acc.items():
                np.add(acc, grads[name], out=acc, casting="same_kind")
        r.folded.append(wid)
        r.grads[wid] = FOLDED  # the key says who contributed; the arrays are released

    @staticmethod
    def _own(g: np.ndarray, dtype: np.dtype, owned: bool) -> np.ndarray:
        """``g`` as a writable array of ``dtype`` to sum into: itself when the core owns it, else a copy."""
        if owned and g.dtype == dtype and g.flags.c_contiguous:
            try:
                g.flags.writeable = True
                return g
            except ValueError:
                pass
        return np.array(g, dtype=dtype, copy=True)

    def _close(self, now: float, reason: str) -> None:
        r = self.round
        if r.grads:  # none when every contribution was skipped (NaN/Inf): the step passes without an update
            self.optimizer.apply(self.weights, self.aggregate(r), consume=True)
        loss = None
        if r.losses:
            total = sum(n for _, n in r.losses)
            loss = sum(l * n for l, n in r.losses) / total if total else None
            if loss is not None and not math.isfinite(loss):
                loss = None  # huge reported losses can overflow the mean
            if loss is not None:
                self.loss_history.append((r.step, loss))
        self.rounds.append({
            "step": r.step, "opened_at": r.opened_at, "closed_at": now, "duration": now - r.opened_at,
            "reason": reason, "aggregated": len(r.grads), "eligible": len(r.eligible),
            "contributors": [{**a, "after": a["at"] - r.opened_at} for a in r.arrivals],
            "missing": [self.members.by_id[w].name for w in r.eligible if w not in r.grads],
            "straggler": straggler(r.opened_at, now, r.arrivals, [(self.members.by_id[w].name, rank) for w, rank in r.eligible.items() if w not in r.grads]),
            "loss": loss, "examples": r.examples,
            "late": r.late,  # the live list: late pushes for this round arrive after it closed
        })
        r.grads = {}  # drop references to the request buffers
        self.last_round = r
        self.global_step += 1
        self._open_round(now)

    def _changed(self) -> None:
        self.version += 1
