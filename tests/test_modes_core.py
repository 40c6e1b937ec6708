"""PS_MODE=async|ssp in the sans-IO core, by simulation: gradients applied on arrival, the SSP gate of pulls,
membership releasing it, bad input, the end of the job, checkpoints, ranks, and the settings that go with it.

The hypothesis property drives the real core (body and same-host pushes, copied and checked as the seam hands them over, NaN under policy skip,
retries, leaves, rejoins, lease expiries) and checks after every action that a granted pull never breaks
the bound, and at the end that no (worker, step) was applied twice and that the weights equal a numpy float32
SGD replay of the applied gradients in arrival order, bit for bit."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st

from ps_service import checkpoint
from tests.configs import core_config
from ps_service.core import CoreConfig, ParameterServerCore
from ps_service.settings import PSSettings
from ps_service.http import REFUSALS
from shared.protocol import ModelInit, PushRequest, PushStatus

W0 = {"b": np.zeros(2, np.float32), "w": np.zeros((3, 2), np.float32)}
LR = 0.25


def make(n=2, mode="async", now=0.0, **cfg):
    cfg.setdefault("min_workers", n)
    cfg.setdefault("startup_grace_seconds", 0.0)
    core = ParameterServerCore(core_config(mode=mode, **cfg))
    core.init_model(ModelInit({k: v.copy() for k, v in W0.items()}, {"name": "sgd", "learning_rate": LR}), now)
    ids = [core.register(f"w{i}", now)[0].worker_id for i in range(n)]
    return core, ids


def grad(seed):
    rng = np.random.default_rng(seed)
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in W0.items()}


def push(core, wid, step, g, now=0.0, shm=False, **kw):
    """A push as the seam hands it over: a same-host one (``shm``) copied and checked as read (finite_checked when
    it is finite), a body one checked by the core."""
    checked = shm and all(np.isfinite(v).all() for v in g.values())
    return core.push(PushRequest(wid, step, {k: v.copy() for k, v in g.items()}, finite_checked=checked, **kw), now)


def snapshot(core):
    return (core.version, core.global_step, dict(core.push_counts), {k: v.tobytes() for k, v in core.weights.items()},
            core.modes.export(), dict(core.modes.staleness_counts))


def test_async_applies_each_gradient_on_arrival_and_records_staleness():
    core, (a, b) = make(2)
    assert core.started and core.round is None and core.ranks() == (0, 1)
    ga, gb = grad(1), grad(2)
    ra = push(core, a, 0, ga, loss=1.5, num_examples=4)
    assert ra.status is PushStatus.ACCEPTED and ra.step == 1 and ra.closed
    rb = push(core, b, 0, gb)  # computed on step 0, applied to step 1: staleness 1
    assert rb.status is PushStatus.ACCEPTED and core.global_step == 2 and core.gradients_applied == 2
    for k in W0:
        np.testing.assert_array_equal(core.weights[k], (W0[k] - np.float32(LR) * ga[k]) - np.float32(LR) * gb[k])
    assert core.modes.staleness_counts == {0: 1, 1: 1} and core.modes.workers[b].last_staleness == 1
    assert core.examples == 4 and list(core.loss_history) == [(0, 1.5)]
    assert push(core, b, 0, gb).status is PushStatus.DUPLICATE and core.global_step == 2
    assert core.may_pull(a) and core.may_pull(b) and core.wait_reason(0.0).startswith("async")
    core.leave(a, 1.0)
    core.leave(b, 1.0)  # every worker gone (they crashed, say): the status says so, not "no barrier"
    assert core.wait_reason(1.0) == "async: no active worker (of 2 registered): training resumes when one registers"


def test_max_staleness_refuses_old_gradients():
    core, (a, b) = make(2, max_staleness=1)
    for step in range(3):
        push(core, a, step, grad(step))
    before = snapshot(core)[3]
    assert push(core, b, 0, grad(9)).status is PushStatus.STALE  # 3 steps old
    assert snapshot(core)[3] == before and core.global_step == 3 and core.push_counts["stale"] == 1
    assert push(core, b, 2, grad(9)).status is PushStatus.ACCEPTED  # 1 step old


def test_ssp_gates_pulls_and_leave_or_expiry_releases_the_bound():
    core, (a, b, c) = make(3, mode="ssp", ssp_staleness=1, lease_seconds=2.0)
    step = 0
    for _ in range(2):  # a runs ahead: clocks a=2, b=c=0
        push(core, a, step, grad(step))
        step = core.global_step
    assert not core.may_pull(a) and core.may_pull(b) and core.may_pull(None)  # no worker id: not gated
    assert core.pull_floor == 0 and "w0 at clock 2 waits for clock >= 1" in core.wait_reason(1.0)
    push(core, b, 0, grad(7), now=1.0)  # b reaches 1, c still at 0
    assert not core.may_pull(a)
    core.leave(c, 1.5)  # c leaves: the floor is b's clock 1, a may pull at once
    assert core.pull_floor == 1 and core.may_pull(a)
    push(core, a, core.global_step, grad(8), now=1.6)  # a at 3: waits for b
    assert not core.may_pull(a)
    core.members.touch(a, 3.5)
    core.tick(4.0)  # b's lease (last seen 1.0) ran out: the bound is released
    assert core.members.by_id[b].state == "expired" and core.may_pull(a) and core.pull_floor == 3
    core.register("w1", 4.1)  # b comes back at max(its clock, floor) = 3: nobody waits
    assert core.modes.workers[b].clock == 3 and core.may_pull(a) and core.may_pull(b)


def test_bad_input_changes_nothing():
    core, (a, b) = make(2, mode="ssp", ssp_staleness=2)
    g = grad(3)

    nan = grad(4)
    nan["w"][1, 1] = np.nan
    bad_shape = {"b": np.zeros(2, np.float32), "w": np.zeros((2, 3), np.float32)}
    refusals = [
        (lambda: push(core, a, 0, nan, shm=True), "nonfinite_gradient"),
        (lambda: push(core, a, 0, nan), "nonfinite_gradient"),
        (lambda: push(core, a, 0, bad_shape), "tensor_mismatch"),
        (lambda: push(core, a, 5, g), "future_step"),
        (lambda: push(core, "nobody", 0, g), "unknown_worker"),
    ]
    for call, code in refusals:
        before = snapshot(core)
        with pytest.raises(REFUSALS) as exc:
            call()
        assert exc.value.code == code and snapshot(core) == before
    assert push(core, a, 0, g, 1.0, shm=True).status is PushStatus.ACCEPTED
    for k in W0:
        np.testing.assert_array_equal(core.weights[k], W0[k] - np.float32(LR) * g[k])
    core.leave(b, 2.0)
    with pytest.raises(REFUSALS) as exc:
        push(core, b, 1, g)
    assert exc.value.code == "not_active"


def test_nonfinite_skip_advances_without_an_update_and_the_end_of_the_job():
    core, (a,) = make(1, nonfinite_policy="skip", max_steps=2)
    nan = grad(1)
    nan["b"][0] = np.inf
    assert push(core, a, 0, nan, shm=True).status is PushStatus.SKIPPED
    assert core.global_step == 1 and core.gradients_applied == 0 and core.modes.workers[a].clock == 1
    assert all(np.array_equal(core.weights[k], W0[k]) for k in W0)
    assert push(core, a, 1, grad(2)).status is PushStatus.ACCEPTED and core.done
    weights = snapshot(core)[3]
    assert push(core, a, 2, grad(3)).status is PushStatus.STALE  # the job is over: nothing applied
    assert core.global_step == 2 and snapshot(core)[3] == weights and core.modes.workers[a].clock == 2


def test_a_push_before_the_start_is_refused():
    core = ParameterServerCore(core_config(mode="async", min_workers=2, startup_grace_seconds=0.0))
    core.init_model(ModelInit({k: v.copy() for k, v in W0.items()}, {"name": "sgd", "learning_rate": LR}), 0.0)
    a = core.register("w0", 0.0)[0].worker_id
    with pytest.raises(REFUSALS) as exc:
        push(core, a, 0, grad(1))
    assert exc.value.code == "not_started" and core.global_step == 0


def test_ranks_are_the_active_members_cached_per_membership_change():
    core, (a, b, c) = make(3)
    first = core.ranks()
    assert first == (0, 1, 2) and core.ranks() is first  # cached: no sort per pull
    core.leave(b, 1.0)
    assert core.ranks() == (0, 2)
    core.register("w3", 1.0)
    assert core.ranks() == (0, 1, 2)
    sync, _ = make(2, mode="sync")
    assert sync.ranks() is sync.round.ranks


def test_checkpoint_keeps_the_clocks_and_a_restore_is_sound():
    core, (a, b) = make(2, mode="ssp", ssp_staleness=1)
    for step in (0, 1):
        push(core, a, step, grad(step))
    push(core, b, 0, grad(5))  # clocks a=2, b=1; floor 1
    state = checkpoint.decode(checkpoint.encode(core.export_state(), 0.0)[0])
    assert state["staleness"] == {"floor": 1, "clocks": {a: 2, b: 1}}
    restored = ParameterServerCore(core_config(mode="ssp", ssp_staleness=1, min_workers=2, startup_grace_seconds=0))
    restored.import_state(state, 10.0)
    assert restored.global_step == 3 and restored.modes.live_count() == 0
    with pytest.raises(REFUSALS) as exc:  # a push from before the restart: register first
        push(restored, a, 2, grad(6), now=10.0)
    assert exc.value.code == "not_active"
    assert restored.register("w1", 10.0)[0].worker_id == b and restored.modes.workers[b].clock == 1
    assert restored.register("w0", 10.0)[0].worker_id == a and restored.modes.workers[a].clock == 2
    assert restored.started and restored.may_pull(b) and restored.may_pull(a)
    assert push(restored, b, 3, grad(7), now=10.0).status is PushStatus.ACCEPTED
    sync_state = checkpoint.decode(checkpoint.encode(make(1, mode="sync")[0].export_state(), 0.0)[0])
    assert sync_state["staleness"] is None  # a sync checkpoint restored in ssp: everyone starts at the floor 0
    for bad in ({"floor": -1, "clocks": {}}, {"floor": 0, "clocks": {"x": "1"}}, {"floor": 0}):
        data = core.export_state() | {"staleness": bad}
        with pytest.raises(checkpoint.CheckpointError):
            checkpoint.decode(checkpoint.encode(data, 0.0)[0])


def test_settings_and_config():
    s = PSSettings(mode="ssp", ssp_staleness=2, max_staleness=10)
    cfg = CoreConfig.from_settings(s)
    assert (cfg.mode, cfg.ssp_staleness, cfg.max_staleness) == ("ssp", 2, 10)
    assert CoreConfig.from_settings(PSSettings()).mode == "sync"
    for barrier in ({"replicas_to_aggregate": 3}, {"round_timeout_seconds": 5.0}, {"min_replicas": 2}):
        with pytest.raises(ValueError, match="barrier"):
            PSSettings(mode="async", **barrier)
    PSSettings(mode="sync", replicas_to_aggregate=3, total_num_replicas=4)
    with pytest.raises(ValueError):
        PSSettings(mode="bsp")


#: one action: (kind, worker index, transport/finite/bool draw)
ACTIONS = st.lists(st.tuples(st.sampled_from(["work"] * 16 + ["retry", "leave", "rejoin", "tick"]),
                             st.integers(0, 3), st.integers(0, 9)), min_size=30, max_size=150)


@settings(max_examples=60, deadline=None)
@given(bound=st.sampled_from([None, 0, 1, 3]), max_staleness=st.sampled_from([None, 2]), actions=ACTIONS)
def test_property_bound_never_violated_nothing_applied_twice_and_numpy_replay(bound, max_staleness, actions):
    mode = "async" if bound is None else "ssp"
    core, ids = make(4, mode=mode, ssp_staleness=bound or 0, max_staleness=max_staleness, lease_seconds=3.0,
                     nonfinite_policy="skip")
    now, pulled, last_push = 0.0, {}, {}
    replay = {k: v.copy() for k, v in W0.items()}
    applied: set[tuple[str, int]] = set()
    seed = 0
    for kind, i, draw in actions:
        wid, now = ids[i], now + 0.1
        active = core.members.is_active(wid)
        if kind == "work" and active and wid not in pulled:  # a pull with the worker's id
            if core.may_pull(wid):
                clock = core.modes.workers[wid].clock
                assert bound is None or min(core.modes.workers[w].clock for w in core.members.active_by_id) >= clock - bound
                pulled[wid] = core.global_step
        elif kind == "work" and active:  # push what it computed on the weights it pulled
            seed += 1
            g = grad(seed)
            if draw == 0:
                g["b"][1] = np.nan
            step = pulled.pop(wid)
            before = core.global_step
            res = push(core, wid, step, g, now, shm=draw % 2 == 1)
            last_push[wid] = (step, g)
            if res.status is PushStatus.ACCEPTED:
                assert (wid, step) not in applied and core.modes.workers[wid].last_staleness == before - step
                applied.add((wid, step))
                for k in W0:
                    replay[k] = replay[k] - np.float32(LR) * g[k]
            assert core.global_step == before + (res.status in (PushStatus.ACCEPTED, PushStatus.SKIPPED))
        elif kind == "retry" and active and wid in last_push:
            assert push(core, wid, *last_push[wid], now).status is PushStatus.DUPLICATE
        elif kind == "leave" and active:
            core.leave(wid, now)
            pulled.pop(wid, None)
        elif kind == "rejoin" and not active:
            core.register(f"w{i}", now)
        elif kind == "tick":
            now += 3.5 if draw < 3 else 0.5  # sometimes wid's lease runs out
            for w in list(core.members.active_by_id):
                if w != wid:
                    core.members.touch(w, now)
            core.tick(now)
            pulled = {w: s for w, s in pulled.items() if core.members.is_active(w)}
        live = [core.modes.workers[w].clock for w in core.members.active_by_id]
        if bound is not None and live:
            assert max(live) - min(live) <= bound + 1 and core.modes.floor == min(live)
            assert any(core.may_pull(w) for w in core.members.active_by_id)  # the slowest may always pull
    event(f"applied {min(len(applied), 20) // 10 * 10}+")
    assert core.gradients_applied == len(applied) == core.push_counts["accepted"]
    assert core.global_step == core.push_counts["accepted"] + core.push_counts["skipped"]
    for k in W0:
        assert core.weights[k].tobytes() == replay[k].tobytes()
