"""The PS process's live objects: the core, its clock, the waiters, the encoded weights.

Routes get the :class:`Runtime` from ``request.app.state.runtime``. It owns the
only clock (``time.monotonic``), wakes long-polling pulls whenever the core's
version moves, and encodes the weights once per (step, round) so every worker
is served the same bytes.
"""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Awaitable, Callable

from ps_service.buffers import POOL
from ps_service.core import CoreConfig, ParameterServerCore
from ps_service.settings import PSSettings
from ps_service.shm import ShmHub
from shared.codec import ZERO_COPY_MIN_BYTES, encode_tensors, pack, pack_parts

log = logging.getLogger("ps_service")


def core_config(s: PSSettings) -> CoreConfig:
    return CoreConfig(
        replicas_to_aggregate=s.replicas_to_aggregate,
        total_num_replicas=s.total_num_replicas,
        min_workers=s.min_workers,
        startup_grace_seconds=s.startup_grace_seconds,
        max_steps=s.max_steps,
        aggregation=s.aggregation,
        lease_seconds=s.lease_seconds,
        round_timeout_seconds=s.round_timeout_seconds,
        min_replicas=s.min_replicas,
        optimizer_overrides=s.optimizer_overrides(),
        nonfinite_policy=s.nonfinite_policy,
    )


def runtime(request) -> "Runtime":
    """The Runtime of the app serving ``request`` (set by ``app.py``'s lifespan)."""
    return request.app.state.runtime


class Runtime:
    def __init__(self, settings: PSSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.core = ParameterServerCore(core_config(settings))
        self.started_wall = time.time()
        self.started_mono = clock()
        self._event = asyncio.Event()
        self._seen_version = self.core.version
        self.shm = ShmHub(settings.shm_dir or None)
        self._body_key: tuple | None = None
        self._body: bytes | memoryview = b""
        self.bytes_in = 0
        self.bytes_out = 0
        #: requests refused for a missing or wrong token (issue: access control)
        self.auth_failures = 0
        #: the last checkpoint written or restored: {"step", "path", "time", "duration_seconds", "count"}
        self.checkpoint_info: dict | None = None
        #: called with no argument after each change of the core (e.g. metrics observing closed rounds)
        self.observers: list[Callable[[], None]] = []

    def now(self) -> float:
        return self.clock()

    def notify(self) -> None:
        """Wake every waiter if the core changed since the last call."""
        if self.core.version != self._seen_version:
            self._seen_version = self.core.version
            self._event.set()
            self._event = asyncio.Event()
            for observe in self.observers:
                try:
                    observe()
                except Exception:  # monitoring must never break training
                    log.exception("observer failed")

    async def wait_until(self, predicate: Callable[[], bool], timeout: float) -> bool:
        """Wait (at most ``timeout`` s) until ``predicate()``; its final value."""
        deadline = self.clock() + timeout
        while not predicate():
            remaining = deadline - self.clock()
            if remaining <= 0:
                return False
            try:
                await asyncio.wait_for(self._event.wait(), remaining)
            except asyncio.TimeoutError:
                return predicate()
        return True

    def _pull_head(self) -> tuple[tuple, dict]:
        core = self.core
        ranks = sorted(core.round.eligible.values()) if core.round else []
        key = (core.global_step, core.done, tuple(ranks), core.optimizer.iterations if core.optimizer else -1)
        return key, {"step": core.global_step, "done": core.done, "ranks": ranks}

    def shm_pull_body(self) -> bytes:
        """The pull answer of a same-host worker: no tensors (they are in the weights file)."""
        return pack({**self._pull_head()[1], "tensors": {}, "shm": True})

    def pull_body(self) -> bytes | memoryview:
        """msgpack of the current weights, encoded once per (step, round membership).

        A large body is a snapshot of the weights in a pooled buffer (one copy, no msgpack
        buffer growth) that is never written again while an answer still sends it, so the
        weights can change under an answer in flight."""
        core = self.core
        key, head = self._pull_head()
        if key != self._body_key:
            obj = {**head, "tensors": encode_tensors(core.weights)}
            self._body = b""  # the old body's buffer goes back to the pool once no answer sends it
            if sum(w.nbytes for w in core.weights.values()) < ZERO_COPY_MIN_BYTES:
                self._body = pack(obj)
            else:
                parts = pack_parts(obj)
                size = sum(len(p) for p in parts)
                view, at = POOL.take(size), 0
                for p in parts:
                    view[at:at + len(p)] = p
                    at += len(p)
                self._body = view
            self._body_key = key
        return self._body

    def drop_body(self) -> None:
        """Forget the encoded weights (a push is coming in, its round re-encodes them): their
        buffer serves the push's body once no answer sends it, which bounds the PS's memory."""
        self._body, self._body_key = b"", None

    async def ticker(self) -> None:
        """Background task: leases, start-up grace, round deadlines."""
        while True:
            await asyncio.sleep(self.settings.tick_seconds)
            self.core.tick(self.now())
            self.notify()
            if self.shm.attached:
                self.shm.prune({m.worker_id for m in self.core.members.by_id.values() if m.active})

    def run_guarded(self, fn: Callable[[], object]) -> object:
        """Run a core call and wake the waiters whatever happened."""
        try:
            return fn()
        finally:
            self.notify()
