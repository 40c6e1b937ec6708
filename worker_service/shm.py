"""The worker's side of the same-host transport (shared/shm.py): gradients into its file, weights from the PS's.

Contract: :meth:`ShmChannel.open` maps the PS's weights file named by ``GET /v1/shm`` read-only
from the worker's shared directory and checks its nonce (OSError/ValueError otherwise: the PS is
on another host, and the worker stays on HTTP), then makes and maps the worker's own gradient
file (``0600``, random name, random nonce). Once the PS attached it, :meth:`unlink` removes its
name: the mappings keep it alive until both sides are gone. :meth:`write` stores one push
(marker = a fresh sequence number, sent with the push). :attr:`weights` are read-only arrays over
the PS's live weights: they hold the step the last pull named until the PS closes that step's
round, which needs this worker's push (or refuses it as late).
"""
from __future__ import annotations

import os
import secrets
from typing import Mapping

import numpy as np

from shared import shm


class ShmChannel:
    def __init__(self, directory: str, layout: shm.Layout, weights_region) -> None:
        self.layout = layout
        self.weights: dict[str, np.ndarray] = shm.data_views(layout, weights_region)
        self.nonce = secrets.token_bytes(shm.NONCE_BYTES)
        self.gradient_file = f"syncps-g-{secrets.token_hex(16)}"
        self._path: str | None = os.path.join(directory, self.gradient_file)
        fd, self._region = shm.create_region(directory, self.gradient_file, layout.region_bytes, self.nonce, shm.WRITING)
        os.close(fd)
        self._grads = shm.data_views(layout, self._region)
        # a random start: a push of an earlier channel still in flight can never match this file's marker
        self._seq = secrets.randbits(48)

    @classmethod
    def open(cls, directory: str, offer: dict) -> "ShmChannel":
        layout = shm.Layout.from_wire(offer.get("layout"))
        name, region_bytes = offer.get("weights_file"), offer.get("region_bytes")
        if not isinstance(name, str) or not shm.WEIGHTS_FILE.fullmatch(name) or region_bytes != layout.region_bytes:
            raise ValueError("the PS's shm offer is malformed")
        nonce = offer.get("nonce")
        if not isinstance(nonce, str):
            raise ValueError("the PS's shm offer has no nonce")
        return cls(directory, layout, shm.map_existing(directory, name, region_bytes, bytes.fromhex(nonce), writable=False))

    def unlink(self) -> None:
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass
            self._path = None

    def write(self, grads: Mapping[str, np.ndarray]) -> int | None:
        """Store the gradients; the sequence number to push, or None if they do not fit the layout."""
        if not self.layout.matches(grads):
            return None
        self._seq += 1
        shm.set_header(self._region, None, shm.WRITING)
        for name, view in self._grads.items():
            np.copyto(view, grads[name])
        shm.set_header(self._region, None, self._seq)
        return self._seq

    def close(self) -> None:
        """Drop our name and references; the mappings go with the last array over them."""
        self.unlink()
        self._grads = {}
        self.weights = {}
