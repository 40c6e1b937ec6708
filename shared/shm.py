"""Same-host tensor files: the layout and the byte-level rules both sides of the shm transport follow.

When a worker runs on the PS's host (``make run``, ``bench/``, several worker processes on one
box), tensors need not cross a socket: the PS keeps its weights in a file in a shared-memory
directory (``/dev/shm``, a tmpfs) that every worker maps read-only, and each worker writes its
gradients into a file of its own there that the PS maps; the HTTP push and pull then carry only
the small control map (docs/protocol.md, "Same-host transport"). The HTTP exchange stays the
synchronisation: a worker computes on the weights of the step its pull named, and the PS changes
them only when it closes that step's round, after which a push for that step is refused (late or
stale) whatever it was computed from.

A file is one *region*: a :data:`HEADER_BYTES` header (16-byte nonce, int64 marker) then the
tensors of a :class:`Layout`, each at an :data:`ALIGN`-aligned offset (cache-line aligned for numpy
and BLAS, without a page of padding per small tensor). The nonce proves the other
side mapped the very file its peer made (same host, same directory). In a gradient file the marker
is the sequence number of the push it holds (:data:`WRITING` while the worker writes), so the PS
never sums a file that is not the push it was sent.

Contract: file names match :data:`GRADIENT_FILE` / :data:`WEIGHTS_FILE`; dtypes come from the codec's
allow-list; nothing here trusts a length it did not compute from a validated layout.
"""
from __future__ import annotations

import hmac
import mmap
import os
import re
import struct
from dataclasses import dataclass
from functools import cached_property
from typing import Any, Callable, Mapping

import numpy as np

from shared.codec import DTYPES, MAX_NDIM, MAX_TENSORS, dtype_name
from shared.errors import bad_request

ALIGN = 64
#: the header takes a page, so the tensors start page-aligned
HEADER_BYTES = 4096
NONCE_BYTES = 16
#: the marker while a region is being written
WRITING = -1
_MARKER = struct.Struct("<q")
GRADIENT_FILE = re.compile(r"syncps-g-[0-9a-f]{32}")
WEIGHTS_FILE = re.compile(r"syncps-w-[0-9]+-[0-9a-f]{16}")
#: header of an HTTP push whose tensors are in the worker's gradient file (value "shm")
TENSORS_HEADER = "X-Syncps-Tensors"


def _aligned(n: int, to: int = ALIGN) -> int:
    return -(-n // to) * to


@dataclass(frozen=True)
class TensorSlot:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    offset: int  # from the start of the region's data (after the header)

    @cached_property
    def nbytes(self) -> int:
        return int(np.prod(self.shape, dtype=np.int64)) * self.dtype.itemsize


@dataclass(frozen=True)
class Layout:
    """Where each tensor of a model sits in a region (names in sorted order)."""

    tensors: tuple[TensorSlot, ...]

    @classmethod
    def of(cls, arrays: Mapping[str, np.ndarray]) -> "Layout":
        slots, at = [], 0
        for name in sorted(arrays):
            a = arrays[name]
            slots.append(TensorSlot(name, DTYPES[dtype_name(a.dtype)], tuple(a.shape), at))
            at = _aligned(at + a.nbytes)
        return cls(tuple(slots))

    @cached_property
    def data_bytes(self) -> int:
        last = self.tensors[-1] if self.tensors else None
        return _aligned(last.offset + last.nbytes, HEADER_BYTES) if last else 0

    @cached_property
    def region_bytes(self) -> int:
        return HEADER_BYTES + self.data_bytes

    def to_wire(self) -> list:
        return [[t.name, dtype_name(t.dtype), list(t.shape), t.offset] for t in self.tensors]

    @classmethod
    def from_wire(cls, obj: Any) -> "Layout":
        """The layout a PS sent (validated: allow-listed dtypes, in-order non-overlapping offsets)."""
        if not isinstance(obj, list) or not 0 < len(obj) <= MAX_TENSORS:
            raise bad_request("bad_field", "shm layout must be a non-empty list")
        slots, end = [], 0
        for item in obj:
            if not (isinstance(item, list) and len(item) == 4 and isinstance(item[0], str) and item[1] in DTYPES
                    and isinstance(item[2], list) and len(item[2]) <= MAX_NDIM
                    and all(isinstance(d, int) and d >= 0 for d in item[2]) and isinstance(item[3], int)):
                raise bad_request("bad_field", "shm layout entry must be [name, dtype, shape, offset]")
            slot = TensorSlot(item[0], DTYPES[item[1]], tuple(item[2]), item[3])
            if slot.offset < end or slot.offset % ALIGN:
                raise bad_request("bad_field", "shm layout offsets must be aligned and increasing")
            slots.append(slot)
            end = slot.offset + slot.nbytes
        return cls(tuple(slots))

    def views(self, data: memoryview | np.ndarray) -> dict[str, np.ndarray]:
        """The tensors as arrays over ``data`` (one region's data part)."""
        buf = np.frombuffer(data, np.uint8)
        return {t.name: buf[t.offset:t.offset + t.nbytes].view(t.dtype).reshape(t.shape) for t in self.tensors}

    def matches(self, arrays: Mapping[str, np.ndarray]) -> bool:
        return len(arrays) == len(self.tensors) and all(
            t.name in arrays and arrays[t.name].dtype == t.dtype and tuple(arrays[t.name].shape) == t.shape
            for t in self.tensors)


def map_file(fd: int, size: int, writable: bool) -> mmap.mmap:
    """A shared mapping of the first ``size`` bytes of ``fd``."""
    return mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)


