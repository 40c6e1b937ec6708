"""Gradient compression on the wire (worker -> PS, request bodies only): the encodings, their checks, and
the worker's error-feedback residuals (docs/protocol.md, "Compression", gives the byte layout of each).

The job chooses one encoding (``PS_COMPRESSION``); the PS tells workers at registration (:class:`Spec`). Only float32
model tensors are compressed (not a torch model's ``buffer:`` statistics); a compressed tensor keeps its name.

Contract: :func:`decode_push` (PS side; :func:`check_declared` for same-host pushes) checks every compressed tensor's
form before it makes its float32 gradient (dense, in memory the PS owns; top-k: a :class:`SparseTensor`), exactly,
and raises ProtocolError 422 ``compression_mismatch`` (the push declares another encoding than the job's) or
``bad_encoding``. :class:`Compressor` is the worker side: ``topk`` and ``2bit`` keep per tensor the residual of what
was not sent and add it to the next gradient (error feedback); ``topk`` sends more during the warm-up steps
(:meth:`Spec.density`). With partitioned rounds each partition's pieces are encoded as tensors of their own
(:meth:`Compressor.encode_partitions`): every encoding is elementwise, so the pieces and the residuals are the whole
tensor's, bit for bit. Pure numpy; no I/O.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

import numpy as np

from shared import scan
from shared.codec import bfloat16
from shared.errors import unprocessable
from shared.halves import F16, F32, U32, Alloc, fresh, from_bf16, from_fp16, to_bf16, to_fp16
from shared.partitions import Plan
from shared.shards import Piece, split

NAMES = ("none", "bf16", "fp16", "topk", "2bit")
#: torch buffers (running statistics, taken as the round's aggregate): never compressed
BUFFER_PREFIX = "buffer:"
#: candidate pruning of top-k: the magnitude threshold is estimated on a strided sample of this size
_SAMPLE = 1 << 16
#: topk warm-up: the density of step 0 (8 bytes per sent entry: at 0.25 a push is half of float32's bytes)
WARMUP_START = 0.25


class NonFiniteGradient(ValueError):
    """A 2-bit worker's gradient holds NaN/Inf: 2 bits cannot carry it (the worker stops, as on a 422)."""


@dataclass(frozen=True)
class Spec:
    """The job's choice: the encoding and its parameter."""

    name: str = "none"
    topk_ratio: float = 0.01
    threshold: float = 0.5
    #: topk: the first steps send more (:meth:`density`), as Deep Gradient Compression's warm-up does
    topk_warmup_steps: int = 0

    def __post_init__(self) -> None:
        if self.name not in NAMES:
            raise ValueError(f"compression {self.name!r} is not one of {NAMES}")
        if not 0 < self.topk_ratio <= 1 or not 0 < self.threshold < math.inf:
            raise ValueError("compression: topk_ratio must be in (0, 1] and threshold a positive finite number")
        w = self.topk_warmup_steps
        if isinstance(w, bool) or not isinstance(w, int) or not 0 <= w < 2 ** 53:
            raise ValueError("compression: topk_warmup_steps must be a non-negative integer")

    on = property(lambda self: self.name != "none")
    to_wire = asdict

    @classmethod
    def from_wire(cls, obj: Any) -> "Spec":
        """The spec a registration answer carries (absent: none). ValueError if malformed."""
        if obj is None:
            return cls()
        if not isinstance(obj, dict):
            raise ValueError("compression must be a map")
        d = cls()  # an absent field: its default
        return cls(str(obj.get("name", d.name)), float(obj.get("topk_ratio", d.topk_ratio)),
                   float(obj.get("threshold", d.threshold)), obj.get("topk_warmup_steps", d.topk_warmup_steps))

    def compresses(self, name: str, dtype: np.dtype) -> bool:
        """Whether a tensor of the model travels compressed."""
        return self.on and dtype == F32 and not name.startswith(BUFFER_PREFIX)

    def density(self, step: int = -1) -> float:
        """The share of a tensor's entries a top-k push computed on ``step``'s weights sends: ``topk_ratio``, except
        during the warm-up (``0 <= step < topk_warmup_steps``), where it falls geometrically from
        ``WARMUP_START`` (or ``topk_ratio`` if larger) at step 0 towards ``topk_ratio``:
        ``start * (topk_ratio / start) ** (step / topk_warmup_steps)``."""
        r, w = self.topk_ratio, self.topk_warmup_steps
        if not 0 <= step < w or r >= WARMUP_START:
            return r
        return WARMUP_START * (r / WARMUP_START) ** (step / w)

    def k(self, n: int, step: int = -1) -> int:
        """Entries a top-k push sends of a tensor of ``n`` elements: ceil(density(step) * n), at least 1."""
        return min(n, max(1, math.ceil(self.density(step) * n)))


