"""The async and SSP modes' state machine (ps_service/core/staleness.py), driven by simulation with an injected clock.

:class:`PS` below is the push path phase 2 puts in the core, in miniature: classify, then apply an accepted
gradient on arrival with the PS's optimizer and bump the global step.
"""
from __future__ import annotations

import functools
import random

import numpy as np
import pytest
from hypothesis import given, settings, target
from hypothesis import strategies as st

from ps_service.core.model import ModelState
from ps_service.core.optimizers import Optimizer
from ps_service.core.staleness import BoundedStaleness
from shared.protocol import ModelInit, PushStatus

W0 = {"b": np.zeros((2,), np.float32), "w": np.linspace(-1, 1, 6, dtype=np.float32).reshape(3, 2)}
SGD = {"name": "sgd", "learning_rate": 0.25}
ADAM = {"name": "adam", "learning_rate": 0.1}
ACCEPTED, STALE, DUPLICATE, SKIPPED = PushStatus.ACCEPTED, PushStatus.STALE, PushStatus.DUPLICATE, PushStatus.SKIPPED


@functools.cache
def _grad(worker: str, step: int) -> dict[str, np.ndarray]:
    rng = np.random.default_rng([int(worker[1:]), step])
    return {k: rng.standard_normal(v.shape).astype(np.float32) for k, v in W0.items()}


def grad(worker: str, step: int) -> dict[str, np.ndarray]:
    """The gradient worker w computes on step s's weights (fresh copies: the PS consumes what it is given)."""
    return {k: v.copy() for k, v in _grad(worker, step).items()}


class PS:
    """Weights, optimizer and global step (the core's ModelState) with a staleness machine in front."""

    def __init__(self, bound=None, max_staleness=None, spec=SGD, workers=()):
        self.model = ModelState({})
        self.model.init_model(ModelInit({k: v.copy() for k, v in W0.items()}, dict(spec)), 0.0)
        self.modes = BoundedStaleness(bound, max_staleness)
        self.applied: list[tuple[str, int]] = []  # (worker, step) in the order applied
        for w in workers:
            self.modes.join(w, 0.0)

    @property
    def step(self) -> int:
        return self.model.global_step

    def push(self, worker: str, step: int, now: float = 0.0, finite: bool = True):
        v = self.modes.push(worker, step, self.model.global_step, finite, now)
        if v.applies:
            self.model.optimizer.apply(self.model.weights, grad(worker, step), consume=True)
            self.applied.append((worker, step))
        if v.advances:
            self.model.global_step += 1
        return v

    def weights(self) -> dict[str, bytes]:
        return {k: v.tobytes() for k, v in self.model.weights.items()}


def numpy_sgd_replay(applied) -> dict[str, bytes]:
    """Plain float32 SGD over the applied gradients in arrival order."""
    w = {k: v.copy() for k, v in W0.items()}
    lr = np.float32(SGD["learning_rate"])
    for worker, step in applied:
        for k, g in grad(worker, step).items():
            w[k] = w[k] - g * lr
    return {k: v.tobytes() for k, v in w.items()}


def optimizer_replay(applied, spec) -> dict[str, bytes]:
    w = {k: v.copy() for k, v in W0.items()}
    opt = Optimizer(spec, w)
    for worker, step in applied:
        opt.apply(w, grad(worker, step))
    return {k: v.tobytes() for k, v in w.items()}


# ---- async ------------------------------------------------------------------------------
def test_async_applies_each_gradient_on_arrival_and_records_its_staleness():
    ps = PS(workers=["w0", "w1"])
    assert ps.modes.may_pull("w0") and ps.modes.may_pull("w1")
    v0, v1 = ps.push("w0", 0, now=1.0), ps.push("w1", 0, now=2.0)  # both computed on step 0's weights
    assert (v0.status, v0.staleness, v1.status, v1.staleness) == (ACCEPTED, 0, ACCEPTED, 1)
    assert ps.step == 2 and ps.weights() == numpy_sgd_replay([("w0", 0), ("w1", 0)])
    v = ps.push("w0", 2, now=3.0)
    assert v.applies and v.staleness == 0 and v.clock == 2 and ps.step == 3
    w0 = ps.modes.workers["w0"]
    assert (w0.applied, w0.staleness_max, w0.last_staleness, w0.mean_staleness) == (2, 0, 0, 0.0)
    assert ps.modes.staleness_counts == {0: 2, 1: 1} and ps.modes.spread == 1
    assert all(ps.modes.may_pull(w) for w in ("w0", "w1"))  # async never waits


