"""The PS's side of the same-host transport (shared/shm.py): its weights file and the workers' gradient files.

Contract:
- :meth:`ShmHub.offer` (``GET /v1/shm``) moves the weights into a file on first use (``0600``, in ``PS_SHM_DIR``,
  kind ``W``): the optimizer updates them there and every same-host worker maps them read-only. It returns the file's
  name, nonce and size (a worker that maps it and reads the same nonce is on this host). :meth:`published` writes the
  global step into its marker. When the weights move out (the body answers' frame, ``core/model.py``), :meth:`mirror`
  copies a step's weights into the file (marker -1 meanwhile), :meth:`adopt` takes them back, :meth:`holds` says
  where they are (the policy: ``TensorSeam._file_current``).
- :meth:`ShmHub.attach` (``POST /v1/workers/{id}/shm``) maps the gradient file the worker made, checked as
  docs/protocol.md's step 3 says, never the PS's own weights file. The mapping stays while the worker is attached: its
  pages are the worker's (in the PS's RSS, not its anonymous memory); dropped after each read they would fault in
  again at the next push (7 ms more CPU a read of a 40 MB file on the 2-core VM).
- :meth:`ShmHub.gradients` copies a push once out of the worker's file into a pooled buffer of the PS's own
  (:data:`ps_service.core.buffers.POOL`), checking each tensor for NaN/Inf once copied
  (:func:`ps_service.core.checks.read_checked`), between two reads of the marker (409 ``shm_torn``).
- Refusals (409 ``shm_unavailable``, ``shm_not_attached``, ``shm_torn``; 400 for malformed names): docs/protocol.md.
The weights file is unlinked on shutdown; files left by a killed PS (no flock held) are swept on start.
"""
from __future__ import annotations

import contextlib
import logging
import os
import secrets

import numpy as np

from ps_service.core.buffers import POOL
from ps_service.core.checks import read_checked
from shared import frame, shm
from shared.errors import ProtocolError, bad_request

try:
    import fcntl
except ImportError:  # not a POSIX system: no same-host transport
    fcntl = None

log = logging.getLogger("ps_service")


def _lock(fd: int) -> None:
    """The exclusive flock a live PS keeps on its weights file, and the start-up sweep tests (OSError: held)."""
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def unavailable(detail: str) -> ProtocolError:
    return ProtocolError(409, "shm_unavailable", detail)


