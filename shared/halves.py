"""float32 <-> the two 16-bit floats of the wire, ``bfloat16`` and IEEE ``float16``, bit for bit. Pure numpy; no I/O.

The ``bf16`` and ``fp16`` encodings (shared/compression.py) cast float32 gradients down on the worker and back up on
the PS. bfloat16 goes by ml_dtypes' own cast (``astype``) and an assignment: this module's integer arithmetic for it
had no gain beyond the noise (docs/performance.md, the fast-path ledger). float16's casts here are a few whole-array
float operations, chunk by chunk (:data:`shared.scan.CHUNK` elements: the temporaries stay in the L2 cache), widened
by a gather from a table; numpy's casts go an element at a time (the ledger: +56 % steps/s at TCP 1e6 x 2 fp16; times:
bench/results/2026-12-02-float16-casts-in-whole-array-arithmetic-sixteenth-session.jsonl).

Contract: :func:`to_bf16` and :func:`to_fp16` return exactly ``x.astype(bfloat16)`` / ``x.astype(float16)`` of a
float32 array (round to nearest even, subnormals, overflow to +-Inf and NaN included), with the shape of ``x`` and no
floating-point warning; a float16 chunk holding a NaN is cast by numpy. :func:`from_bf16` and :func:`from_fp16` widen
to float32 exactly (every 16-bit pattern gives the library's float32), into memory from ``alloc``.
"""
from __future__ import annotations

from typing import Callable

import numpy as np

from shared import scan
from shared.codec import bfloat16

F16 = np.dtype("<f2")
F32 = np.dtype("<f4")
U32 = np.dtype("<u4")

#: ``alloc(n)``: n writable bytes for a widened tensor (the PS's pooled buffers: ps_service/core/buffers.py)
Alloc = Callable[[int], np.ndarray]

_ABS = np.uint32(0x7FFFFFFF)
#: float32's exponent field, and Inf's bits: patterns of |x| above it are NaNs
_EXP32 = np.uint32(0x7F800000)
#: |x| >= 2**16: 4 |x| would not overflow, so such a chunk scales by 2**112 (to Inf) and back by 2**-110
_OVERFLOW16 = np.uint32(0x47800000)
#: float16's smallest normal, 2**-14, as float32: the least rounding magic (float16's subnormals step as it does)
_MIN_NORMAL16 = np.float32(2.0 ** -14)
#: 4 |x| and 2**15 times |x|'s power of two (its exponent field + 15: integer arithmetic, which wraps where the float
#: would overflow): added, the float32 sum's 23 mantissa bits round |x| to float16's 10
_TIMES4, _EXP_PLUS15 = np.float32(4.0), np.uint32(15 << 23)
#: every float16 pattern's float32 value (256 KB: a gather from it stays in the L2 cache)
_FP16_TABLE = np.arange(1 << 16, dtype=np.uint16).view(F16).astype(F32)


def fresh(n: int) -> np.ndarray:
    """n bytes of new memory: the default ``alloc``."""
    return np.empty(n, np.uint8)


def to_bf16(x: np.ndarray) -> np.ndarray:
    """``x.astype(bfloat16)`` of a float32 array (ml_dtypes' cast: round to nearest even, NaN and Inf kept)."""
    with np.errstate(all="ignore"):  # ml_dtypes warns on a NaN's cast, and on overflow to Inf
        return np.asarray(x, F32).astype(bfloat16())


def from_bf16(b: np.ndarray, alloc: Alloc = fresh) -> np.ndarray:
    """``b.astype(float32)`` of a bfloat16 array (exact), into memory from ``alloc``."""
    out = alloc(4 * b.size).view(F32).reshape(b.shape)
    out[...] = b
    return out


def to_fp16(x: np.ndarray) -> np.ndarray:
    """``x.astype(float16)`` of a float32 array, bit for bit, with no overflow warning: M. Maratyszcza's branchless
    ``fp16_ieee_from_fp32_value`` (FP16 library; PyTorch's c10 has it), a chunk at a time. A magic power of two,
    ``2**15`` times |x|'s own (at least float16's smallest normal), plus ``4 |x|``: float32's addition rounds
    |x| to nearest even at float16's step for that exponent, subnormals included, and the sum's exponent and
    mantissa bits are the float16's. A chunk with |x| >= 2**16 scales by 2**112 then 2**-110 instead of 4, so
    that those overflow to Inf."""
    flat = np.ascontiguousarray(x, F32).reshape(-1)
    bits, n = flat.view(U32), flat.size
    out = np.empty(n, np.uint16)
    m = min(n, scan.CHUNK)
    mag, magic, sign = np.empty(m, U32), np.empty(m, U32), np.empty(m, U32)
    for lo, hi in scan.ranges(n):
        k = hi - lo
        b, a, e, t = bits[lo:hi], mag[:k], magic[:k], sign[:k]
        np.bitwise_and(b, _ABS, out=a)
        top = a.max()
        if top > _EXP32:  # a NaN
            with np.errstate(over="ignore", invalid="ignore"):
                out[lo:hi] = flat[lo:hi].astype(F16).view(np.uint16)
            continue
        af, ef = a.view(F32), e.view(F32)
        np.bitwise_and(a, _EXP32, out=e)  # |x|'s power of two (0 for a float32 subnormal)
        np.maximum(ef, _MIN_NORMAL16, out=ef)
        e += _EXP_PLUS15
        if top < _OVERFLOW16:
            af *= _TIMES4
        else:
            with np.errstate(over="ignore"):
                af *= np.float32(2.0 ** 112)
                af *= np.float32(2.0 ** -110)
        ef += af  # the rounding
        np.right_shift(e, 13, out=a)
        np.bitwise_and(a, 0x7C00, out=a)  # the exponent's low 5 bits: one less than float16's ...
        np.bitwise_and(e, 0xFFF, out=e)  # ... for the mantissa's implicit 1 (bit 10) adds it; a carry as well
        a += e
        np.right_shift(b, 16, out=t)
        np.bitwise_and(t, 0x8000, out=t)
        a |= t  # the sign
        out[lo:hi] = a
    return out.view(F16).reshape(np.shape(x))


def from_fp16(h: np.ndarray, alloc: Alloc = fresh) -> np.ndarray:
    """``h.astype(float32)`` of a float16 array (exact), into memory from ``alloc``: each element's value
    gathered from a table of all 65,536 (its index array made a chunk at a time)."""
    src = np.ascontiguousarray(h).reshape(-1).view(np.uint16)
    out = alloc(4 * src.size).view(F32)
    idx = np.empty(min(src.size, scan.CHUNK), np.intp)
    for lo, hi in scan.ranges(src.size):
        i = idx[:hi - lo]
        i[:] = src[lo:hi]
        np.take(_FP16_TABLE, i, out=out[lo:hi], mode="clip")  # the default mode buffers `out`
    return out.reshape(h.shape)
