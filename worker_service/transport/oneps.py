"""A tensor transport to one PS process (:class:`OnePS`): a push is one ``POST /v1/gradients?pull=1`` and a pull one
``GET /v1/model`` through the PS's :class:`~worker_service.transport.endpoint.Endpoint`; the kinds (request
bodies, same-host files) say only what a push's frame holds and how an answer's weights are read."""
from __future__ import annotations

from abc import abstractmethod
from typing import Any, Callable, Mapping

import numpy as np

from shared import frame, marks
from shared.protocol import API, PUSH_STATUS_HEADER
from worker_service.transport.base import Pulled, PushAnswer, TensorTransport
from worker_service.transport.endpoint import Endpoint
from worker_service.transport.partitioned import Alongside


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
        return m, Pulled(m["step"], m["done"], list(m.get("ranks", [])), tensors)

    def alongside(self, meta: dict, hold: dict | None, wait: float, timeout: float,
                  into: Mapping[str, np.ndarray] | None) -> Alongside | None:
        """The pull of the next weights to run alongside this push (a partitioned push, a sharded PS's follower's
        partitioned hold: :class:`~worker_service.transport.http.BodyTransport`'s), started; None: the push's own
        answer carries them (or, a hold, nothing does)."""
        return None

    def push(self, meta: dict, grads: Mapping[str, np.ndarray], wait: float, timeout: float,
             on_way: Callable[[], None] | None = None, hold: dict | None = None,
             into: Mapping[str, np.ndarray] | None = None) -> PushAnswer:
        """One request, which this thread sends: ``on_way`` is called once its body is made. A push asks for the next
        weights (``pull=1``) unless :meth:`alongside` pulls them; ``hold``: the query of a sharded PS's hold (``POST
        /v1/shard/gradients``, its JSON answer: the receipt); ``into``: where a pull alongside joins cut tensors."""
        body = self.push_body(meta, grads)
        pull = self.alongside(meta, hold, wait, timeout, into)
        if on_way is not None:
            on_way()
        ask = hold is None and pull is None
        answer = self.post(f"{API}/gradients" if hold is None else f"{API}/shard/gradients", body,
                           {"pull": 1, "timeout": wait, **self.answer_params()} if ask else hold,
                           timeout + (wait if ask else 0.0), meta["step"])
        if pull is None:
            return answer
        if marks.ON:
            marks.mark("push.answered", peer=self.endpoint.base_url.split("//")[-1], step=meta["step"])
        got = pull.result()  # as a ``pull=1`` answer: the step and done of the weights it carries
        return answer if got is None else PushAnswer(answer.status, got.step, got.done, got)

    def post(self, path: str, body: list[bytes | memoryview], params: dict, timeout: float, step: int) -> PushAnswer:
        """``body`` (frames) posted to ``path`` for ``step`` (a push, a hold, a sharded PS's commit); its answer: the
        next weights (a frame, the status in a header), or JSON without them."""
        resp = self.endpoint.call("POST", path, body=body, headers={"content-type": frame.MEDIA_TYPE}, params=params,
                                  timeout=timeout, what=f"POST {path} (step {step})")
        if resp.headers.get("content-type", "").startswith(frame.MEDIA_TYPE):
            m, got = self._pulled(resp.content)  # got None: the client pulls
            return PushAnswer(resp.headers[PUSH_STATUS_HEADER.lower()], m["step"], m["done"], got)
        obj = resp.json()  # (a hold's: its receipt, and no done)
        return PushAnswer(obj["status"], obj["step"], obj.get("done", False), None, obj.get("receipt"))

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