class ShmHub:
    def __init__(self, directory: str | None) -> None:
        self.directory = directory if directory and fcntl is not None and os.path.isdir(directory) else None
        self.layout: frame.Layout | None = None
        self.weights_name: str | None = None
        self._weights: shm.Region | None = None
        self._views: dict[str, np.ndarray] = {}  # the file's tensors (the core's weights while the file holds them)
        self._weights_id: tuple[int, int] | None = None  # (st_dev, st_ino) of the weights file
        self._nonce = secrets.token_bytes(shm.NONCE_BYTES)
        #: an open descriptor of the weights file holding an exclusive flock: "this file's PS is alive"
        self._lock_fd: int | None = None
        #: worker_id -> its gradient file, mapped read-only
        self.attached: dict[str, shm.PeerRegion] = {}
        #: worker_id -> the transport of its last accepted push ("shm" or "http"), for monitoring
        self.last_transport: dict[str, str] = {}
        self.bytes_in = 0
        #: copies of the weights into the file made by :meth:`mirror` (monitoring, tests)
        self.mirrored = 0
        if self.directory:
            self._sweep()

    def _sweep(self) -> None:
        """Unlink weights files whose PS is gone: a live PS holds an exclusive flock on its file (which works
        across containers sharing the directory, where PIDs mean nothing)."""
        for name in os.listdir(self.directory):
            if not shm.WEIGHTS_FILE.fullmatch(name):
                continue
            try:
                fd = shm.open_in(self.directory, name, os.O_RDONLY)
            except OSError:
                continue
            try:
                _lock(fd)
                os.unlink(os.path.join(self.directory, name))
                log.info("removed %s (its PS is gone)", name)
            except OSError:  # locked: its PS runs
                pass
            finally:
                os.close(fd)

    def offer(self, weights: dict[str, np.ndarray], step: int) -> dict:
        """Describe the weights file, moving ``weights`` (the core's dict, updated in place) into it first."""
        if self.directory is None:
            raise unavailable("the PS's same-host transport is off (PS_SHM_DIR)")
        if self.weights_name is None:
            layout = frame.Layout.of(weights, sorted(weights))
            name = f"syncps-w-{os.getpid()}-{secrets.token_hex(8)}"
            try:
                self._lock_fd, region = shm.create_region(self.directory, name, shm.KIND_WEIGHTS, layout,
                                                          self._nonce, step, lock=_lock)
            except OSError as exc:  # e.g. a full tmpfs
                raise unavailable(f"cannot make the weights file: {exc}") from exc
            st = os.fstat(self._lock_fd)
            self.layout, self.weights_name, self._weights = layout, name, region
            self._views = region.views()
            self._weights_id = (st.st_dev, st.st_ino)
            self.adopt(weights)  # the optimizer now updates the file
        return {"weights_file": self.weights_name, "nonce": self._nonce.hex(),
                "region_bytes": shm.region_bytes(self.layout)}

    def published(self, step: int) -> None:
        """The weights in the file are those of ``step`` (its marker, for readers)."""
        if self._weights is not None and self._weights.marker != step:
            self._weights.marker = step

    def holds(self, weights: dict[str, np.ndarray] | None) -> bool:
        """The core's weights are the file's arrays (the optimizer updates them there)."""
        if not self._views or not weights or len(weights) != len(self._views):
            return False
        first = next(iter(self._views))
        return weights.get(first) is self._views[first]

    def adopt(self, weights: dict[str, np.ndarray], copy: bool = True) -> None:
        """Make the file's arrays the core's, copying the weights in first (``copy`` False: :meth:`mirror` just did)."""
        for key, view in self._views.items():
            if weights[key] is not view:
                if copy:
                    np.copyto(view, weights[key])
                weights[key] = view

    def mirror(self, weights: dict[str, np.ndarray], step: int) -> None:
        """Copy the core's weights, kept elsewhere, into the file as ``step``'s (marker "writing" meanwhile)."""
        self._weights.marker = shm.WRITING
        for key, view in self._views.items():
            np.copyto(view, weights[key])
        self._weights.marker = step
        self.mirrored += 1

    @staticmethod
    def attach_fields(name: object, nonce: object) -> bytes:
        """An attach's fields judged on their own (400 ``bad_field``: the body's form, before the worker's state, as
        docs/protocol.md's Errors order them): the nonce's bytes."""
        if not isinstance(name, str) or not shm.GRADIENT_FILE.fullmatch(name):
            raise bad_request("bad_field", "file must be a gradient file name (syncps-g-<32 hex>)")
        if not isinstance(nonce, str) or len(nonce) != 2 * shm.NONCE_BYTES:
            raise bad_request("bad_field", f"nonce must be {2 * shm.NONCE_BYTES} hex digits")
        try:
            return bytes.fromhex(nonce)
        except ValueError:
            raise bad_request("bad_field", "nonce must be hex") from None

    def attach(self, worker_id: str, name: str, want: bytes) -> None:
        """Map the worker's gradient file ``name`` (its fields checked by :meth:`attach_fields`; ``want`` the nonce)."""
        if self.layout is None:
            raise unavailable("GET /v1/shm first")
        try:
            region, st = shm.map_existing(self.directory, name, shm.KIND_GRADIENTS, want, False, self.layout)
        except OSError as exc:
            raise unavailable(f"cannot open {name} here (another host?): {exc.strerror or exc}") from None
        except ValueError as exc:
            raise unavailable(str(exc)) from None
        if (st.st_dev, st.st_ino) == self._weights_id:
            raise unavailable(f"{name} is the PS's weights file")
        self.detach(worker_id)
        self.attached[worker_id] = shm.PeerRegion(region)

    def detach(self, worker_id: str) -> None:
        peer = self.attached.pop(worker_id, None)
        if peer is not None:
            peer.close()

    def prune(self, keep: set[str]) -> None:
        """Forget the files of workers that are gone (left or expired)."""
        for worker_id in [w for w in self.attached if w not in keep]:
            self.detach(worker_id)

    def gradients(self, worker_id: str, seq: int) -> tuple[dict[str, np.ndarray], bool]:
        """One push's gradients (``seq``: its ``shm_seq``, checked with the push's meta: shared.protocol) copied out
        of the worker's file into memory the PS owns, and whether finite."""
        region = self.attached.get(worker_id)  # (attached: after GET /v1/shm, so :attr:`layout` is set)
        if region is None:
            raise ProtocolError(409, "shm_not_attached", "this worker has no gradient file here: attach again")
        if region.marker[0] != seq:
            raise ProtocolError(409, "shm_torn", "the gradient file does not hold that push (rewritten?)")
        out = self.layout.views(POOL.take(self.layout.data_bytes))
        bad = read_checked(region.tensors, out)
        if region.marker[0] != seq:  # rewritten while it was read: what was read may mix two pushes
            raise ProtocolError(409, "shm_torn", "the gradient file was rewritten during the push")
        self.bytes_in += self.layout.data_bytes
        return out, bad is None

    def close(self) -> None:
        """Unlink the weights file (the core's arrays keep the mapping until they go)."""
        for worker_id in list(self.attached):
            self.detach(worker_id)
        if self.weights_name is not None:
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.directory, self.weights_name))
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
