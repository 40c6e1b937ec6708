"""Two edges of a sharded PS's round with a follower that sums as told (pieces of 1 MiB or more,
ps_service/sharding/turns.py), in-process shards (uvicorn threads) and raw holds and commits, as a worker makes them:

- a round whose sum overflows (finite float32 gradients whose sum is not finite: ``Accumulator.spoiled``, the round
  applies nothing on one PS): on the coordinator's pieces, every shard applies nothing and the job goes on (no
  rollback); on a follower's pieces only, that follower applies nothing and the coordinator applies its own pieces
  (docs/protocol-shards.md says so: one PS would apply nothing at all);
- fixed R, a member refused after R heads (late on every shard) that registers again into the stuck round: it takes
  part in the round on every shard, and the round is the one-PS round.
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

from cluster.processes import wait_for
from tests.test_shard_follow import P, W0, LR, gradient, start
from tests.test_shards import assemble, commit, hold, two_shards
from tests.timing import allow

HUGE = np.float32(3e38)  # finite; two of them overflow when added (float32's largest is 3.4e38)


def one_ps(rounds: list[list[dict]], part: slice = slice(None)) -> np.ndarray:
    """One PS's weights (``part`` of them: as a PS owning only that part) after ``rounds`` (each: its contributors'
    gradients in rank order), SGD, mean: a round whose rank-order sum is not finite applies nothing."""
    w = W0["w"][part].copy()
    for grads in rounds:
        total = grads[0]["w"][part].copy()
        with np.errstate(over="ignore"):
            for g in grads[1:]:
                np.add(total, g["w"][part], out=total)
        if not np.isfinite(total).all():
            continue
        if len(grads) > 1:
            total /= np.float32(len(grads))
        w = w - np.float32(LR) * total
    return w


@contextmanager
def two_shards_folding(n: int, **kw):
    """Two in-process shards whose follower sums as told (a piece of 2.4 MB each), ``n`` workers registered and the
    model initialised (SGD): (coordinator, follower, their http clients, the map, the worker ids)."""
    with two_shards(min_workers=n, lease_seconds=30.0, shard_split_elements=P // 2, **kw) as (c, f):
        hc, hf, m, ids = start(c, f, n)
        try:
            yield c, f, hc, hf, m, ids
        finally:
            hc.close(), hf.close()


def push(hc, hf, m, wid, step, grads):
    """Hold on both shards, then commit with the follower's receipt: (the follower's hold answer, the commit's)."""
    assert hold(hc, m, 0, wid, step, grads).json()["status"] == "held"
    r = hold(hf, m, 1, wid, step, grads).json()
    return r, commit(hc, wid, step, [r.get("receipt")])


@pytest.mark.parametrize("where", [0, 1])
def test_a_round_whose_sum_overflows_applies_nothing_on_that_shard_and_the_job_goes_on(where, caplog):
    """Two workers; round 0's gradients are finite but their sum overflows in shard ``where``'s pieces. Rank 0 commits
    first, and the follower sums it as told before rank 1 commits. Shard 0's sum overflows: no shard applies anything
    (one PS's round), the record names no contributor, no rollback. Shard 1's: it applies nothing, shard 0 its own
    pieces (unlike one PS: no shard knows another's sum). Round 1 is then the rank-order mean on both."""
    with two_shards_folding(2) as (c, f, hc, hf, m, ids):
        at = m.pieces[where][0].start  # an element of shard ``where``'s piece
        rounds = []
        for step in range(2):
            grads = [gradient(10 * step + i) for i in range(2)]
            if step == 0:
                for g in grads:
                    g["w"][at] = HUGE
            _, answer = push(hc, hf, m, ids[0], step, grads[0])
            assert answer.json()["status"] == "accepted"
            wait_for(lambda: f.rt.shards.holds.folded == [(0, ids[0])], allow(10), "the follower to sum rank 0")
            _, answer = push(hc, hf, m, ids[1], step, grads[1])
            assert answer.json()["status"] == "accepted"
            wait_for(lambda: f.rt.core.global_step == c.rt.core.global_step == step + 1, allow(10), f"round {step}")
            rounds.append(grads)
        st = hc.get("/v1/status").json()["shard"]
        assert (st["rollbacks"], st["blocked"], [r["error"] for r in st["shards"]]) == (0, None, [None, None])
        records = hc.get("/v1/rounds").json()["rounds"]
        assert [r["aggregated"] for r in sorted(records, key=lambda r: r["step"])] == ([0, 2] if where == 0 else [2, 2])
        got = assemble(m, [dict(c.rt.core.weights), dict(f.rt.core.weights)])["w"]
        assert np.isfinite(got).all()
        if where == 0:
            assert got.tobytes() == one_ps(rounds).tobytes(), "not one PS's weights"
        else:  # each shard as a PS of its own pieces: shard 1 applied nothing of round 0, shard 0 its pieces
            for piece in (m.pieces[0][0], m.pieces[1][0]):
                part = slice(piece.start, piece.stop)
                assert got[part].tobytes() == one_ps(rounds, part).tobytes()
            part = slice(m.pieces[0][0].start, m.pieces[0][0].stop)
            assert got[part].tobytes() != one_ps(rounds)[part].tobytes()  # one PS applies nothing of round 0
        said = [r.getMessage() for r in caplog.records if "overflows: nothing applied" in r.getMessage()]
        assert said == ([] if where == 0 else ["round 0: the sum of this shard's pieces of its 2 contributors "
                                               "overflows: nothing applied here (the other shards apply theirs)"])
