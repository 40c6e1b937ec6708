"""The same-host carrier of a hot-standby pair's steps: a ring of records in a file the standby owns in its
shared-memory directory (docs/protocol-standby.md, "Same host: the log": the bytes, the checks, the order).

The standby makes it (:meth:`Log.create`, an flock held while it lives) and advertises it (:meth:`Log.advert`); the
primary maps only that very file (:meth:`LogWriter.open`), so a file it can map is on its own host. The primary
writes record ``seq`` once the standby applied ``seq - slots`` (:meth:`LogWriter.room`), its marker last, and reads
the log's ``closed`` after a full barrier (:meth:`LogWriter.commit`): 0, the record is on the standby; else the
standby closed the log first (:meth:`Log.close_for`, then the same barrier, then it reads every record committed:
Dekker's two stores and two loads) and the record does not count. :func:`barrier` is an uncontended lock's acquire and
release (a locked instruction: a full barrier on x86-64); elsewhere (:data:`USABLE` false) there is no log.
"""
from __future__ import annotations

import contextlib
import mmap
import os
import platform
import re
import secrets
import struct
import threading

import numpy as np

from shared import frame, shm

try:
    import fcntl
except ImportError:  # not a POSIX system: no log, the steps go over HTTP
    fcntl = None
#: the log's ordering argument (:func:`barrier`) holds here: x86-64 and POSIX
USABLE = fcntl is not None and platform.machine().lower() in {"x86_64", "amd64"}

KIND_LOG = b"L"
NAME = re.compile(r"syncps-l-[0-9a-f]{32}")
#: the file header (shared/shm.py's first 40 bytes: magic, kind, nonce, then ``applied``), then its own fields
APPLIED_AT, CLOSED_AT, GEOMETRY = 32, 40, struct.Struct("<qq")  # geometry at 48: slots, slot size
SLOTS_AT = 4096  # the slots start on the second page
SLOT_HEADER = 64  # a slot: its header (seq, term, length, gated), then the record's frame
SEQ, TERM, LENGTH, GATED = range(4)  # the slot header's int64 fields
#: room for a message's meta (members, clocks) beyond the model's tensors
META_ROOM = 64 << 10
#: slots of a log, at most (fewer for a large model: at most LOG_BYTES, at least 2)
SLOTS, LOG_BYTES = 4, 256 << 20
_BARRIER = threading.Lock()


def barrier() -> None:
    """A full memory barrier (the module's docstring)."""
    with _BARRIER:
        pass


