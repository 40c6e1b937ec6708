"""Two edges of a sharded PS's round with a follower that sums as told (pieces of 1 MiB or more,
ps_service/sharding/turns.py), in-process shards (uvicorn threads) and raw holds and commits, as a worker makes them:

- a round whose sum overflows (finite float32 gradients whose sum is not finite: ``Accumulator.spoiled``, the round
  applies nothing on one PS): on the coordinator's pieces, every shard applies nothing and the job goes on (no
  rollback); on a follower's pieces only, that follower applies nothing and the coordinator applies its own pieces
  (docs/protocol-shards.md says so: one PS would apply nothing at all);
- fixed R, a member refused after R heads (late on every shard) that registers again into the stuck round: it takes
  part in the round on every shard (the coordinator names it `back` to the follower, which had it late), its stock
  push is accepted, and the round is the one-PS round; a stock worker whose commit is 409 `not_held` redoes the step
  (tests/test_client.py).
"""
from __future__ import annotations

from contextlib import contextmanager

import numpy as np
import pytest

from cluster.processes import wait_for
from ps_service.core import ParameterServerCore
from ps_service.sharding.holds import Holds
from ps_service.sharding.turns import Tracker
from shared.protocol import ModelInit
from tests.configs import core_config
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


def test_a_refused_member_that_registers_again_into_the_stuck_round_contributes_on_every_shard():
    """Fixed R = 2 of 3: a and b hold first (the round's heads), w's hold comes after them (late on both shards). a, b
    and w leave before any commit: the round is stuck. w registers again (its process restarted): it joins the stuck
    round under its id and rank, and the coordinator tells the follower so. Its stock push (holds on both shards at
    once, then the commit) is accepted and the round closes with w alone: one PS's round, bit for bit."""
    with two_shards_folding(3, replicas_to_aggregate=2) as (c, f, hc, hf, m, ids):
        grads = [gradient(i) for i in range(3)]
        a, b, w = ids
        for i in (0, 1):
            assert hold(hc, m, 0, ids[i], 0, grads[i]).json()["status"] == "held"
        assert hold(hc, m, 0, w, 0, grads[2]).json()["status"] == "late"  # after R heads
        wait_for(lambda: f.rt.shards.holds.late_for(w, 0), allow(10), "the follower to hear that w is late")
        assert hold(hf, m, 1, w, 0, grads[2]).json()["status"] == "late"
        for x in ids:
            assert hc.delete(f"/v1/workers/{x}").status_code == 200
        reg = hc.post("/v1/workers", json={"name": "w2"}).json()
        assert (reg["worker_id"], reg["rank"], reg["start_step"]) == (w, 2, 0)  # it joined the stuck round
        # (a stock worker pulls and computes first; before the fix the follower kept w late: its hold was answered
        # late, the commit 409 not_held, which the stock worker does not retry)
        wait_for(lambda: not f.rt.shards.holds.late_for(w, 0), allow(10), "the follower to hear that w is back")
        client = c.client()
        client.attach_reader()
        client.attach(w)
        try:
            assert client.push(w, 0, grads[2])["status"] == "accepted"
        finally:
            client.close()
        wait_for(lambda: f.rt.core.global_step == c.rt.core.global_step == 1, allow(10), "round 0")
        (record,) = hc.get("/v1/rounds").json()["rounds"]
        assert ([x["rank"] for x in record["contributors"]], record["reason"]) == ([2], "unreachable")
        got = assemble(m, [dict(c.rt.core.weights), dict(f.rt.core.weights)])["w"]
        assert got.tobytes() == one_ps([[grads[2]]]).tobytes(), "not one PS's weights"
        st = hc.get("/v1/status").json()["shard"]
        assert (st["rollbacks"], st["blocked"], len(f.rt.shards.holds)) == (0, None, 0)


@pytest.mark.parametrize("w_leaves", [True, False], ids=["w-leaves", "w-stays"])
def test_the_coordinator_tells_a_follower_that_a_late_member_is_back_in_the_stuck_round(w_leaves):
    """Sans-IO: the coordinator's core and its :class:`Tracker`, a follower's :class:`Holds` fed its messages. Fixed
    R = 2 of 3: w's hold after 2 heads is late (named ``late``); every member leaves, w registers again and joins the
    stuck round (named ``back``): the follower no longer answers its hold late, and reads it in its turn. ``w_leaves``
    False: w stays (its process restarted within its lease, say): the stuck round recalls it (before: it kept w late,
    and w's pull waited for the next round until another worker registered)."""
    core = ParameterServerCore(core_config(min_workers=3, startup_grace_seconds=0.0, replicas_to_aggregate=2))
    core.init_model(ModelInit({"w": np.zeros(2, np.float32)}, {"name": "sgd", "learning_rate": LR}), 0.0)
    a, b, w = (core.register(f"w{i}", 0.0)[0].worker_id for i in range(3))
    tracker, holds = Tracker(), Holds()

    def heard() -> dict | None:
        msg = tracker.message(core)
        if msg is not None:
            holds.progress(core.global_step, msg["step"], msg["start"], msg["folded"], msg["turns"],
                           msg["late"], msg["back"])
        return msg

    assert heard()["turns"] == []  # fixed R: no head yet
    assert core.hold(a, 0) and core.hold(b, 0) and not core.hold(w, 0)
    assert (heard()["late"], holds.late_for(w, 0), holds.may_read(w, 0, 0)) == ([w], True, True)
    for x in (a, b, w) if w_leaves else (a, b):
        core.leave(x, 1.0)
    assert core.members.by_id[w].state == ("left" if w_leaves else "expired")  # (recalled)
    heard()
    member, start = core.register("w2", 2.0)
    assert (member.worker_id, start) == (w, 0) and core.round.counts(w)
    assert (heard()["back"], holds.late_for(w, 0), holds.may_read(w, 0, 0)) == ([w], False, False)  # its turn: not yet
    assert core.hold(w, 0)
    assert (heard()["turns"], holds.may_read(w, 0, 0)) == ([w], True)
    assert tracker.message(core) is None  # nothing moved
