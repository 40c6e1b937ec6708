"""Weights a worker keeps stay its own while later steps' answers are read: the answer buffers the stock transports
reuse (shared/rawhttp.py's two per connection, a sharded worker's two assembled sets) are handed out again only once
nothing views them (shared/refs.py).

A worker (the stock transport, through a real PS in this process: tests/live_ps.py) keeps step 1's weights, as the
PyTorch bridge or a user's loop might, and holds each later step's until the next one is read (as the worker's loop
holds the weights it computes with while its push's answer comes). Over one PS and over two shards, with whole pulls
and partitioned rounds (the next weights pulled partition by partition alongside the push, a chunked answer): the kept
arrays keep their bits to the end, each held one until it is let go, every answer is the PS's weights; and the
pools were asked about the kept weights' buffer while it was kept, and told it is in use (the check was made, not
skipped by a pool that never looked at that buffer).

In a job with weight deltas (topk compression on one PS) the transport writes each answer's delta into its own held
copy (worker_service/transport/http.py, HeldWeights): the views a worker kept of step 0 keep their bits, the held
tensors they viewed took step 1's delta in fresh copies (one each, then in place again), and the held copy is the PS's
weights. The stock loop (worker_service/loop.py) lets a step's weights go before its push: over a job of STEPS steps of
deltas it never makes such a copy.
"""
from __future__ import annotations

import sys
from types import SimpleNamespace

import numpy as np
import pytest

from shared import rawhttp, refs
from tests.live_ps import live_ps
from tests.test_shards import two_shards
from tests.timing import allow
from worker_service.client import PSClient
from worker_service.loop import train
from worker_service.transport import sharded
from worker_service.transport.http import HeldWeights

LR = 0.5
#: three tensors of 96 KiB, which 64 KiB partitions (and two shards) cut, and one of 32 KiB that a partition (and a
#: shard) holds whole: a view of its answer's buffer; every answer is over rawhttp's 64 KiB pool threshold
W0 = {name: np.linspace(-1, 1, n, dtype=np.float32) + i for i, (name, n) in enumerate(
    (("a", 24_576), ("b", 24_576), ("c", 24_576), ("d", 8_192)))}
STEPS = 6
KEPT = 1  # the step whose weights are kept to the end


def gradient(step: int) -> dict[str, np.ndarray]:
    return {k: np.full_like(v, 0.25 * (step + 1)) for k, v in W0.items()}


def owner(a: np.ndarray) -> np.ndarray:
    """The array whose memory ``a`` views (through numpy views and memoryviews): a pooled buffer, or ``a`` itself."""
    while True:
        base = a.base
        if isinstance(base, memoryview):
            base = base.obj
        if not isinstance(base, np.ndarray):
            return a
        a = base


@pytest.fixture
def asked(monkeypatch) -> list[tuple[int, bool]]:
    """Every ``refs.free`` question the worker's pools ask (rawhttp's answer buffers, a sharded worker's sets):
    (the buffer's id, the answer). The PS's own pool, in this process too, is left alone."""
    seen: list[tuple[int, bool]] = []

    def free(obj: object) -> bool:  # refs.free's own count, in a frame of its shape (one parameter, the call)
        verdict = sys.getrefcount(obj) <= refs.FREE_COUNT
        seen.append((id(obj), verdict))
        return verdict

    for module in (rawhttp, sharded):
        monkeypatch.setattr(module, "refs", SimpleNamespace(free=free))
    return seen


def train_keeping(url: str, asked: list[tuple[int, bool]]) -> None:
    client = PSClient(url, timeout=allow(10), attempts=1)
    try:
        wid = client.join("w", lambda mode: (W0, {"name": "sgd", "learning_rate": LR}))["worker_id"]
        expect = {k: v.copy() for k, v in W0.items()}
        got = client.pull(0, wid, allow(10))
        held: list[tuple[int, dict, dict]] = []  # (step, its weights, their bits): the kept step's and the last
        for step in range(STEPS):
            assert client.push(wid, step, gradient(step))["status"] == "accepted"
            del got
            got = client.pull(step + 1, wid, allow(10))
            assert got.step == step + 1
            for k, v in got.tensors.items():
                expect[k] -= np.float32(LR) * gradient(step)[k]
                assert v.tobytes() == expect[k].tobytes(), f"step {step + 1} {k}: not the PS's weights"
            for s, tensors, bits in held:
                assert {k: v.tobytes() for k, v in tensors.items()} == bits, f"step {s}'s weights changed at {step + 1}"
            held = [h for h in held if h[0] == KEPT] + [(got.step, got.tensors, {k: v.tobytes()
                                                                                 for k, v in got.tensors.items()})]
            if got.step == KEPT:
                since = len(asked)
                kept = {id(owner(v)) for v in got.tensors.values()} - {id(v) for v in got.tensors.values()}
                assert kept, "the kept weights view no buffer: nothing to check"
        assert any(i in kept and not verdict for i, verdict in asked[since:]), \
            "no pool asked about the kept weights' buffer while they were kept"
        assert not any(i in kept and verdict for i, verdict in asked[since:])
    finally:
        client.close()


