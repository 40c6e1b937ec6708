"""The PS's buffer pool (ps_service/core/buffers.py): a buffer comes back once nothing views it, at any size
up to the pool's bounds; one in use never does; and a live PS over TCP makes its large body buffers once, not at
every push (a fresh buffer's pages are zeroed by the kernel: 17 % of the PS's CPU at 1e7 parameters)."""
from __future__ import annotations

import numpy as np
import pytest

from ps_service.core import buffers
from ps_service.core.buffers import ROUND_BYTES, BufferPool
from tests.live_ps import live_ps
from tests.timing import allow


def _addr(view: memoryview) -> int:
    return np.frombuffer(view, np.uint8).ctypes.data


def test_a_freed_buffer_serves_the_next_take_at_any_size():
    pool = BufferPool()
    for n in (100_000, 5 << 20, 40_000_123, 400_000_000):
        first = pool.take(n)
        where = _addr(first)
        del first
        again = pool.take(n - 77)  # a frame whose header is a few bytes shorter: the same buffer
        assert _addr(again) == where and len(again) == n - 77
        del again
    assert pool.made == 4


def test_a_buffer_in_use_is_never_handed_out():
    pool = BufferPool()
    a = pool.take(8 << 20)
    view = np.frombuffer(a, np.float32)[10:20]  # a numpy view of it is enough to hold it
    del a
    b = pool.take(8 << 20)
    assert _addr(b) != view.ctypes.data - 40
    del view, b
    assert pool.made == 2 and _addr(pool.take(8 << 20)) in {_addr(memoryview(k)) for k in pool._kept}


def test_a_small_take_leaves_a_model_sized_buffer_alone():
    pool = BufferPool()
    del_me = pool.take(40 << 20)
    del del_me
    small = pool.take(1 << 20)  # less than half of the free 40 MB buffer: a buffer of its own
    big = pool.take(40 << 20)
    assert pool.made == 2 and len(small) == 1 << 20 and len(big) == 40 << 20


def test_what_the_pool_keeps_is_bounded_in_count_and_bytes():
    pool = BufferPool(limit=5 * ROUND_BYTES, keep=3)
    held = [pool.take(2 * ROUND_BYTES) for _ in range(3)]
    assert len(pool._kept) == 2 and pool.kept_bytes == 4 * ROUND_BYTES  # a third would pass the bytes' bound
    held += [pool.take(ROUND_BYTES // 2) for _ in range(2)]
    assert len(pool._kept) == 3 and pool.kept_bytes == 4 * ROUND_BYTES + ROUND_BYTES // 2  # the count's bound
    assert pool.made == 5 and pool.take(100).obj.__class__ is bytearray  # below POOL_MIN_BUFFER: not pooled
    del held


@pytest.fixture(autouse=True)
def _a_pool_with_room():
    """The pool is the process's: earlier tests in this process may have left it its KEEP_BUFFERS buffers of other
    sizes kept, so that a live PS here could keep none of its own (each push a fresh buffer). Start with none kept."""
    buffers.POOL._kept.clear()


def ones_rounds(clients, wids, size: int, rounds: int) -> int:
    """``rounds`` rounds of every client pushing ones; the pool's count of buffers made after the third."""
    made = 0
    for step in range(rounds):
        for c, wid in zip(clients, wids):
            assert c.push(wid, step, {"w": np.ones(size, np.float32)})["status"] == "accepted"
        got = clients[0].pull(step + 1, wids[0], wait=allow(10.0))
        assert got.step == step + 1
        del got
        if step == 2:
            made = buffers.POOL.made
    return made


def test_a_live_ps_makes_its_large_body_buffers_once():
    """20 MB pushes over TCP, two workers, ten rounds: the bodies, the sum and the weights' frame come from buffers
    made in the first rounds (the old pool kept nothing above 16 MB: a fresh buffer per push)."""
    size, rounds = 5_000_000, 10
    with live_ps(total_num_replicas=2, lease_seconds=600) as ps:
        clients = [ps.client(), ps.client()]
        wids = [c.register(f"w{i}")["worker_id"] for i, c in enumerate(clients)]
        clients[0].init_model({"w": np.zeros(size, np.float32)}, {"name": "sgd", "learning_rate": 1.0})
        made_before = ones_rounds(clients, wids, size, rounds)
        np.testing.assert_array_equal(clients[1].pull(rounds, wids[1], wait=allow(10.0)).tensors["w"],
                                      np.full(size, -float(rounds), np.float32))
        assert buffers.POOL.made == made_before, f"{buffers.POOL.made - made_before} buffers made in 7 rounds"
        for c in clients:
            c.close()


@pytest.mark.parametrize("name", ["2bit", "bf16"])
def test_a_live_ps_decodes_compressed_pushes_into_buffers_made_once(name):
    """2-bit and bf16 pushes are decoded to float32 (a model-sized array per push) into the pool's buffers, not
    fresh arrays (whose pages the kernel zeroes at every step): from the third round on, every push's decoded
    tensor lies in a buffer the pool keeps, and ten rounds of 20 MB tensors make no buffer after the third. The
    weights are what the decoded pushes give."""
    size, rounds = 5_000_000, 10
    with live_ps(compression=name, compression_2bit_threshold=1.0, total_num_replicas=2, lease_seconds=600,
                 shm_dir="", startup_grace_seconds=0.0) as ps:
        core, where = ps.rt.core, []
        push = core.push

        def spy(req, now):
            where.append(req.tensors["w"].ctypes.data)
            return push(req, now)
        core.push = spy
        clients = [ps.client(), ps.client()]
        wids = [c.register(f"w{i}")["worker_id"] for i, c in enumerate(clients)]
        clients[0].init_model({"w": np.zeros(size, np.float32)}, {"name": "sgd", "learning_rate": 1.0})
        for c, wid in zip(clients, wids):
            assert c.attach(wid) == f"http+{name}"
        made_before = ones_rounds(clients, wids, size, rounds)
        kept = [(b.ctypes.data, b.ctypes.data + b.nbytes) for b in buffers.POOL._kept]
        assert len(where) == 2 * rounds
        assert all(any(lo <= at < hi for lo, hi in kept) for at in where[6:]), "a push decoded outside the pool"
        assert buffers.POOL.made == made_before, f"{buffers.POOL.made - made_before} buffers made in 7 rounds"
        w = core.weights["w"]
        assert w[0] == w[-1] == -float(rounds) and np.unique(w).size == 1  # 1.0 sent as 1.0 (2-bit: the threshold)
        for c in clients:
            c.close()