def test_max_staleness_refuses_old_gradients_and_a_retry_is_a_duplicate():
    ps = PS(max_staleness=1, workers=["w0", "w1"])
    for step in range(3):
        assert ps.push("w1", step).applies  # w1 runs three steps while w0 computes on step 0
    before = ps.weights()
    v = ps.push("w0", 0)
    assert (v.status, v.staleness, v.clock) == (STALE, 3, 0)
    assert ps.push("w0", 0).status is DUPLICATE
    assert ps.weights() == before and ps.step == 3 and ps.modes.applied() == 3
    assert ps.push("w0", 2).status is ACCEPTED  # one step old: within the limit


def test_a_gradient_is_never_applied_twice():
    ps = PS(workers=["w0"])
    assert ps.push("w0", 0).applies
    assert ps.push("w0", 0).status is DUPLICATE  # a retried push
    assert ps.push("w0", 1).applies
    assert ps.push("w0", 0).status is DUPLICATE  # a late copy of an older push
    assert ps.applied == [("w0", 0), ("w0", 1)] and ps.modes.workers["w0"].clock == 2


def test_a_skipped_push_ends_the_iteration_without_an_update():
    ps = PS(bound=0, workers=["w0", "w1"])
    before = ps.weights()
    v = ps.push("w0", 0, finite=False)
    assert v.status is SKIPPED and v.clock == 1 and not v.applies and v.advances
    assert ps.weights() == before and ps.step == 1 and ps.modes.staleness_counts == {}
    assert not ps.modes.may_pull("w0")  # s = 0: it waits for w1's iteration 0
    assert ps.push("w1", 0).staleness == 1  # the skipped iteration counts as a step
    assert ps.modes.may_pull("w0")


@pytest.mark.parametrize("bad", [(-1, 0), (1, 0)])
def test_steps_outside_the_past_and_unknown_workers_are_caller_bugs(bad):
    ps = PS(workers=["w0"])
    with pytest.raises(ValueError):
        ps.modes.push("w0", bad[0], bad[1], True, 0.0)
    with pytest.raises(KeyError):
        ps.modes.push("nobody", 0, 0, True, 0.0)


# ---- SSP ---------------------------------------------------------------------------------
def test_ssp_holds_the_fastest_within_s_clocks_of_the_slowest():
    ps = PS(bound=2, workers=["w0", "w1", "w2"])
    for i in range(3):
        assert ps.modes.may_pull("w0")
        ps.push("w0", ps.step, now=float(i))
    assert ps.modes.workers["w0"].clock == 3 and not ps.modes.may_pull("w0")  # 0 < 3 - 2
    wait = ps.modes.wait("w0", now=10.0)
    assert (wait.clock, wait.needs, wait.slowest) == (3, 1, 0)
    assert wait.stragglers == (("w1", 10.0), ("w2", 10.0)) and ps.modes.spread == 3
    ps.push("w1", 0, now=11.0)
    assert not ps.modes.may_pull("w0") and ps.modes.wait("w0", 12.0).stragglers == (("w2", 12.0),)
    ps.push("w2", 1, now=12.0)
    assert ps.modes.may_pull("w0") and ps.modes.wait("w0", 12.0) is None and ps.modes.floor == 1


def test_s0_is_lockstep():
    ps = PS(bound=0, workers=["w0", "w1"])
    for step in range(3):
        assert ps.modes.may_pull("w0") and ps.modes.may_pull("w1")
        ps.push("w0", 2 * step)
        assert not ps.modes.may_pull("w0") and ps.modes.may_pull("w1")
        ps.push("w1", 2 * step)
    assert ps.modes.spread == 0 and ps.modes.floor == 3


def test_leave_or_lease_expiry_releases_the_bound_at_once():
    lease, seen = 5.0, {}
    ps = PS(bound=1, workers=["w0", "w1", "w2"])
    now = 0.0
    for _ in range(2):
        now += 1.0
        ps.push("w0", ps.step, now)
        seen["w0"] = seen["w2"] = now  # w2 heartbeats; w1 has gone silent since 0
    assert not ps.modes.may_pull("w0")
    now = 5.5
    expired = [w for w in ("w1",) if seen.get(w, 0.0) + lease < now]
    assert expired == ["w1"]
    ps.modes.drop("w1", now)  # the core's tick: the lease ran out
    assert not ps.modes.may_pull("w0")  # w2 is still at 0
    ps.modes.drop("w2", now)  # a leave
    assert ps.modes.may_pull("w0") and ps.modes.floor == 2 and ps.modes.live_count() == 1
    ps.modes.drop("w0", now)
    assert ps.modes.floor == 2 and ps.modes.spread == 0  # nobody live: the floor stays


