"""Wire codec: numpy tensors <-> msgpack, without pickle.

A tensor on the wire is the msgpack map ``{"dtype": str, "shape": [int, ...],
"data": bin}``: C order, little-endian. ``dtype`` comes from :data:`DTYPES`
(the allow-list); nothing else is ever decoded. Decoding checks the dtype,
the shape and the byte length *before* anything is allocated, and returns a
read-only ``np.frombuffer`` view over the received bytes (no copy). Encoding
hands msgpack a memoryview of the array (no intermediate ``tobytes``).

Every refusal is a :class:`shared.errors.ProtocolError` (400 for a body that is
not valid msgpack of the right form, 422 for a tensor that is well-formed but
not acceptable).
"""
from __future__ import annotations

import itertools
import math
import struct
from typing import Any, Mapping

import msgpack
import numpy as np

from shared.errors import ProtocolError, bad_request, unprocessable

#: wire name -> numpy dtype (always little-endian). bfloat16 is not offered:
#: numpy has no native type for it.
DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
}
FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})
MAX_NDIM = 8
MAX_TENSORS = 4096
MAX_NAME_LEN = 256
#: container entries one body may declare in all (a push of MAX_TENSORS 8-d tensors needs ~49k):
#: bounds the objects a hostile body of small items makes the PS allocate
MAX_ITEMS = 16 * MAX_TENSORS


def dtype_name(dtype: np.dtype) -> str:
    """The wire name of a numpy dtype, or ProtocolError(422) if not allowed."""
    dt = np.dtype(dtype)
    for name, allowed in DTYPES.items():
        if dt.kind == allowed.kind and dt.itemsize == allowed.itemsize:
            return name
    raise unprocessable("unsupported_dtype", f"dtype {dt} is not in the allow-list {sorted(DTYPES)}")


def encode_tensor(array: np.ndarray) -> dict:
    """The wire map of one array (little-endian, C order; no copy when it already is)."""
    name = dtype_name(array.dtype)
    arr = np.asarray(array, dtype=DTYPES[name])
    if not arr.flags.c_contiguous:
        arr = arr.copy(order="C")
    data = memoryview(arr.reshape(-1)).cast("B") if arr.size else b""
    return {"dtype": name, "shape": list(arr.shape), "data": data}


def encode_tensors(tensors: Mapping[str, np.ndarray]) -> dict:
    return {name: encode_tensor(arr) for name, arr in tensors.items()}


def decode_tensor(obj: Any, name: str = "tensor", max_bytes: int | None = None) -> np.ndarray:
    """Check and view one wire map as a read-only array (no copy, no pickle)."""
    if not isinstance(obj, dict):
        raise bad_request("bad_tensor", f"tensor {name!r} must be a map with dtype, shape, data")
    unknown = set(obj) - {"dtype", "shape", "data"}
    if unknown:
        raise bad_request("bad_tensor", f"tensor {name!r} has unknown fields {sorted(map(str, unknown))}")
    dtype, shape, data = obj.get("dtype"), obj.get("shape"), obj.get("data")
    if not isinstance(dtype, str) or not isinstance(shape, list) or not isinstance(data, (bytes, bytearray, memoryview)):
        raise bad_request("bad_tensor", f"tensor {name!r} needs dtype (str), shape (list of int) and data (bin)")
    if dtype not in DTYPES:
        raise unprocessable("unsupported_dtype", f"tensor {name!r}: dtype {dtype[:32]!r} is not in the allow-list {sorted(DTYPES)}")
    if len(shape) > MAX_NDIM or not all(type(d) is int and d >= 0 for d in shape):
        raise unprocessable("bad_shape", f"tensor {name!r}: shape must be at most {MAX_NDIM} non-negative ints")
    dt = DTYPES[dtype]
    expected = math.prod(shape) * dt.itemsize
    if max_bytes is not None and expected > max_bytes:
        raise unprocessable("tensor_too_large", f"tensor {name!r} declares {expected} bytes, limit {max_bytes}")
    if len(data) != expected:
        raise unprocessable("bad_length", f"tensor {name!r}: shape {shape} of {dtype} needs {expected} bytes, got {len(data)}")
    try:
        arr = np.frombuffer(data, dtype=dt).reshape(shape)
    except ValueError:  # zero-size, but the other dimensions overflow numpy's index type
        raise unprocessable("bad_shape", f"tensor {name!r}: shape {shape} is too large") from None
    arr.flags.writeable = False
    return arr


def decode_tensors(obj: Any, max_bytes: int | None = None) -> dict[str, np.ndarray]:
    if not isinstance(obj, dict):
        raise bad_request("bad_tensors", "tensors must be a map of name -> tensor")
    if len(obj) > MAX_TENSORS:
        raise unprocessable("too_many_tensors", f"at most {MAX_TENSORS} tensors")
    out = {}
    for name, value in obj.items():
        if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
            raise bad_request("bad_tensor_name", f"tensor names are non-empty strings of at most {MAX_NAME_LEN} chars")
        out[name] = decode_tensor(value, name, max_bytes)
    return out


