"""The sans-IO half of a shard: pushes held until a round names them, and a follower's apply of a round.

No I/O, no clock. Contract:

- :func:`hold_tensors` checks a push's pieces exactly as the core checks a push (names, exact dtypes,
  shapes: 422 ``tensor_mismatch``; NaN/Inf: 422 ``nonfinite_gradient``) before anything changes, and
  returns them: the seam handed them over in memory the shard owns, whatever carried them.
- :class:`Holds` keeps one held push per worker (the newest: a later push replaces it).
- :func:`apply_round` (a follower, told by the coordinator "apply round s with contributors C") sums the
  held pieces of C in (rank, worker_id) order exactly as the coordinator's round does
  (:class:`~ps_service.core.rounds.Accumulator`), steps the same optimizer once with the coordinator's
  ``mean_of``, bumps the global step, and drops every hold of step <= s. An apply of a round already applied
  is answered as done (the coordinator retries); one ahead of the shard, or naming a gradient the shard does
  not hold, is refused (409) and changes nothing: the shard never mixes steps.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np

from ps_service.core.checks import validate
from ps_service.core.rounds import Accumulator
from shared.errors import ProtocolError
from shared.protocol import PushRequest


@dataclass(frozen=True)
class Held:
    step: int
    tensors: Mapping[str, np.ndarray]
    via: str  # the transport it came by ("http" or "shm"): the commit answers through it


def hold_tensors(weights: Mapping[str, np.ndarray], push: PushRequest) -> Mapping[str, np.ndarray]:
    """The push's pieces, checked, in memory the shard owns (refusals before any change)."""
    validate(weights, push.tensors, "reject", check_finite=not push.finite_checked)
    return push.tensors


class Holds:
    def __init__(self) -> None:
        self.by_worker: dict[str, Held] = {}

    def __len__(self) -> int:
        return len(self.by_worker)

    def put(self, worker_id: str, held: Held) -> None:
        self.by_worker[worker_id] = held

    def get(self, worker_id: str, step: int) -> Held | None:
        h = self.by_worker.get(worker_id)
        return h if h is not None and h.step == step else None

    def discard(self, worker_id: str, step: int) -> None:
        if self.get(worker_id, step) is not None:
            del self.by_worker[worker_id]

    def drop_through(self, step: int) -> None:
        """Forget every hold of a round that is over (step <= ``step``)."""
        for w in [w for w, h in self.by_worker.items() if h.step <= step]:
            del self.by_worker[w]


def apply_round(core, holds: Holds, step: int, contributors: Sequence[tuple[int, str]], mean_of: int) -> bool:
    """Apply round ``step`` with ``contributors`` ((rank, worker_id) pairs) on a follower's ``core`` (its
    weights, optimizer and global step). True if applied now, False if it was already."""
    g = core.global_step
    if step < g:
        return False
    if step > g:
        raise ProtocolError(409, "shard_behind", f"this shard is at step {g}, asked to apply round {step}: it "
                                                 "restarted from an older state than the coordinator")
    missing = [w for _, w in contributors if holds.get(w, step) is None]
    if missing:
        raise ProtocolError(409, "missing_gradient", f"round {step}: no held push of {missing[:4]} here (this "
                                                     "shard restarted since they pushed?)")
    if mean_of < 1:
        raise ProtocolError(400, "bad_field", "mean_of must be >= 1")
    total = None
    if contributors:
        acc = Accumulator(tuple(core.weights), "sum")
        for rank, w in contributors:
            acc.apply(w, rank, holds.get(w, step).tensors)
        total, _ = acc.take_sum()  # None: this shard's pieces of the round overflow when summed; nothing applied
    holds.drop_through(step)
    core.apply_round(total, mean_of, len(contributors))
    return True
