"""The one tensor frame: how a set of named tensors is laid out in an HTTP body, a shared-memory file and a checkpoint
(docs/protocol.md, "Tensor frame", specifies it byte by byte: a prefix, a msgpack header, padding, then the tensors'
raw bytes in the canonical layout, :meth:`Layout.of`). ``meta`` carries the message's control fields: the route's
business, not the frame's.

Contract: decoding checks every field (allow-listed dtypes, at most MAX_NDIM dimensions and MAX_TENSORS tensors,
unique names, canonical offsets, exact lengths) before it makes any array, never unpickles, and returns arrays that
are views of the given buffer (no copy; writable when the buffer is). Every refusal is a
:class:`shared.errors.ProtocolError`: 400 ``bad_frame`` for a malformed frame, 422 for a well-formed tensor that is
not acceptable (``unsupported_dtype``, ``bad_shape``, ``too_many_tensors``).
"""
from __future__ import annotations

import math
import struct
from dataclasses import dataclass, field
from functools import cached_property
from typing import Any, Mapping

import numpy as np

from shared.codec import DTYPES, bfloat16, dtype_name, pack, unpack
from shared.errors import ProtocolError, bad_request, unprocessable  # noqa: F401 (ProtocolError: docs)

MAGIC = b"SYNCPSF1"
#: media type of a body that is one frame
MEDIA_TYPE = "application/x-syncps-frame"
#: alignment of data_start and of every tensor offset (a cache line; float64 needs 8)
ALIGN = 64
PREFIX = struct.Struct("<8sII")
MAX_NDIM = 8
MAX_TENSORS = 4096
MAX_NAME_LEN = 256
#: largest dimension (numpy's index type must hold every product of them)
MAX_DIM = 1 << 40
#: longest header accepted (4096 tensors with 256-character names and 8 dimensions fit)
MAX_HEADER_BYTES = 2 << 20
_PAD = bytes(ALIGN)


def aligned(n: int, to: int = ALIGN) -> int:
    """``n`` rounded up to a multiple of ``to``."""
    return -(-n // to) * to


def bad_frame(detail: str) -> ProtocolError:
    return bad_request("bad_frame", detail)


@dataclass(frozen=True)
class TensorSpec:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # from data_start
    nbytes: int = field(init=False, compare=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "nbytes", math.prod(self.shape) * self.dtype.itemsize)


@dataclass(frozen=True)
class Layout:
    """Which tensors a frame holds and where (canonical offsets, header order)."""

    tensors: tuple[TensorSpec, ...]

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray], order: list[str] | None = None) -> "Layout":
        """The canonical layout of ``arrays`` (in ``order``, default: insertion order)."""
        specs, at = [], 0
        for name in order if order is not None else list(arrays):
            a = arrays[name]
            spec = TensorSpec(name, DTYPES[dtype_name(a.dtype)] or bfloat16(), tuple(int(d) for d in a.shape), at)
            specs.append(spec)
            at = aligned(at + spec.nbytes)
        return cls(tuple(specs))

    @cached_property
    def data_bytes(self) -> int:
        last = self.tensors[-1] if self.tensors else None
        return last.offset + last.nbytes if last else 0

    def to_wire(self) -> list:
        return [[t.name, dtype_name(t.dtype), list(t.shape), t.offset] for t in self.tensors]

    def matches(self, arrays: Mapping[str, np.ndarray]) -> bool:
        """Same names, dtypes and shapes (any order)."""
        return len(arrays) == len(self.tensors) and all(
            t.name in arrays and arrays[t.name].dtype == t.dtype and tuple(arrays[t.name].shape) == t.shape
            for t in self.tensors)

    def views(self, data: memoryview | np.ndarray) -> dict[str, np.ndarray]:
        """The tensors as arrays over ``data`` (the frame's data part, at least ``data_bytes`` long)."""
        buf = np.frombuffer(data, np.uint8)
        return {t.name: buf[t.offset:t.offset + t.nbytes].view(t.dtype).reshape(t.shape) for t in self.tensors}


def header(layout: Layout, meta: Mapping[str, Any] | None = None) -> bytes:
    """Prefix, header and padding: the frame's bytes before ``data_start``."""
    head = pack({"meta": dict(meta or {}), "tensors": layout.to_wire(), "data_bytes": layout.data_bytes})
    if len(head) > MAX_HEADER_BYTES:
        raise ValueError(f"a frame header of {len(head)} bytes is over the limit of {MAX_HEADER_BYTES}")
    start = PREFIX.pack(MAGIC, len(head), 0) + head
    return start + bytes(aligned(len(start)) - len(start))


