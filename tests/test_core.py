"""The sans-IO core, driven by simulation: barrier, staleness, duplicates, backups, elasticity."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ps_service.core.membership import FOLLOWER, SILENCE
from ps_service.core.rounds import Accumulator
from ps_service.core import ParameterServerCore
from tests.configs import core_config
from shared.compression import SparseTensor
from shared.compression import dense as compression_dense
from ps_service.http import REFUSALS, status_of
from shared.protocol import ModelInit, PushRequest, PushStatus
from worker_service.tasks.linear import LinearTask

W0 = {"w": np.zeros((3, 2), np.float32), "b": np.zeros((2,), np.float32)}


def make(n_workers=2, now=0.0, spec=None, **cfg):
    cfg.setdefault("min_workers", n_workers)
    cfg.setdefault("startup_grace_seconds", 0.0)
    core = ParameterServerCore(core_config(**cfg))
    core.init_model(ModelInit({k: v.copy() for k, v in W0.items()}, spec or {"name": "sgd", "learning_rate": 0.5}), now)
    ids = [core.register(f"w{i}", now)[0].worker_id for i in range(n_workers)]
    return core, ids


def grad(seed, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(dtype) for k, v in W0.items()}


def push(core, wid, step, g=None, now=0.0, loss=None):
    """A push of copies of ``g``: the core owns (and sums into) the arrays it is given."""
    g = {k: v.copy() for k, v in g.items()} if g is not None else grad(step)
    return core.push(PushRequest(wid, step, g, loss=loss), now)


def test_round_closes_with_mean_of_all_and_bumps_step():
    core, ids = make(3)
    assert core.started and core.global_step == 0
    gs = [grad(i) for i in range(3)]
    assert push(core, ids[0], 0, gs[0]).status is PushStatus.ACCEPTED
    assert push(core, ids[1], 0, gs[1]).status is PushStatus.ACCEPTED
    assert core.global_step == 0 and core.progress().needed == 1
    res = push(core, ids[2], 0, gs[2])
    assert res.status is PushStatus.ACCEPTED and res.closed and res.step == 1
    for k in W0:
        mean = (gs[0][k] + gs[1][k] + gs[2][k]) / np.float32(3)
        np.testing.assert_array_equal(core.weights[k], W0[k] - np.float32(0.5) * mean)
    assert core.rounds[-1].aggregated == 3 and core.rounds[-1].reason == "full"


@settings(max_examples=40, deadline=None)
@given(n=st.integers(1, 5), steps=st.integers(1, 4), data=st.data())
def test_any_arrival_order_gives_bit_identical_weights(n, steps, data):
    """Float addition is order-sensitive: the PS must sum in rank order, not arrival order."""
    results = []
    for shuffle in (False, True):
        core, ids = make(n, spec={"name": "adam", "learning_rate": 0.1})
        for step in range(steps):
            order = list(range(n))
            if shuffle:
                order = data.draw(st.permutations(order))
            for i in order:
                assert push(core, ids[i], step, grad(100 * step + i)).status is PushStatus.ACCEPTED
        assert core.global_step == steps
        results.append({k: v.copy() for k, v in core.weights.items()})
    for k in W0:
        assert results[0][k].tobytes() == results[1][k].tobytes()


def test_stale_is_refused_counted_and_never_applied():
    core, ids = make(2, replicas_to_aggregate=1)
    for step in range(3):  # worker 1 alone closes rounds 0, 1, 2 while worker 0 computes on step 0
        assert push(core, ids[1], step).closed
    before = {k: v.copy() for k, v in core.weights.items()}
    res = push(core, ids[0], 0)  # three rounds old
    assert res.status is PushStatus.STALE and res.step == 3
    assert push(core, ids[0], 2).status is PushStatus.LATE  # the round that just closed without it
    assert core.push_counts["stale"] == 1 and core.members.by_id[ids[0]].pushes["stale"] == 1
    assert all(np.array_equal(before[k], core.weights[k]) for k in W0)
    assert len(core.round.acc) == 0


def test_duplicate_in_open_round_and_after_the_boundary():
    core, ids = make(2)
    g = grad(1)
    assert push(core, ids[0], 0, g).status is PushStatus.ACCEPTED
    assert push(core, ids[0], 0, g).status is PushStatus.DUPLICATE
    assert len(core.round.acc) == 1 and core.global_step == 0
    push(core, ids[1], 0)
    assert core.global_step == 1
    before = {k: v.copy() for k, v in core.weights.items()}
    assert push(core, ids[1], 0).status is PushStatus.DUPLICATE  # a retry that crossed the boundary
    assert all(np.array_equal(before[k], core.weights[k]) for k in W0)
    assert core.push_counts["duplicate"] == 2 and core.push_counts["accepted"] == 2


def test_backup_workers_first_r_win_others_late():
    core, ids = make(3, replicas_to_aggregate=2, total_num_replicas=3)
    g = [grad(i) for i in range(3)]
    push(core, ids[2], 0, g[2])
    res = push(core, ids[0], 0, g[0])
    assert res.closed and core.global_step == 1
    late = push(core, ids[1], 0, g[1])
    assert late.status is PushStatus.LATE
    for k in W0:
        np.testing.assert_array_equal(core.weights[k], W0[k] - np.float32(0.5) * ((g[0][k] + g[2][k]) / np.float32(2)))
    assert core.rounds[-1].late and core.rounds[-1].late[0].rank == 1


def test_elastic_join_takes_effect_at_the_round_boundary():
    core, ids = make(2)
    push(core, ids[0], 0)
    m, start = core.register("newcomer", 1.0)
    assert start == 1 and m.worker_id not in core.round.eligible
    assert push(core, m.worker_id, 0).status is PushStatus.LATE  # not in round 0
    push(core, ids[1], 0)
    assert core.global_step == 1 and m.worker_id in core.round.eligible and len(core.round.eligible) == 3
    push(core, ids[0], 1)
    push(core, ids[1], 1)
    assert core.global_step == 1  # still waits for the newcomer
    push(core, m.worker_id, 1)
    assert core.global_step == 2


def test_a_leaving_worker_no_longer_holds_the_round():
    core, ids = make(3)
    push(core, ids[0], 0)
    push(core, ids[1], 0)
    core.leave(ids[2], 1.0)
    assert core.global_step == 1 and core.rounds[-1].aggregated == 2
    assert ids[2] not in core.round.eligible


def test_expired_lease_closes_the_round_on_tick():
    core, ids = make(2, lease_seconds=5.0)
    push(core, ids[0], 0, now=4.0)
    assert not core.tick(4.9) or core.global_step == 0
    assert core.global_step == 0
    core.tick(5.5)  # ids[1] last seen at 0: expired
    assert core.global_step == 1 and core.members.by_id[ids[1]].state == "expired"
    m, start = core.register("w1", 6.0)  # comes back under its name
    assert m.worker_id == ids[1] and m.rank == 1 and start == 2


def test_round_deadline_needs_the_quorum():
    core, ids = make(3, replicas_to_aggregate=3, round_timeout_seconds=2.0, min_replicas=2, lease_seconds=100)
    push(core, ids[0], 0, now=0.5)
    core.tick(3.0)
    assert core.global_step == 0  # 1 < quorum 2: keeps waiting
    push(core, ids[1], 0, now=3.1)
    core.tick(3.2)
    assert core.global_step == 1 and core.rounds[-1].reason == "deadline"
    assert push(core, ids[2], 0, now=3.3).status is PushStatus.LATE


def test_held_leases_hold_the_lease_and_the_deadline_and_release_gives_both_afresh():
    """A sharded coordinator whose follower does not answer holds the leases (no round could be applied anyway):
    nobody expires and no round closes by its deadline meanwhile; released, both count from the release."""
    core, ids = make(3, replicas_to_aggregate=3, round_timeout_seconds=2.0, min_replicas=2, lease_seconds=5.0)
    push(core, ids[0], 0, now=0.5)
    push(core, ids[1], 0, now=0.6)
    core.members.hold(FOLLOWER, 1.0)
    core.tick(30.0)
    assert core.global_step == 0 and core.members.active_count == 3  # neither the deadline nor the lease ran out
    core.members.release(FOLLOWER, 30.0)
    core.members.touch(ids[0], 30.0)  # nor had the coordinator heard from any worker: that silence ends too
    core.tick(31.9)
    assert core.global_step == 0
    core.tick(32.1)  # the deadline, 2 s from the release
    assert core.global_step == 1 and core.rounds[-1].reason == "deadline"
    assert core.members.active_count == 3
    for t in (34.0, 36.0, 38.0, 40.0):
        for wid in ids[:2]:
            core.members.touch(wid, t)
    core.tick(39.9)
    assert core.members.active_count == 3
    core.tick(40.1)  # the silent worker's lease: 5 s and the reconnect allowance's 5 from the release
    assert core.members.active_count == 2 and not core.members.get(ids[2]).active


def test_start_waits_for_min_workers_then_grace():
    core = ParameterServerCore(core_config(min_workers=2, startup_grace_seconds=3.0, lease_seconds=100.0))
    core.init_model(ModelInit(dict(W0), {}), 0.0)
    core.register("a", 0.0)
    core.tick(10.0)
    assert not core.started and core.state().value == "waiting_for_workers"
    core.register("b", 10.0)
    core.tick(12.9)
    assert not core.started
    core.tick(13.0)
    assert core.started and len(core.round.eligible) == 2


def test_start_is_immediate_when_the_expected_count_is_reached():
    core = ParameterServerCore(core_config(total_num_replicas=2, startup_grace_seconds=60.0))
    core.init_model(ModelInit(dict(W0), {}), 0.0)
    core.register("a", 0.0)
    assert not core.started
    core.register("b", 0.1)
    assert core.started


def test_max_steps_marks_done_and_closes_no_more_rounds():
    core, ids = make(1, max_steps=2)
    push(core, ids[0], 0)
    push(core, ids[0], 1)
    assert core.done and core.round is None and core.state().value == "done"
    assert push(core, ids[0], 1).status is PushStatus.DUPLICATE


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_a_worker_registering_after_the_end_is_not_in_the_ranks(mode):
    """protocol.md, pull: once the job is done a registration still answers (``done``), but the worker trains no step:
    the ranks a pull names stay those of the end (before: the newcomer's rank was listed)."""
    core, ids = make(2, max_steps=1, mode=mode)
    push(core, ids[0], 0)
    if mode == "sync":
        push(core, ids[1], 0)
    assert core.done and core.ranks() == (0, 1)
    m, start = core.register("late", 1.0)
    assert (m.rank, start, core.state().value) == (2, 1, "done") and core.ranks() == (0, 1)
    core.register("w1", 2.0)  # a worker of the job registering again after the end: still there
    assert core.ranks() == (0, 1)


def test_a_round_keeps_the_ranks_of_members_that_left_and_gives_them_to_nobody_else_until_it_closes():
    """protocol.md, pull: ``ranks`` are the round's members' (every pull of a round shards alike), and distinct: a
    rank given back while the round lists it goes to no other worker until the round closes (a newcomer joining the
    stuck round used to get it: ``ranks`` (0, 0, 1), two workers with one shard and shard 1 nobody's)."""
    core, ids = make(2)
    core.leave(ids[0], 1.0)
    assert core.ranks() == (0, 1)  # w0 left mid-round: w1's shard stays 1 of 2
    core.leave(ids[1], 1.0)
    m, start = core.register("n", 2.0)  # nobody alive in round 0: joins it at once, under a rank it does not list
    assert (m.rank, start, core.global_step) == (2, 0, 0) and core.ranks() == (0, 1, 2)
    m2, start2 = core.register("n2", 2.0)  # round 0 has a live member again: n2 counts from round 1
    assert (m2.rank, start2) == (3, 1) and core.ranks() == (0, 1, 2)
    push(core, m.worker_id, 0)
    assert core.global_step == 1 and core.ranks() == (2, 3)
    assert core.register("n3", 3.0)[0].rank == 0  # round 0 closed: the ranks it listed are free again
    back, start = core.register("w0", 3.0)
    assert (back.worker_id, back.rank, start) == (ids[0], 1, 2)  # its rank 0 is n3's: the lowest free one


@pytest.mark.parametrize("policy", ["reject", "skip"])
def test_a_push_for_the_final_step_once_done_is_stale_and_says_done(policy):
    """protocol.md, push: no round opens at PS_MAX_STEPS, so a push computed on the final weights is answered
    ``stale`` (counted, never applied), as in async; a retry of it is ``duplicate``. It used to be 409
    ``not_started``, which a client would wait on as if training had not begun."""
    core, ids = make(2, max_steps=1, nonfinite_policy=policy)
    push(core, ids[0], 0)
    push(core, ids[1], 0)
    assert core.done
    before = {k: v.copy() for k, v in core.weights.items()}
    res = push(core, ids[0], 1)
    assert (res.status, res.step) == (PushStatus.STALE, 1) and core.push_counts["stale"] == 1
    assert push(core, ids[0], 1).status is PushStatus.DUPLICATE
    nan = {k: np.full_like(v, np.nan) for k, v in W0.items()}
    if policy == "skip":
        assert push(core, ids[1], 1, nan).status is PushStatus.STALE  # no round to skip it in
    else:
        with pytest.raises(REFUSALS) as e:
            push(core, ids[1], 1, nan)
        assert e.value.code == "nonfinite_gradient"
    assert all(np.array_equal(before[k], core.weights[k]) for k in before) and core.global_step == 1


@pytest.mark.parametrize("sparse", [False, True])
def test_finite_gradients_whose_sum_overflows_never_reach_the_weights(sparse):
    """Two finite float32 pushes of 3e38 sum to inf: the round closes, applies nothing (its record: no gradient
    aggregated), the weights stay as they were and the next round trains as usual. Dense pushes are checked in
    the final sum, top-k ones (SparseTensor) in their k sums as made."""
    core, ids = make(2)
    big = {k: np.full_like(v, 3e38) for k, v in W0.items()}
    for wid in ids:
        g = {k: v.copy() for k, v in big.items()}
        if sparse:
            g = {k: SparseTensor(v.shape, np.arange(v.size, dtype=np.int64), v.reshape(-1)) for k, v in g.items()}
        assert core.push(PushRequest(wid, 0, g), 0.0).status is PushStatus.ACCEPTED
    assert core.global_step == 1 and core.rounds[-1].aggregated == 0
    assert all(core.weights[k].tobytes() == W0[k].tobytes() for k in W0)
    assert core.rounds[-1].missing == ("w0", "w1")
    gs = [grad(i) for i in range(2)]
    for wid, g in zip(ids, gs):
        push(core, wid, 1, g)
    assert core.global_step == 2 and core.rounds[-1].aggregated == 2 and np.isfinite(core.weights["w"]).all()


@pytest.mark.parametrize("dtype, scale, applied", [
    (np.float32, 1.0, 2),     # ordinary gradients: read, finite, applied
    (np.float32, 1e25, 2),    # squares would overflow (|x| > 1.8e19): finite, applied
    (np.float32, 3e38, 0),    # finite gradients whose sum overflows: nothing applied
])
def test_a_sum_added_in_place_is_read_once_for_overflow(monkeypatch, dtype, scale, applied):
    """Finite gradients can overflow when added (two float32 3e38 make inf): a sum added to in place unchecked is read
    once for NaN/Inf when the round ends, and an overflow keeps the round from applying anything."""
    from ps_service.core import checks
    reads = []
    real = checks.finite
    monkeypatch.setattr(checks, "finite", lambda g: reads.append(g.shape) or real(g))
    core = ParameterServerCore(core_config(min_workers=2, startup_grace_seconds=0.0))
    w0 = {k: v.astype(dtype) for k, v in W0.items()}
    core.init_model(ModelInit({k: v.copy() for k, v in w0.items()}, {"name": "sgd", "learning_rate": 0.5}), 0.0)
    ids = [core.register(f"w{i}", 0.0)[0].worker_id for i in range(2)]
    for wid in ids:
        assert push(core, wid, 0, {k: np.full_like(v, scale) for k, v in w0.items()}).status is PushStatus.ACCEPTED
    assert core.global_step == 1 and core.rounds[-1].aggregated == applied
    assert len(reads) >= 2 * len(w0) + 1  # each push's tensors, then the sum
    if applied:
        g = np.full_like(w0["w"], scale)
        assert core.weights["w"].tobytes() == (w0["w"] - dtype(0.5) * ((g + g) / dtype(2))).tobytes()
    else:
        assert core.weights["w"].tobytes() == w0["w"].tobytes()


def test_sum_aggregation():
    core, ids = make(2, aggregation="sum")
    g = [grad(1), grad(2)]
    push(core, ids[0], 0, g[0])
    push(core, ids[1], 0, g[1])
    for k in W0:
        np.testing.assert_array_equal(core.weights[k], W0[k] - np.float32(0.5) * (g[0][k] + g[1][k]))


@pytest.mark.parametrize("case,status,code", [
    ("future", 422, "future_step"), ("unknown", 404, "unknown_worker"), ("shape", 422, "tensor_mismatch"),
    ("missing", 422, "tensor_mismatch"), ("nan", 422, "nonfinite_gradient"), ("int", 422, "tensor_mismatch"),
    ("float64", 422, "tensor_mismatch"),
])
def test_refused_pushes_change_nothing(case, status, code):
    core, ids = make(2)
    push(core, ids[0], 0)
    before = (core.version, core.global_step, len(core.round.acc), dict(core.push_counts))
    wid, step, g = ids[1], 0, grad(5)
    if case == "future":
        step = 3
    elif case == "unknown":
        wid = "nope"
    elif case == "shape":
        g["w"] = np.zeros((2, 3), np.float32)
    elif case == "missing":
        del g["b"]
    elif case == "nan":
        g["b"] = np.array([np.nan, 0], np.float32)
    elif case == "int":
        g["b"] = np.zeros(2, np.int32)
    elif case == "float64":  # finite as float64, -inf weights once cast to the model's float32: never cast
        g["b"] = np.array([1e300, 0], np.float64)
    with pytest.raises(REFUSALS) as err:
        push(core, wid, step, g)
    assert (status_of(err.value), err.value.code) == (status, code)
    assert (core.version, core.global_step, len(core.round.acc), dict(core.push_counts)) == before


def test_nonfinite_skip_policy_counts_and_does_not_apply():
    core, ids = make(2, nonfinite_policy="skip")
    bad = grad(1)
    bad["w"][0, 0] = np.inf
    res = push(core, ids[0], 0, bad)
    assert res.status is PushStatus.LATE or core.push_counts["skipped"] == 1
    assert core.push_counts["skipped"] == 1 and len(core.round.acc) == 0


def test_a_skipped_push_is_in_its_round_record_as_skipped_not_missing():
    """A NaN push under policy skip arrived: it can be the straggler that closed the round (last_arrival), never a
    member that ``never_arrived`` (a black-box check from the README found both, and the pusher in ``missing``)."""
    bad = grad(1)
    bad["w"][0, 0] = np.nan
    core, ids = make(2, nonfinite_policy="skip")  # elastic: the round waits for both
    push(core, ids[0], 0, now=1.0)
    assert push(core, ids[1], 0, bad, now=3.0).status is PushStatus.SKIPPED
    rec = core.rounds[-1]
    assert (rec.reason, rec.aggregated, [a.name for a in rec.contributors], [a.name for a in rec.skipped],
            rec.missing) == ("full", 1, ["w0"], ["w1"], ())  # everyone pushed: full, not membership
    assert (rec.straggler.name, rec.straggler.kind, rec.straggler.waited_seconds) == ("w1", "last_arrival", 2.0)
    core, ids = make(2, nonfinite_policy="skip", replicas_to_aggregate=1, total_num_replicas=2)
    assert push(core, ids[0], 0, bad, now=0.5).status is PushStatus.SKIPPED  # closes round 0 (R = 1)
    rec = core.rounds[-1]
    assert (rec.aggregated, rec.contributors, [a.name for a in rec.skipped], rec.missing, rec.straggler) == \
        (0, (), ["w0"], ("w1",), None)  # w1 a backup the round did not need: no straggler, as with an accepted push


def test_a_nonfinite_push_for_a_closed_round_is_late_not_skipped():
    """Policy skip: `skipped` is for the open round by a member it counts; a NaN backup that lost the race is
    `late` as a finite one would be (it was `skipped` and counted as one)."""
    bad = grad(1)
    bad["w"][0, 0] = np.nan
    core, (a, b, c) = make(3, nonfinite_policy="skip", replicas_to_aggregate=2, total_num_replicas=3)
    push(core, a, 0)
    push(core, b, 0)  # round 0 closes with a and b
    assert push(core, c, 0, bad).status is PushStatus.LATE and core.push_counts["skipped"] == 0
    assert [x.name for x in core.rounds[-1].late] == ["w2"] and core.rounds[-1].skipped == ()
    assert push(core, c, 1, bad).status is PushStatus.SKIPPED and core.push_counts["skipped"] == 1


def test_init_first_caller_wins_and_ps_settings_take_precedence():
    core = ParameterServerCore(core_config(optimizer_overrides={"name": "sgd", "learning_rate": 0.25}))
    core.init_model(ModelInit(dict(W0), {"name": "adam", "learning_rate": 0.001, "beta1": 0.5}), 0.0)
    assert core.optimizer.spec == {"name": "sgd", "learning_rate": 0.25}
    with pytest.raises(REFUSALS) as err:
        core.init_model(ModelInit(dict(W0), {}), 0.0)
    assert status_of(err.value) == 409
    core2 = ParameterServerCore(core_config(optimizer_overrides={"learning_rate": 0.2}))
    core2.init_model(ModelInit(dict(W0), {"name": "adam", "learning_rate": 0.001, "beta1": 0.5}), 0.0)
    assert core2.optimizer.spec["name"] == "adam" and core2.optimizer.spec["learning_rate"] == 0.2
    assert core2.optimizer.spec["beta1"] == 0.5


def check_ranks(core: ParameterServerCore) -> None:
    """Each rank one worker's (docs/protocol.md, register and pull): the present members' distinct, the ranks a pull
    names distinct, and the open round lists each of its members under the member's rank, held by no other."""
    present = {m.rank: m.worker_id for m in core.members.by_id.values() if m.state != "left"}
    ranks = core.ranks()
    assert len(present) == sum(m.state != "left" for m in core.members.by_id.values()), present
    assert len(set(ranks)) == len(ranks), ranks
    for w, rank in (core.round.eligible.items() if core.round is not None else ()):
        assert core.members.by_id[w].rank == rank and present.get(rank, w) == w, (w, rank, present)


#: workers coming and going: (what, which worker); pushes for the open round, from a member yet to push it
churn = st.lists(st.tuples(st.sampled_from(["push", "push", "register", "leave", "tick"]), st.integers(0, 6)),
                 min_size=5, max_size=60)


@settings(max_examples=150, deadline=None)
@given(cfg=st.sampled_from([{}, {"replicas_to_aggregate": 2}, {"replicas_to_aggregate": 3, "min_replicas": 2}]),
       script=churn)
def test_workers_coming_and_going_never_share_a_rank(cfg, script):
    """Simulation: joins, graceful leaves (ranks given back), expiries and pushes in any order, elastic or fixed R
    (backups, stuck rounds joined at once): after every call each rank is one worker's (:func:`check_ranks`), so no
    two members of a round train one shard. Before, a rank given back while the round listed it went to the next
    newcomer."""
    core, _ = make(2, lease_seconds=3.0, **cfg)
    now = 0.0
    for kind, i in script:
        now += 2.0 if kind == "tick" else 0.25
        m = core.members.by_name.get(f"w{i}")
        if kind == "register":
            core.register(f"w{i}", now)
        elif kind == "tick":
            core.tick(now)
        elif m is not None and m.active and kind == "leave":
            core.leave(m.worker_id, now)
        elif m is not None and m.active and core.round is not None and core.global_step not in m.recent:
            push(core, m.worker_id, core.global_step, now=now)
        check_ranks(core)


def test_rank_is_stable_per_name_and_freed_on_leave():
    """protocol.md, register: the lowest rank no present member holds and the open round does not list; a member that
    left gets its old rank back unless another holds it or the open round lists it for another."""
    core, ids = make(3)
    m, _ = core.register("w1", 1.0)
    assert m.worker_id == ids[1] and m.rank == 1
    core.leave(ids[1], 2.0)
    newcomer, _ = core.register("fresh", 3.0)
    assert newcomer.rank == 3  # round 0 lists w1's rank 1: not handed out before it closes
    back, _ = core.register("w1", 4.0)
    assert back.worker_id == ids[1] and back.rank == 1  # round 0 lists it for w1 itself
    core.leave(ids[1], 5.0)
    push(core, ids[0], 0, now=5.5)
    push(core, ids[2], 0, now=5.5)
    assert core.global_step == 1 and core.ranks() == (0, 2, 3)
    assert core.register("fresh2", 6.0)[0].rank == 1  # round 0 closed: w1's rank was given back
    back, _ = core.register("w1", 7.0)
    assert back.worker_id == ids[1] and back.rank == 4  # held by fresh2 now


def test_a_newcomer_in_an_orphaned_round_trains_a_shard_of_its_own():
    """Fixed R = 2: w0 pushed its shard's gradient and left, w1 died; below min_replicas nobody else can close the
    round, so a newcomer joins it at once. It gets a rank the round does not list, so its place among the round's
    ranks (its data shard, as the worker loop takes it) is nobody else's: it used to get w0's rank 0 back, ranks
    (0, 0, 1), the same place as w0's and place 1 nobody's. The round sums both shards' gradients in rank order."""
    task = LinearTask()
    core = ParameterServerCore(core_config(min_workers=2, startup_grace_seconds=0.0, lease_seconds=5.0,
                                           replicas_to_aggregate=2, min_replicas=2))
    core.init_model(ModelInit(task.init_params(), task.optimizer()), 0.0)
    w0, _ = (core.register(f"w{i}", 0.0)[0] for i in range(2))
    w = {k: v.copy() for k, v in core.weights.items()}

    def train(m, now):
        """worker_service/loop.py's step: its place among the pull's ranks, that shard's batch, the push."""
        ranks = core.ranks()
        place = (ranks.index(m.rank), len(ranks))
        _, g, n = task.loss_and_grads(core.weights, task.batch(0, *place, 8))
        res = core.push(PushRequest(m.worker_id, 0, {k: v.copy() for k, v in g.items()}, num_examples=n), now)
        return place, g, res

    place0, g0, _ = train(w0, 1.0)
    core.leave(w0.worker_id, 4.0)  # heard from w0 at 4: w1's silence is its own, not the PS's
    core.tick(6.0)  # w1 expires; R = 2 still needs a gradient
    new, start = core.register("new", 6.5)
    assert (new.rank, start, core.ranks()) == (2, 0, (0, 1, 2)) and core.round.counts(new.worker_id)
    places = sorted(core.ranks().index(rank) for rank in core.round.eligible.values())
    assert places == [0, 1, 2]  # each place one member's
    place_new, g_new, res = train(new, 7.0)
    assert (place0, place_new) == ((0, 2), (2, 3)) and res.closed and core.rounds[-1].aggregated == 2
    for k in w:  # summed in rank order: w0 (rank 0), then the newcomer (rank 2)
        assert core.weights[k].tobytes() == (w[k] - np.float32(0.5) * ((g0[k] + g_new[k]) / np.float32(2))).tobytes()


def test_a_gradient_of_another_dtype_is_named_in_the_refusal():
    core, ids = make(1)
    g = grad(1, np.float64)
    with pytest.raises(REFUSALS) as err:
        core.push(PushRequest(ids[0], 0, g), 0.0)
    assert err.value.code == "tensor_mismatch"
    assert "'b' is float64, the model's is float32" in err.value.detail
    core.push(PushRequest(ids[0], 0, grad(1)), 0.0)
    assert core.global_step == 1 and all(np.isfinite(w).all() for w in core.weights.values())


def test_read_only_and_non_contiguous_gradients_are_copied_not_written():
    core, ids = make(2)
    g0, g1 = grad(1), grad(2)
    ro = {k: np.frombuffer(v.tobytes(), v.dtype).reshape(v.shape) for k, v in g0.items()}  # read-only
    fortran = {k: np.asfortranarray(v) for k, v in g1.items()}
    keep = {k: v.copy() for k, v in fortran.items()}
    core.push(PushRequest(ids[0], 0, ro), 0.0)
    core.push(PushRequest(ids[1], 0, fortran), 0.0)
    for k in W0:
        np.testing.assert_array_equal(core.weights[k], W0[k] - np.float32(0.5) * ((g0[k] + g1[k]) / np.float32(2)))
        np.testing.assert_array_equal(fortran[k], keep[k])


def test_the_accumulator_sums_in_rank_order_into_the_first_ranks_buffer():
    g = [grad(i) for i in range(3)]
    acc = Accumulator(tuple(W0), "mean")
    given = {k: v.copy() for k, v in g[0].items()}
    acc.apply("z", 1, {k: v.copy() for k, v in g[2].items()})  # rank 1, id z: after (1, "b")
    acc.apply("b", 1, {k: v.copy() for k, v in g[1].items()}, pending=[(0, "a")])
    assert acc.folded == []  # rank 0 may still come
    acc.apply("a", 0, given, pending=[])
    assert acc.folded == [(0, "a"), (1, "b"), (1, "z")] and len(acc) == 3
    out, n = acc.take_sum()
    assert out["w"] is given["w"] and len(acc) == 0 and n == 3  # summed in place: the core owns what it is given
    for k in W0:
        expected = g[0][k].copy()
        expected += g[1][k]
        expected += g[2][k]
        assert out[k].tobytes() == expected.tobytes()


def rank_order_sum(grads: list[dict], name: str) -> np.ndarray:
    """``grads[0][name] + grads[1][name] + ...`` in that order, in a new array (the reference every sum is held to)."""
    out = grads[0][name].copy()
    for g in grads[1:]:
        out += g[name]
    return out


@settings(max_examples=80, deadline=None)
@given(n=st.integers(1, 5), eager=st.booleans(), data=st.data())
def test_sparse_top_k_gradients_are_summed_in_o_k_with_the_dense_sums_bits(n, eager, data):
    """Top-k pushes (SparseTensor: some entries, zero elsewhere; -0.0 and 0.0 among the values) are added in
    O(k) when the running sum came only from such pushes, mixed with dense ones otherwise (owned, or same-host
    files read once): whatever the arrival order, the sum is bit-identical to the rank-order sum of the dense
    arrays, signs of zeros included."""
    rng = np.random.default_rng(data.draw(st.integers(0, 2**32 - 1)))
    size = {k: v.size for k, v in W0.items()}
    pushes, dense = [], []
    for i in range(n):
        sparse = data.draw(st.booleans()) or i > 0 and data.draw(st.booleans())
        p, d = {}, {}
        for k, v in W0.items():
            full = rng.choice(np.array([0.0, -0.0, 1.5, -2.25, 3e-3], np.float32), size[k])
            if sparse:
                idx = np.sort(rng.choice(size[k], rng.integers(0, size[k] + 1), replace=False))
                vals = full[idx]
                p[k] = SparseTensor(v.shape, idx.astype(np.intp), vals)
                d[k] = p[k].dense()
            else:
                p[k] = full.reshape(v.shape)
                d[k] = full.reshape(v.shape).copy()
        pushes.append(p)
        dense.append(d)
    order = data.draw(st.permutations(range(n)))
    acc, arrived = Accumulator(tuple(W0), "sum"), set()
    for i in order:
        arrived.add(i)
        pending = [(j, f"w{j}") for j in range(n) if j not in arrived] if eager else None
        acc.apply(f"w{i}", i, pushes[i], pending)
    out, _ = acc.take_sum()
    for k in W0:
        expected = rank_order_sum(dense, k)
        assert compression_dense(out[k]).tobytes() == expected.tobytes(), (k, out[k], expected)
    # the same pushes taken by take_sum: a tensor summed only from top-k pushes comes as its entries (the union of
    # theirs), the dense sum's bits there and +0.0 elsewhere
    acc, arrived = Accumulator(tuple(W0), "sum"), set()
    for i in order:
        arrived.add(i)
        pending = [(j, f"w{j}") for j in range(n) if j not in arrived] if eager else None
        grads = {k: SparseTensor(g.shape, g.indices.copy(), g.values.copy()) if isinstance(g, SparseTensor)
                 else dense[i][k].copy() for k, g in pushes[i].items()}
        acc.apply(f"w{i}", i, grads, pending)
    total, _ = acc.take_sum()
    all_sparse = all(isinstance(p["w"], SparseTensor) for p in pushes)
    for k in W0:
        expected = rank_order_sum(dense, k)
        assert isinstance(total[k], SparseTensor) == all_sparse
        assert compression_dense(total[k]).tobytes() == expected.tobytes()
        if all_sparse:
            union = np.unique(np.concatenate([p[k].indices for p in pushes]))
            assert total[k].indices.tolist() == union.tolist()


def unreachable_round(**cfg):
    """R = N = 3: w0 and w1 push step 0; w2 still owes its gradient."""
    core, ids = make(3, replicas_to_aggregate=3, total_num_replicas=3, lease_seconds=5.0, **cfg)
    g = [grad(i) for i in range(3)]
    push(core, ids[0], 0, g[0], now=1.0)
    push(core, ids[1], 0, g[1], now=4.0)
    return core, ids, g


def assert_closed_unreachable(core, g, closed_at):
    rec = core.rounds[-1]
    assert core.global_step == 1 and rec.reason == "unreachable" and rec.closed_at == closed_at
    assert (rec.aggregated, rec.eligible, rec.missing, rec.replicas_to_aggregate) == (2, 3, ("w2",), 3)
    for k in W0:
        np.testing.assert_array_equal(core.weights[k], W0[k] - np.float32(0.5) * ((g[0][k] + g[1][k]) / np.float32(2)))


def test_fixed_r_out_of_reach_after_a_leave_closes_with_what_it_has():
    core, ids, g = unreachable_round()
    assert core.wait_reason(4.5) == "waiting for 1 more gradient(s) from w2"
    core.leave(ids[2], 5.0)
    assert_closed_unreachable(core, g, 5.0)
    assert core.progress().unreachable and core.progress().needed == 2  # round 1 counts w0 and w1: it closes when both pushed
    push(core, ids[1], 1, now=6.0)
    assert push(core, ids[0], 1, now=6.1).closed and core.rounds[-1].reason == "unreachable"


def test_fixed_r_out_of_reach_after_a_lease_expiry_closes_on_tick():
    core, ids, g = unreachable_round()
    core.tick(4.9)
    assert core.global_step == 0  # w2's lease (last seen at 0) holds until 5.0
    core.tick(5.5)
    assert core.members.by_id[ids[2]].state == "expired"
    assert_closed_unreachable(core, g, 5.5)


def test_fixed_r_out_of_reach_still_waits_for_the_live_members():
    core, ids = make(3, replicas_to_aggregate=3, lease_seconds=100.0)
    push(core, ids[0], 0, now=1.0)
    core.leave(ids[2], 2.0)
    assert core.global_step == 0 and core.progress().unreachable and core.progress().needed == 1
    assert core.wait_reason(2.0) == ("waiting for 1 more gradient(s) from w1 "
                                     "(R=3 is out of reach: the round closes with what they bring)")
    assert core.progress().effective == 2
    push(core, ids[1], 0, now=3.0)
    assert core.global_step == 1 and core.rounds[-1].reason == "unreachable" and core.rounds[-1].aggregated == 2


def test_fixed_r_out_of_reach_below_min_replicas_waits_for_a_worker_who_joins_at_once():
    core, ids = make(3, replicas_to_aggregate=3, min_replicas=2, lease_seconds=100.0)
    push(core, ids[0], 0, now=1.0)
    core.leave(ids[1], 2.0)
    core.leave(ids[2], 2.0)
    assert core.global_step == 0 and core.progress().stuck
    assert core.wait_reason(2.0) == ("R=3 is out of reach: 1 gradient(s) in, below min_replicas 2: "
                                     "waiting for a worker to (re)register")
    m, start = core.register("w2", 3.0)  # comes back: joins the open round, nobody else can close it
    assert start == 0 and core.round.counts(m.worker_id)
    assert push(core, m.worker_id, 0, now=3.5).closed
    assert core.rounds[-1].reason == "unreachable" and core.rounds[-1].aggregated == 2


def test_fixed_r_with_no_gradient_in_waits_for_a_rejoining_worker():
    core, ids = make(2, replicas_to_aggregate=2, lease_seconds=5.0)
    core.members.touch(ids[0], 4.0)
    core.leave(ids[0], 4.5)  # w0 leaves, w1 died at 0 (the PS heard w0 meanwhile: w1 is expired on time)
    core.tick(6.0)
    assert core.global_step == 0 and core.progress().stuck
    assert core.wait_reason(6.0) == "no live member in this round: waiting for a worker to (re)register"
    _, start = core.register("w1", 7.0)
    assert start == 0 and push(core, ids[1], 0, now=7.5).closed and core.rounds[-1].reason == "unreachable"


def test_every_worker_silent_is_held_and_the_round_closes_once_one_is_back():
    """Both stop at once: the PS cannot tell that from its own outage, so nobody expires (no gradient of the open
    round is lost if it was the PS); the first back ends the silence and the other expires a lease and 5 s later."""
    core, ids = make(2, replicas_to_aggregate=2, lease_seconds=5.0)
    push(core, ids[0], 0, now=0.5)
    core.tick(60.0)
    assert core.members.active_count == 2 and core.members.holds == {SILENCE: 0.5}
    assert core.wait_reason(60.0).startswith("no worker heard from for 59.5 s")
    push(core, ids[1], 0, now=61.0)  # w1 was cut off, not dead: the round closes exactly as without the outage
    assert core.global_step == 1 and core.rounds[-1].reason == "full" and core.rounds[-1].aggregated == 2
    for t in (63.0, 65.0, 67.0, 69.0):
        core.members.touch(ids[1], t)
    core.tick(70.9)
    assert core.members.get(ids[0]).active
    core.tick(71.1)  # w0 never came back: a lease and the reconnect allowance after w1 was heard
    assert not core.members.get(ids[0]).active and core.members.get(ids[1]).active


def test_a_stuck_round_recalls_the_workers_registered_for_the_next_one():
    """A worker that joined while round 0 had live members waits for round 1; when every member of round 0 dies
    before pushing, round 0 is stuck: it recalls the joiner (409 on its next call), which registers again and
    joins it, instead of both waiting for each other for ever."""
    for cfg in ({}, {"replicas_to_aggregate": 2}, {"replicas_to_aggregate": 2, "min_replicas": 2}):
        core, ids = make(2, lease_seconds=5.0, **cfg)
        if cfg.get("min_replicas"):
            push(core, ids[0], 0, grad(1), now=0.5)
            core.leave(ids[0], 0.6)
        m, start = core.register("fresh", 1.0)
        assert start == 1 and not core.round.counts(m.worker_id)
        # a client that pushes for the open round anyway: late (not counted)
        assert push(core, m.worker_id, 0, grad(3), now=1.5).status is PushStatus.LATE
        for t in (2.5, 4.0):
            core.members.touch(m.worker_id, t)
        recalls = core.recalls
        core.tick(5.1)  # w1 (and w0) expire: round 0 cannot close with its own members
        assert core.recalls == recalls + 1 and core.members.by_id[m.worker_id].state == "expired"
        assert [e["event"] for e in core.members.events][-1] == "recalled"
        with pytest.raises(REFUSALS) as err:
            core.members.touch(m.worker_id, 5.2)
        assert err.value.code == "not_active"
        m, start = core.register("fresh", 5.3)
        assert start == 0 and core.round.counts(m.worker_id)
        # its late push is forgotten: this one counts (it was `duplicate`, and the round stuck for good)
        res = push(core, m.worker_id, 0, grad(2), now=5.4)
        assert res.status is PushStatus.ACCEPTED and res.closed and core.global_step == 1, cfg


@pytest.mark.parametrize("restarted", [False, True], ids=["stays", "registers-again-while-active"])
def test_a_member_done_with_a_stuck_round_without_contributing_is_recalled_into_it(restarted):
    """Fixed R = 2 of 3: w0's and w2's pushes count at their heads, w1's comes after them (late: done with the round);
    then w0's and w2's bodies never come (their processes died). Once they expire the round is stuck: w1, live but
    done with it, is recalled, registers again and joins it, as a worker that did not count would (before: nobody
    recalled, w1's pull waited for a round that could not come until another worker registered). ``restarted``: w1's
    process restarted under its name within its lease first: the round no longer counts it (its next round is the
    next one), as for a member that came back (before: counted, its push for the round a `duplicate`)."""
    core, ids = make(3, replicas_to_aggregate=2, total_num_replicas=3, lease_seconds=5.0)
    assert core.claim(ids[0], 0) and core.claim(ids[2], 0)
    assert push(core, ids[1], 0, now=0.5).status is PushStatus.LATE
    core.release(ids[0])
    core.release(ids[2])
    if restarted:
        m, start = core.register("w1", 1.0)
        assert (m.worker_id, start) == (ids[1], 1) and not core.round.counts(ids[1])
    for t in (2.0, 3.0, 4.0, 5.0):
        core.members.touch(ids[1], t)
    core.tick(5.5)  # w0 and w2 expire: nobody left can close round 0
    assert core.global_step == 0 and core.members.by_id[ids[1]].state == "expired"
    assert [e["event"] for e in core.members.events][-1] == "recalled"
    m, start = core.register("w1", 5.6)
    assert start == 0 and core.round.counts(ids[1])
    res = push(core, ids[1], 0, now=5.7)
    assert res.status is PushStatus.ACCEPTED and res.closed and core.global_step == 1
    assert (core.rounds[-1].reason, core.rounds[-1].aggregated) == ("unreachable", 1)


def test_the_core_config_comes_from_the_settings_in_one_mapping():
    from dataclasses import fields

    from ps_service.core.config import CoreConfig
    from ps_service.settings import PSSettings
    s = PSSettings(replicas_to_aggregate=3, total_num_replicas=4, min_workers=2, max_steps=9, lease_seconds=3.0,
                   round_timeout_seconds=7.0, min_replicas=2, nonfinite_policy="skip", aggregation="sum",
                   startup_grace_seconds=1.5, optimizer="adam", learning_rate=0.01)
    cfg = CoreConfig.from_settings(s)
    assert cfg == CoreConfig(replicas_to_aggregate=3, total_num_replicas=4, min_workers=2, max_steps=9, lease_seconds=3.0,
                             round_timeout_seconds=7.0, min_replicas=2, nonfinite_policy="skip", aggregation="sum",
                             startup_grace_seconds=1.5, start_timeout_seconds=120.0, mode="sync", ssp_staleness=3,
                             max_staleness=None,
                             optimizer_overrides={"name": "adam", "learning_rate": 0.01})
    # CoreConfig has no defaults of its own: every field but the fixed count is a setting of the same name
    assert {f.name for f in fields(CoreConfig)} - set(PSSettings.model_fields) == {"optimizer_overrides",
                                                                                  "max_rounds_kept"}


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
def test_the_finiteness_check_finds_every_nan_and_inf_wherever_it_sits(dtype):
    """ps_service.core.checks.finite: any NaN, +Inf or -Inf at the start, inside or at the end is found; huge finite
    values are not."""
    from ps_service.core.checks import finite
    FINITE_CHUNK = 1 << 18  # (where a chunked check's edges would be)
    n = 2 * FINITE_CHUNK + 77
    big = np.finfo(dtype).max
    g = np.full(n, big, dtype)
    g[1::2] = -big
    assert finite(g) and finite(g.reshape(-1, 1)) and finite(g[::3])
    for at in (0, 5, FINITE_CHUNK - 1, FINITE_CHUNK, 2 * FINITE_CHUNK + 76):
        for bad in (np.nan, np.inf, -np.inf):
            h = g.copy()
            h[at] = bad
            assert not finite(h) and not finite(h[at:at + 1])


