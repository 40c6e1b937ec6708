"""Partitions of a round (shared/partitions.py, ps_service/core/partitions.py, docs/partitions.md), by simulation: the
plan covers every element once, in order; and a round summed and applied partition by partition (one rank-order
accumulator per partition, arrivals shuffled across workers and partitions, partitions closing in the order their
last gradient comes, the optimizer's step advanced by the first) ends with the weights, slots and iteration count of
today's core, bit for bit, for every optimizer of either flavor, mean and sum, float32 and float64, at Q = 1 to one
element a partition."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from ps_service.core import ParameterServerCore
from ps_service.core.rounds import Accumulator
from ps_service.core.errors import CoreError
from ps_service.monitoring import awaited
from shared.partitions import plan
from shared.protocol import ModelInit, PushRequest, PushStatus
from shared.shards import spec_of
from tests.configs import core_config

SHAPES = {"a": (7, 5), "b": (5,), "buffer:bn.mean": (3,), "c": (1,)}
OPTIMIZERS = [
    {"name": "sgd", "learning_rate": 0.1},
    {"name": "momentum", "learning_rate": 0.1, "momentum": 0.9},
    {"name": "momentum", "learning_rate": 0.1, "momentum": 0.9, "nesterov": True},
    {"name": "adam", "learning_rate": 0.1},
    {"name": "adagrad", "learning_rate": 0.1},
    {"name": "sgd", "learning_rate": 0.1, "flavor": "torch", "weight_decay": 0.01},
    {"name": "sgd", "learning_rate": 0.1, "flavor": "torch", "momentum": 0.9, "nesterov": True},
    {"name": "adam", "learning_rate": 0.1, "flavor": "torch", "weight_decay": 0.01},
    {"name": "adamw", "learning_rate": 0.1, "flavor": "torch"},
    {"name": "adagrad", "learning_rate": 0.1, "flavor": "torch", "lr_decay": 0.01},
]
WORKERS, STEPS = 3, 4


def weights0(dtype: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(7)
    return {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}


def gradient(step: int, rank: int, dtype: str) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(1000 * step + rank)
    return {k: rng.standard_normal(s).astype(dtype) for k, s in SHAPES.items()}


def core(optimizer: dict, aggregation: str, dtype: str, **cfg) -> tuple[ParameterServerCore, list[str]]:
    c = ParameterServerCore(core_config(min_workers=WORKERS, startup_grace_seconds=0.0, aggregation=aggregation, **cfg))
    c.init_model(ModelInit(weights0(dtype), dict(optimizer)), 0.0)
    return c, [c.register(f"w{i}", 0.0)[0].worker_id for i in range(WORKERS)]


def state(c: ParameterServerCore) -> dict[str, bytes]:
    out = {f"w/{k}": v.tobytes() for k, v in c.weights.items()}
    out.update({f"{s}/{k}": v.tobytes() for s, t in c.optimizer.slots.items() for k, v in t.items()})
    return out | {"iterations": str(c.optimizer.iterations).encode()}


def today(optimizer: dict, aggregation: str, dtype: str, seed: int) -> dict[str, bytes]:
    """The core as it is: whole pushes, arrivals shuffled."""
    c, ids = core(optimizer, aggregation, dtype)
    rng = random.Random(seed)
    for step in range(STEPS):
        for rank in rng.sample(range(WORKERS), WORKERS):
            assert c.push(PushRequest(ids[rank], step, gradient(step, rank, dtype)), 0.0).status is PushStatus.ACCEPTED
    assert c.global_step == STEPS
    return state(c)


def partitioned(optimizer: dict, aggregation: str, dtype: str, partition_bytes: int, seed: int) -> dict[str, bytes]:
    """The same rounds partition by partition: each worker's frames in partition order, workers interleaved at
    random; a partition closes (summed, applied) when its last gradient is in."""
    c, ids = core(optimizer, aggregation, dtype)
    p = plan(spec_of(c.weights), partition_bytes)
    rng = random.Random(seed)
    for step in range(STEPS):
        grads = {rank: gradient(step, rank, dtype) for rank in range(WORKERS)}
        accs = [Accumulator(p.keys[q], aggregation) for q in range(p.count)]
        missing = [set(range(WORKERS)) for _ in range(p.count)]
        sent = {rank: 0 for rank in range(WORKERS)}  # each worker's next partition
        closed = 0
        while closed < p.count:
            rank = rng.choice([r for r in range(WORKERS) if sent[r] < p.count])
            q = sent[rank]
            sent[rank] += 1
            missing[q].discard(rank)
            frame = {k: v.copy() for k, v in p.split(grads[rank], q).items()}
            accs[q].apply(ids[rank], rank, frame, tuple((r, ids[r]) for r in missing[q]))
            if not missing[q]:
                total, n = accs[q].take_sum()
                c.update(total, consume=True, mean_of=n, pieces=p.partitions[q], advance=closed == 0)
                closed += 1
    return state(c)


@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: f"{o.get('flavor', 'tf1')}-{o['name']}"
                         + ("-nesterov" if o.get("nesterov") else "") + ("-m" if o.get("momentum") else ""))
@pytest.mark.parametrize("aggregation", ["mean", "sum"])
def test_a_round_partition_by_partition_is_todays_bit_for_bit(optimizer, aggregation):
    for dtype in ("float32", "float64"):
        want = today(optimizer, aggregation, dtype, seed=1)
        for partition_bytes in (0, 4, 24, 60, 10_000):  # Q = 1, one element a partition, uneven cuts, whole
            for seed in (1, 2):
                got = partitioned(optimizer, aggregation, dtype, partition_bytes, seed)
                assert got.keys() == want.keys()
                diff = sorted(k for k in want if got[k] != want[k])
                assert not diff, f"{dtype}, {partition_bytes} bytes a partition, seed {seed}: {diff} differ"


@pytest.mark.parametrize("partition_bytes", [0, 1, 4, 8, 20, 24, 60, 140, 10_000])
def test_the_plan_covers_every_element_once_in_order(partition_bytes):
    spec = {**{k: (s, "float32") for k, s in SHAPES.items()}, "d": ((2, 2), "float64")}
    p = plan(spec, partition_bytes)
    pieces = [piece for part in p.partitions for piece in part]
    assert [x.name for x in pieces] == sorted(x.name for x in pieces)
    for name, (shape, dtype) in spec.items():
        mine = [x for x in pieces if x.name == name]
        assert mine[0].start == 0 and mine[-1].stop == math.prod(shape)
        assert all(a.stop == b.start for a, b in zip(mine, mine[1:]))
        assert all(x.whole == (len(mine) == 1) for x in mine)
    item = {name: np.dtype(d).itemsize for name, (_, d) in spec.items()}
    for part in p.partitions:  # within the size, unless one element is larger
        nbytes = sum(x.size * item[x.name] for x in part)
        assert partition_bytes == 0 or nbytes <= partition_bytes or (len(part) == 1 and part[0].size == 1)
    assert p.whole == (p.count == 1)
    assert (p.count == 1) == (partition_bytes in (0, 10_000))
    if partition_bytes:  # a partition is cut only where the next piece would not fit
        for a, b in zip(p.partitions, p.partitions[1:]):
            assert sum(x.size * item[x.name] for x in (*a, b[0])) > partition_bytes


def test_split_gives_views_of_the_partitions_elements():
    w = weights0("float32")
    p = plan(spec_of(w), 24)
    flat = np.concatenate([w[k].reshape(-1) for k in sorted(w)])
    got = np.concatenate([v.reshape(-1) for q in range(p.count) for v in
                          (p.split(w, q)[x.key] for x in p.partitions[q])])
    assert got.tobytes() == flat.tobytes()
    some = p.split(w, p.count - 1)
    assert all(np.shares_memory(v, w[x.name]) for x, v in zip(p.partitions[-1], (some[x.key] for x in p.partitions[-1])))


# ---- the core's partitioned rounds (ParameterServerCore.partition_bytes) ---------------------------------------
def partitioned_core(optimizer: dict, partition_bytes: int, workers: int = WORKERS, dtype: str = "float32",
                     **cfg) -> tuple[ParameterServerCore, list[str]]:
    c = ParameterServerCore(core_config(min_workers=workers, startup_grace_seconds=0.0, **cfg))
    c.partition_bytes = partition_bytes
    c.init_model(ModelInit(weights0(dtype), dict(optimizer)), 0.0)
    return c, [c.register(f"w{i}", 0.0)[0].worker_id for i in range(workers)]


def frame(c: ParameterServerCore, wid: str, step: int, rank: int, q: int, now: float = 0.0, dtype: str = "float32"):
    g = {k: v.copy() for k, v in c.partitions.split(gradient(step, rank, dtype), q).items()}
    return c.push(PushRequest(wid, step, g, partition=q), now)


@pytest.mark.parametrize("optimizer", [OPTIMIZERS[0], OPTIMIZERS[3], OPTIMIZERS[8]], ids=["sgd", "adam", "torch-adamw"])
@pytest.mark.parametrize("aggregation", ["mean", "sum"])
@pytest.mark.parametrize("partition_bytes", [4, 24, 60])
def test_the_cores_partitioned_rounds_end_with_todays_bits(optimizer, aggregation, partition_bytes):
    """Each worker's frames in partition order, workers interleaved at random: every frame accepted, the step
    advancing only with a round's last partition, and the weights, slots and iteration count today's."""
    want = today(optimizer, aggregation, "float32", seed=1)
    for seed in (1, 2, 3):
        c, ids = partitioned_core(optimizer, partition_bytes, aggregation=aggregation)
        q_count, rng = c.partitions.count, random.Random(seed)
        assert q_count > 1
        for step in range(STEPS):
            sent = {rank: 0 for rank in range(WORKERS)}
            while any(n < q_count for n in sent.values()):
                rank = rng.choice([r for r in range(WORKERS) if sent[r] < q_count])
                assert c.global_step == step
                assert frame(c, ids[rank], step, rank, sent[rank]).status is PushStatus.ACCEPTED
                sent[rank] += 1
            assert c.global_step == step + 1 and not c.deciding
        assert state(c) == want


def test_a_round_is_decided_by_partition_0_and_closes_with_its_last_partition():
    c, ids = partitioned_core(OPTIMIZERS[0], 100, workers=2)
    assert c.partitions.count == 3
    assert frame(c, ids[0], 0, 0, 0).status is PushStatus.ACCEPTED
    assert frame(c, ids[0], 0, 0, 2).status is PushStatus.ACCEPTED  # before the decision: held, not folded
    assert not c.deciding and c.global_step == 0
    assert frame(c, ids[1], 0, 1, 0).status is PushStatus.ACCEPTED  # the decision
    assert c.deciding and c.global_step == 0 and "partitions [1, 2]" in c.wait_reason(0.0)
    assert awaited(c) == tuple(ids)  # /v1/status round.awaited: both owe frames (it listed anyone, done or not)
    late, start = c.register("late", 0.0)
    assert start == 1 and frame(c, late.worker_id, 0, 2, 0).status is PushStatus.LATE
    for rank, q in ((0, 1), (1, 2)):
        assert frame(c, ids[rank], 0, rank, q).status is PushStatus.ACCEPTED
    assert c.deciding and c.global_step == 0 and "partitions [1]" in c.wait_reason(0.0)
    assert awaited(c) == (ids[1],)  # worker 0 sent every frame: no longer awaited
    assert frame(c, ids[1], 0, 1, 1).status is PushStatus.ACCEPTED
    assert not c.deciding and c.global_step == 1 and c.rounds[-1].aggregated == 2
    assert late.worker_id in c.round.eligible  # the newcomer is in the next round


def test_frames_out_of_order_repeated_or_of_a_push_not_counted_change_nothing():
    c, ids = partitioned_core(OPTIMIZERS[3], 100, workers=2, replicas_to_aggregate=1)
    with pytest.raises(CoreError) as e:
        frame(c, ids[0], 0, 0, 1)
    assert e.value.code == "not_started"
    with pytest.raises(CoreError) as e:
        c.push(PushRequest(ids[0], 0, {}, partition=3), 0.0)
    assert e.value.code == "tensor_mismatch"
    assert frame(c, ids[0], 0, 0, 0).status is PushStatus.ACCEPTED  # R = 1: decided
    assert frame(c, ids[1], 0, 1, 0).status is PushStatus.LATE
    assert frame(c, ids[1], 0, 1, 1).status is PushStatus.LATE  # dropped with its push
    assert frame(c, ids[0], 0, 0, 1).status is PushStatus.ACCEPTED
    assert frame(c, ids[0], 0, 0, 1).status is PushStatus.DUPLICATE
    assert frame(c, ids[0], 0, 0, 2).status is PushStatus.ACCEPTED and c.global_step == 1
    # the weights: one Adam step of worker 0's gradient alone, as today's core makes it with R = 1
    ref, rids = core(OPTIMIZERS[3], "mean", "float32", replicas_to_aggregate=1)
    ref.push(PushRequest(rids[0], 0, gradient(0, 0, "float32")), 0.0)
    assert {k: v.tobytes() for k, v in c.weights.items()} == {k: v.tobytes() for k, v in ref.weights.items()}


def test_a_member_lost_after_the_decision_is_not_waited_for_in_its_missing_partitions():
    c, ids = partitioned_core(OPTIMIZERS[0], 100, workers=3, lease_seconds=5.0)
    for rank in range(3):
        assert frame(c, ids[rank], 0, rank, 0).status is PushStatus.ACCEPTED
    for rank in (0, 1):
        for q in (1, 2):
            assert frame(c, ids[rank], 0, rank, q, now=4.0).status is PushStatus.ACCEPTED
    assert c.deciding and c.global_step == 0
    c.tick(6.0)  # worker 2's lease ends: partitions 1 and 2 close with workers 0 and 1
    assert c.global_step == 1 and not c.deciding and c.rounds[-1].aggregated == 3
    assert_sgd_step_of_ranks_below(c, ((0, 3), (1, 2), (2, 2)))


def assert_sgd_step_of_ranks_below(c: ParameterServerCore, counts) -> None:
    """Step 0's weights: partition q, for each (q, n) of ``counts``, one SGD step (lr 0.1) of the mean of ranks 0..n-1's
    gradients (a buffer takes the mean)."""
    p, lr, w0 = c.partitions, np.float32(0.1), weights0("float32")
    for q, n in counts:
        for piece in p.partitions[q]:
            total = None
            for rank in range(n):
                g = p.split(gradient(0, rank, "float32"), q)[piece.key].copy()
                total = g if total is None else np.add(total, g, out=total)
            mean = total / np.float32(n)
            want = mean if piece.name.startswith("buffer:") else p.split(w0, q)[piece.key] - mean * lr
            assert p.split(c.weights, q)[piece.key].tobytes() == want.tobytes(), (q, piece.key)


@pytest.mark.parametrize("decided", [False, True])
def test_a_contributor_that_registers_again_while_active_is_not_waited_for_in_its_later_partitions(decided):
    """Worker 2's partition 0 is in when its process restarts under its name, within its lease: the new process starts
    at the next step and never sends the old one's later frames, so the round closes them without it (as for a member
    lost after the decision), before the decision or after it; before, the round waited for them while the worker's
    renewed lease kept it alive: for ever."""
    c, ids = partitioned_core(OPTIMIZERS[0], 100, workers=3, lease_seconds=5.0)
    for rank in (2, 0, 1) if decided else (2,):
        assert frame(c, ids[rank], 0, rank, 0).status is PushStatus.ACCEPTED
    assert c.deciding == decided
    m, start = c.register("w2", 1.0)
    assert (m.worker_id, start) == (ids[2], 1)
    for rank in (0, 1):
        for q in range(1 if decided else 0, 3):
            assert frame(c, ids[rank], 0, rank, q, now=2.0).status is PushStatus.ACCEPTED
    assert c.global_step == 1 and not c.deciding and c.rounds[-1].aggregated == 3
    assert_sgd_step_of_ranks_below(c, ((0, 3), (1, 2), (2, 2)))  # worker 2's partition 0 only


def test_async_and_ssp_keep_one_partition():
    c, _ = partitioned_core(OPTIMIZERS[0], 24, workers=1, mode="async")
    assert c.partitions is None and c.parts is None