def encode(tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None,
           layout: Layout | None = None) -> list[bytes | memoryview]:
    """The frame of ``tensors`` as buffers to send one after the other (tensor memory is referenced, not
    copied, when it is already C-contiguous little-endian of an allowed dtype)."""
    layout = layout or Layout.of(tensors)
    parts: list[bytes | memoryview] = [header(layout, meta)]
    end = 0
    for t in layout.tensors:
        if t.offset > end:
            parts.append(_PAD[:t.offset - end])
        arr = np.ascontiguousarray(tensors[t.name], dtype=t.dtype)
        if arr.nbytes:
            parts.append(memoryview(arr.reshape(-1).view(np.uint8)))  # as bytes: bfloat16 has no buffer format
        end = t.offset + t.nbytes
    return parts


def encode_bytes(tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None) -> bytes:
    """:func:`encode` joined into one bytes object (small frames, tests, checkpoints)."""
    return b"".join(encode(tensors, meta))


def write_into(buf: memoryview, tensors: Mapping[str, np.ndarray], meta: Mapping[str, Any] | None = None,
               layout: Layout | None = None) -> int:
    """Write the frame (:func:`encode`'s buffers) into ``buf`` of bytes (one copy of each tensor); its length."""
    at = 0
    for part in encode(tensors, meta, layout):
        buf[at:at + len(part)] = part
        at += len(part)
    return at


def frame_bytes(layout: Layout, meta: Mapping[str, Any] | None = None) -> int:
    return len(header(layout, meta)) + layout.data_bytes


def _header(mv: memoryview) -> dict | int:
    """The header (a map) of the frame whose first bytes ``mv`` holds, read before its tensors come; or, an int, how
    many bytes that needs. 400 ``bad_frame`` (``bad_msgpack``, ``duplicate_key``) if ``mv`` does not start a frame."""
    if len(mv) < PREFIX.size:
        return PREFIX.size
    magic, hlen, reserved = PREFIX.unpack_from(mv, 0)
    if magic != MAGIC:
        raise bad_frame(f"not a frame: the magic is {bytes(magic)[:8]!r}, not {MAGIC!r}")
    if reserved != 0 or hlen > MAX_HEADER_BYTES:
        raise bad_frame(f"bad frame prefix (header of {hlen} bytes, reserved {reserved})")
    if len(mv) < PREFIX.size + hlen:
        return PREFIX.size + hlen
    head = unpack(bytes(mv[PREFIX.size:PREFIX.size + hlen]))  # (a copy: no bin value holds a view of the body)
    if not isinstance(head, dict) or set(head) != {"meta", "tensors", "data_bytes"}:
        raise bad_frame('the header must be a map with exactly the keys "meta", "tensors" and "data_bytes"')
    return head


def peek_meta(buf: bytes | bytearray) -> dict | int | None:
    """The meta of the frame whose first bytes ``buf`` holds, read off its header alone (:func:`_header`); or, an
    int, how many bytes that needs; None if ``buf`` does not start a frame."""
    try:
        head = _header(memoryview(buf).cast("B"))
    except ProtocolError:
        return None
    if isinstance(head, int):
        return head
    meta = head.get("meta")
    return meta if isinstance(meta, dict) else None


@dataclass(frozen=True)
class Frame:
    meta: dict[str, Any]
    layout: Layout
    data_start: int
    tensors: dict[str, np.ndarray]  # views of the decoded buffer, in header order


def decode(buf: bytes | bytearray | memoryview, exact: bool = True) -> Frame:
    """Check and view a frame (see the module docstring). ``exact``: ``buf`` is the frame and nothing
    more (a body); else the frame is a prefix of ``buf`` (a file region)."""
    mv = memoryview(buf).cast("B")
    head = _header(mv)
    if isinstance(head, int):
        raise bad_frame(f"the frame is {len(mv)} bytes, shorter than its prefix and header ({head})")
    meta, entries, data_bytes = head["meta"], head["tensors"], head["data_bytes"]
    if not isinstance(meta, dict):
        raise bad_frame("header.meta must be a map")
    layout = _layout(entries) if entries != [] else _EMPTY  # no tensors: a control message
    if type(data_bytes) is not int or data_bytes != layout.data_bytes:
        raise bad_frame(f"header.data_bytes must be {layout.data_bytes} (the end of the last tensor)")
    hlen = PREFIX.unpack_from(mv, 0)[1]
    start = aligned(PREFIX.size + hlen)
    end = start + data_bytes
    if (len(mv) != end) if exact else (len(mv) < end):
        raise bad_frame(f"the frame is {len(mv)} bytes; its header says {end}")
    gaps = [(PREFIX.size + hlen, start), *((start + a.offset + a.nbytes, start + b.offset)
                                           for a, b in zip(layout.tensors, layout.tensors[1:]))]
    if any(mv[lo:hi] != _PAD[:hi - lo] for lo, hi in gaps):
        raise bad_frame("padding bytes must be zero")
    return Frame(meta, layout, start, layout.views(mv[start:end]))