def test_a_newcomer_joins_at_the_floor_and_a_returner_keeps_its_clock():
    ps = PS(bound=1, workers=["w0", "w1"])
    for _ in range(2):
        ps.push("w0", ps.step)
        ps.push("w1", ps.step)
    ps.push("w0", ps.step)  # clocks: w0 3, w1 2
    assert ps.modes.join("w2", 1.0) == 2  # the slowest live clock: blocks nobody, waits for nobody
    assert ps.modes.may_pull("w2") and ps.modes.floor == 2
    ps.modes.drop("w0", 2.0)
    assert ps.modes.join("w0", 3.0) == 3  # back: leaving did not reset it
    ps.modes.drop("w1", 4.0)
    ps.modes.drop("w2", 4.0)
    ps.push("w0", ps.step)
    ps.push("w0", ps.step)  # alone: floor 5
    assert ps.modes.join("w1", 5.0) == 5 and ps.modes.floor == 5  # a returner below the floor comes up to it


def test_checkpoint_keeps_clocks_and_floor_but_no_duplicate_memory():
    ps = PS(bound=2, workers=["w0", "w1"])
    for _ in range(3):
        ps.push("w0", ps.step)
    ps.push("w1", ps.step)
    data = ps.modes.export()
    assert data == {"floor": 1, "clocks": {"w0": 3, "w1": 1}}
    again = BoundedStaleness(2)
    again.load(data, now=100.0)
    assert again.live_count() == 0 and again.floor == 1 and again.spread == 0
    assert again.join("w0", 101.0) == 3 and again.may_pull("w0")  # w1 is not live: it blocks nobody
    assert again.floor == 3  # the first one back is the slowest live worker
    assert again.join("w1", 102.0) == 3 and again.may_pull("w0")  # so w1 comes back at the floor
    assert again.push("w1", 0, 0, True, 103.0).applies  # the restored PS is at an older step: not a duplicate


def test_percentiles_are_nearest_rank_over_the_applied_gradients():
    m = BoundedStaleness()
    assert m.percentile(50) is None
    m.staleness_counts = {0: 5, 3: 4, 10: 1}
    assert [m.percentile(q) for q in (10, 50, 51, 90, 99, 100)] == [0, 0, 3, 3, 10, 10]


def test_for_mode():
    assert BoundedStaleness.for_mode("sync", 2, None) is None
    a, s = BoundedStaleness.for_mode("async", 2, 5), BoundedStaleness.for_mode("ssp", 2, None)
    assert (a.bound, a.max_staleness, s.bound, s.max_staleness) == (None, 5, 2, None)
    with pytest.raises(ValueError):
        BoundedStaleness.for_mode("hogwild", 2, None)
    with pytest.raises(ValueError):
        BoundedStaleness(-1)


# ---- properties ---------------------------------------------------------------------------
KINDS = ["work"] * 7 + ["nan", "retry", "leave", "join", "tick"]
STEPS = (0.0, 0.5, 1.0, 2.0)
#: one int per action, read as (what, which worker, seconds passing) by :func:`decode` (cheap to draw);
#: "work" is a worker's next move: pull when it holds no weights, else push
ACTIONS = st.integers(0, len(KINDS) * 5 * len(STEPS) - 1)


