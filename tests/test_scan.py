"""shared/scan.py: the chunked scans give exactly np.flatnonzero's indices of the whole test, and top-k through them
picks exactly what the whole-array selection picks (ties, zeros, NaN and Inf included)."""
from __future__ import annotations

import math

import numpy as np
import pytest

from shared import compression as C
from shared import scan
from shared import weight_deltas as wd

SIZES = [1, 7, scan.CHUNK - 1, scan.CHUNK, scan.CHUNK + 1, 3 * scan.CHUNK + 5, 8 * C._SAMPLE + 13]


def whole_top_k(x: np.ndarray, k: int) -> np.ndarray:
    """The selection top_k makes, done on whole arrays (the implementation before shared/scan.py)."""
    flat = x.reshape(-1)
    n = flat.size
    if k >= n:
        return np.arange(n, dtype=C.U32)
    mag = np.abs(flat)
    if not np.isfinite(mag.max()):
        mag[~np.isfinite(mag)] = np.inf
    elif n > 8 * C._SAMPLE and k * 64 < n:
        sample = np.sort(mag[::n // C._SAMPLE])
        t = sample[max(0, sample.size - 1 - 2 * math.ceil(k * sample.size / n) - 8)]
        cand = np.flatnonzero(mag >= t)
        if cand.size >= k:
            return np.sort(cand[np.argpartition(mag[cand], cand.size - k)[cand.size - k:]]).astype(C.U32)
    return np.sort(np.argpartition(mag, n - k)[n - k:]).astype(C.U32)


@pytest.mark.parametrize("n", SIZES)
def test_magnitude_at_least_is_flatnonzero_of_the_whole_test(n):
    rng = np.random.default_rng(n)
    x = rng.standard_normal(n).astype(np.float32)
    x[rng.integers(0, n, max(1, n // 10))] = 0.0
    for t in (np.float32(0.0), np.float32(1.5), np.float32(9.0)):
        got = scan.magnitude_at_least(x, t)
        assert got.dtype == np.intp and np.array_equal(got, np.flatnonzero(np.abs(x) >= t))


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_magnitude_at_least_gives_up_on_nan_or_inf_in_any_chunk(bad):
    x = np.ones(3 * scan.CHUNK + 5, np.float32)
    x[-1] = bad  # in the last, short chunk
    assert scan.magnitude_at_least(x, np.float32(0.5)) is None


@pytest.mark.parametrize("n", SIZES)
def test_bits_differ_is_flatnonzero_and_stops_past_the_limit(n):
    rng = np.random.default_rng(n + 1)
    old = rng.integers(0, 2**32, n, dtype=np.uint32)
    for share in (0.0, 0.01, 0.5, 1.0):
        new = old.copy()
        new[rng.random(n) < share] ^= 1
        want = np.flatnonzero(old != new)
        assert np.array_equal(scan.bits_differ(old, new), want)
        limit = (n - 1) // 2
        got = scan.bits_differ(old, new, limit)
        assert (got is None) == (want.size > limit)
        assert got is None or np.array_equal(got, want)


def test_changed_indices_keeps_its_uint32_form_and_the_sparse_limit():
    n = 1001
    old = np.zeros(n, np.float32)
    new = old.copy()
    new[[3, 500, 1000]] = [1.0, -0.0, np.nan]  # -0.0 and NaN differ in bits
    got = wd.changed_indices(old, new, wd.sparse_limit(n))
    assert got.dtype == C.U32 and got.tolist() == [3, 500, 1000]
    new[: wd.sparse_limit(n) + 1] = 2.0
    assert wd.changed_indices(old, new, wd.sparse_limit(n)) is None
    assert all(wd.worth_sparse(k, n) == (k <= wd.sparse_limit(n)) for k in range(n + 1))


@pytest.mark.parametrize("case", ["normal", "ties", "half_zero", "nan", "inf"])
def test_top_k_picks_what_the_whole_array_selection_picks(case):
    rng = np.random.default_rng(7)
    n = 8 * C._SAMPLE + 4099  # large enough for the sampled threshold, cut into chunks with a short last one
    x = rng.standard_normal(n).astype(np.float32)
    if case == "ties":
        x = np.round(x * 2) / 2  # many equal magnitudes at the k-th
    elif case == "half_zero":
        x[: n // 2] = 0.0
    elif case == "nan":
        x[rng.integers(0, n, 3)] = np.nan
    elif case == "inf":
        x[[5, n - 1]] = [np.inf, -np.inf]
    for k in (1, n // 1000, n // 100, n // 65):
        got = C.top_k(x.copy(), k)
        assert got.dtype == C.U32 and np.array_equal(got, whole_top_k(x.copy(), k)), (case, k)
