"""A follower's rounds: each one a :class:`~ps_service.core.partitions.RoundParts` of its core
(``core.followed_round``), opened by the round's first frame, summed key or decision. Partitioned
(``PS_PARTITION_BYTES`` = P > 0; docs/partitions.md, Shards) or not (one partition, its pieces whole). Pure, no I/O,
no clock.

Contract: a follower's pieces are planned into partitions with the wire's plan over its own pieces as its model
(its core's :attr:`~ps_service.core.ParameterServerCore.plan`: one partition, its pieces whole, when
unpartitioned). Four inputs drive its open round, in any order:

- :func:`frame` (partitioned): a worker's frame of partition q of step s, checked as a push's pieces are (422
  ``tensor_mismatch``, ``nonfinite_gradient``) before anything changes. Kept (``held``) until the decision names its
  sender; ``duplicate`` if that worker's frame of q came already, ``late`` (kept nowhere) if round s is over here or
  decided without that worker (or no longer waiting for it); 409 ``shard_behind`` if s is ahead of this shard.
- :func:`fold` (unpartitioned): a held push whose key the round's sum has reached (the coordinator summed it, or
  decided the round with it: :meth:`~ps_service.sharding.holds.Holds.fold`), summed at once.
- :func:`decide`: the coordinator's decision of round s, the contributors as (rank, worker_id) in sum order; frames
  of others are dropped. Each partition closes, summed over them in rank order and applied, once their frames of it
  are in; the step advances with the last. A repeat, or a step this shard has passed: nothing done (False). No
  contributors (the coordinator's sum overflowed): nothing applied, whatever was summed. A sum that overflows here
  applies nothing here (unpartitioned: logged).
- :func:`drop` (partitioned): members of round s bring no more frames: the partitions waiting for them close without
  them.

The weights are those of the same round on one PS, bit for bit, when no member is lost mid-round.
"""
from __future__ import annotations

import logging
from typing import Mapping, Sequence

import numpy as np

from ps_service.core.checks import validate
from ps_service.sharding.holds import Key, passed
from shared.errors import unprocessable

log = logging.getLogger("ps_service")


def frame(core, worker_id: str, step: int, q: int, tensors: Mapping[str, np.ndarray], now: float) -> str:
    """Take ``worker_id``'s frame of partition ``q`` of round ``step`` (its arrays are the round's from now on):
    ``held``, ``duplicate`` or ``late``."""
    p = core.plan
    if not 0 <= q < p.count:
        raise unprocessable("tensor_mismatch", f"partition {q}: this shard's pieces make {p.count}")
    validate(p.split(core.weights, q), tensors, "reject")
    if passed(core.global_step, step):
        return "late"
    parts = core.followed_round()
    if (refusal := parts.refusal(q, worker_id)) is not None:
        return refusal  # duplicate; late: not a contributor, or the partition no longer waits for it
    core.close_parts(now, parts.frame(q, worker_id, None, tensors))  # (summed now, or once the round is decided)
    return "held"


def fold(core, key: Key, tensors: Mapping[str, np.ndarray]) -> None:
    """Sum ``key``'s held push (its arrays the round's from now on) into the open round's one partition: no push still
    possible sorts before it."""
    core.followed_round().frame(0, key[1], key[0], tensors, settled=True)


def decide(core, step: int, contributors: Sequence[Key], now: float) -> bool:
    """Round ``step`` is decided with ``contributors`` ((rank, worker_id), sum order): its partitions close as their
    frames are in. False: a repeat, or a round this shard has passed (nothing done)."""
    if passed(core.global_step, step) or (core.parts is not None and core.parts.decided):
        return False
    parts = core.followed_round()
    core.close_parts(now, parts.decide({w: (int(r), w) for r, w in contributors}, bool(contributors)))
    if parts.plan.count == 1 and parts.applies and parts.accs[0].spoiled:
        log.warning("round %d: the sum of this shard's pieces of its %d contributors overflows: nothing applied here "
                    "(the other shards apply theirs)", step, len(contributors))
    return True


def drop(core, step: int, workers, now: float) -> bool:
    """Members of round ``step`` bring no more frames of it: its partitions close without them. False: none, or a round
    this shard has passed (nothing to do)."""
    if not workers or passed(core.global_step, step):
        return False
    parts = core.followed_round()
    core.close_parts(now, [q for w in workers for q in parts.drop(w)])
    return True
