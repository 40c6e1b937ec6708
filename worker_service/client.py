"""The worker's client of the PS protocol (docs/protocol.md).

Every exchange goes through one :class:`~worker_service.transport.base.Connection` (the lean
:class:`~shared.rawhttp.RawConnection` for ``http://``; httpx for ``https://``; a drill
wraps either in :class:`~worker_service.transport.faults.FaultyConnection`) and through
:meth:`PSClient.call`: a timeout on every exchange; connection errors, timeouts and 5xx retried with
capped exponential backoff and jitter, each retry logged with the request and the error; a 4xx raised
as :class:`shared.errors.ProtocolError` with the PS's error code. Pushes are safe to retry: the PS
answers a repeated (worker, step) with ``duplicate``. With a ``token``, every request carries
``Authorization: Bearer <token>``.

Tensors go through one tensor transport, chosen by :meth:`PSClient.attach` once the worker is
registered: same-host files when the PS's weights file is found in ``shm_dir``, else request bodies,
compressed as the job says (``compression`` of the registration answer: worker_service/transport/compressed.py).
A push asks the PS to answer with the next weights once its round closes (one round trip per step);
those weights are kept and returned by the next :meth:`PSClient.pull` that they satisfy.
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Callable, Mapping, Sequence, TypeVar
from urllib.parse import urlencode

import numpy as np
from pydantic import SecretStr

from shared import frame
from shared.errors import ProtocolError
from shared.protocol import API
from shared.rawhttp import ConnectionLost, RawConnection
from shared.tokens import bearer_header
from worker_service import retry
from shared.compression import Spec
from worker_service.transport.base import Connection, Pulled, PushAnswer, Response, TensorTransport
from worker_service.transport.compressed import body_transport
from worker_service.transport.http import BodyTransport
from worker_service.transport.httpx import HttpxConnection
from worker_service.transport.sharded import ShardedTransport
from worker_service.transport.shm import ShmChannel, ShmTransport

log = logging.getLogger("worker")
#: how often :meth:`PSClient.wait_ready` says it still waits for the PS
WAIT_LOG_SECONDS = 10.0
#: PS answers to a same-host push that mean "attach the gradient file again" (e.g. the PS restarted)
SHM_AGAIN = frozenset({"shm_not_attached", "shm_torn"})

__all__ = ["PSClient", "Pulled", "PushAnswer", "ServerError"]
T = TypeVar("T")


class ServerError(Exception):
    """A 5xx answer: the PS is restarting or overloaded; retried."""


def connect(base_url: str) -> Connection:
    """The production connection for ``base_url``."""
    return RawConnection(base_url) if base_url.startswith("http://") else HttpxConnection(base_url)


class PSClient:
    def __init__(self, base_url: str, timeout: float = 30.0, attempts: int = 10, retry_timeout: float = 120.0,
                 token: SecretStr | str | None = None, shm_dir: str | None = None,
                 connection: Connection | None = None) -> None:
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self.attempts = attempts
        self.retry_timeout = retry_timeout
        self.token = SecretStr(token) if isinstance(token, str) else token
        self.conn = connection or connect(self.base_url)
        self._headers = dict(bearer_header(self.token))
        #: seconds a push waits for its round to close (then it answers without weights)
        self.push_wait = 5.0
        self._prefetched: Pulled | None = None
        #: the shared directory of the same-host transport (None: tensors always in request bodies)
        self.shm_dir = shm_dir
        self.tensors: TensorTransport = BodyTransport(self.call)
        #: the job's gradient compression of request bodies (from the last registration answer)
        self.compression = Spec()
        #: the PS's shard count (from the last registration answer; > 1: tensors through every shard)
        self.shards = 1
        #: time.monotonic() of the last answer to an exchange that renewed this worker's lease (a push, a pull
        #: with its worker id): the heartbeat thread stays quiet while these come often enough
        self.lease_renewed = float("-inf")

    @property
    def transport(self) -> str:
        return self.tensors.name

    # ---- exchanges ----------------------------------------------------------------------
    def call(self, method: str, path: str, *, params: Mapping[str, Any] | None = None,
             body: Sequence[bytes | memoryview] = (), headers: Mapping[str, str] | None = None,
             timeout: float | None = None, attempts: int | None = None, what: str | None = None) -> Response:
        """One exchange, retried on connection errors, timeouts and 5xx; a 4xx is raised as ProtocolError."""
        target = path + (f"?{urlencode(params)}" if params else "")
        head = {**self._headers, **(headers or {})}

        def once() -> Response:
            resp = self.conn.request(method, target, head, body, timeout or self.timeout)
            if resp.status_code >= 500:
                raise ServerError(f"{resp.status_code} from the PS")
            return resp

        resp = retry.call(once, what or f"{method} {path}", attempts or self.attempts, self.retry_timeout,
                          (ConnectionLost, ServerError))
        if resp.status_code >= 400:
            try:
                obj = resp.json()
                code, detail = obj.get("error", "http_error"), obj.get("detail", "")
            except (ValueError, AttributeError):
                code, detail = "http_error", bytes(resp.content[:200]).decode("utf-8", "replace")
            raise ProtocolError(resp.status_code, code, detail)
        return resp

    def call_json(self, method: str, path: str, obj: Any = None, **kw: Any) -> Any:
        body = [json.dumps(obj).encode()] if obj is not None else []
        headers = {"content-type": "application/json"} if obj is not None else {}
        return self.call(method, path, body=body, headers=headers, **kw).json()

    # ---- control ------------------------------------------------------------------------
    def register(self, name: str) -> dict:
        reg = self.call_json("POST", f"{API}/workers", {"name": name})
        self.compression = Spec.from_wire(reg.get("compression"))
        self.shards = reg.get("shards", 1)
        return reg

    def leave(self, worker_id: str) -> None:
        self.call("DELETE", f"{API}/workers/{worker_id}")

    def heartbeat(self, worker_id: str) -> dict:
        return self.call_json("POST", f"{API}/workers/{worker_id}/heartbeat")

    def status(self) -> dict:
        return self.call_json("GET", f"{API}/status")

    def sibling(self, base_url: str) -> "PSClient":
        """A client of another PS process (a shard) with this one's settings."""
        return PSClient(base_url, self.timeout, self.attempts, self.retry_timeout, self.token, self.shm_dir)

    def attach_reader(self) -> None:
        """A client that only pulls (evaluation, monitoring): through every shard when the PS is sharded."""
        try:
            self.shards = self.call_json("GET", f"{API}/shards")["shards"]
        except ProtocolError as exc:
            if exc.status != 404:  # 404: not a sharded PS
                raise
            return
        self.attach(None)

    def attach(self, worker_id: str | None) -> str:
        """Choose this worker's tensor transport: same-host files if the PS is on this host, else request
        bodies; through every shard (worker_service/transport/sharded.py) when the PS is sharded. Its name."""
        self.tensors.close()
        self.tensors = body_transport(self.call, self.compression)
        if self.shards > 1:
            self.tensors = ShardedTransport.open(self, worker_id)
            return self.transport
        if worker_id is None:
            return self.transport
        if not self.shm_dir:
            return self.transport
        try:
            channel = ShmChannel.open(self.shm_dir, self.call_json("GET", f"{API}/shm"))
        except (ProtocolError, OSError, ValueError) as exc:
            log.info("tensors in request bodies (same-host transport unavailable: %s)", exc)
            return self.transport
        try:
            self.call_json("POST", f"{API}/workers/{worker_id}/shm",
                           {"file": channel.gradient_file, "nonce": channel.nonce.hex()})
        except ProtocolError as exc:
            channel.close()
            log.info("tensors in request bodies (the PS cannot use our gradient file: %s)", exc)
            return self.transport
        channel.unlink()  # the PS holds it mapped: it vanishes with the last mapping
        self.tensors = ShmTransport(self.call, channel)
        log.info("tensors through %s (same host as the PS)%s", self.shm_dir,
                 f": float32, not compressed (the job's compression {self.compression.name} applies to request "
                 "bodies; WORKER_SHM_DIR= sends this worker's over HTTP)" if self.compression.on else "")
        return self.transport

    # ---- tensors ------------------------------------------------------------------------
    def init_model(self, tensors: Mapping[str, np.ndarray], optimizer: Mapping[str, Any] | None = None) -> bool:
        """True if this call initialised the model, False if another caller had (409)."""
        body = frame.encode(tensors, {"optimizer": dict(optimizer or {})})
        try:
            self.call("PUT", f"{API}/model", body=body, headers={"content-type": frame.MEDIA_TYPE})
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
        got = self.tensors.pull(min_step, worker_id, wait, self.timeout)
        if worker_id:
            self.lease_renewed = time.monotonic()
        return got

    def push(self, worker_id: str, step: int, grads: Mapping[str, np.ndarray], loss: float | None = None,
             num_examples: int | None = None, timings: Mapping[str, float] | None = None,
             on_way: Callable[[], None] | None = None) -> dict:
        """``on_way``: called at most once, as the push is under way (:meth:`TensorTransport.push`)."""
        meta = {"worker_id": worker_id, "step": step, "loss": loss, "num_examples": num_examples,
                "timings": dict(timings or {})}
        once = [on_way] if on_way is not None else []  # a push sent again (with_transport) does not call it again
        answer = self.with_transport(worker_id, lambda t: t.push(meta, grads, self.push_wait, self.timeout,
                                                                 once.pop() if once else None))
        self.lease_renewed = time.monotonic()
        self._prefetched = answer.pulled
        return {"status": answer.status, "step": answer.step, "done": answer.done}

    def gradient_buffers(self) -> dict[str, np.ndarray] | None:
        """Where the next push's gradients may be computed, for a push that copies nothing (the same-host
        file), or None (:meth:`TensorTransport.gradient_buffers`)."""
        return self.tensors.gradient_buffers()

    def with_transport(self, worker_id: str | None, send: Callable[[TensorTransport], T]) -> T:
        """``send(transport)``; if the PS says the same-host file is gone or rewritten (it restarted), attach
        again and send again, and if it says so again, send through the request body."""
        try:
            return send(self.tensors)
        except ProtocolError as exc:
            if exc.code not in SHM_AGAIN:
                raise
            log.warning("PS says %s (%s): choosing the tensor transport again", exc.code, exc.detail)
            self.attach(worker_id)
            try:
                return send(self.tensors)
            except ProtocolError as again:
                if again.code not in SHM_AGAIN:
                    raise
                log.warning("PS says %s again: this push goes in the request body", again.code)
                return send(body_transport(self.call, self.compression))

    # ---- lifecycle ----------------------------------------------------------------------
    def wait_ready(self, deadline_seconds: float = 60.0) -> None:
        """Poll /healthz until the PS answers (start-up ordering: the PS may not be up yet)."""
        start = time.monotonic()
        end, said = start + deadline_seconds, None
        while True:
            try:
                if self.conn.request("GET", "/healthz", {}, (), 2.0).status_code == 200:
                    if said is not None:
                        log.info("the PS at %s answers (after %.1f s)", self.base_url, time.monotonic() - start)
                    return
            except ConnectionLost:
                pass
            now = time.monotonic()
            if now > end:
                raise TimeoutError(f"the PS at {self.base_url} did not answer within {deadline_seconds:g} s")
            if said is None or now - said >= WAIT_LOG_SECONDS:  # say so at once, then every 10 s
                log.info("waiting for the PS at %s to answer (%.0f s so far, giving up after %g s)", self.base_url,
                         now - start, deadline_seconds)
                said = now
            time.sleep(0.1)

    def close(self) -> None:
        self.tensors.close()
        self.conn.close()
