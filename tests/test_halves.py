"""float32 <-> bfloat16 / float16 (shared/halves.py): bit for bit the libraries' casts. Up: every 16-bit pattern.
Down: float32 patterns where rounding can go wrong (ties, the last value before a carry, the largest finite, the
subnormal range, Inf, NaN) and random ones, over chunk boundaries."""
from __future__ import annotations

import numpy as np
import pytest

from shared import halves as H, scan
from shared.codec import bfloat16

F32 = np.float32
U32 = np.uint32


def random_bits(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 1 << 32, n, dtype=np.uint64).astype(U32)


def check_down(convert, dtype, x: np.ndarray) -> None:
    with np.errstate(invalid="ignore", over="ignore"):  # the libraries warn on a NaN's or an overflow's cast
        want = x.astype(dtype)
    got = convert(x)
    assert got.dtype == dtype and got.shape == x.shape
    bad = np.flatnonzero(got.view(np.uint16).ravel() != want.view(np.uint16).ravel())
    assert bad.size == 0, [(hex(int(b)), hex(int(g)), hex(int(w))) for b, g, w in zip(
        x.view(U32).ravel()[bad[:5]], got.view(np.uint16).ravel()[bad[:5]], want.view(np.uint16).ravel()[bad[:5]])]


def test_bf16_conversions_are_ml_dtypes_casts_bit_for_bit():
    every = np.arange(1 << 16, dtype=np.uint16).view(bfloat16())
    assert np.array_equal(H.from_bf16(every).view(U32), every.astype(F32).view(U32))
    rng = np.random.default_rng(3)
    bits = random_bits(rng, 3 * scan.CHUNK + 11)
    edges = np.array([0x7F7FFFFF, 0x7F7F8000, 0x7F7F7FFF, 0x00008000, 0x00018000, 0x80008000, 0x3F808000,
                      0x3F818000, 0x3F80FFFF, 0x7F800000, 0xFF800000, 0, 0x80000000, 1, 0x7FFF], U32)
    nans = np.array([0x7FC00001, 0xFFFFFFFF], U32)  # apart: a chunk holding a NaN is the library's own cast
    for x in (bits.view(F32), edges.view(F32), nans.view(F32), bits.view(F32)[np.isfinite(bits.view(F32))],
              rng.standard_normal((7, 1001)).astype(F32)):
        check_down(H.to_bf16, bfloat16(), x)


def test_every_float16_widens_as_numpy_does():
    every = np.arange(1 << 16, dtype=np.uint16).view(H.F16)
    got = H.from_fp16(every.reshape(256, 256))
    assert got.dtype == F32 and got.shape == (256, 256)
    assert np.array_equal(got.ravel().view(U32), every.astype(F32).view(U32))
    pool = np.full(4 * (1 << 16), 0xAB, np.uint8)  # the PS's pooled buffer: written in place
    assert np.shares_memory(H.from_fp16(every, alloc=lambda n: pool[:n]), pool)
    assert np.array_equal(pool.view(U32), every.astype(F32).view(U32))


def float16_boundaries() -> np.ndarray:
    """Every finite float16 value as float32, the midpoint to the next one (a tie), and the float32s one step
    below and above each: both signs, Inf's neighbourhood and the subnormals included."""
    values = np.arange(0x7C00, dtype=np.uint16).view(H.F16).astype(np.float64)
    mids = (values[:-1] + values[1:]) / 2
    mids = np.append(mids, 65520.0)  # past 65504, the tie between the largest finite and (its next step) Inf
    points = np.concatenate([values, mids]).astype(F32).view(U32)
    near = np.concatenate([points - U32(1), points, points + U32(1)])
    near = np.concatenate([near, near | U32(0x80000000)])
    return near[~np.isnan(near.view(F32))]  # 0 - 1 is a NaN: a chunk holding one is numpy's own cast


@pytest.mark.parametrize("case", ["boundaries", "random bits", "random finite", "gradients", "edges"])
def test_to_fp16_is_numpys_cast_bit_for_bit(case):
    rng = np.random.default_rng(7)
    if case == "boundaries":
        x = float16_boundaries().view(F32)
    elif case == "random bits":  # every exponent; one NaN, whose chunk is numpy's own cast
        x = random_bits(rng, 3 * scan.CHUNK + 11).view(F32)
        x = x[~np.isnan(x)]
        x[scan.CHUNK + 5] = np.nan
    elif case == "random finite":  # exponents around float16's range: normals, subnormals, zeros, overflows
        exp = rng.integers(95, 150, 3 * scan.CHUNK + 5, dtype=np.uint64).astype(U32) << U32(23)
        x = (exp | (random_bits(rng, exp.size) & U32(0x807FFFFF))).view(F32)
    elif case == "gradients":
        x = (rng.standard_normal((5, 2 * scan.CHUNK + 3)) * 1e-3).astype(F32)
    else:
        x = np.array([0x477FE000, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x47800000, 0x7F7FFFFF, 0x7F800000,
                      0x38800000, 0x387FFFFF, 0x387FF000, 0x33800000, 0x33000000, 0x33000001, 0x337FFFFF,
                      0x32FFFFFF, 0x00000001, 0x007FFFFF, 0, 0x80000000, 0xFF800000, 0xC77FF000, 0x3F800FFF,
                      0x3F801000, 0x3F801001, 0x3F803000], U32).view(F32)
        check_down(H.to_fp16, H.F16, np.array([0x7FC00000, 0x7F800001, 0xFFFFFFFF], U32).view(F32))  # NaNs apart
    check_down(H.to_fp16, H.F16, x)


def test_to_fp16_overflows_to_inf_without_a_warning():
    x = np.array([65519.0, 65520.0, -1e9, np.inf, 3e38, 1e-30], F32)
    with np.errstate(all="raise"):
        got = H.to_fp16(x)
    assert got.tolist() == [65504.0, np.inf, -np.inf, np.inf, np.inf, 0.0]
