"""Partitions of a round (ps_service/core/partitions.py, docs/partitions.md), by simulation: the plan covers every
element once, in order; and a round summed and applied partition by partition (one rank-order accumulator per
partition, arrivals shuffled across workers and partitions, partitions closing in the order their last gradient
comes, the optimizer's step advanced by the first) ends with the weights, slots and iteration count of today's core,
bit for bit, for every optimizer of either flavor, mean and sum, float32 and float64, at Q = 1 to one element a
partition."""
from __future__ import annotations

import math
import random

import numpy as np
import pytest

from ps_service.core import ParameterServerCore
from ps_service.core.rounds import Accumulator
from ps_service.core.partitions import plan
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


def core(optimizer: dict, aggregation: str, dtype: str) -> tuple[ParameterServerCore, list[str]]:
    c = ParameterServerCore(core_config(min_workers=WORKERS, startup_grace_seconds=0.0, aggregation=aggregation))
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
        accs = [Accumulator(p.keys(q), aggregation) for q in range(p.count)]
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
