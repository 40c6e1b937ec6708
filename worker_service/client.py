"""The worker's HTTP client of the PS protocol (docs/protocol.md).

Every call has a timeout. Connection errors, timeouts and 5xx answers are
retried with capped exponential backoff and jitter (stamina); a 4xx answer is
raised as :class:`shared.errors.ProtocolError` with the PS's error code. Pushes
are safe to retry: the PS answers a repeated (worker, step) with ``duplicate``.
With a ``token``, every request carries ``Authorization: Bearer <token>``.

Tensor calls (pull, push, init) go through :class:`worker_service.rawhttp.RawConnection`
(no body copies) unless an httpx ``transport`` is injected. A push asks the PS to answer
with the next weights once its round closes (``?pull=1``, one round trip per step); those
weights are kept and returned by the next :meth:`PSClient.pull` that they satisfy.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping
from urllib.parse import urlencode

import httpx
import numpy as np
import stamina

from shared.codec import decode_tensors, encode_tensors, pack_parts, unpack
from pydantic import SecretStr

from shared.errors import ProtocolError
from shared.protocol import API, MSGPACK, PUSH_STATUS_HEADER
from shared.tokens import bearer_header
from worker_service.rawhttp import ConnectionLost, RawConnection


class ServerError(Exception):
    """A 5xx answer: the PS is restarting or overloaded; retried."""


def _retryable(exc: Exception) -> bool:
    return isinstance(exc, (httpx.TransportError, ConnectionLost, ServerError))


@dataclass(frozen=True)
class Pulled:
    step: int
    done: bool
    ranks: list[int]
    tensors: dict[str, np.ndarray]
    nbytes: int


def _pulled(body: bytes | memoryview) -> Pulled:
    obj = unpack(body)
    tensors = {k: v if v.flags.aligned else v.copy() for k, v in decode_tensors(obj["tensors"]).items()}  # BLAS
    return Pulled(obj["step"], obj["done"], obj.get("ranks", []), tensors, len(body))


class PSClient:
    def __init__(self, base_url: str, timeout: float = 30.0, attempts: int = 10, retry_timeout: float = 120.0,
                 transport: httpx.BaseTransport | None = None, token: SecretStr | str | None = None) -> None:
        self.timeout = timeout
        self.attempts = attempts
        self.retry_timeout = retry_timeout
        self.token = SecretStr(token) if isinstance(token, str) else token
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, transport=transport,
                                 limits=httpx.Limits(max_keepalive_connections=2), headers=bearer_header(self.token))
        self.raw = RawConnection(base_url) if transport is None and base_url.startswith("http://") else None
        #: seconds a push waits for its round to close (then it answers without weights)
        self.push_wait = 5.0
        self._prefetched: Pulled | None = None

    def close(self) -> None:
        self.http.close()
        if self.raw is not None:
            self.raw.close()

    def _request(self, method: str, path: str, *, timeout: float | None = None, parts: list | None = None,
                 **kw: Any) -> httpx.Response:
        """One call, retried; ``parts`` (a body as buffers, maybe empty) takes the raw connection."""
        for attempt in stamina.retry_context(on=_retryable, attempts=self.attempts, timeout=self.retry_timeout,
                                             wait_initial=0.05, wait_max=1.0, wait_jitter=0.2):
            with attempt:
                if parts is not None and self.raw is not None:
                    query = f"?{urlencode(kw['params'])}" if kw.get("params") else ""
                    headers = {k: v for k, v in self.http.headers.items() if k != "accept-encoding"}
                    resp = self.raw.request(method, path + query, {**headers, **kw.get("headers", {})}, parts,
                                            timeout or self.timeout)
                else:
                    if parts:
                        kw["content"] = b"".join(parts)
                    resp = self.http.request(method, path, timeout=timeout or self.timeout, **kw)
                if resp.status_code >= 500:
                    raise ServerError(f"{resp.status_code} from {method} {path}")
        if resp.status_code >= 400:
            try:
                body = resp.json()
                code, detail = body.get("error", "http_error"), body.get("detail", "")
            except ValueError:
                code, detail = "http_error", resp.text[:200]
            raise ProtocolError(resp.status_code, code, detail)
        return resp

    def register(self, name: str) -> dict:
        return self._request("POST", f"{API}/workers", json={"name": name}).json()

    def leave(self, worker_id: str) -> None:
        self._request("DELETE", f"{API}/workers/{worker_id}")

    def heartbeat(self, worker_id: str) -> dict:
        return self._request("POST", f"{API}/workers/{worker_id}/heartbeat").json()

    def init_model(self, tensors: Mapping[str, np.ndarray], optimizer: Mapping[str, Any] | None = None) -> bool:
        """True if this call initialised the model, False if another caller had (409)."""
        body = pack_parts({"tensors": encode_tensors(tensors), "optimizer": dict(optimizer or {})})
        try:
            self._request("PUT", f"{API}/model", parts=body, headers={"content-type": MSGPACK})
            return True
        except ProtocolError as exc:
            if exc.status == 409:
                return False
            raise

    def pull(self, min_step: int = 0, worker_id: str | None = None, wait: float = 5.0) -> Pulled | None:
        """Weights once ``global_step >= min_step`` (or done); None if ``wait`` s passed first."""
        ready, self._prefetched = self._prefetched, None
        if ready is not None and (ready.step >= min_step or ready.done):
            return ready
        params: dict[str, Any] = {"min_step": min_step, "timeout": wait}
        if worker_id:
            params["worker_id"] = worker_id
        resp = self._request("GET", f"{API}/model", params=params, timeout=self.timeout + wait, parts=[])
        if resp.status_code == 204:
            return None
        return _pulled(resp.content)

    def push(self, worker_id: str, step: int, grads: Mapping[str, np.ndarray], loss: float | None = None,
             num_examples: int | None = None, timings: Mapping[str, float] | None = None) -> dict:
        body = pack_parts({"worker_id": worker_id, "step": step, "loss": loss, "num_examples": num_examples,
                           "timings": dict(timings or {}), "tensors": encode_tensors(grads)})
        params = {"pull": 1, "timeout": self.push_wait}
        resp = self._request("POST", f"{API}/gradients", parts=body, params=params, headers={"content-type": MSGPACK},
                             timeout=self.timeout + self.push_wait)
        if resp.headers.get("content-type", "").startswith(MSGPACK):  # the answer carries the next weights
            self._prefetched = _pulled(resp.content)
            return {"status": resp.headers[PUSH_STATUS_HEADER.lower()], "step": self._prefetched.step,
                    "done": self._prefetched.done}
        return resp.json()

    def status(self) -> dict:
        return self._request("GET", f"{API}/status").json()

    def wait_ready(self, deadline_seconds: float = 60.0) -> None:
        """Poll /healthz until the PS answers (start-up ordering: the PS may not be up yet)."""
        end = time.monotonic() + deadline_seconds
        while True:
            try:
                if self.http.get("/healthz", timeout=2.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            if time.monotonic() > end:
                raise TimeoutError(f"PS at {self.http.base_url} did not answer within {deadline_seconds} s")
            time.sleep(0.1)
