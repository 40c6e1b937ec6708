"""Tensors through same-host files (shared/shm.py): gradients into the worker's file, weights from the PS's.

Contract: :meth:`ShmTransport.open` maps the PS's weights file named by ``GET /v1/shm`` read-only and checks it
(OSError/ValueError otherwise: the PS is on another host, and the worker stays on HTTP), then makes the worker's own
gradient file (``0600``, random name and nonce, the same layout); once the PS attached it, :meth:`unlink` removes its
name. :meth:`write` stores one push under a fresh sequence number (the marker is -1 while writing); a task can compute
straight into the file (:meth:`ShmTransport.gradient_buffers`) and the push then copies nothing. A push's frame names
the sequence number (``shm_seq``) and holds no tensor; gradients that do not fit the layout go in the body.
:attr:`live` are read-only arrays over the PS's live weights: they hold the step the last pull named until the round
of that step closes, which needs this worker's push. The PS copies a push out of the file, checked, before its answer.
"""
from __future__ import annotations

import os
import secrets
from typing import Mapping

import numpy as np

from shared import frame, shm
from worker_service.transport.endpoint import Endpoint
from worker_service.transport.oneps import OnePS

#: sequence numbers start at a random value below this (2^48) and count up by one per push
SEQ_START_BITS = 48


class ShmTransport(OnePS):
    name = "shm"

    def __init__(self, endpoint: Endpoint | None, directory: str, weights: shm.Region) -> None:
        super().__init__(endpoint)
        self.layout = weights.layout
        self.live: dict[str, np.ndarray] = weights.views()
        self.nonce = secrets.token_bytes(shm.NONCE_BYTES)
        self.gradient_file = f"syncps-g-{secrets.token_hex(16)}"
        self._path: str | None = os.path.join(directory, self.gradient_file)
        fd, self._region = shm.create_region(directory, self.gradient_file, shm.KIND_GRADIENTS, self.layout,
                                             self.nonce, shm.WRITING)
        os.close(fd)
        self._grads = self._region.views()
        # a random start: a push of an earlier transport still in flight can never match this file's marker
        self._seq = secrets.randbits(SEQ_START_BITS)

    @classmethod
    def open(cls, endpoint: Endpoint | None, directory: str, offer: dict) -> "ShmTransport":
        name, size, nonce = offer.get("weights_file"), offer.get("region_bytes"), offer.get("nonce")
        if not (isinstance(name, str) and shm.WEIGHTS_FILE.fullmatch(name) and type(size) is int
                and isinstance(nonce, str)):
            raise ValueError("the PS's shm offer is malformed")
        region, _ = shm.map_existing(directory, name, shm.KIND_WEIGHTS, bytes.fromhex(nonce), writable=False,
                                     size=size)
        return cls(endpoint, directory, region)

    def unlink(self) -> None:
        if self._path is not None:
            try:
                os.unlink(self._path)
            except OSError:
                pass
            self._path = None

    def gradient_buffers(self) -> dict[str, np.ndarray]:
        """The file's arrays, for the next push's gradients to be computed straight into (the marker says
        "writing" from now until :meth:`write`)."""
        self._region.marker = shm.WRITING
        return self._grads

    def write(self, grads: Mapping[str, np.ndarray]) -> int | None:
        """Store the gradients (those that are the file's own arrays, from :meth:`gradient_buffers`, are there
        already); the sequence number to push, or None if they do not fit the layout."""
        if not self.layout.matches(grads):
            return None
        self._seq += 1
        self._region.marker = shm.WRITING
        for name, view in self._grads.items():
            if grads[name] is not view:
                np.copyto(view, grads[name])
        self._region.marker = self._seq
        return self._seq

    def push_body(self, meta: dict, grads: Mapping[str, np.ndarray]) -> list[bytes | memoryview]:
        seq = self.write(grads)
        if seq is None:  # not the model's layout: send them in the body, the PS says what is wrong
            return frame.encode(grads, meta)
        return frame.encode({}, {**meta, "shm_seq": seq})

    def pull_params(self) -> dict:
        return {"shm": 1}

    def weights(self, answer: frame.Frame) -> dict[str, np.ndarray]:
        return self.live if answer.meta.get("shm") is True else dict(answer.tensors)

    def close(self) -> None:
        """Drop our name and references; the mappings go with the last array over them."""
        self.unlink()
        self._grads = {}
        self.live = {}
