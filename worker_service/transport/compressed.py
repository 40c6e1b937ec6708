"""Compressed gradients in request bodies: :class:`BodyTransport` whose pushes carry the job's encoding.

The job's choice comes with the registration answer (``compression``: :class:`shared.compression.Spec`).
Each push's float32 gradients are encoded once by the transport's :class:`shared.compression.Compressor`,
which keeps the error-feedback residuals of ``topk`` and ``2bit`` for as long as the transport lives (a
new attach, e.g. after a PS restart, starts from zero residuals); the frame's meta says
``"compression": <name>``. A retried exchange resends the same bytes. Weights come back in float32.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from shared import frame
from shared.compression import Compressor, Spec
from worker_service.transport.base import Call
from worker_service.transport.http import BodyTransport


class CompressedBodyTransport(BodyTransport):
    def __init__(self, call: Call, spec: Spec) -> None:
        super().__init__(call)
        self.name = f"http+{spec.name}"
        self.compressor = Compressor(spec)

    def push_body(self, meta: dict, grads: Mapping[str, np.ndarray]) -> list[bytes | memoryview]:
        return frame.encode(self.compressor.encode(grads), {**meta, "compression": self.compressor.spec.name})


def body_transport(call: Call, spec: Spec) -> BodyTransport:
    """The request-body transport of a job: plain, or compressed as the job says."""
    return CompressedBodyTransport(call, spec) if spec.on else BodyTransport(call)
