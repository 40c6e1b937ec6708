"""Request bodies for the tests, as docs/protocol.md ("Tensor frame") specifies them byte by byte.

Honest frames come from :mod:`shared.frame`; hostile ones are put together here by hand (struct +
msgpack), so that any field can lie: the prefix, the header (even with a key twice, which
``msgpack.packb`` cannot write), the padding and the data.
"""
from __future__ import annotations

import struct
from typing import Any, Callable, Mapping

import msgpack
import numpy as np

from shared import frame

FRAME = frame.MEDIA_TYPE
PREFIX = struct.Struct("<8sII")  # magic, header length, reserved


def pack(obj: Any) -> bytes:
    return msgpack.packb(obj, use_bin_type=True)


def push_frame(worker_id: str, step: int, tensors: Mapping[str, np.ndarray], **meta: Any) -> bytes:
    """An honest push body."""
    return frame.encode_bytes(tensors, {"worker_id": worker_id, "step": step, **meta})


class Packed(bytes):
    """msgpack bytes to embed as they are in :func:`msgpack_map`."""


def msgpack_map(*pairs: tuple[Any, Any]) -> Packed:
    """A msgpack map of ``pairs`` in this order, a repeated key included; a :class:`Packed` value is embedded as is."""
    n = len(pairs)
    out = bytes([0x80 | n]) if n < 16 else b"\xde" + n.to_bytes(2, "big")
    for key, value in pairs:
        out += pack(key) + (value if isinstance(value, Packed) else pack(value))
    return Packed(out)


def repeated(item: bytes, n: int) -> bytes:
    """msgpack: an array32 of ``n`` copies of the msgpack ``item`` (an item bomb when the items are tiny)."""
    return b"\xdd" + n.to_bytes(4, "big") + item * n


def raw_frame(head: Mapping | bytes, data: bytes = b"", *, magic: bytes = frame.MAGIC, hlen: int | None = None,
              reserved: int = 0, tail: bytes = b"") -> bytes:
    """Prefix, header (a map to msgpack, or bytes as they are), zero padding up to data_start, data, tail.
    ``hlen`` overrides the header length the prefix declares."""
    h = head if isinstance(head, bytes) else pack(head)
    start = PREFIX.size + len(h)
    return (PREFIX.pack(magic, len(h) if hlen is None else hlen, reserved) + h + bytes(frame.aligned(start) - start)
            + data + tail)


def parts(tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None) -> tuple[dict, bytes]:
    """An honest frame taken apart: its header (a dict to tamper with) and its data bytes."""
    layout = frame.Layout.of(tensors)
    body = frame.encode_bytes(tensors, meta)
    head = {"meta": dict(meta or {}), "tensors": layout.to_wire(), "data_bytes": layout.data_bytes}
    return head, body[len(body) - layout.data_bytes:]


def tampered(tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None,
             edit: Callable[[dict], Any] | None = None, data: bytes | None = None, **prefix: Any) -> bytes:
    """An honest frame whose header ``edit`` changed in place (``data`` replaces the tensor bytes;
    ``prefix``: :func:`raw_frame`'s keywords)."""
    head, honest = parts(tensors, meta)
    if edit is not None:
        edit(head)
    return raw_frame(head, honest if data is None else data, **prefix)


def entry(name: str = "x", dtype: str = "float32", shape: list | None = None, offset: Any = 0) -> list:
    """One header.tensors entry."""
    return [name, dtype, [2] if shape is None else shape, offset]


def one_tensor(*spec: Any, data: bytes = b"", data_bytes: Any = None, meta: dict | None = None) -> bytes:
    """A frame of the single entry ``entry(*spec)`` over ``data`` (data_bytes defaults to its length)."""
    return raw_frame({"meta": meta or {}, "tensors": [entry(*spec)],
                      "data_bytes": len(data) if data_bytes is None else data_bytes}, data)


def hand_frame(meta: Mapping[str, Any] | Packed, *tensors: tuple[Any, Any, Any, bytes]) -> bytes:
    """A frame of tensors declared by hand, ``(name, dtype, shape, data)`` each (any dtype or shape, even one the
    PS refuses), at the canonical offsets of their data's lengths. A :class:`Packed` meta is embedded as is."""
    entries, data = [], b""
    for name, dtype, shape, raw in tensors:
        data += bytes(frame.aligned(len(data)) - len(data))
        entries.append([name, dtype, shape, len(data)])
        data += raw
    return raw_frame(msgpack_map(("meta", meta if isinstance(meta, Packed) else Packed(pack(meta))),
                                 ("tensors", entries), ("data_bytes", len(data))), data)
