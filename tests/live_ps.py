"""A real PS (uvicorn on loopback) in a thread of the test process, so tests can look inside its core.

``live_ps(**settings)`` starts ``ps_service.app.create_app`` under uvicorn on a
free port and yields a :class:`LivePS` (its clients: :func:`worker_client`, which serves a PS process too;
:func:`held_ports`: ports for a test that starts PSs on them again); :func:`state_hash` digests everything a
refused request must leave alone (weights, optimizer slots and iterations, the
step, round progress, membership, counters), and :func:`raw_exchange` speaks
HTTP/1.1 over a bare socket for the requests a well-behaved client cannot send
(lying Content-Length, stalled or abandoned bodies).
"""
from __future__ import annotations

import dataclasses
import hashlib
import socket
import threading
from collections import deque
from contextlib import contextmanager
from enum import Enum
from typing import Any, Iterator

import httpx
import numpy as np
import uvicorn

from cluster.processes import bindable, free_port, hold_port, wait_for
from tests.timing import allow
from cluster.inprocess import serve_in_thread
from ps_service.runtime import Runtime
from ps_service.settings import PSSettings
from worker_service.client import PSClient


@dataclasses.dataclass
class LivePS:
    url: str
    port: int
    app: Any
    server: uvicorn.Server

    @property
    def rt(self) -> Runtime:
        return self.app.state.runtime

    def client(self, token: str | None = None, **kw) -> PSClient:
        """A :func:`worker_client` of this PS."""
        return worker_client(self.url, token, **kw)

    def http(self, token: str | None = None) -> httpx.Client:
        headers = {"Authorization": f"Bearer {token}"} if token else {}
        return httpx.Client(base_url=self.url, timeout=allow(10), headers=headers)


def worker_client(url: str, token: str | None = None, **kw) -> PSClient:
    """A worker client of the PS at ``url`` (one attempt a call) that does not wait for the round to close after a
    push."""
    c = PSClient(url, timeout=allow(10), attempts=1, token=token, **kw)
    c.push_wait = 0.0
    return c


def _start(ps_settings: PSSettings) -> tuple[Any, uvicorn.Server, threading.Thread]:
    return serve_in_thread(ps_settings, start_timeout=allow(20))


@contextmanager
def held_ports(n: int) -> Iterator[list[int]]:
    """``n`` free ports, held from other processes for the block (cluster.processes.hold_port): a test that starts
    PSs on them again and again (a shard restarted, restored) keeps them between one's stop and the next's start,
    when another test process's free_port could hand them out. :func:`live_ps` binds beside the hold."""
    ports = [free_port() for _ in range(n)]
    held = [hold_port("127.0.0.1", p) for p in ports]
    try:
        yield ports
    finally:
        for h in held:
            if h is not None:
                h.close()


@contextmanager
def live_ps(port: int | None = None, **settings: Any) -> Iterator[LivePS]:
    given = port is not None
    port = port or free_port()
    ps_settings = PSSettings(host="127.0.0.1", port=port, **settings)
    app, server, thread = _start(ps_settings)
    if not server.started and given:  # a PS started again on its port: the port can be held a moment longer
        # (CI, twice: EADDRINUSE, with ports from the ephemeral range; free_port now hands out ports below it)
        wait_for(lambda: bindable(port, reuse_address=True), allow(20), f"port {port} to be free again")
        app, server, thread = _start(ps_settings)
    try:
        assert server.started, "uvicorn did not start"
        yield LivePS(f"http://127.0.0.1:{port}", port, app, server)
    finally:
        server.should_exit = True
        thread.join(allow(15))


def _canon(obj: Any) -> Any:
    """A deterministic, hashable-as-text form of the core's state (arrays by dtype, shape and bytes)."""
    if isinstance(obj, np.ndarray):
        return ("ndarray", obj.dtype.str, obj.shape, hashlib.sha256(np.ascontiguousarray(obj).tobytes()).hexdigest())
    if isinstance(obj, Enum):
        return obj.value
    if dataclasses.is_dataclass(obj) and not isinstance(obj, type):
        return (type(obj).__name__, _canon(vars(obj)))
    if isinstance(obj, dict):
        return sorted((repr(k), _canon(v)) for k, v in obj.items())
    if isinstance(obj, (set, frozenset)):
        return sorted(repr(_canon(v)) for v in obj)
    if isinstance(obj, (list, tuple, deque)):
        return [_canon(v) for v in obj]
    return repr(obj)


def state_hash(rt: Runtime) -> str:
    """SHA-256 of the PS state a refused request must not touch."""
    core = rt.core
    opt = core.optimizer
    state = {
        "weights": core.weights,
        "optimizer": None if opt is None else {"spec": opt.spec, "iterations": opt.iterations, "slots": opt.slots},
        "global_step": core.global_step, "started": core.started, "version": core.version,
        "round": core.round, "last_round": core.last_round, "rounds": list(core.rounds),
        "members": core.members.by_id, "member_events": list(core.members.events),
        "push_counts": core.push_counts, "examples": core.examples, "loss_history": list(core.loss_history),
    }
    return hashlib.sha256(repr(_canon(state)).encode()).hexdigest()


def raw_exchange(port: int, data: bytes | list[bytes], read: bool = True, shutdown: bool = False,
                 timeout: float | None = None) -> tuple[int | None, bytes]:
    """Send raw bytes (parts in order), optionally half-close, and read one response: (status, body); ``timeout``
    bounds each socket operation (default ``allow(10)``).

    Status is None when the server closed without answering."""
    with socket.create_connection(("127.0.0.1", port), timeout=allow(10) if timeout is None else timeout) as s:
        for part in [data] if isinstance(data, bytes) else data:
            s.sendall(part)
        if shutdown:
            s.shutdown(socket.SHUT_WR)
        if not read:
            return None, b""
        return read_response(s)


def read_response(s: socket.socket) -> tuple[int | None, bytes]:
    buf = b""
    while b"\r\n\r\n" not in buf:
        chunk = s.recv(65536)
        if not chunk:
            return None, buf
        buf += chunk
    head, _, body = buf.partition(b"\r\n\r\n")
    lines = head.decode("latin-1").split("\r\n")
    status = int(lines[0].split()[1])
    length = next((int(v) for k, _, v in (ln.partition(":") for ln in lines[1:]) if k.lower() == "content-length"), None)
    while length is not None and len(body) < length:
        chunk = s.recv(65536)
        if not chunk:
            break
        body += chunk
    return status, body