class _Ring:
    """The mapping, its header fields and the slots' headers as int64 arrays (one aligned store each)."""

    def __init__(self, mapping: mmap.mmap, slots: int, slot_bytes: int) -> None:
        self.mapping, self.slots, self.slot_bytes = mapping, slots, slot_bytes
        self.head = np.frombuffer(mapping, "<i8", SLOTS_AT // 8)
        self.heads = [np.frombuffer(mapping, "<i8", SLOT_HEADER // 8, self._at(i)) for i in range(slots)]

    def _at(self, index: int) -> int:
        return SLOTS_AT + index * self.slot_bytes

    def slot(self, seq: int) -> tuple[np.ndarray, memoryview]:
        """Record ``seq``'s slot: its header, and the bytes its frame may take."""
        i = (seq - 1) % self.slots
        at = self._at(i) + SLOT_HEADER
        return self.heads[i], memoryview(self.mapping)[at:at + self.slot_bytes - SLOT_HEADER]

    @property
    def applied(self) -> int:
        return int(self.head[APPLIED_AT // 8])

    @property
    def closed(self) -> int:
        return int(self.head[CLOSED_AT // 8])

    def release(self) -> None:
        self.head = self.heads = None
        with contextlib.suppress(BufferError):  # a view still held (a record being read): it goes with it
            self.mapping.close()


class Log(_Ring):
    """The standby's side: the file it made, mapped writable (a record's arrays are the optimizer's input in place)."""

    def __init__(self, directory: str, name: str, nonce: bytes, fd: int, mapping, slots: int, slot_bytes: int):
        super().__init__(mapping, slots, slot_bytes)
        self.path, self.name, self.nonce, self._fd = os.path.join(directory, name), name, nonce, fd

    @classmethod
    def create(cls, directory: str, model: frame.Layout, applied: int, slots: int | None = None) -> "Log":
        """A new log for a model of ``model``'s layout, its first record ``applied + 1``. OSError if impossible (no
        space: ENOSPC now, not SIGBUS later)."""
        slot = frame.aligned(SLOT_HEADER + frame.frame_bytes(model) + META_ROOM, shm.PAGE)
        n = slots or max(2, min(SLOTS, LOG_BYTES // slot))
        name, nonce = f"syncps-l-{secrets.token_hex(16)}", secrets.token_bytes(shm.NONCE_BYTES)
        fd, mapping = shm.create_file(directory, name, SLOTS_AT + n * slot, KIND_LOG, nonce, applied,
                                      lambda fd: fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB))  # (the sweep's test)
        GEOMETRY.pack_into(mapping, 48, n, slot)
        return cls(directory, name, nonce, fd, mapping, n, slot)

    def advert(self) -> dict:
        """What the primary needs to map it (``GET /v1/ha`` ``log``)."""
        return {"name": self.name, "nonce": self.nonce.hex(), "slots": self.slots, "slot_bytes": self.slot_bytes}

    def record(self, seq: int, term: int) -> tuple[bool, memoryview] | None:
        """Record ``seq`` if committed by a primary of ``term``: (gated, its frame's bytes); else None."""
        head, body = self.slot(seq)
        if head[SEQ] != seq or head[TERM] != term:
            return None
        n = int(head[LENGTH])
        return (bool(head[GATED]), body[:n]) if 0 < n <= len(body) else None

    @_Ring.applied.setter
    def applied(self, seq: int) -> None:
        self.head[APPLIED_AT // 8] = seq

    def close_for(self, term: int) -> None:
        """No record counts from now on (``term``: the closer's, > 0); every one committed before is readable."""
        self.head[CLOSED_AT // 8] = term
        barrier()

    def remove(self) -> None:
        """Unlink the file and drop the mapping (a record still read keeps its pages)."""
        with contextlib.suppress(OSError):
            os.unlink(self.path)
        os.close(self._fd)
        self.release()


def sweep(directory: str) -> None:
    """Unlink the logs whose standby is gone (killed: no flock held on them)."""
    with contextlib.suppress(OSError):
        for name in os.listdir(directory):
            if not NAME.fullmatch(name):
                continue
            with contextlib.suppress(OSError):
                fd = shm.open_in(directory, name, os.O_RDONLY)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    os.unlink(os.path.join(directory, name))
                finally:
                    os.close(fd)


class LogWriter(_Ring):
    """The primary's side: the standby's log, mapped writable once proven."""

    @classmethod
    def open(cls, directory: str, advert: dict) -> "LogWriter":
        """Map the advertised log in ``directory`` (this host's shared-memory directory); ValueError if it is not the
        file advertised, OSError if there is none here (another host)."""
        name, slots, slot = advert.get("name"), advert.get("slots"), advert.get("slot_bytes")
        if not (isinstance(name, str) and NAME.fullmatch(name) and type(slots) is int and type(slot) is int
                and 2 <= slots <= SLOTS and slot % shm.PAGE == 0 and SLOT_HEADER < slot <= 1 << 40):
            raise ValueError(f"not a log's advert: {advert!r}")
        mapping, _ = shm.map_file(directory, name, SLOTS_AT + slots * slot, KIND_LOG,
                                  bytes.fromhex(str(advert.get("nonce"))), writable=True)
        if GEOMETRY.unpack_from(mapping, 48) != (slots, slot):
            mapping.close()
            raise ValueError(f"{name} is not the log advertised (its geometry)")
        return cls(mapping, slots, slot)

    def room(self, seq: int) -> bool:
        """Whether record ``seq`` may be written now (the standby applied ``seq - slots``)."""
        return seq - self.slots <= self.applied

    def begin(self, seq: int) -> memoryview:
        """Record ``seq``'s bytes (call only with :meth:`room`): its commit marker zeroed first."""
        head, body = self.slot(seq)
        head[SEQ] = 0
        return body

    def commit(self, seq: int, term: int, gated: bool, length: int) -> int:
        """Record ``seq`` committed (its marker written last): 0 if it counts, else the term the log was closed with."""
        head, _ = self.slot(seq)
        head[TERM], head[LENGTH], head[GATED] = term, length, int(gated)
        head[SEQ] = seq
        barrier()
        return self.closed
