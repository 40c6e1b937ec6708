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

import logging
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
from shared.shm import TENSORS_HEADER
from worker_service.rawhttp import ConnectionLost, RawConnection
from worker_service.shm import ShmChannel

log = logging.getLogger("worker")


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


def _pulled(body: bytes | memoryview, channel: ShmChannel | None = None) -> Pulled:
    """The weights of a pull answer (in the body, or the PS's weights file for a same-host answer)."""
    obj = unpack(body)
    if obj.get("shm") is True and channel is not None:
        return Pulled(obj["step"], obj["done"], obj.get("ranks", []), channel.weights, channel.layout.data_bytes)
    tensors = {k: v if v.flags.aligned else v.copy() for k, v in decode_tensors(obj["tensors"]).items()}  # BLAS
    return Pulled(obj["step"], obj["done"], obj.get("ranks", []), tensors, len(body))


class PSClient:
    def __init__(self, base_url: str, timeout: float = 30.0, attempts: int = 10, retry_timeout: float = 120.0,
                 transport: httpx.BaseTransport | None = None, token: SecretStr | str | None = None,
                 shm_dir: str | None = None) -> None:
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
        #: the shared directory of the same-host transport (None: tensors always over HTTP)
        self.shm_dir = shm_dir
        self.shm: ShmChannel | None = None

    @property
    def transport(self) -> str:
        return "shm" if self.shm is not None else "http"

    def setup_shm(self, worker_id: str) -> bool:
        """Move this worker's tensors to the same-host transport if the PS is on this host (else HTTP)."""
        self.drop_shm()
        if not self.shm_dir:
            return False
        try:
            offer = self._request("GET", f"{API}/shm").json()
            channel = ShmChannel.open(self.shm_dir, offer)
        except (ProtocolError, OSError, ValueError) as exc:
            log.info("tensors over HTTP (same-host transport unavailable: %s)", exc)
            return False
        try:
            self._request("POST", f"{API}/workers/{worker_id}/shm",
                          json={"file": channel.gradient_file, "nonce": channel.nonce.hex()})
        except ProtocolError as exc:
            channel.close()
            log.info("tensors over HTTP (the PS cannot use our gradient file: %s)", exc)
            return False
        channel.unlink()  # the PS holds it open: it vanishes with the last descriptor
        self.shm = channel
        log.info("tensors through %s (same host as the PS)", self.shm_dir)
        return True

    def drop_shm(self) -> None:
        if self.shm is not None:
            self.shm.close()
            self.shm = None

    def close(self) -> None:
        self.drop_shm()
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
        if self.shm is not None:
            params["shm"] = 1
        resp = self._request("GET", f"{API}/model", params=params, timeout=self.timeout + wait, parts=[])
        if resp.status_code == 204:
            return None
        return _pulled(resp.content, self.shm)

    def push(self, worker_id: str, step: int, grads: Mapping[str, np.ndarray], loss: float | None = None,
             num_examples: int | None = None, timings: Mapping[str, float] | None = None, _again: bool = True) -> dict:
        head = {"worker_id": worker_id, "step": step, "loss": loss, "num_examples": num_examples,
                "timings": dict(timings or {})}
        params = {"pull": 1, "timeout": self.push_wait}
        headers = {"content-type": MSGPACK}
        channel = self.shm
        seq = channel.write(grads) if channel is not None else None
        if seq is not None:  # the tensors are in our gradient file; the body is the rest
            body = pack_parts({**head, "tensors": {}, "shm_seq": seq})
            headers[TENSORS_HEADER] = "shm"
        else:
            body = pack_parts({**head, "tensors": encode_tensors(grads)})
        try:
            resp = self._request("POST", f"{API}/gradients", parts=body, params=params, headers=headers,
                                 timeout=self.timeout + self.push_wait)
        except ProtocolError as exc:
            if seq is None or not _again or exc.code not in ("shm_not_attached", "shm_torn"):
                raise
            log.info("PS says %s: attaching the gradient file again", exc.code)
            self.setup_shm(worker_id)  # then push again (over HTTP if that failed)
            return self.push(worker_id, step, grads, loss, num_examples, timings, _again=False)
        if resp.headers.get("content-type", "").startswith(MSGPACK):  # the answer carries the next weights
            self._prefetched = _pulled(resp.content, channel)
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
