"""The PS's sans-IO core: model, optimizer, sync barrier and membership in one state machine.

Nothing here does I/O or reads a clock: every entry point takes ``now`` (seconds,
monotonic) and returns what happened; the FastAPI routes in ``app.py`` are thin
drivers and the tests drive it by simulation.

Barrier semantics (TensorFlow's SyncReplicasOptimizer, done right; docs/protocol.md):

- A round ``g`` is open while ``global_step == g``. Its *eligible* set is fixed
  when it opens: the active members at that moment (joins take effect at the
  next boundary; a member that registers while the open round has nobody alive
  to wait for becomes eligible at once).
- ``replicas_to_aggregate`` R unset (elastic, the default): the round closes when
  every eligible member that is still active has pushed. R set: it closes at the
  first R accepted gradients; with more workers than R (backups, N > R) the others
  get ``late``. A round past ``round_timeout`` closes with what it has if that is at
  least ``min_replicas``.
- Push classification for worker w and step s: a second push of (w, s) is
  ``duplicate``; s == g from an eligible w is ``accepted``; s == g from a
  non-eligible w, or s == g-1 from a member of round g-1 that missed it, is
  ``late``; anything older is ``stale``. Only ``accepted`` gradients are applied.
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
from typing import Any, Mapping

import numpy as np

from ps_service.membership import ACTIVE, Member, Membership
from ps_service.optimizers import HYPERPARAMS, Optimizer, normalize_spec
from ps_service.stragglers import straggler
from shared.codec import FLOAT_DTYPES, dtype_name
from shared.errors import ProtocolError, unprocessable
from shared.protocol import JobState, ModelInit, PushRequest, PushStatus

RECENT_STEPS = 16  # per-worker memory of pushed steps, for duplicate detection


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
    examples: int = 0  # examples behind the accepted gradients


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

    # ---- membership --------------------------------------------------------------------
    def register(self, name: str, now: float) -> tuple[Member, int]:
        """(member, start_step): the step whose weights the worker should pull first."""
        m, _ = self.members.register(name, now)
        start = self.global_step
        r = self.round
        if r is not None and m.worker_id not in r.eligible:
            if self._alive_eligible(r):
                start = self.global_step + 1  # joins at the next round boundary
            else:
                r.eligible[m.worker_id] = m.rank  # nobody alive to wait for: join this round
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

    def _alive_eligible(self, r: Round) -> list[str]:
        return [w for w in r.eligible if self.members.by_id[w].state == ACTIVE]

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
            return max(0, self.config.replicas_to_aggregate - len(r.grads))
        return sum(1 for w in self._alive_eligible(r) if w not in r.grads)

    def tick(self, now: float) -> bool:
        """Advance time: leases, start-up, round deadline. True if anything changed."""
        changed = bool(self.members.expire(now))
        if not self.started and self.initialized and not self.done:
            active = len(self.members.active())
            if active >= max(1, self.config.min_workers):
                if self._ready_since is None:
                    self._ready_since = now
                expected = self.expected_workers()
                if (expected and active >= expected) or now - self._ready_since >= self.config.startup_grace_seconds:
                    self.started = True
                    self.started_at = now
                    self._open_round(now)
                    changed = True
            else:
                self._ready_since = None
        r = self.round
        if r is not None:
            if r.grads and self.needed(r) == 0:
                self._close(now, "full" if not self.config.replicas_to_aggregate or len(r.grads) >= self.config.replicas_to_aggregate else "membership")
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
            if finite and not np.isfinite(g).all():
                finite = False
                if self.config.nonfinite_policy == "reject":
                    raise unprocessable("nonfinite_gradient", f"tensor {name!r} has NaN or Inf values")
        return finite

    def push(self, req: PushRequest, now: float) -> PushResult:
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
            status = None
        elif req.step == self.global_step and m.worker_id in self.round.eligible:
            status = PushStatus.ACCEPTED
        elif req.step == self.global_step or (
            req.step == self.global_step - 1 and self.last_round is not None and m.worker_id in self.last_round.eligible
        ):
            status = PushStatus.LATE
        else:
            status = PushStatus.STALE
        label = status.value if status else "skipped"
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
        self._changed()
        return PushResult(status or PushStatus.LATE, self.global_step, closed)

    def aggregate(self, r: Round) -> dict[str, np.ndarray]:
        """Sum (then mean) the round's gradients in rank order, in the weights' dtype."""
        order = sorted(r.grads, key=lambda w: r.eligible[w])
        out = {}
        for name, w in self.weights.items():
            acc = np.array(r.grads[order[0]][name], dtype=w.dtype, copy=True)
            for wid in order[1:]:
                np.add(acc, r.grads[wid][name], out=acc, casting="same_kind")
            if self.config.aggregation == "mean" and len(order) > 1:
                acc /= len(order)
            out[name] = acc
        return out

    def _close(self, now: float, reason: str) -> None:
        r = self.round
        grads = self.aggregate(r)
        self.optimizer.apply(self.weights, grads)
        loss = None
        if r.losses:
            total = sum(n for _, n in r.losses)
            loss = sum(l * n for l, n in r.losses) / total if total else None
            if loss is not None and math.isfinite(loss):
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
