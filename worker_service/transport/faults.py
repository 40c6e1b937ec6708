"""A fault-injecting connection: an unreliable network between a worker and the PS, for tests and drills
(docs/guides/faults.md).

:class:`FaultyConnection` wraps the production connection, so a drill runs through the same code as training,
whichever tensor transport the worker uses. Each exchange, independently, with the configured probabilities (a
seeded ``random.Random``: a run's fault pattern is reproducible): ``drop_before``, the request never reaches the PS
(``ConnectionLost``, nothing processed); ``drop_after``, the PS processes it but the answer is lost
(``ConnectionLost``: the retry repeats a request that took effect); ``duplicate``, the PS gets it twice and the
client the first answer. Enabled in a worker by the ``WORKER_FAULT_*`` settings; what was injected is in ``counts``.
"""
from __future__ import annotations

import random
import threading
from typing import Mapping, Sequence

from shared.rawhttp import ConnectionLost
from worker_service.transport.base import Response, Transport


class FaultyConnection:
    def __init__(self, inner: Transport, drop_before: float = 0.0, drop_after: float = 0.0, duplicate: float = 0.0,
                 seed: int | str = 0) -> None:
        if min(drop_before, drop_after, duplicate) < 0 or drop_before + drop_after + duplicate > 1:
            raise ValueError("fault probabilities must be >= 0 and sum to at most 1")
        self.inner = inner
        self.drop_before, self.drop_after, self.duplicate = drop_before, drop_after, duplicate
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

    def request(self, method: str, target: str, headers: Mapping[str, str], body: Sequence[bytes | memoryview] = (),
                timeout: float = 30.0) -> Response:
        fault = self._draw()
        if fault == "drop_before":
            raise ConnectionLost(f"fault injected: {method} {target.split('?')[0]} dropped before the PS")
        response = self.inner.request(method, target, headers, body, timeout)
        if fault == "drop_after":
            raise ConnectionLost(f"fault injected: the answer to {method} {target.split('?')[0]} was lost")
        if fault == "duplicate":  # the client gets the first answer
            self.inner.request(method, target, headers, body, timeout)
        return response

    def close(self) -> None:
        self.inner.close()


def from_settings(s, inner: Transport) -> Transport:
    """``inner`` wrapped as the ``WORKER_FAULT_*`` settings ask (seeded with fault_seed and the worker's
    name), or ``inner`` itself when they are all 0."""
    if not (s.fault_drop_before or s.fault_drop_after or s.fault_duplicate):
        return inner
    return FaultyConnection(inner, s.fault_drop_before, s.fault_drop_after, s.fault_duplicate,
                            seed=f"{s.fault_seed}:{s.name}")