def marker_of(region: mmap.mmap) -> int:
    return _MARKER.unpack_from(region, NONCE_BYTES)[0]


def set_header(region: mmap.mmap, nonce: bytes | None = None, marker: int = WRITING) -> None:
    if nonce is not None:
        region[:NONCE_BYTES] = nonce
    _MARKER.pack_into(region, NONCE_BYTES, marker)


def data_views(layout: Layout, region: mmap.mmap) -> dict[str, np.ndarray]:
    """The tensors of a mapped region, as arrays over the mapping (writable if the mapping is)."""
    return layout.views(memoryview(region)[HEADER_BYTES:HEADER_BYTES + layout.data_bytes])


def open_in(directory: str, name: str, flags: int) -> int:
    """Open ``directory/name`` without following a symlink; a regular file of ours, or OSError."""
    fd = os.open(os.path.join(directory, name), flags | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not (st.st_mode & 0o170000 == 0o100000 and st.st_uid == os.geteuid()):
            raise PermissionError(f"{name} is not a regular file of this user")
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_in(directory: str, name: str, size: int) -> int:
    """A new ``0600`` file of ``size`` zero bytes (OSError if it exists or the directory is full)."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on first touch
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    return fd


def create_region(directory: str, name: str, size: int, nonce: bytes, marker: int,
                  lock: Callable[[int], None] | None = None) -> tuple[int, mmap.mmap]:
    """A new file of ``size`` bytes, ``lock(fd)`` applied first if given, mapped writable, header
    written; (its descriptor, for the caller to keep or close; the mapping). OSError if impossible."""
    fd = create_in(directory, name, size)
    try:
        if lock is not None:
            lock(fd)
        region = map_file(fd, size, writable=True)
    except BaseException:
        os.close(fd)
        os.unlink(os.path.join(directory, name))
        raise
    set_header(region, nonce, marker)
    return fd, region


def map_existing(directory: str, name: str, size: int, nonce: bytes, writable: bool) -> mmap.mmap:
    """Map the peer's file ``name``: a regular file of ours, no symlink, exactly ``size`` bytes,
    holding ``nonce``. OSError if it cannot be opened here, ValueError if it is not the file meant."""
    fd = open_in(directory, name, os.O_RDWR if writable else os.O_RDONLY)
    try:
        if os.fstat(fd).st_size != size:
            raise ValueError(f"{name} is not {size} bytes")
        region = map_file(fd, size, writable)
    finally:
        os.close(fd)
    if not hmac.compare_digest(bytes(region[:NONCE_BYTES]), nonce):
        raise ValueError(f"{name} does not hold the expected nonce")
    return region
