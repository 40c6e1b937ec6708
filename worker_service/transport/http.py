"""Tensors in the request and response bodies: each push body and each weights answer is one frame.

Contract: with the job's compression (the registration answer's) each push's float32 gradients are encoded once by the
transport's :class:`shared.compression.Compressor`, which keeps its error-feedback residuals while the transport lives;
a retried exchange resends the same bytes. With the job's ``partition_bytes`` a push body is its partitions' frames,
head first (docs/protocol-partitions.md), views of the gradients or their pieces' encodings. When the PS's answers
name a ``lineage`` the transport keeps its own copy of the weights (:class:`HeldWeights`) and asks ``since=<the step
it holds>`` (docs/protocol.md, Weight deltas): a delta is written into the copy (bit-exact), the task gets
read-only views that stay as they are: a held tensor still viewed takes the delta in a fresh copy, one nothing views
takes it in place; a delta the copy cannot take makes it forget the copy and answer None (the client pulls densely).
An answer without ``lineage`` is used as it is: views of the answer's buffer.
"""
from __future__ import annotations

from typing import Mapping

import numpy as np

from shared import frame, partitions, refs, weight_deltas
from shared.compression import Compressor, Spec
from shared.errors import ProtocolError
from shared.shards import spec_of
from worker_service.transport.endpoint import Endpoint
from worker_service.transport.oneps import OnePS
from worker_service.transport.partitioned import Alongside


class HeldWeights:
    """The worker's own copy of the last weights a PS with weight deltas served it."""

    def __init__(self) -> None:
        self.step: int | None = None
        self.lineage: str | None = None
        self.tensors: dict[str, np.ndarray] = {}
        #: held tensors a delta was written into a copy of, as something still viewed them (0 in the stock loop)
        self.copies = 0

    def params(self) -> dict:
        """The query parameters naming what is held."""
        return {} if self.lineage is None else {"since": self.step}

    def forget(self) -> None:
        self.step, self.lineage, self.tensors = None, None, {}

    def take(self, answer: frame.Frame) -> dict[str, np.ndarray] | None:
        """Keep an answer's weights (a delta: applied to the copy) and return read-only views of them; None
        (and nothing held) for a delta this copy cannot take. An answer without ``lineage``: not kept."""
        meta, tensors = answer.meta, answer.tensors
        lineage = meta.get("lineage")
        if not isinstance(lineage, str):
            self.forget()
            # views of the answer's buffer; copied only if the buffer leaves them unaligned (BLAS wants aligned)
            return {k: v if v.flags.aligned else v.copy() for k, v in tensors.items()}
        try:
            if "since" in meta:
                self._apply(meta, tensors, lineage)
            else:
                self.tensors = {k: v.copy() for k, v in tensors.items()}  # (views of a copy name it as their base)
        except (ProtocolError, ValueError, TypeError, KeyError):
            self.forget()
            return None
        self.step, self.lineage = meta["step"], lineage
        return {k: _read_only(v) for k, v in self.tensors.items()}

    def _apply(self, meta: dict, tensors: Mapping[str, np.ndarray], lineage: str) -> None:
        """Write a delta into the held copy: in place into a held tensor nothing else views, else (the task, or a
        user's loop, keeps the views it was given) into a fresh copy, so those views keep their bits."""
        held, sparse = self.tensors, meta.get("sparse")
        if (meta["since"] != self.step or lineage != self.lineage or not isinstance(sparse, list)
                or set(tensors) != set(held) or not set(sparse) <= set(held)):
            raise ValueError("a delta from weights this worker does not hold")
        for name, wire in tensors.items():
            target = held[name]  # with ``held``, the only references to a tensor no view of which is alive
            if name in sparse:
                if wire.size and not refs.free(target):
                    target = held[name] = target.copy()
                    self.copies += 1
                weight_deltas.apply(target, wire, name)
            elif wire.dtype != target.dtype or wire.shape != target.shape:
                raise ValueError(f"tensor {name!r} is not the one held")
            elif refs.free(target):  # copied in: a view would keep this answer's whole buffer for one small tensor
                np.copyto(target, wire)
            else:
                held[name] = wire.copy()
                self.copies += 1


def _read_only(v: np.ndarray) -> np.ndarray:
    out = v.view()
    out.flags.writeable = False
    return out


class BodyTransport(OnePS):
    """Frames in request bodies, compressed as ``spec`` says (none by default); with ``partition_bytes`` (the job's)
    a push is its partitions' frames (docs/protocol-partitions.md), the head first."""

    def __init__(self, endpoint: Endpoint, spec: Spec = Spec(), partition_bytes: int = 0) -> None:
        super().__init__(endpoint)
        self.name = f"http+{spec.name}" if spec.on else "http"
        self.compressor = Compressor(spec) if spec.on else None
        self.held = HeldWeights()
        self.partition_bytes = partition_bytes
        self._plan: tuple[dict, partitions.Plan] | None = None  # (the gradients' spec, its plan)
        self._alongside: Alongside | None = None  # the last pull alongside a push (partitions), on its connection

    def push_body(self, meta: dict, grads: Mapping[str, np.ndarray]) -> list[bytes | memoryview]:
        """The push's frames: with partitions (the job's ``partition_bytes``, more than one) its partitions', head
        first, else one, of the gradients in their order; views of the gradients, sent as they are (no copy), or their
        pieces' encodings (:meth:`Compressor.encode_partitions`; the head says ``compression``)."""
        p = self._partitions(grads) if self.partition_bytes else None
        c, step = self.compressor, meta["step"]
        if p is None or p.count == 1:
            parts = [grads if c is None else c.encode(grads, step)]
        else:
            parts = [p.split(grads, q) for q in range(p.count)] if c is None else c.encode_partitions(grads, p, step)
        meta = meta if c is None else {**meta, "compression": c.spec.name}
        head = {**meta, "partitions": len(parts)} if len(parts) > 1 else meta
        return frame.encode_many([(parts[0], head), *[(t, {"partition": q}) for q, t in enumerate(parts[1:], 1)]])

    def _partitions(self, grads: Mapping[str, np.ndarray]) -> partitions.Plan:
        """The plan of the gradients' spec (computed once)."""
        spec = spec_of(grads)
        if self._plan is None or self._plan[0] != spec:
            self._plan = (spec, partitions.plan(spec, self.partition_bytes))
        return self._plan[1]

    def alongside(self, meta: dict, hold: dict | None, wait: float, timeout: float,
                  into: Mapping[str, np.ndarray] | None) -> Alongside | None:
        """With partitions (a push of several, or a follower's hold): :class:`Alongside` pulls the next weights on a
        second connection as the PS sends them (worker_service/transport/partitioned.py), its pull naming no worker
        for a hold; ``into``: where it joins cut tensors (:func:`whole`)."""
        p = self._plan[1] if self._plan is not None and self.partition_bytes else None
        if p is None or (p.count == 1 and hold is None):
            return None
        # a pull still reading (a push that failed, or a pull past its wait) keeps its connection until it ends
        last = self._alongside
        free = last is not None and not last.running
        puller = last.endpoint if free else self.endpoint.sibling(self.endpoint.base_url)
        self._alongside = Alongside(puller, meta["step"] + 1, None if hold is not None else meta["worker_id"], wait,
                                    timeout, p, self._plan[0], into)
        return self._alongside

    def close(self) -> None:
        if self._alongside is not None:
            self._alongside.endpoint.close()
        super().close()

    def pull_params(self) -> dict:
        return self.held.params()

    answer_params = pull_params

    def weights(self, answer: frame.Frame) -> dict[str, np.ndarray] | None:
        return self.held.take(answer)