@pytest.mark.parametrize("partition_bytes", [0, 64 << 10], ids=["whole", "partitioned"])
def test_one_ps(partition_bytes, asked):
    with live_ps(min_workers=1, startup_grace_seconds=0, shm_dir="", partition_bytes=partition_bytes) as ps:
        train_keeping(ps.url, asked)


@pytest.mark.parametrize("partition_bytes", [0, 64 << 10], ids=["whole", "partitioned"])
def test_two_shards(partition_bytes, asked):
    # each 96 KiB tensor cut between the shards (pieces of 16,384 elements): assembled into the worker's kept sets
    with two_shards(min_workers=1, shard_split_elements=16_384, partition_bytes=partition_bytes) as (c, f):
        train_keeping(c.url, asked)
        assert c.rt.core.global_step == f.rt.core.global_step == STEPS


def test_weights_kept_in_a_job_with_weight_deltas():
    with live_ps(min_workers=1, startup_grace_seconds=0, shm_dir="", compression="topk") as ps:
        client = PSClient(ps.url, timeout=allow(10), attempts=1)
        try:
            wid = client.join("w", lambda mode: (W0, {"name": "sgd", "learning_rate": LR}))["worker_id"]
            kept = client.pull(0, wid, allow(10)).tensors
            bits = {k: v.tobytes() for k, v in kept.items()}
            for step in range(2):
                assert client.push(wid, step, gradient(step))["status"] == "accepted"
                assert client.pull(step + 1, wid, allow(10)).step == step + 1
            held = client.tensors.current.held
            assert held.lineage is not None and held.step == 2  # the answers were deltas on a held copy
            assert {k: v.tobytes() for k, v in kept.items()} == bits, "step 0's weights changed under the worker"
            assert held.copies == len(W0)  # step 1's delta, into copies of the tensors step 0's views viewed; then none
            assert all(held.tensors[k].tobytes() == v.tobytes() for k, v in ps.rt.core.weights.items())
        finally:
            client.close()


class KeepsNothing:
    """A task of the stock loop over W0 (the gradients of :func:`gradient`), keeping nothing of the weights."""
    name = "kept"

    def init_params(self) -> dict[str, np.ndarray]:
        return {k: v.copy() for k, v in W0.items()}

    def optimizer(self, mode: str = "sync") -> dict:
        return {"name": "sgd", "learning_rate": LR}

    def batch(self, step: int, shard_index: int, shard_count: int, batch_size: int) -> int:
        return step

    def loss_and_grads(self, params, batch: int):
        return float(params["a"][0]), gradient(batch), 1

    def evaluate(self, params) -> dict[str, float]:
        return {"a0": float(params["a"][0])}


@pytest.fixture
def deltas(monkeypatch) -> list[int]:
    """The step of every delta a worker's held copy takes."""
    steps: list[int] = []
    apply = HeldWeights._apply
    monkeypatch.setattr(HeldWeights, "_apply", lambda self, meta, *a: steps.append(meta["step"]) or apply(self, meta, *a))
    return steps


def test_the_stock_loop_makes_no_copy_in_a_job_with_weight_deltas(deltas):
    with live_ps(min_workers=1, startup_grace_seconds=0, shm_dir="", compression="topk", max_steps=STEPS) as ps:
        client = PSClient(ps.url, timeout=allow(10), attempts=1)
        try:
            summary = train(client, KeepsNothing(), "w", 1, prefetch=False)
            held = client.tensors.current.held
            assert summary.done and summary.steps == STEPS and deltas == list(range(1, STEPS + 1))
            assert held.copies == 0, "the stock loop still viewed the held copy when a delta came"
            assert all(held.tensors[k].tobytes() == v.tobytes() for k, v in ps.rt.core.weights.items())
        finally:
            client.close()

