"""The worker's transports, in two layers, each called only from above (nothing here imports the client).

- :class:`Transport`, as httpx's ``BaseTransport``: one method, one HTTP exchange over plain values
  (:class:`shared.rawhttp.RawConnection` for ``http://``; :class:`shared.httpxconn.HttpxConnection`
  for ``https://``; :class:`~worker_service.transport.faults.FaultyConnection` wraps any to drop or duplicate
  exchanges in drills; :class:`~worker_service.transport.mock.MockTransport` answers with a function, for tests).
  :class:`~worker_service.transport.endpoint.Endpoint` composes one with the token, timeouts and retries.
- :class:`TensorTransport`: where a step's tensors travel, over an endpoint: ``push`` and ``pull``. One PS:
  :class:`~worker_service.transport.oneps.OnePS` (request bodies, ``http.py``; same-host files, ``shm.py``), chosen
  and chosen again by :class:`~worker_service.transport.attach.Attached`; a sharded PS:
  :class:`~worker_service.transport.sharded.ShardedTransport`, composed of one ``Attached`` per shard.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np


class Response(Protocol):
    status_code: int
    headers: Mapping[str, str]  # lower-case names
    content: bytes | memoryview

    def json(self) -> Any: ...


class Transport(Protocol):
    """One HTTP/1.1 exchange at a time; ``ConnectionLost`` (shared.rawhttp) when it breaks. Never retries."""

    def request(self, method: str, target: str, headers: Mapping[str, str], body: Sequence[bytes | memoryview] = (),
                timeout: float = 30.0) -> Response: ...

    def close(self) -> None: ...


@dataclass(frozen=True)
class Pulled:
    step: int
    done: bool
    ranks: list[int]
    tensors: dict[str, np.ndarray]


@dataclass(frozen=True)
class PushAnswer:
    status: str
    step: int
    done: bool
    pulled: Pulled | None  # the next weights, when the PS answered with them
    receipt: str | None = None  # a sharded PS's follower's hold (docs/protocol-shards.md)


class TensorTransport(ABC):
    """What the client calls: a push (that waits for the next weights) and a pull. Retries are the endpoint's."""

    name = "?"

    @abstractmethod
    def push(self, meta: dict, grads: Mapping[str, np.ndarray], wait: float, timeout: float,
             on_way: Callable[[], None] | None = None) -> PushAnswer:
        """Push, and wait at most ``wait`` s for the round to close and its weights to come back.

        ``on_way`` (the worker's next batch, :mod:`worker_service.prefetch`) is called once, when this thread has
        started the push and its work can overlap the rest."""

    @abstractmethod
    def pull(self, min_step: int, worker_id: str | None, wait: float, timeout: float) -> Pulled | None:
        """Weights once ``global_step >= min_step`` (or done); None if ``wait`` s passed first."""

    def gradient_buffers(self) -> dict[str, np.ndarray] | None:
        """Arrays to compute the next push's gradients into, where this transport sends them from (the same-host
        file: the push then copies nothing); None: compute them anywhere. Ask once per step, just before computing:
        the memory is this transport's again as soon as it is asked for."""
        return None

    def close(self) -> None:
        pass