def pack(obj: Any) -> bytes:
    """msgpack bytes of a plain structure (bin for bytes/memoryview)."""
    return msgpack.packb(obj, use_bin_type=True)


def _no_ext(code: int, data: bytes) -> Any:
    raise bad_request("bad_msgpack", f"msgpack extension type {code} is not accepted")


def unpack(body: bytes) -> Any:
    """Parse a msgpack body; anything malformed or truncated is ProtocolError(400).

    Bodies of :data:`ZERO_COPY_MIN_BYTES` or more go through :func:`unpack_view`, so
    their tensor data is not copied out of the body."""
    if len(body) >= ZERO_COPY_MIN_BYTES:
        return unpack_view(body)
    try:
        return msgpack.unpackb(body, raw=False, strict_map_key=True, ext_hook=_no_ext, use_list=True)
    except ProtocolError:
        raise
    except (ValueError, TypeError, msgpack.UnpackException, msgpack.ExtraData, RecursionError) as exc:
        raise bad_request("bad_msgpack", f"body is not valid msgpack: {type(exc).__name__}") from None


#: bodies at least this large are parsed by :func:`unpack_view` (bin fields stay views of the body)
ZERO_COPY_MIN_BYTES = 1 << 16
_MAX_DEPTH = 32
_FIXED = {0xc0: None, 0xc2: False, 0xc3: True}
_NUM = {0xca: ">f", 0xcb: ">d", 0xcc: ">B", 0xcd: ">H", 0xce: ">I", 0xcf: ">Q",
        0xd0: ">b", 0xd1: ">h", 0xd2: ">i", 0xd3: ">q"}
_LEN = {0xc4: ">B", 0xc5: ">H", 0xc6: ">I", 0xd9: ">B", 0xda: ">H", 0xdb: ">I",
        0xdc: ">H", 0xdd: ">I", 0xde: ">H", 0xdf: ">I"}


def unpack_view(body: bytes | bytearray | memoryview) -> Any:
    """:func:`unpack` without copying ``bin`` payloads: they come back as memoryviews of ``body``.

    The same refusals as :func:`unpack` (malformed, truncated, trailing bytes, ext types,
    map keys other than str/bytes): ProtocolError(400). Containers may not declare more
    entries than bytes remain, nor more than :data:`MAX_ITEMS` in all (checked on the declared
    counts, before the items are built), and nesting is limited to 32 levels.
    """
    reader = _ViewReader(body)
    value = reader.obj(0)
    if reader.pos != reader.end:
        raise _bad_msgpack("extra data after the body")
    return value


def _bad_msgpack(why: str) -> ProtocolError:
    return bad_request("bad_msgpack", f"body is not valid msgpack: {why}")


class _ViewReader:
    """One pass over a msgpack body (no closures: nothing keeps the body alive afterwards)."""

    def __init__(self, body: bytes | bytearray | memoryview) -> None:
        self.mv = memoryview(body).cast("B")
        self.end = len(self.mv)
        self.pos = 0
        self.budget = MAX_ITEMS  # container entries left (a hostile body of tiny items stays small)

    def spend(self, n: int) -> None:
        self.budget -= n
        if self.budget < 0:
            raise _bad_msgpack(f"more than {MAX_ITEMS} items")

    def take(self, fmt: str) -> Any:
        size = struct.calcsize(fmt)
        if self.pos + size > self.end:
            raise _bad_msgpack("truncated")
        value = struct.unpack_from(fmt, self.mv, self.pos)[0]
        self.pos += size
        return value

    def length(self, t: int, short_mask: int, short_max: int) -> int:
        return t & short_mask if t <= short_max else self.take(_LEN[t])

    def obj(self, depth: int) -> Any:
        if self.pos >= self.end:
            raise _bad_msgpack("truncated")
        if depth > _MAX_DEPTH:
            raise _bad_msgpack("nested too deeply")
        t = self.mv[self.pos]
        self.pos += 1
        if t <= 0x7f:
            return t
        if t >= 0xe0:
            return t - 0x100
        if t in _FIXED:
            return _FIXED[t]
        if t in _NUM:
            return self.take(_NUM[t])
        if 0xa0 <= t <= 0xbf or 0xd9 <= t <= 0xdb or 0xc4 <= t <= 0xc6:
            n = self.length(t, 0x1f, 0xbf)
            if self.pos + n > self.end:
                raise _bad_msgpack("truncated")
            raw = self.mv[self.pos:self.pos + n]
            self.pos += n
            if t in (0xc4, 0xc5, 0xc6):
                return raw
            try:
                return str(raw, "utf-8")
            except UnicodeDecodeError:
                raise _bad_msgpack("invalid utf-8") from None
        if 0x90 <= t <= 0x9f or t in (0xdc, 0xdd):
            n = self.length(t, 0x0f, 0x9f)
            if n > self.end - self.pos:
                raise _bad_msgpack("truncated")
            self.spend(n)
            return [self.obj(depth + 1) for _ in range(n)]
        if 0x80 <= t <= 0x8f or t in (0xde, 0xdf):
            n = self.length(t, 0x0f, 0x8f)
            if 2 * n > self.end - self.pos:
                raise _bad_msgpack("truncated")
            self.spend(n)
            out = {}
            for _ in range(n):
                key = self.obj(depth + 1)
                if isinstance(key, memoryview):
                    key = bytes(key)
                elif not isinstance(key, str):
                    raise _bad_msgpack("map keys must be str or bytes")
                out[key] = self.obj(depth + 1)
            return out
        raise _bad_msgpack(f"type byte 0x{t:02x} is not accepted")


