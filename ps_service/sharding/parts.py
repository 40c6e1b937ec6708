"""A follower's partitioned rounds (``PS_PARTITION_BYTES`` = P > 0 on a sharded PS; docs/partitions.md, Shards).
Pure, no I/O, no clock.

Contract: a follower's pieces are planned into partitions with the wire's plan over its own pieces as its model
(its core's :attr:`~ps_service.core.ParameterServerCore.plan`). Its core's open round is a
:class:`~ps_service.core.partitions.RoundParts` from partition 0, opened by the round's first frame or decision. Three
inputs drive it, in any order:

- :func:`frame`: a worker's frame of partition q of step s, checked as a push's pieces are (422 ``tensor_mismatch``,
  ``nonfinite_gradient``) before anything changes. Kept (``held``) until the decision names its sender; ``duplicate``
  if that worker's frame of q came already, ``late`` (kept nowhere) if round s is over here or decided without that
  worker (or no longer waiting for it); 409 ``shard_behind`` if s is ahead of this shard.
- :func:`decide`: the coordinator's decision of round s, the contributors as (rank, worker_id) in sum order; frames
  of others are dropped. Each partition closes, summed over them in rank order and applied, once their frames of it
  are in; the step advances with the last. A repeat, or a step this shard has passed: nothing done (False).
- :func:`drop`: a member of round s brings no more frames: the partitions waiting for it close without it.

The weights are those of the same round at P = 0, bit for bit, when no member is lost mid-round.
"""
from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np

from ps_service.core.checks import validate
from ps_service.core.partitions import RoundParts
from ps_service.sharding.holds import Key, passed
from shared.errors import unprocessable


def _open(core) -> RoundParts:
    if core.parts is None:
        core.parts = RoundParts.open(core.plan, core.config.aggregation, first=0)
    return core.parts


def frame(core, worker_id: str, step: int, q: int, tensors: Mapping[str, np.ndarray], now: float) -> str:
    """Take ``worker_id``'s frame of partition ``q`` of round ``step`` (its arrays are the round's from now on):
    ``held``, ``duplicate`` or ``late``."""
    p = core.plan
    if not 0 <= q < p.count:
        raise unprocessable("tensor_mismatch", f"partition {q}: this shard's pieces make {p.count}")
    validate(p.split(core.weights, q), tensors, "reject")
    if passed(core.global_step, step):
        return "late"
    parts = _open(core)
    if (refusal := parts.refusal(q, worker_id)) is not None:
        return refusal  # duplicate; late: not a contributor, or the partition no longer waits for it
    core.close_parts(now, parts.frame(q, worker_id, None, tensors))  # (summed now, or once the round is decided)
    return "held"


def decide(core, step: int, contributors: Sequence[Key], now: float) -> bool:
    """Round ``step`` is decided with ``contributors`` ((rank, worker_id), sum order): its partitions close as their
    frames are in. False: a repeat, or a round this shard has passed (nothing done)."""
    if passed(core.global_step, step) or (core.parts is not None and core.parts.decided):
        return False
    parts = _open(core)
    core.close_parts(now, parts.decide({w: (int(r), w) for r, w in contributors}, True))
    return True


def drop(core, step: int, worker_id: str, now: float) -> bool:
    """A member of round ``step`` brings no more frames of it: its partitions close without it. False: a round this
    shard has passed (nothing to do)."""
    if passed(core.global_step, step):
        return False
    core.close_parts(now, _open(core).drop(worker_id))
    return True