class FrameReader:
    """The frames of a body that holds several one after another (a partitioned push, docs/protocol-partitions.md):
    frame 0 at offset 0, each next one at the first multiple of :data:`ALIGN` at or after the end of the one before
    (zero bytes between), the last ending the body. :meth:`feed` decodes each frame once its bytes are in (checked as
    :func:`decode` checks one: 400 ``bad_frame``), :meth:`finish` checks the body's end."""

    def __init__(self) -> None:
        self.end = 0  # where the last decoded frame ends
        self.count = 0  # frames decoded

    def feed(self, buf: bytes | bytearray | memoryview, got: int, limit: int) -> list[Frame]:
        """The frames ``buf[:got]`` completes (at most ``limit`` frames in all)."""
        mv = memoryview(buf).cast("B")
        out = []
        while self.count < limit and (end := self.next_end(mv, got)) is not None and end <= got:
            start = aligned(self.end) if self.count else 0
            if mv[self.end:start] != _PAD[:start - self.end]:
                raise bad_frame("padding bytes must be zero")
            out.append(decode(mv[start:end]))
            self.end, self.count = end, self.count + 1
        return out

    def next_end(self, buf: bytes | bytearray | memoryview, got: int) -> int | None:
        """Where the next frame ends in the body, once its header is among ``buf[:got]`` (None: not yet)."""
        start = aligned(self.end) if self.count else 0
        size = _extent(memoryview(buf).cast("B")[start:got]) if got >= start else None
        return None if size is None else start + size

    def finish(self, total: int, count: int) -> None:
        """The body ended at ``total`` bytes: it held exactly ``count`` frames."""
        if self.count < count:
            raise bad_frame(f"the body ends after {self.count} of its {count} frames")
        if self.end != total:
            raise bad_frame(f"the body is {total} bytes; its {count} frames end at {self.end}")


def _extent(mv: memoryview) -> int | None:
    """The length of the frame ``mv`` starts, once its prefix and header are in (None: not yet)."""
    head = _header(mv)
    if isinstance(head, int):
        return None
    size = head["data_bytes"]
    if type(size) is not int or size < 0:
        raise bad_frame("header.data_bytes must be the end of the last tensor")
    return aligned(PREFIX.size + PREFIX.unpack_from(mv, 0)[1]) + size


def decode_following(buf: bytes | bytearray | memoryview, count: int) -> list[Frame]:
    """The ``count`` frames of a whole body that holds several (:class:`FrameReader`)."""
    reader = FrameReader()
    frames = reader.feed(buf, len(buf), count)
    reader.finish(len(buf), count)
    return frames


def encode_many(frames: list[tuple[Mapping[str, np.ndarray], Mapping[str, Any]]]) -> list[bytes | memoryview]:
    """Several frames (tensors, meta) as one body's buffers (:class:`FrameReader`'s layout)."""
    parts: list[bytes | memoryview] = []
    size = 0
    for tensors, meta in frames:
        if size % ALIGN:
            parts.append(_PAD[:aligned(size) - size])
            size = aligned(size)
        more = encode(tensors, meta)
        parts += more
        size += sum(map(len, more))  # (every buffer is bytes, or a memoryview of uint8)
    return parts


_EMPTY = Layout(())  # a frame with no tensors (a same-host push, an answer whose weights are in the file)


def _layout(entries: Any) -> Layout:
    if not isinstance(entries, list):
        raise bad_frame("header.tensors must be a list")
    if len(entries) > MAX_TENSORS:
        raise unprocessable("too_many_tensors", f"at most {MAX_TENSORS} tensors")
    specs, names, at = [], set(), 0
    for entry in entries:
        if not (isinstance(entry, list) and len(entry) == 4):
            raise bad_frame("each header.tensors entry is [name, dtype, shape, offset]")
        name, dtype, shape, offset = entry
        if not isinstance(name, str) or not 0 < len(name) <= MAX_NAME_LEN:
            raise bad_frame(f"tensor names are strings of 1 to {MAX_NAME_LEN} characters")
        if name in names:
            raise bad_frame(f"tensor {name!r} appears twice")
        if not isinstance(dtype, str) or dtype not in DTYPES:
            raise unprocessable("unsupported_dtype", f"tensor {name!r}: dtype {str(dtype)[:32]!r} is not in the "
                                                     f"allow-list {sorted(DTYPES)}")
        if not (isinstance(shape, list) and len(shape) <= MAX_NDIM
                and all(type(d) is int and 0 <= d < MAX_DIM for d in shape)):
            raise unprocessable("bad_shape", f"tensor {name!r}: shape must be at most {MAX_NDIM} ints in [0, 2^40)")
        spec = TensorSpec(name, DTYPES[dtype] or bfloat16(), tuple(shape), at)  # (bfloat16: looked up once)
        if math.prod(d for d in shape if d) * spec.dtype.itemsize >= 1 << 62:
            raise unprocessable("bad_shape", f"tensor {name!r}: shape {shape} is too large")
        if type(offset) is not int or offset != at:
            raise bad_frame(f"tensor {name!r}: offset must be {at} (canonical layout, {ALIGN}-byte aligned)")
        names.add(name)
        specs.append(spec)
        at = aligned(at + spec.nbytes)
    return Layout(tuple(specs))
