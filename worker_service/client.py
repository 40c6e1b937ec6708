"""The worker's HTTP client of the PS protocol (docs/protocol.md).

Every call has a timeout. Connection errors, timeouts and 5xx answers are
retried with capped exponential backoff and jitter (stamina); a 4xx answer is
raised as :class:`shared.errors.ProtocolError` with the PS's error code. Pushes
are safe to retry: the PS answers a repeated (worker, step) with ``duplicate``.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Mapping

import httpx
import numpy as np
import stamina

from shared.codec import decode_tensors, encode_tensors, pack, unpack
from shared.errors import ProtocolError
from shared.protocol import API, MSGPACK


class ServerError(Exception):
    """A 5xx answer: the PS is restarting or overloaded; retried."""


def _retryable(exc: Exception) -> bool:
    return isinstance(exc, (httpx.TransportError, ServerError))


@dataclass(frozen=True)
class Pulled:
    step: int
    done: bool
    ranks: list[int]
    tensors: dict[str, np.ndarray]
    nbytes: int


class PSClient:
    def __init__(self, base_url: str, timeout: float = 30.0, attempts: int = 10, retry_timeout: float = 120.0,
                 transport: httpx.BaseTransport | None = None) -> None:
        self.timeout = timeout
        self.attempts = attempts
        self.retry_timeout = retry_timeout
        self.http = httpx.Client(base_url=base_url.rstrip("/"), timeout=timeout, transport=transport,
                                 limits=httpx.Limits(max_keepalive_connections=2))

    def close(self) -> None:
        self.http.close()

    def _request(self, method: str, path: str, *, timeout: float | None = None, **kw: Any) -> httpx.Response:
        for attempt in stamina.retry_context(on=_retryable, attempts=self.attempts, timeout=self.retry_timeout,
                                             wait_initial=0.05, wait_max=2.0, wait_jitter=0.2):
            with attempt:
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
        body = pack({"tensors": encode_tensors(tensors), "optimizer": dict(optimizer or {})})
        try:
            self._request("PUT", f"{API}/model", content=body, headers={"content-type": MSGPACK})
            return True
        except ProtocolError as exc:
            if exc.status == 409:
                return False
            raise

    def pull(self, min_step: int = 0, worker_id: str | None = None, wait: float = 5.0) -> Pulled | None:
        """Weights once ``global_step >= min_step`` (or done); None if ``wait`` s passed first."""
        params: dict[str, Any] = {"min_step": min_step, "timeout": wait}
        if worker_id:
            params["worker_id"] = worker_id
        resp = self._request("GET", f"{API}/model", params=params, timeout=self.timeout + wait)
        if resp.status_code == 204:
            return None
        obj = unpack(resp.content)
        return Pulled(obj["step"], obj["done"], obj.get("ranks", []), decode_tensors(obj["tensors"]), len(resp.content))

    def push(self, worker_id: str, step: int, grads: Mapping[str, np.ndarray], loss: float | None = None,
             num_examples: int | None = None, timings: Mapping[str, float] | None = None) -> dict:
        body = pack({"worker_id": worker_id, "step": step, "tensors": encode_tensors(grads), "loss": loss,
                     "num_examples": num_examples, "timings": dict(timings or {})})
        return self._request("POST", f"{API}/gradients", content=body, headers={"content-type": MSGPACK}).json()

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