def decode(action: int) -> tuple[str, int, float]:
    kind, rest = divmod(action, 5 * len(STEPS))
    return KINDS[kind], rest % 5, STEPS[rest // 5]


def simulate(k, bound, max_staleness, spec, actions, lease=6.0):
    """Run ``actions`` ((what, worker index, seconds) each) against a PS and an independent model of the rules;
    assert the rules after each one."""
    names = [f"w{i}" for i in range(k)]
    ps = PS(bound, max_staleness, spec, names)
    clock = {w: 0 for w in names}  # the model: clocks, live set, floor, highest step pushed
    live, last_step, floor = set(names), {w: -1 for w in names}, 0
    holding: dict[str, tuple[int, int]] = {}  # worker -> (step of the weights it got, its clock then)
    seen, now, verdicts = {w: 0.0 for w in names}, 0.0, []

    def allowed(w):
        return bound is None or all(clock[v] >= clock[w] - bound for v in live)

    for kind, i, dt in actions:
        now += dt
        w = names[i % k]
        if kind == "tick":  # leases: a worker silent for `lease` seconds is dropped
            for v in sorted(live):
                if seen[v] + lease < now:
                    live.discard(v)
                    holding.pop(v, None)
                    ps.modes.drop(v, now)
                    if live:  # one drop at a time: the last live one leaves the floor at its clock
                        floor = min(clock[u] for u in live)
        elif w not in live:  # a dead worker's move is to register again
            if kind in ("work", "join"):
                clock[w] = max(clock[w], floor)
                live.add(w)
                seen[w] = now
                assert ps.modes.join(w, now) == clock[w]
        elif kind == "leave":
            live.discard(w)
            holding.pop(w, None)
            ps.modes.drop(w, now)
        elif kind == "work" and w not in holding:
            seen[w] = now
            granted = ps.modes.may_pull(w)
            assert granted == allowed(w)  # never past the bound, and never held back within it
            if granted:
                holding[w] = (ps.step, clock[w])
        elif kind in ("work", "nan") and w in holding:
            seen[w] = now
            step, _ = holding.pop(w)
            before = ps.weights()
            v = ps.push(w, step, now, finite=kind == "work")
            want = (DUPLICATE if step <= last_step[w] else SKIPPED if kind == "nan"
                    else STALE if max_staleness is not None and v.staleness > max_staleness else ACCEPTED)
            assert v.status is want
            last_step[w] = max(last_step[w], step)
            if want in (ACCEPTED, SKIPPED):
                clock[w] += 1
            if not v.applies:
                assert ps.weights() == before
            verdicts.append((v.status, v.staleness))
        elif kind == "retry" and last_step[w] >= 0:
            seen[w] = now
            before = ps.weights()
            assert ps.push(w, last_step[w], now).status is DUPLICATE and ps.weights() == before
        if live:
            low = min(clock[v] for v in live)
            assert low >= floor  # the slowest live clock never goes down
            floor = low
            assert (ps.modes.floor, ps.modes.spread) == (floor, max(clock[v] for v in live) - floor)
        for v in live:
            assert ps.modes.workers[v].clock == clock[v]
        if bound is not None:  # every read granted so far is still within the bound: SSP's guarantee
            assert all(floor >= c - bound for _, c in holding.values())
            assert ps.modes.spread <= bound + 1
        assert not live or any(ps.modes.may_pull(v) for v in live)  # no deadlock: the slowest may always go on
    assert len(set(ps.applied)) == len(ps.applied) == ps.modes.applied()
    assert ps.step == len(ps.applied) + sum(s is SKIPPED for s, _ in verdicts)
    return ps, verdicts


@settings(max_examples=100, deadline=None)
@given(k=st.integers(1, 5), bound=st.sampled_from([None, 0, 1, 2, 8]), max_staleness=st.sampled_from([None, 0, 2]),
       actions=st.lists(ACTIONS, min_size=20, max_size=100))
def test_ssp_and_async_rules_hold_and_weights_equal_a_numpy_replay(k, bound, max_staleness, actions):
    ps, verdicts = simulate(k, bound, max_staleness, SGD, [decode(a) for a in actions])
    assert ps.weights() == numpy_sgd_replay(ps.applied)
    target(float(len(ps.applied)), label="gradients applied")
    target(float(sum(s is not ACCEPTED for s, _ in verdicts)), label="pushes refused")


@settings(max_examples=40, deadline=None)
@given(k=st.integers(1, 4), bound=st.sampled_from([None, 1]), actions=st.lists(ACTIONS, min_size=20, max_size=60))
def test_a_fixed_arrival_order_gives_the_same_run_bit_for_bit(k, bound, actions):
    actions = [decode(a) for a in actions]
    first, verdicts = simulate(k, bound, None, ADAM, actions)
    second, again = simulate(k, bound, None, ADAM, actions)
    assert verdicts == again and first.applied == second.applied
    assert first.weights() == second.weights() == optimizer_replay(first.applied, ADAM)


@pytest.mark.parametrize("bound", [None, 0, 3])
def test_a_long_run_with_many_workers_and_stragglers(bound):
    """2,000 moves of 30 workers, a third of them slow (they move a fifth as often), with leaves and expiries."""
    rng = random.Random(bound)
    weights = [1.0 if i % 3 else 0.2 for i in range(30)]
    actions = [(rng.choices(KINDS, [6, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1])[0], rng.choices(range(30), weights)[0],
                rng.choice(STEPS) / 20) for _ in range(2000)]
    ps, _ = simulate(30, bound, None, SGD, actions, lease=5.0)
    assert len(ps.applied) > 50 and ps.weights() == numpy_sgd_replay(ps.applied)
    assert ps.modes.percentile(99) >= ps.modes.percentile(50) >= 0