def pack_parts(obj: Any, min_view_bytes: int = ZERO_COPY_MIN_BYTES) -> list[bytes | memoryview]:
    """:func:`pack` as a list of buffers whose concatenation is valid msgpack of ``obj``: every
    bytes-like of ``min_view_bytes`` or more is referenced, not copied (scatter-gather sends).

    Such a payload starts at an offset of the body that is a multiple of :data:`ALIGN` when
    its map allows it (the map header and its keys are written in wider, equally valid msgpack
    forms to get there), so a receiver that lands the body on an aligned buffer gets aligned
    arrays, which BLAS and numpy's fast loops need."""
    out: list[bytes | memoryview] = []
    small: list[bytes] = []
    at = [0]  # bytes emitted so far
    packer = msgpack.Packer(use_bin_type=True)

    def emit(b: bytes) -> None:
        small.append(b)
        at[0] += len(b)

    def big(value: Any) -> bool:
        return isinstance(value, (bytes, bytearray, memoryview)) and memoryview(value).nbytes >= min_view_bytes

    def walk(value: Any) -> None:
        if isinstance(value, dict):
            items = list(value.items())
            first = next((i for i, (k, v) in enumerate(items) if big(v)), None)
            if first is not None and all(isinstance(k, str) for k, _ in items[:first + 1]):
                items = _aligned_prefix(items, first, at[0], packer, emit)
            else:
                emit(packer.pack_map_header(len(items)))
            for k, v in items:
                if k is not None:
                    emit(packer.pack(k))
                walk(v)
        elif isinstance(value, (list, tuple)):
            emit(packer.pack_array_header(len(value)))
            for v in value:
                walk(v)
        elif big(value):
            view = memoryview(value).cast("B")
            emit(b"\xc6" + len(view).to_bytes(4, "big"))
            out.append(b"".join(small))
            small.clear()
            out.append(view)
            at[0] += len(view)
        else:
            emit(packer.pack(value))

    walk(obj)
    if small:
        out.append(b"".join(small))
    return out


#: alignment of large payloads inside bodies made by :func:`pack_parts` (float64 needs 8)
ALIGN = 8


def _forms(n: int, fix_max: int, fix_tag: int, wide: tuple[tuple[int, int], ...]) -> list[bytes]:
    """Every msgpack header form for a length n (fixed form first)."""
    forms = [bytes([fix_tag | n])] if n <= fix_max else []
    return forms + [bytes([tag]) + n.to_bytes(size, "big") for tag, size in wide if n < 1 << (8 * size)]


def _aligned_prefix(items: list, first: int, at: int, packer: msgpack.Packer, emit) -> list:
    """Emit a map header and its entries up to the key of the first large payload so that the
    payload starts aligned (when some choice of header/key widths gets there); the rest of the
    entries is returned for the caller to write, with ``None`` for the key already written."""
    heads = _forms(len(items), 15, 0x80, ((0xde, 2), (0xdf, 4)))
    keys = [k.encode() for k, _ in items[:first + 1]]
    key_forms = [[f + k for f in _forms(len(k), 31, 0xa0, ((0xd9, 1), (0xda, 2), (0xdb, 4)))] for k in keys]
    key_forms = [forms[:1] for forms in key_forms[:-3]] + key_forms[-3:]  # at most 3 keys vary: <= 64 tries
    fixed = sum(len(packer.pack(v)) for _, v in items[:first])  # the values before the payload
    best = None
    for head in heads:
        for combo in itertools.product(*key_forms):
            if (at + len(head) + fixed + sum(map(len, combo)) + 5) % ALIGN == 0:
                best = (head, combo)
                break
        if best:
            break
    head, combo = best or (heads[0], tuple(f[0] for f in key_forms))
    emit(head)
    for (k, v), key in zip(items[:first], combo):
        emit(key)
        emit(packer.pack(v))
    emit(combo[first])
    return [(None, items[first][1])] + items[first + 1:]
