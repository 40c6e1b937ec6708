"""The worker's client of the PS protocol (docs/protocol.md): registration, the model's upload, pulls and pushes.

Every exchange goes through one :class:`~worker_service.transport.endpoint.Endpoint` (timeouts, retries, the 4xx it
raises, the token) over one :class:`~worker_service.transport.base.Transport`; timeouts and retry attempts default to
the ``WORKER_*`` settings' defaults. Pushes are safe to retry: the PS answers a repeated (worker, step) with
``duplicate``. Tensors go through one tensor transport, chosen by :meth:`PSClient.attach` once the worker is
registered (:class:`~worker_service.transport.attach.Attached`, or
:class:`~worker_service.transport.sharded.ShardedTransport` for a sharded PS). A push asks the PS to answer with the
next weights once its round closes (one round trip per step); those weights are kept and returned by the next
:meth:`PSClient.pull` that they satisfy.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, Mapping

import numpy as np
from pydantic import SecretStr

from shared import frame
from shared.compression import Spec
from shared.errors import ProtocolError
from shared.protocol import API
from shared.rawhttp import ConnectionLost
from worker_service.settings import default
from worker_service.transport.attach import Attached
from worker_service.transport.base import Pulled, PushAnswer, TensorTransport, Transport
from worker_service.transport.endpoint import Endpoint, connect, split_urls
from worker_service.transport.http import BodyTransport
from worker_service.transport.sharded import ShardedTransport

log = logging.getLogger("worker")
#: how often :meth:`PSClient.wait_ready` says it still waits for the PS
WAIT_LOG_SECONDS = 10.0

__all__ = ["PSClient", "Pulled", "PushAnswer"]


class PSClient:
    def __init__(self, base_url: str, timeout: float | None = None, attempts: int | None = None,
                 retry_timeout: float | None = None, token: SecretStr | str | None = None, shm_dir: str | None = None,
                 connection: Transport | None = None) -> None:
        urls = split_urls(base_url)  # a hot-standby pair: both PS, comma-separated
        base_url = urls[0]
        self.endpoint = Endpoint(
            base_url, connection or connect(base_url), timeout=default("request_timeout_seconds", timeout),
            attempts=default("retry_attempts", attempts),
            retry_timeout=default("retry_timeout_seconds", retry_timeout),
            token=SecretStr(token) if isinstance(token, str) else token, urls=urls)
        #: seconds a push waits for its round to close (then it answers without weights)
        self.push_wait = 5.0
        #: the weights the last push brought back, until a pull takes them (None: none)
        self.prefetched: Pulled | None = None
        #: the shared directory of the same-host transport (None: tensors always in request bodies)
        self.shm_dir = shm_dir
        self.tensors: TensorTransport = BodyTransport(self.endpoint)
        #: the job's gradient compression of request bodies (from the last registration answer)
        self.compression = Spec()
        #: the job's partition size (PS_PARTITION_BYTES, from the last registration answer; 0: one partition)
        self.partition_bytes = 0
        #: the PS's shard count (from the last registration answer; > 1: tensors through every shard)
        self.shards = 1
        self.mode = "sync"  # the job's (PS_MODE), from the registration answer
        #: time.monotonic() of the last answer to an exchange that renewed this worker's lease (a push, a pull with
        #: its worker id): the heartbeat thread stays quiet while these come often enough, and beats on while a
        #: pull or push waits for a slow round (the PS that hears from no worker for half a lease, waiting or not,
        #: takes it for its own outage: docs/protocol.md)
        self.lease_renewed = float("-inf")

    base_url = property(lambda self: self.endpoint.base_url)
    ps_url = property(lambda self: ",".join(self.endpoint.urls), doc="every PS URL (a hot-standby pair: both)")
    conn = property(lambda self: self.endpoint.transport, doc="the transport every exchange goes through")
    timeout = property(lambda self: self.endpoint.timeout)
    token = property(lambda self: self.endpoint.token)

    transport = property(lambda self: self.tensors.name, doc="the tensor transport's name (shm, http, http+topk...)")

    # ---- control ------------------------------------------------------------------------
    def register(self, name: str) -> dict:
        self.endpoint.voter = name  # a hot-standby pair's elections: this worker's vote
        reg = self.endpoint.call_json("POST", f"{API}/workers", {"name": name})
        self.compression = Spec.from_wire(reg.get("compression"))
        self.partition_bytes = int(reg.get("partition_bytes") or 0)  # docs/protocol-partitions.md
        self.shards = reg.get("shards", 1)
        self.mode = reg.get("mode", "sync")
        return reg

    def join(self, name: str, model: Callable[[str], tuple[Mapping[str, np.ndarray], Mapping[str, Any]]]) -> dict:
        """Register, initialise an empty PS with ``model(mode)`` (the tensors and the optimizer spec for the job's
        mode), attach; the registration answer."""
        reg = self.register(name)
        if not reg["model_initialized"]:
            tensors, optimizer = model(self.mode)
            if self.init_model(tensors, optimizer):  # False: another worker's came first
                log.info("initialised the PS with this worker's model (%d tensors)", len(tensors))
        self.attach(reg["worker_id"])
        return reg

    def leave(self, worker_id: str) -> None:
        self.endpoint.call("DELETE", f"{API}/workers/{worker_id}")

    def heartbeat(self, worker_id: str) -> dict:
        return self.endpoint.call_json("POST", f"{API}/workers/{worker_id}/heartbeat")

    def status(self) -> dict:
        return self.endpoint.call_json("GET", f"{API}/status")

    def attach_reader(self) -> None:
        """A client that only pulls (evaluation, monitoring): through every shard when the PS is sharded."""
        try:
            self.shards = self.endpoint.call_json("GET", f"{API}/shards")["shards"]
        except ProtocolError as exc:
            if exc.status != 404:  # 404: not a sharded PS
                raise
            return
        self.attach(None)

    def attach(self, worker_id: str | None) -> str:
        """Choose this worker's tensor transport (same-host files if the PS is on this host, else request bodies;
        through every shard when the PS is sharded). Its name."""
        self.tensors.close()
        self.tensors = BodyTransport(self.endpoint, self.compression)  # if choosing fails: a usable one
        if self.shards > 1:
            self.tensors = ShardedTransport.open(self.endpoint, worker_id, self.shm_dir, self.compression,
                                                 self.partition_bytes)
        else:
            self.tensors = Attached(self.endpoint, worker_id, self.shm_dir, self.compression, self.partition_bytes)
        return self.transport

    # ---- tensors ------------------------------------------------------------------------
    def init_model(self, tensors: Mapping[str, np.ndarray], optimizer: Mapping[str, Any] | None = None) -> bool:
        """True if this call initialised the model, False if another caller had (409)."""
        body = frame.encode(tensors, {"optimizer": dict(optimizer or {})})
        try:
            self.endpoint.call("PUT", f"{API}/model", body=body, headers={"content-type": frame.MEDIA_TYPE})
            return True
        except ProtocolError as exc:
            if exc.status == 409:
                return False
            raise

    def pull(self, min_step: int = 0, worker_id: str | None = None, wait: float = 5.0) -> Pulled | None:
        """Weights once ``global_step >= min_step`` (or done); None if ``wait`` s passed first. The tensors are
        read-only arrays: through request bodies (weight deltas included) the caller may keep them, later pulls and
        pushes never change them; through the same-host file they view the PS's live weights, which change once the
        round of their step closes (a caller that keeps them must copy them)."""
        ready, self.prefetched = self.prefetched, None
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
        answer = self.tensors.push(meta, grads, self.push_wait, self.timeout, on_way)
        self.lease_renewed = time.monotonic()
        self.prefetched = answer.pulled
        return {"status": answer.status, "step": answer.step, "done": answer.done}

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
        self.endpoint.close()
