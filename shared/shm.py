"""Same-host tensor files: the byte-level rules both sides of the shared-memory transport follow.

The PS keeps its weights in a file in a shared-memory directory (``/dev/shm``) that every worker on its host maps
read-only, and each such worker writes its gradients into a file of its own there that the PS maps; the HTTP push
and pull then carry only their control fields (docs/protocol.md, "Same-host transport", gives the bytes). A file is
one *region*: a 64-byte header (:data:`HEADER`: magic, kind ``W`` for weights or ``G`` for gradients, the creator's
nonce, and a marker: -1 while the creator writes, else the push's sequence number or the weights' step), then one
tensor frame (:mod:`shared.frame`), zero-padded to whole pages. The nonce proves a peer mapped the very file its
creator made; the kind keeps a weights file (or a link to it) from passing for a gradient file.

Contract: names match :data:`GRADIENT_FILE` / :data:`WEIGHTS_FILE`; a peer's file is opened without following links,
must be a regular file of this user with one link, of exactly the expected size, with the expected magic, kind and
nonce and a valid frame; nothing here trusts a length it did not compute. :func:`create_file` / :func:`map_file`: the
file and its header alone (a region's frame aside), for a file of another layout (the standby's log, ring.py).
"""
from __future__ import annotations

import hmac
import mmap
import os
import re
import struct
from typing import Callable

import numpy as np

from shared import frame

MAGIC = b"SYNCPSM1"
HEADER = struct.Struct("<8sc7x16sq24x")
HEADER_BYTES = HEADER.size  # 64
PAGE = 4096
NONCE_BYTES = 16
KIND_WEIGHTS, KIND_GRADIENTS = b"W", b"G"
#: the marker while a region's tensors are being written
WRITING = -1
_MARKER = struct.Struct("<q")
_MARKER_AT = 32
GRADIENT_FILE = re.compile(r"syncps-g-[0-9a-f]{32}")
WEIGHTS_FILE = re.compile(r"syncps-w-[0-9]+-[0-9a-f]{16}")


def region_bytes(layout: frame.Layout) -> int:
    """The size of a file holding ``layout``: header, frame, padding to a page."""
    return frame.aligned(HEADER_BYTES + frame.frame_bytes(layout), PAGE)


class Region:
    """A mapped region: its marker, and its tensors as arrays over the mapping."""

    def __init__(self, mapping: mmap.mmap, layout: frame.Layout) -> None:
        self.mapping = mapping
        self.layout = layout
        start = HEADER_BYTES + len(frame.header(layout))
        self.data = memoryview(mapping)[start:start + layout.data_bytes]

    @property
    def marker(self) -> int:
        return _MARKER.unpack_from(self.mapping, _MARKER_AT)[0]

    @marker.setter
    def marker(self, value: int) -> None:
        _MARKER.pack_into(self.mapping, _MARKER_AT, value)

    def views(self) -> dict[str, np.ndarray]:
        """The tensors over the mapping (writable if the mapping is)."""
        return self.layout.views(self.data)


def open_in(directory: str, name: str, flags: int) -> int:
    """Open ``directory/name`` without following a symlink: a regular file of this user with one link,
    or OSError. Non-blocking, so a FIFO put there is refused at once rather than waiting for its writer (the PS's
    event loop with it); on a regular file ``O_NONBLOCK`` changes nothing."""
    fd = os.open(os.path.join(directory, name), flags | os.O_NOFOLLOW | os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if not (st.st_mode & 0o170000 == 0o100000 and st.st_uid == os.geteuid()):
            raise PermissionError(f"{name} is not a regular file of this user")
        if st.st_nlink != 1:
            raise PermissionError(f"{name} has {st.st_nlink} links (a link to another file?)")
    except BaseException:
        os.close(fd)
        raise
    return fd


def create_file(directory: str, name: str, size: int, kind: bytes, nonce: bytes, marker: int,
                lock: Callable[[int], None] | None = None) -> tuple[int, mmap.mmap]:
    """A new ``0600`` file of ``size`` bytes (allocated now), ``lock(fd)`` applied if given before it is mapped
    writable, its header written; (its descriptor, for the caller to keep or close; the mapping). OSError if impossible (it
    exists, the directory is full...)."""
    path = os.path.join(directory, name)
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.ftruncate(fd, size)
        if hasattr(os, "posix_fallocate"):
            os.posix_fallocate(fd, 0, size)  # ENOSPC now, not SIGBUS on first touch
        if lock is not None:
            lock(fd)
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE)
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    HEADER.pack_into(mapping, 0, MAGIC, kind, nonce, marker)
    return fd, mapping


