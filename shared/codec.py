"""Control messages: strict msgpack, and the dtype allow-list every tensor is checked against.

Tensors never travel inside msgpack (they travel in frames: :mod:`shared.frame`); what is msgpack is small: a frame's
header, a checkpoint's envelope. Writing is msgpack's :func:`msgpack.packb`; reading is the one reader below
(:func:`unpack`: plain data only, bounded allocation, every refusal a 400 :class:`shared.errors.ProtocolError`), not
msgpack's unpacker, which allocates each container at its declared length before reading its items and copies
``bin`` values.
"""
from __future__ import annotations

import functools
import struct
from typing import Any

import msgpack
import numpy as np

from shared.errors import ProtocolError, bad_request

@functools.cache
def bfloat16() -> np.dtype:
    """ml_dtypes' ``bfloat16``, imported on first use: ml_dtypes costs about a second of CPU to import, which a
    process that never meets a bf16 tensor (every one without ``bf16`` compression) does not pay."""
    import ml_dtypes

    return np.dtype(ml_dtypes.bfloat16)


#: wire name -> numpy dtype (always little-endian); ``bfloat16``'s is :func:`bfloat16` (None here: ``DTYPES[name] or
#: bfloat16()``). ``bfloat16`` (ml_dtypes) and ``uint32`` are only ever the compressed encoding of a float32 gradient
#: (shared/compression.py): no model or checkpoint tensor has them.
DTYPES: dict[str, np.dtype | None] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "bfloat16": None,
    "uint32": np.dtype("<u4"),
}
FLOAT_DTYPES = frozenset({"float16", "float32", "float64"})


def dtype_name(dtype: np.dtype) -> str:
    """The wire name of a numpy dtype, or ProtocolError(422 unsupported_dtype) if it is not allowed."""
    dt = np.dtype(dtype)
    if dt.kind == "V":  # ml_dtypes' types: a bfloat16 one exists only once ml_dtypes is imported
        if dt.name == "bfloat16" and dt == bfloat16():
            return "bfloat16"
    else:
        for name, allowed in DTYPES.items():
            if allowed is not None and dt.kind == allowed.kind and dt.itemsize == allowed.itemsize:
                return name
    raise ProtocolError(422, "unsupported_dtype", f"dtype {dt} is not in the allow-list {sorted(DTYPES)}")


def pack(obj: Any) -> bytes:
    """msgpack bytes of a plain structure (bin for bytes)."""
    return msgpack.packb(obj, use_bin_type=True)


#: container entries one message may declare in all: bounds what a hostile message of tiny items allocates
MAX_ITEMS = 1 << 16
_MAX_DEPTH = 32
_FIXED = {0xc0: None, 0xc2: False, 0xc3: True}
_NUM = {0xca: ">f", 0xcb: ">d", 0xcc: ">B", 0xcd: ">H", 0xce: ">I", 0xcf: ">Q",
        0xd0: ">b", 0xd1: ">h", 0xd2: ">i", 0xd3: ">q"}
_LEN = {0xc4: ">B", 0xc5: ">H", 0xc6: ">I", 0xd9: ">B", 0xda: ">H", 0xdb: ">I",
        0xdc: ">H", 0xdd: ">I", 0xde: ">H", 0xdf: ">I"}


def unpack(body: bytes | bytearray | memoryview) -> Any:
    """Parse one msgpack object that is all of ``body`` (large ``bin`` values come back as memoryviews of it).

    Refused with ProtocolError(400): malformed, truncated or trailing bytes, extension types (the
    timestamp included), map keys that are not strings (``bad_msgpack``), a key twice in one map
    (``duplicate_key``). Containers may not declare more entries than bytes remain, nor more than
    :data:`MAX_ITEMS` in all (checked on the declared counts, before the items are built), and nesting
    is limited to 32 levels: a hostile message stays as small in memory as it is on the wire.
    """
    reader = _Reader(body)
    value = reader.obj(0)
    if reader.pos != reader.end:
        raise _bad_msgpack("extra data after the message")
    return value


def _bad_msgpack(why: str) -> ProtocolError:
    return bad_request("bad_msgpack", f"not valid msgpack: {why}")


class _Reader:
    """One pass over a msgpack message (pure Python: control messages are small)."""

    def __init__(self, body: bytes | bytearray | memoryview) -> None:
        self.mv = memoryview(body).cast("B")
        self.end = len(self.mv)
        self.pos = 0
        self.budget = MAX_ITEMS

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
            out: dict = {}
            for _ in range(n):
                key = self.obj(depth + 1)
                if not isinstance(key, str):
                    raise _bad_msgpack("map keys must be strings")
                if key in out:
                    raise bad_request("duplicate_key", f"the key {key[:64]!r} appears twice in one map")
                out[key] = self.obj(depth + 1)
            return out
        raise _bad_msgpack(f"type byte 0x{t:02x} is not accepted (extension types are refused)")