# ---- top-k ---------------------------------------------------------------------------------------------
def top_k(x: np.ndarray, k: int) -> np.ndarray:
    """The flat indices (ascending, uint32) of the ``k`` entries of ``x`` of largest magnitude (NaN and
    Inf first; ties broken deterministically by numpy's partition)."""
    flat = x.reshape(-1)
    n = flat.size
    if k >= n:
        return np.arange(n, dtype=U32)
    if k <= 0:
        return np.empty(0, U32)
    if n > 8 * _SAMPLE and k * 64 < n:
        # every entry at or above a magnitude t that at least k entries reach is a candidate; the top k
        # are among them (exact). t is estimated low from a strided sample; if too few reach it (or the
        # scan meets a NaN or an Inf), the whole-array pass below.
        sample = np.sort(np.abs(flat[::n // _SAMPLE]))
        t = sample[max(0, sample.size - 1 - 2 * math.ceil(k * sample.size / n) - 8)]
        cand = scan.magnitude_at_least(flat, t)
        if cand is not None and cand.size >= k:
            pick = cand[np.argpartition(np.abs(flat[cand]), cand.size - k)[cand.size - k:]]
            return np.sort(pick).astype(U32)
    mag = np.abs(flat)
    if not np.isfinite(mag.max()):
        mag[~np.isfinite(mag)] = np.inf  # NaN sorts above Inf in numpy; both are sent first
    return np.sort(np.argpartition(mag, n - k)[n - k:]).astype(U32)


def pack_topk(indices: np.ndarray, values: np.ndarray) -> np.ndarray:
    """The top-k layout: uint32 ``[2, k]`` of ``indices`` and the float32 ``values``' bits."""
    out = np.empty((2, indices.size), U32)
    out[0] = indices
    out[1] = np.ascontiguousarray(values, F32).view(U32)
    return out


def check_topk(wire: np.ndarray, n: int, name: str) -> np.ndarray:
    """The indices of a top-k layout (uint32 [2, k], k <= n, row 0 strictly increasing and < n), else 422
    bad_encoding. Row 1 is any bits."""
    if wire.dtype != U32 or wire.ndim != 2 or wire.shape[0] != 2 or wire.shape[1] > n:
        raise _bad(name, f"topk wants uint32 of shape [2, k] with k <= {n}; got {wire.dtype} {list(wire.shape)}")
    idx = wire[0]
    if idx.size and (idx[-1] >= n or (idx.size > 1 and not (idx[1:] > idx[:-1]).all())):
        raise _bad(name, f"topk indices must be strictly increasing and below {n}")
    return idx


class SparseTensor:
    """A decoded top-k tensor as the PS keeps it: float32 of ``shape``, zero but at the flat ``indices`` (strictly
    increasing) where it holds ``values``. ``dense()`` makes the array; the PS's rank-order sum adds it without
    making it (ps_service/core/rounds.py): the same bits, O(k) instead of O(n)."""
    dtype = F32

    def __init__(self, shape: tuple[int, ...], indices: np.ndarray, values: np.ndarray) -> None:
        self.shape, self.indices, self.values = shape, indices, values

    def dense(self) -> np.ndarray:
        out = np.zeros(math.prod(self.shape), F32)
        out[self.indices] = self.values
        return out.reshape(self.shape)


def dense(g: np.ndarray | SparseTensor) -> np.ndarray:
    """``g`` as an array (a :class:`SparseTensor` made dense)."""
    return g.dense() if isinstance(g, SparseTensor) else g


# ---- 2-bit (MXNet) ---------------------------------------------------------------------------------------
_SHIFTS = np.array([6, 4, 2, 0], np.uint8)
_CODES = (np.arange(256, dtype=np.uint8)[:, None] >> _SHIFTS) & 3  # [byte, element] -> code
#: the low bit of every 2-bit code of a word: code 0b01 is a low bit set under a clear high bit
_LOW_BITS = np.uint32(0x55555555)


def quantize_2bit(acc: np.ndarray, threshold: np.float32) -> np.ndarray:
    """MXNet's 2-bit codes of ``acc`` (uint32 words); ``acc`` becomes the residual ``acc - sent`` in place.
    Element-wise, so done in chunks of :data:`shared.scan.CHUNK` (a multiple of 16: whole words) whose
    temporaries stay in the cache: the same bits as the whole array at once."""
    flat = acc.reshape(-1)
    packed = np.empty(-(-flat.size // 16) * 4, np.uint8)
    for lo, hi in scan.ranges(flat.size):  # a chunk starts on a word; the last word's codes past it are zero
        part, out = flat[lo:hi], packed[lo // 4:-(-hi // 16) * 4]
        pos, neg = part >= threshold, part <= -threshold
        codes = np.zeros(out.size * 4, np.uint8)
        np.add(pos.view(np.uint8) * np.uint8(3), neg.view(np.uint8) * np.uint8(2), out=codes[:part.size])
        quads = codes.reshape(-1, 4)
        out[:] = (quads[:, 0] << 6) | (quads[:, 1] << 4) | (quads[:, 2] << 2) | quads[:, 3]
        sent = (pos.view(np.int8) - neg.view(np.int8)).astype(F32)  # +1, -1, 0
        sent *= threshold
        part -= sent
    return packed.view(U32)


def dequantize_2bit(wire: np.ndarray, shape: tuple[int, ...], threshold: np.float32, name: str,
                    alloc: Alloc = fresh) -> np.ndarray:
    """The float32 tensor of 2-bit words (0, +-threshold), into memory from ``alloc``; 422 bad_encoding for code
    0b01 or nonzero padding codes."""
    n = math.prod(shape)
    if wire.dtype != U32 or wire.shape != (-(-n // 16),):
        raise _bad(name, f"2bit wants uint32 of shape [{-(-n // 16)}]; got {wire.dtype} {list(wire.shape)}")
    octets = wire.view(np.uint8)
    t = wire >> 1  # a code 0b01: a low bit set under a clear high bit (word-wide: 0.7 ms at 1e7 elements, against
    np.invert(t, out=t)  # 5.7 for a per-byte table)
    np.bitwise_and(t, wire, out=t)
    if np.bitwise_and(t, _LOW_BITS, out=t).any():
        raise _bad(name, "2bit code 0b01 is not a value")
    # one 16-byte gather per byte: the byte's 4 float32 values (a table of 256 rows viewed as complex128)
    table = np.array([0, 0, -threshold, threshold], F32)[_CODES].view(np.complex128).reshape(256)
    out = alloc(16 * octets.size).view(np.complex128)
    values = np.take(table, octets, out=out, mode="clip").view(F32)  # "clip": not buffered (uint8 < 256 anyway)
    if values[n:].any():
        raise _bad(name, "2bit padding codes (past the tensor's last element) must be zero")
    return values[:n].reshape(shape)


# ---- both sides --------------------------------------------------------------------------------------------
#: the 16-bit encodings: (their wire dtype, the worker's cast down, the PS's widening)
_HALVES = {"bf16": (bfloat16, to_bf16, from_bf16), "fp16": (lambda: F16, to_fp16, from_fp16)}


def _bad(name: str, detail: str):
    return unprocessable("bad_encoding", f"tensor {name!r}: {detail}")


def decode_tensor(spec: Spec, name: str, shape: tuple[int, ...], wire: np.ndarray,
                  alloc: Alloc = fresh) -> np.ndarray | SparseTensor:
    """The float32 gradient a compressed tensor stands for (in memory from ``alloc``; top-k: a :class:`SparseTensor`
    over the wire's memory), or 422 bad_encoding."""
    if spec.name in _HALVES:
        want, _, widen = _HALVES[spec.name]
        if wire.dtype != want() or wire.shape != shape:
            raise _bad(name, f"{spec.name} wants {want().name} of shape {list(shape)}; "
                             f"got {wire.dtype} {list(wire.shape)}")
        return widen(wire, alloc)
    if spec.name == "topk":  # its entries, checked
        return SparseTensor(shape, check_topk(wire, math.prod(shape), name).astype(np.intp), wire[1].view(F32))
    return dequantize_2bit(wire, shape, np.float32(spec.threshold), name, alloc)


def check_declared(spec: Spec, declared: str | None, via_body: bool) -> None:
    """422 compression_mismatch unless a push declares the job's encoding (same-host pushes: none)."""
    expected = spec.name if via_body else "none"
    declared = "none" if declared is None else declared  # absent is none; "" is not a name
    if declared != expected:
        raise unprocessable("compression_mismatch", f"this push declares compression {declared!r}; the "
                                                    f"job's is {expected!r} (GET /v1/status, the registration answer)")


def decode_push(spec: Spec, declared: str | None, tensors: Mapping[str, np.ndarray],
                model: Mapping[str, np.ndarray], alloc: Alloc = fresh
                ) -> tuple[Mapping[str, np.ndarray | SparseTensor], bool]:
    """A body push's tensors as the core takes them: the compressed ones decoded to float32 (top-k ones as
    :class:`SparseTensor`; dense ones into memory from ``alloc``), and whether the push is known to hold no NaN/Inf
    without reading its dense tensors: every model tensor came top-k (its k values checked here) or 2-bit (+-threshold
    or 0 by construction); False: not known, the core checks the dense tensors as any others. Tensors the model does
    not have are left as they are (the core refuses them)."""
    check_declared(spec, declared, via_body=True)
    out = dict(tensors)
    finite = spec.name in ("topk", "2bit") and tensors.keys() == model.keys()
    for name, wire in tensors.items():
        ref = model.get(name)
        if ref is None or not spec.compresses(name, ref.dtype):
            finite = False
            continue
        out[name] = decode_tensor(spec, name, tuple(ref.shape), wire, alloc)
        finite = finite and (spec.name != "topk" or bool(np.isfinite(out[name].values).all()))
    return out, finite


class Compressor:
    """The worker side of one job's encoding: encodes each push, keeping the residuals (topk, 2bit)."""

    def __init__(self, spec: Spec) -> None:
        self.spec = spec
        self.residuals: dict[str, np.ndarray] = {}

    def encode(self, grads: Mapping[str, np.ndarray], step: int = -1) -> dict[str, np.ndarray]:
        """The push's tensors, computed on ``step``'s weights, compressed where the job says (residuals
        updated)."""
        whole = Plan((tuple(Piece(k, 0, np.size(g), True) for k, g in grads.items()),))
        return self.encode_partitions(grads, whole, step)[0]

    def encode_partitions(self, grads: Mapping[str, np.ndarray], plan: Plan, step: int = -1
                          ) -> list[dict[str, np.ndarray]]:
        """The push's partitions (``plan``: :func:`shared.partitions.plan` of the gradients), each its pieces'
        tensors keyed by :attr:`~shared.shards.Piece.key`, compressed where the job says (docs/protocol-partitions.md):
        bf16, fp16 and 2-bit encode each piece's elements (2-bit's words start at the piece's first element); top-k
        chooses its entries over the whole tensor, as one piece would, and sends each in the piece that holds it, at
        its flat index within the piece. Residuals are kept per tensor: every encoding is elementwise, so the
        residuals and the values the PS decodes are those of the whole tensor's encoding, bit for bit."""
        spec = self.spec
        if spec.name == "2bit":
            bad = next((k for k, g in grads.items() if spec.compresses(k, g.dtype) and not np.isfinite(g).all()), None)
            if bad is not None:
                raise NonFiniteGradient(f"gradient {bad!r} holds NaN/Inf: 2-bit quantisation cannot send it")
        where = {p.name: [] for ps in plan.partitions for p in ps}  # tensor -> its (partition, piece), in order
        for q, ps in enumerate(plan.partitions):
            for p in ps:
                where[p.name].append((q, p))
        out: list[dict[str, np.ndarray]] = [{} for _ in plan.partitions]
        for name, g in grads.items():
            g = np.asarray(g)
            pieces = [p for _, p in where[name]]
            wires = self._one(name, g, step, pieces) if spec.compresses(name, g.dtype) else _views(g, pieces)
            for (q, p), wire in zip(where[name], wires):
                out[q][p.key] = wire
        return out

    def _one(self, name: str, grad: np.ndarray, step: int, pieces: list[Piece]) -> list[np.ndarray]:
        """The encodings of ``grad``'s ``pieces`` (in order, together the whole tensor)."""
        spec = self.spec
        if spec.name in _HALVES:  # fp16 beyond +-65504: Inf, which the PS refuses as non-finite
            return [_HALVES[spec.name][1](v) for v in _views(grad, pieces)]
        acc = self.residuals.get(name)
        if acc is None or acc.shape != grad.shape:
            acc = self.residuals[name] = np.zeros(grad.shape, F32)
        acc += grad  # the residual plus this gradient: what is owed to the PS
        if spec.name == "2bit":
            return [quantize_2bit(v, np.float32(spec.threshold)) for v in _views(acc, pieces)]
        flat = acc.reshape(-1)
        idx = top_k(flat, spec.k(flat.size, step))
        values = flat[idx]
        flat[idx] = 0  # the residual keeps what was not sent
        if not np.isfinite(values).all():
            flat[:] = 0  # the PS refuses (or skips) this push; a NaN kept here would poison every later one
        cuts = np.searchsorted(idx, [p.start for p in pieces[1:]])  # idx ascending, the pieces in element order
        return [pack_topk(i - np.uint32(p.start) if p.start else i, v)
                for p, i, v in zip(pieces, np.split(idx, cuts), np.split(values, cuts))]


def _views(t: np.ndarray, pieces: list[Piece]) -> list[np.ndarray]:
    """``pieces`` of the tensor ``t`` (views: ``t`` itself for a whole piece, a slice of its flat elements else)."""
    return list(split({pieces[0].name: t}, pieces).values())