def create_region(directory: str, name: str, kind: bytes, layout: frame.Layout, nonce: bytes,
                  marker: int, lock: Callable[[int], None] | None = None) -> tuple[int, Region]:
    """A new region holding ``layout`` (zero tensors): :func:`create_file`, and its frame header written."""
    fd, mapping = create_file(directory, name, region_bytes(layout), kind, nonce, marker, lock)
    head = frame.header(layout)
    mapping[HEADER_BYTES:HEADER_BYTES + len(head)] = head
    return fd, Region(mapping, layout)


def map_file(directory: str, name: str, size: int | None, kind: bytes, nonce: bytes,
             writable: bool) -> tuple[mmap.mmap, os.stat_result]:
    """Map the peer's file ``name`` and check it is the file meant: ``size`` bytes, magic, ``kind``, ``nonce``. (the
    mapping, the file's stat). OSError if it cannot be opened here, ValueError if it is not the file meant."""
    fd = open_in(directory, name, os.O_RDWR if writable else os.O_RDONLY)
    try:
        st = os.fstat(fd)
        if size is None or st.st_size != size:
            raise ValueError(f"{name} is {st.st_size} bytes, not {size}")
        mapping = mmap.mmap(fd, size, access=mmap.ACCESS_WRITE if writable else mmap.ACCESS_READ)
    finally:
        os.close(fd)
    magic, got_kind, got_nonce, _ = HEADER.unpack(mapping[:HEADER_BYTES])
    if magic != MAGIC or got_kind != kind:
        raise ValueError(f"{name} is not a syncps {kind.decode()} region")
    if not hmac.compare_digest(got_nonce, nonce):
        raise ValueError(f"{name} does not hold the expected nonce")
    return mapping, st


def map_existing(directory: str, name: str, kind: bytes, nonce: bytes, writable: bool,
                 layout: frame.Layout | None = None, size: int | None = None) -> tuple[Region, os.stat_result]:
    """A peer's region (:func:`map_file`) with a valid frame, and ``layout`` (when given: the frame header must be
    exactly the one of that layout) or ``size`` bytes. OSError if it cannot be opened here, ValueError if it is not
    the file meant."""
    want = region_bytes(layout) if layout is not None else size
    mapping, st = map_file(directory, name, want, kind, nonce, writable)
    if layout is not None:
        head = frame.header(layout)
        if mapping[HEADER_BYTES:HEADER_BYTES + len(head)] != head:
            raise ValueError(f"{name} does not hold the model's layout")
    else:
        try:
            layout = frame.decode(memoryview(mapping)[HEADER_BYTES:], exact=False).layout
        except Exception as exc:
            raise ValueError(f"{name} holds no valid frame: {exc}") from None
        if region_bytes(layout) != want:
            raise ValueError(f"{name}: its frame does not fill {want} bytes")
    return Region(mapping, layout), st


class PeerRegion:
    """A peer's region mapped read-only (:func:`map_existing`): its marker, and its tensors over bytes the peer may
    rewrite at any time (every read of it is a copy that checks what it read; shared/shm.py's users never keep a view
    of it past one push). Its pages count in this process's RSS (they are the peer's file's)."""

    def __init__(self, region: Region) -> None:
        #: the marker as a one-element array over the mapping: ``marker[0]`` is its value as the peer last wrote it
        self.marker: np.ndarray | None = np.frombuffer(region.mapping, "<i8", 1, _MARKER_AT)
        #: the tensors over the mapping (read-only arrays), made once
        self.tensors: dict[str, np.ndarray] | None = region.views()

    def close(self) -> None:
        """Drop this object's hold on the mapping (it goes with the last array over it)."""
        self.marker = self.tensors = None
