"""Element-wise work split over the cores (ps_service/core/cores.py): every element exactly once, the same bits as one
numpy call, the caller's error state in every part, errors raised once every part is over, and a part no helper
could start done by the caller (a busy machine never waits for a core)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from ps_service.core import cores
from ps_service.core.accumulator import _add_into
from ps_service.core.optimizers import WHOLE_BYTES, _sgd_mean


@pytest.fixture(autouse=True)
def two_or_more_parts(monkeypatch):
    monkeypatch.setattr(cores, "parts", lambda: 3)  # whatever this machine has: several parts, odd bounds


@pytest.mark.parametrize("size", [0, 1, cores.MIN_ELEMENTS - 1, cores.MIN_ELEMENTS, cores.MIN_ELEMENTS + 1,
                                  3_000_017])
def test_every_element_is_done_exactly_once(size):
    seen = np.zeros(size, np.int32)
    calls = []

    def fn(lo, hi):
        calls.append((lo, hi))
        np.add(seen[lo:hi], 1, out=seen[lo:hi])
    cores.split(fn, size)
    assert (seen == 1).all()
    assert (len(calls) > 3) if size >= cores.MIN_ELEMENTS else (calls == [(0, size)])
    assert all(lo % cores.ALIGN_ELEMENTS == 0 for lo, _ in calls)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("n", [1_000_003, WHOLE_BYTES // 4 + 12_345])
def test_the_fold_and_sgd_give_the_bits_of_one_numpy_call(dtype, n):
    rng = np.random.default_rng(n)
    w, g, acc = (rng.standard_normal(n).astype(dtype) for _ in range(3))
    want_acc = acc + g
    mean = want_acc / dtype(3)
    want_w = w - mean * dtype(0.01)
    _add_into(acc, g)
    assert acc.tobytes() == want_acc.tobytes()
    _sgd_mean(w, acc, 3, dtype(0.01))
    assert w.tobytes() == want_w.tobytes()


def test_every_part_runs_under_the_callers_error_state():
    big = np.full(cores.MIN_ELEMENTS * 3, 3e38, np.float32)
    with np.errstate(over="raise"):
        with pytest.raises(FloatingPointError):
            cores.split(lambda lo, hi: np.add(big[lo:hi], big[lo:hi]), big.size)
    with np.errstate(over="ignore"):
        cores.split(lambda lo, hi: np.add(big[lo:hi], big[lo:hi]), big.size)  # no warning, no error


def test_an_error_in_a_part_is_raised_after_every_part_is_over():
    done = []

    def fn(lo, hi):
        if lo > 0:
            raise ValueError(f"part at {lo}")
        done.append(lo)
    with pytest.raises(ValueError, match="part at"):
        cores.split(fn, cores.MIN_ELEMENTS * 3)
    assert done == [0]


def test_pieces_no_helper_could_start_are_done_by_the_caller():
    cores.split(lambda lo, hi: None, cores.MIN_ELEMENTS * 3)  # the helper threads exist
    release = threading.Event()
    blockers = [cores._pool.submit(release.wait, 30) for _ in range(cores.MAX_PARTS - 1)]  # every helper busy
    try:
        by = []
        cores.split(lambda lo, hi: by.append((threading.current_thread(), hi - lo)), cores.MIN_ELEMENTS * 3)
        assert {t for t, _ in by} == {threading.current_thread()} and sum(n for _, n in by) == cores.MIN_ELEMENTS * 3
    finally:
        release.set()
        for b in blockers:
            b.result(timeout=30)
