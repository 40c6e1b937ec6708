"""Tensors in the request and response bodies: each push body and each weights answer is one frame."""
from __future__ import annotations

from typing import Mapping

import numpy as np

from shared import frame
from worker_service.transport.oneps import OnePS


class BodyTransport(OnePS):
    name = "http"

    def push_body(self, meta: dict, grads: Mapping[str, np.ndarray]) -> list[bytes | memoryview]:
        return frame.encode(grads, meta)  # the arrays' memory is sent as it is (scatter-gather)

    def weights(self, answer: frame.Frame) -> dict[str, np.ndarray]:
        return self.views(answer.tensors)

    @staticmethod
    def views(tensors: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
        """Views of the answer's buffer; copied only if the buffer leaves them unaligned (BLAS wants aligned)."""
        return {k: v if v.flags.aligned else v.copy() for k, v in tensors.items()}
