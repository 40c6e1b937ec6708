"""A fused multiply-add for numpy arrays: ``fma(a, b, c) = a * b + c`` rounded once, as C's ``fma``.

torch's CPU kernels compute ``add(x, y, alpha)``, ``lerp`` and friends with one (``vec::fmadd``); numpy has none.

Contract: for float32 and float64 arrays (and scalars of that dtype; numpy's broadcasting) the result is the correctly
rounded value of the exact ``a * b + c``, element by element, provided nothing overflows and no intermediate is
subnormal (|a * b| and |c| above 1e-290 in float64, 1e-30 in float32, or 0), as for weights, gradients and slots.
Outside that range it may be off by one ulp.

How: float32 computes ``a * b`` exactly in float64 (24 + 24 bits fit in 53), adds ``c`` and rounds the
sum to odd in float64 (the error of the addition, by TwoSum, decides the last bit), then rounds to
float32: rounding to odd with two spare bits makes the second rounding exact. float64 splits the product
into ``p + e`` exactly (Dekker's TwoProduct), adds ``c`` exactly (``s + t``, TwoSum), rounds ``t + e``
to odd and adds it to ``s`` (Boldo and Melquiond, "Emulation of a FMA and correctly rounded sums:
proved algorithms using rounding to odd", IEEE TC 2008). Work is done in blocks of :data:`BLOCK`
elements so temporaries stay in cache.
"""
from __future__ import annotations

import numpy as np

#: elements per block of work
BLOCK = 1 << 14
_SPLIT = np.float64(134217729.0)  # 2^27 + 1: Veltkamp's splitter for float64


def _two_sum(x: np.ndarray, y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """s, t with s = fl(x + y) and s + t = x + y exactly."""
    s = x + y
    bb = s - x
    t = (x - (s - bb)) + (y - bb)
    return s, t


def _round_to_odd(s: np.ndarray, err: np.ndarray) -> np.ndarray:
    """The value s + err (|err| below half an ulp of s) rounded to odd: s if err is 0 or s is odd,
    else s's neighbour towards err. Written into s."""
    bits = s.view(np.int64)
    fix = (err != 0) & ((bits & 1) == 0)
    if fix.any():
        s[fix] = np.nextafter(s[fix], np.where(err[fix] > 0, np.inf, -np.inf))
    return s


def _split(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    c = _SPLIT * x
    hi = c - (c - x)
    return hi, x - hi


def _fma64(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    p = a * b
    ah, al = _split(a)
    bh, bl = _split(b)
    e = ((ah * bh - p) + ah * bl + al * bh) + al * bl  # p + e == a * b exactly
    s, t = _two_sum(p, c)  # s + t == p + c exactly
    v, w = _two_sum(t, e)
    return s + _round_to_odd(v, w)


def _fma32(a: np.ndarray, b: np.ndarray, c: np.ndarray) -> np.ndarray:
    p = a.astype(np.float64) * b  # exact
    s, t = _two_sum(p, c.astype(np.float64))
    return _round_to_odd(s, t).astype(np.float32)


def fma(a, b, c, out: np.ndarray | None = None) -> np.ndarray:
    """``a * b + c`` rounded once, in the common float dtype of the operands (float32 or float64)."""
    a, b, c = np.asarray(a), np.asarray(b), np.asarray(c)
    dtype = np.result_type(a, b, c)
    if dtype not in (np.float32, np.float64):
        raise TypeError(f"fma needs float32 or float64 operands, not {dtype}")
    shape = np.broadcast_shapes(a.shape, b.shape, c.shape)
    if out is None:
        out = np.empty(shape, dtype)
    elif out.shape != shape or out.dtype != dtype:
        raise ValueError(f"out must be {dtype} of shape {shape}")
    if not out.flags.c_contiguous:
        raise ValueError("out must be C-contiguous")
    kernel = _fma32 if dtype == np.float32 else _fma64
    # operands of the full shape are walked block by block; scalars stay scalars
    ops = [x.astype(dtype, copy=False) for x in (a, b, c)]
    ops = [x[()] if x.ndim == 0 else np.broadcast_to(x, shape).reshape(-1) for x in ops]
    dst = out.reshape(-1)
    for lo in range(0, dst.size, BLOCK):
        x, y, z = (v if np.ndim(v) == 0 else v[lo:lo + BLOCK] for v in ops)
        dst[lo:lo + BLOCK] = kernel(np.atleast_1d(x), y, z)
    return out
