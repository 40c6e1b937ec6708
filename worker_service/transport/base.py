"""The worker's tensor transport: the one interface its client pushes gradients and pulls weights through.

Two layers, in the spirit of httpx's ``BaseTransport`` and ps-lite's ``van``:

- a :class:`Connection` moves one HTTP exchange (:class:`shared.rawhttp.RawConnection` in
  production; :class:`worker_service.transport.faults.FaultyConnection` wraps any connection to drop
  or duplicate exchanges in drills);
- a :class:`TensorTransport` decides where a message's tensors travel: in the request body
  (:class:`worker_service.transport.http.BodyTransport`) or through same-host files
  (:class:`worker_service.transport.shm.ShmTransport`). The client picks one when the worker attaches
  and calls only :meth:`TensorTransport.push` / :meth:`TensorTransport.pull` afterwards.

Every exchange goes through the client's ``call`` (timeouts, retries); a transport never retries by itself.
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Protocol, Sequence

import numpy as np

from shared import frame
from shared.protocol import API, PUSH_STATUS_HEADER


class Response(Protocol):
    status_code: int
    headers: Mapping[str, str]  # lower-case names
    content: bytes | memoryview

    def json(self) -> Any: ...


class Connection(Protocol):
    """One HTTP/1.1 exchange at a time; ConnectionLost (shared.rawhttp) when it breaks."""

    def request(self, method: str, target: str, headers: Mapping[str, str], body: Sequence[bytes | memoryview] = (),
                timeout: float = 30.0) -> Response: ...

    def close(self) -> None: ...


#: the client's retried exchange: call(method, path, *, params, body, headers, timeout) -> Response (4xx raised)
Call = Callable[..., Response]


@dataclass(frozen=True)
class Pulled:
    step: int
    done: bool
    ranks: list[int]
    tensors: dict[str, np.ndarray]
    nbytes: int


@dataclass(frozen=True)
class PushAnswer:
    status: str
    step: int
    done: bool
    pulled: Pulled | None  # the next weights, when the PS answered with them


class TensorTransport(ABC):
    name = "?"

    def __init__(self, call: Call) -> None:
        self.call = call

    @abstractmethod
    def push_body(self, meta: dict, grads: Mapping[str, np.ndarray]) -> list[bytes | memoryview]:
        """The push's body (one frame) with the tensors wherever this transport puts them."""

    @abstractmethod
    def pull_params(self) -> dict:
        """Query parameters this transport adds to a pull."""

    @abstractmethod
    def weights(self, answer: frame.Frame) -> dict[str, np.ndarray] | None:
        """The weights of a pull answer; None if this transport cannot use it (a weight delta from weights it
        no longer holds): ask again, densely."""

    def gradient_buffers(self) -> dict[str, np.ndarray] | None:
        """Arrays to compute the next push's gradients into, where this transport sends them from (the same-host
        file: the push then copies nothing); None: compute them anywhere. Ask once per step, just before computing:
        the memory is this transport's again as soon as it is asked for."""
        return None

    def answer_params(self) -> dict:
        """Query parameters this transport adds to a push that asks for the next weights."""
        return {}

    def pulled(self, body: bytes | memoryview) -> Pulled | None:
        """The weights of an answer (None: see :meth:`weights`)."""
        f = frame.decode(body)
        return self._pulled(f, self.weights(f), len(body))

    @staticmethod
    def _pulled(f: frame.Frame, tensors: dict[str, np.ndarray] | None, nbytes: int) -> Pulled | None:
        m = f.meta
        return None if tensors is None else Pulled(m["step"], m["done"], list(m.get("ranks", [])), tensors, nbytes)

    def push(self, meta: dict, grads: Mapping[str, np.ndarray], wait: float, timeout: float,
             on_way: Callable[[], None] | None = None) -> PushAnswer:
        """Push, and wait at most ``wait`` s for the round to close and its weights to come back.

        ``on_way`` (the worker's next batch, :mod:`worker_service.prefetch`) is called once, when this thread has
        started the push and its work can overlap the rest: here at once (one request, which this thread sends), on a
        sharded PS once the pieces are handed to the threads that send them."""
        if on_way is not None:
            on_way()
        resp = self.call("POST", f"{API}/gradients", params={"pull": 1, "timeout": wait, **self.answer_params()},
                         body=self.push_body(meta, grads), headers={"content-type": frame.MEDIA_TYPE},
                         timeout=timeout + wait, what=f"POST {API}/gradients (step {meta['step']})")
        return self.push_answer(resp)

    def push_answer(self, resp: Response) -> PushAnswer:
        """A push's answer: the next weights (a frame, the status in a header), or JSON without them."""
        if resp.headers.get("content-type", "").startswith(frame.MEDIA_TYPE):
            f = frame.decode(resp.content)
            got = self._pulled(f, self.weights(f), len(resp.content))  # None: the client pulls
            return PushAnswer(resp.headers[PUSH_STATUS_HEADER.lower()], f.meta["step"], f.meta["done"], got)
        obj = resp.json()
        return PushAnswer(obj["status"], obj["step"], obj["done"], None)

    def pull(self, min_step: int, worker_id: str | None, wait: float, timeout: float) -> Pulled | None:
        params: dict[str, Any] = {"min_step": min_step, "timeout": wait, **self.pull_params()}
        if worker_id:
            params["worker_id"] = worker_id
        resp = self.call("GET", f"{API}/model", params=params, timeout=timeout + wait,
                         what=f"GET {API}/model (step {min_step})")
        if resp.status_code == 204:
            return None
        got = self.pulled(resp.content)
        # an answer the transport cannot use made it forget what it held: the next pull asks densely
        return got if got is not None else self.pull(min_step, worker_id, wait, timeout)

    def close(self) -> None:
        pass
