"""The PS's side of the same-host transport (shared/shm.py): its weights file and the workers' gradient files.

Contract:
- :meth:`ShmHub.offer` (``GET /v1/shm``) moves the weights into a file on first use (``0600``, in
  ``PS_SHM_DIR``): from then on the optimizer updates them there, in place, and every same-host
  worker maps them read-only (no copy per step on either side). It returns the file's name, nonce
  and layout; a worker that maps it and reads the same nonce is on this host.
- :meth:`ShmHub.attach` (``POST /v1/workers/{id}/shm``) maps the gradient file the worker made
  (name pattern, regular file of this user, no symlink, exact size, matching nonce). The worker then
  unlinks it: the mappings keep it alive, and it vanishes with the last of them.
- :meth:`ShmHub.gradients` gives one push's gradients as writable arrays over that mapping, once
  the file's marker shows it holds that push. The core sums the round into the first of them in
  place: a worker does not write its file again before its round closed (it waits for the answer).
- Refusals: 409 ``shm_unavailable`` (the worker then uses plain HTTP), 409 ``shm_not_attached`` /
  ``shm_torn`` (attach again), 400 for malformed names.
The weights file is unlinked on shutdown; files left by a PS that was killed (no flock held on them)
are swept on start.
"""
from __future__ import annotations

import logging
import os
import secrets

import numpy as np

from shared import shm
from shared.errors import ProtocolError, bad_request

try:
    import fcntl
except ImportError:  # not a POSIX system: no same-host transport
    fcntl = None

log = logging.getLogger("ps_service")


def _hold_lock(fd: int) -> None:
    """The exclusive flock a live PS keeps on its weights file (what the start-up sweep tests)."""
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)


def unavailable(detail: str) -> ProtocolError:
    return ProtocolError(409, "shm_unavailable", detail)


class ShmHub:
    def __init__(self, directory: str | None) -> None:
        self.directory = directory if directory and fcntl is not None and os.path.isdir(directory) else None
        self.layout: shm.Layout | None = None
        self.weights_name: str | None = None
        self._nonce = secrets.token_bytes(shm.NONCE_BYTES)
        #: an open descriptor of the weights file holding an exclusive flock: "this file's PS is alive"
        self._lock_fd: int | None = None
        #: worker_id -> the mapping of its gradient file
        self.attached: dict[str, object] = {}
        #: worker_id -> the transport of its last push ("shm" or "http"), for monitoring
        self.last_transport: dict[str, str] = {}
        self.bytes_in = 0
        if self.directory:
            self._sweep()

    @property
    def enabled(self) -> bool:
        return self.directory is not None

    def _sweep(self) -> None:
        """Unlink weights files whose PS is gone (a killed PS leaves its file). A live PS holds an
        exclusive flock on its file: that works across containers sharing the directory, where PIDs
        mean nothing."""
        for name in os.listdir(self.directory):
            if not shm.WEIGHTS_FILE.fullmatch(name):
                continue
            try:
                fd = shm.open_in(self.directory, name, os.O_RDONLY)
            except OSError:
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                os.unlink(os.path.join(self.directory, name))
                log.info("removed %s (its PS is gone)", name)
            except OSError:  # locked: its PS runs
                pass
            finally:
                os.close(fd)

    def offer(self, weights: dict[str, np.ndarray]) -> dict:
        """Describe the weights file, moving ``weights`` (the core's dict, updated in place) into it first."""
        if not self.enabled:
            raise unavailable("the PS's same-host transport is off (PS_SHM_DIR)")
        if self.weights_name is None:
            layout = shm.Layout.of(weights)
            name = f"syncps-w-{os.getpid()}-{secrets.token_hex(8)}"
            try:
                self._lock_fd, region = shm.create_region(self.directory, name, layout.region_bytes, self._nonce, 0,
                                                          lock=_hold_lock)
            except OSError as exc:  # e.g. a full tmpfs
                raise unavailable(f"cannot make the weights file: {exc}") from exc
            views = shm.data_views(layout, region)
            for key, view in views.items():
                np.copyto(view, weights[key])
                weights[key] = view  # the optimizer now updates the file
            self.layout, self.weights_name = layout, name
        return {"weights_file": self.weights_name, "nonce": self._nonce.hex(), "layout": self.layout.to_wire(),
                "region_bytes": self.layout.region_bytes}

    def attach(self, worker_id: str, name: object, nonce: object) -> None:
        if not isinstance(name, str) or not shm.GRADIENT_FILE.fullmatch(name):
            raise bad_request("bad_field", "file must be a gradient file name (syncps-g-<32 hex>)")
        if not isinstance(nonce, str) or len(nonce) != 2 * shm.NONCE_BYTES:
            raise bad_request("bad_field", f"nonce must be {2 * shm.NONCE_BYTES} hex digits")
        try:
            want = bytes.fromhex(nonce)
        except ValueError:
            raise bad_request("bad_field", "nonce must be hex") from None
        if self.layout is None:
            raise unavailable("GET /v1/shm first")
        try:
            region = shm.map_existing(self.directory, name, self.layout.region_bytes, want, writable=True)
        except OSError as exc:
            raise unavailable(f"cannot open {name} here (another host?): {exc.strerror or exc}") from None
        except ValueError as exc:
            raise unavailable(str(exc)) from None
        self.attached[worker_id] = region

    def detach(self, worker_id: str) -> None:
        """Forget a worker's file; the mapping goes once no round holds its arrays any more."""
        self.attached.pop(worker_id, None)

    def prune(self, keep: set[str]) -> None:
        """Forget the files of workers that are gone (left or expired)."""
        for worker_id in [w for w in self.attached if w not in keep]:
            self.detach(worker_id)

    def gradients(self, worker_id: str, seq: object) -> dict[str, np.ndarray]:
        """One push's gradients as writable arrays over the worker's file (the core may sum into them)."""
        region = self.attached.get(worker_id)
        if region is None or self.layout is None:
            raise ProtocolError(409, "shm_not_attached", "this worker has no gradient file here: attach again")
        if isinstance(seq, bool) or not isinstance(seq, int) or seq < 0:
            raise bad_request("bad_field", "push: shm_seq must be an int >= 0")
        if shm.marker_of(region) != seq:
            raise ProtocolError(409, "shm_torn", "the gradient file does not hold that push (rewritten?)")
        self.bytes_in += self.layout.data_bytes
        return shm.data_views(self.layout, region)

    def close(self) -> None:
        """Unlink the weights file (the core's arrays keep the mapping until they go)."""
        self.attached.clear()
        if self.weights_name is not None:
            try:
                os.unlink(os.path.join(self.directory, self.weights_name))
            except OSError:
                pass
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None
