"""A tensor transport to one PS process (:class:`OnePS`): a push is one ``POST /v1/gradients?pull=1`` and a pull one
``GET /v1/model`` through the PS's :class:`~worker_service.transport.endpoint.Endpoint`; the kinds (request
bodies, same-host files) say only what a push's frame holds and how an answer's weights are read."""
from __future__ import annotations

from abc import abstractmethod
from typing import Any, Callable, Mapping

import numpy as np

from shared import frame
from shared.protocol import API, PUSH_STATUS_HEADER
from worker_service.transport.base import Pulled, PushAnswer, Response, TensorTransport
from worker_service.transport.endpoint import Endpoint


class OnePS(TensorTransport):
    """A tensor transport to one PS process: the frame of a push, and the weights of an answer, as its kind says."""

    def __init__(self, endpoint: Endpoint) -> None:
        self.endpoint = endpoint

    @abstractmethod
    def push_body(self, meta: dict, grads: Mapping[str, np.ndarray]) -> list[bytes | memoryview]:
        """The push's body (one frame) with the tensors wherever this transport puts them."""

    @abstractmethod
    def weights(self, answer: frame.Frame) -> dict[str, np.ndarray] | None:
        """The weights of a pull answer; None if this transport cannot use it (a weight delta from weights it
        no longer holds): ask again, densely."""

    def pull_params(self) -> dict:
        """Query parameters this transport adds to a pull."""
        return {}

    def answer_params(self) -> dict:
        """Query parameters this transport adds to a push that asks for the next weights."""
        return {}

    def _pulled(self, body: bytes | memoryview) -> tuple[dict, Pulled | None]:
        """An answer's meta and its weights (None: see :meth:`weights`)."""
        f = frame.decode(body)
        m, tensors = f.meta, self.weights(f)
        if tensors is None:
            return m, None
        return m, Pulled(m["step"], m["done"], list(m.get("ranks", [])), tensors, len(body))

    def push(self, meta: dict, grads: Mapping[str, np.ndarray], wait: float, timeout: float,
             on_way: Callable[[], None] | None = None, body: list | None = None, pull: bool = True,
             path: str = f"{API}/gradients", params: dict | None = None,
             into: Mapping[str, np.ndarray] | None = None) -> PushAnswer:
        """One request, which this thread sends: ``on_way`` is called at once. ``body``: the push's, if made
        already; ``pull``: ask for the next weights (``pull=1``), else the JSON answer only; ``path`` and ``params``:
        another route's (a sharded PS's follower's hold, partitioned rounds); ``into``: where a partitioned pull
        joins cut tensors (:class:`~worker_service.transport.http.BodyTransport`'s; unused here)."""
        if on_way is not None:
            on_way()
        params = {**({"pull": 1, "timeout": wait, **self.answer_params()} if pull else {}), **(params or {})}
        resp = self.endpoint.call("POST", path, params=params,
                                  body=self.push_body(meta, grads) if body is None else body,
                                  headers={"content-type": frame.MEDIA_TYPE},
                                  timeout=timeout + wait, what=f"POST {path} (step {meta['step']})")
        return self.push_answer(resp)

    def push_answer(self, resp: Response) -> PushAnswer:
        """A push's answer: the next weights (a frame, the status in a header), or JSON without them."""
        if resp.headers.get("content-type", "").startswith(frame.MEDIA_TYPE):
            m, got = self._pulled(resp.content)  # got None: the client pulls
            return PushAnswer(resp.headers[PUSH_STATUS_HEADER.lower()], m["step"], m["done"], got)
        obj = resp.json()
        return PushAnswer(obj["status"], obj["step"], obj["done"], None)

    def pull(self, min_step: int, worker_id: str | None, wait: float, timeout: float) -> Pulled | None:
        params: dict[str, Any] = {"min_step": min_step, "timeout": wait, **self.pull_params()}
        if worker_id:
            params["worker_id"] = worker_id
        resp = self.endpoint.call("GET", f"{API}/model", params=params, timeout=timeout + wait,
                                  what=f"GET {API}/model (step {min_step})")
        if resp.status_code == 204:
            return None
        got = self._pulled(resp.content)[1]
        # an answer the transport cannot use made it forget what it held: the next pull asks densely
        return got if got is not None else self.pull(min_step, worker_id, wait, timeout)
