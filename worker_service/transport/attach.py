"""One PS's tensor transport for one worker, chosen at attach and chosen again when the PS asks for it.

:class:`Attached` chooses same-host files when the PS's weights file is found in ``shm_dir`` and the PS takes the
worker's gradient file (``GET /v1/shm``, ``POST /v1/workers/{id}/shm``), else request bodies, compressed as the job
says; a reader (no worker id) always uses request bodies. A push refused with a code of :data:`SHM_AGAIN` (the PS
restarted) chooses again and is sent again; refused so again, it goes in the request body. ``on_way`` is called at
most once per push.
"""
from __future__ import annotations

import errno
import logging
from typing import Callable, Mapping, TypeVar

import numpy as np

from shared.compression import Spec
from shared.errors import ProtocolError
from shared.protocol import API
from worker_service.transport.base import Pulled, PushAnswer, TensorTransport
from worker_service.transport.endpoint import Endpoint
from worker_service.transport.http import BodyTransport
from worker_service.transport.oneps import OnePS
from worker_service.transport.shm import ShmTransport

log = logging.getLogger("worker")
#: PS answers to a same-host push that mean "attach the gradient file again" (e.g. the PS restarted)
SHM_AGAIN = frozenset({"shm_not_attached", "shm_torn"})
T = TypeVar("T")


class Attached(TensorTransport):
    def __init__(self, endpoint: Endpoint, worker_id: str | None, shm_dir: str | None, compression: Spec,
                 partition_bytes: int = 0) -> None:
        self.endpoint, self.worker_id, self.shm_dir, self.compression = endpoint, worker_id, shm_dir, compression
        self.partition_bytes = partition_bytes  # the job's (registration): a body push's partitions
        self.current: OnePS = self._choose()

    @property
    def name(self) -> str:
        return self.current.name

    def _choose(self) -> OnePS:
        body = BodyTransport(self.endpoint, self.compression, self.partition_bytes)
        if self.worker_id is None or not self.shm_dir:
            return body
        try:
            t = ShmTransport.open(self.endpoint, self.shm_dir, self.endpoint.call_json("GET", f"{API}/shm"))
        except (ProtocolError, OSError, ValueError) as exc:
            # no room for the gradient file on the PS's host: a size to fix, not another host (the PS then holds a
            # body being read and its answers' weights frame: two model copies more)
            full = isinstance(exc, OSError) and exc.errno == errno.ENOSPC
            (log.warning if full else log.info)(
                "tensors in request bodies (same-host transport unavailable: %s)%s", exc,
                f"; {self.shm_dir} has no room for this worker's gradient file: give it more (Docker: a volume or "
                "shm_size)" if full else "")
            return body
        try:
            self.endpoint.call_json("POST", f"{API}/workers/{self.worker_id}/shm",
                                    {"file": t.gradient_file, "nonce": t.nonce.hex()})
        except ProtocolError as exc:
            t.close()
            log.info("tensors in request bodies (the PS cannot use our gradient file: %s)", exc)
            return body
        t.unlink()  # the PS holds it mapped: it vanishes with the last mapping
        log.info("tensors through %s (same host as the PS)%s", self.shm_dir,
                 f": float32, not compressed (the job's compression {self.compression.name} applies to request "
                 "bodies; WORKER_SHM_DIR= sends this worker's over HTTP)" if self.compression.on else "")
        return t

    def send(self, fn: Callable[[OnePS], T]) -> T:
        """``fn(transport)``; if the PS says the same-host file is gone or rewritten (it restarted), choose the
        transport again and send again, and if it says so again, send through the request body."""
        for again in (False, True):
            try:
                return fn(self.current)
            except ProtocolError as exc:
                if exc.code not in SHM_AGAIN:
                    raise
                if again:
                    log.warning("PS says %s again: this push goes in the request body", exc.code)
                    return fn(BodyTransport(self.endpoint, self.compression, self.partition_bytes))
                log.warning("PS says %s (%s): choosing the tensor transport again", exc.code, exc.detail)
                self.current.close()
                self.current = self._choose()

    def push(self, meta: dict, grads: Mapping[str, np.ndarray], wait: float, timeout: float,
             on_way: Callable[[], None] | None = None) -> PushAnswer:
        once = [on_way] if on_way is not None else []  # a push sent again does not call it again
        return self.send(lambda t: t.push(meta, grads, wait, timeout, once.pop() if once else None))

    def pull(self, min_step: int, worker_id: str | None, wait: float, timeout: float) -> Pulled | None:
        return self.current.pull(min_step, worker_id, wait, timeout)

    def gradient_buffers(self) -> dict[str, np.ndarray] | None:
        return self.current.gradient_buffers()

    def close(self) -> None:
        self.current.close()
