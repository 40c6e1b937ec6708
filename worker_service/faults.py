"""A fault-injecting httpx transport: an unreliable network between a worker and the PS, for tests and drills.

Each request, independently, with the configured probabilities (a seeded
``random.Random``, so a run's fault pattern is reproducible for a given
sequence of requests):

- ``drop_before``: the request never reaches the PS; the client gets
  ``httpx.ConnectError`` (nothing was processed).
- ``drop_after``: the PS processes the request and answers, but the answer is
  lost; the client gets ``httpx.ReadError`` (it must retry a request that
  already took effect: the case idempotency exists for).
- ``duplicate``: the request reaches the PS twice (the network duplicated it);
  the client gets the first answer.

Everything else is passed to the wrapped transport unchanged. Enabled in a
worker by the ``WORKER_FAULT_*`` settings; counts of what was injected are in
``counts``.
"""
from __future__ import annotations

import random
import threading

import httpx


class FaultTransport(httpx.BaseTransport):
    def __init__(self, drop_before: float = 0.0, drop_after: float = 0.0, duplicate: float = 0.0, seed: int | str = 0,
                 inner: httpx.BaseTransport | None = None) -> None:
        if min(drop_before, drop_after, duplicate) < 0 or drop_before + drop_after + duplicate > 1:
            raise ValueError("fault probabilities must be >= 0 and sum to at most 1")
        self.drop_before, self.drop_after, self.duplicate = drop_before, drop_after, duplicate
        self.inner = inner or httpx.HTTPTransport()
        self.rng = random.Random(seed)
        self.counts = {"requests": 0, "drop_before": 0, "drop_after": 0, "duplicate": 0}
        self._lock = threading.Lock()

    def _draw(self) -> str | None:
        with self._lock:
            self.counts["requests"] += 1
            x = self.rng.random()
            for kind in ("drop_before", "drop_after", "duplicate"):
                p = getattr(self, kind)
                if x < p:
                    self.counts[kind] += 1
                    return kind
                x -= p
            return None

    def _send(self, request: httpx.Request) -> httpx.Response:
        response = self.inner.handle_request(request)
        response.read()  # the PS has answered in full: it processed the request
        return response

    def handle_request(self, request: httpx.Request) -> httpx.Response:
        fault = self._draw()
        if fault == "drop_before":
            raise httpx.ConnectError("fault injected: request dropped before the PS", request=request)
        response = self._send(request)
        if fault == "drop_after":
            response.close()
            raise httpx.ReadError("fault injected: response lost after the PS processed the request", request=request)
        if fault == "duplicate":
            self._send(request).close()
        return response

    def close(self) -> None:
        self.inner.close()


def from_settings(s) -> FaultTransport | None:
    """The transport the ``WORKER_FAULT_*`` settings ask for (seeded with fault_seed and the worker's name),
    or None when they are all 0."""
    if not (s.fault_drop_before or s.fault_drop_after or s.fault_duplicate):
        return None
    return FaultTransport(s.fault_drop_before, s.fault_drop_after, s.fault_duplicate, seed=f"{s.fault_seed}:{s.name}")
