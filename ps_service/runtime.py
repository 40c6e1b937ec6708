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

from ps_service.core import CoreConfig, ParameterServerCore
from ps_service.settings import PSSettings
from shared.codec import encode_tensors, pack

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


class Runtime:
    def __init__(self, settings: PSSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.core = ParameterServerCore(core_config(settings))
        self.started_wall = time.time()
        self.started_mono = clock()
        self._event = asyncio.Event()
        self._seen_version = self.core.version
        self._body_key: tuple | None = None
        self._body: bytes = b""
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

    def pull_body(self) -> bytes:
        """msgpack of the current weights, encoded once per (step, round membership)."""
        core = self.core
        ranks = sorted(core.round.eligible.values()) if core.round else []
        key = (core.global_step, core.done, tuple(ranks), core.optimizer.iterations if core.optimizer else -1)
        if key != self._body_key:
            self._body = pack({"step": core.global_step, "done": core.done, "ranks": ranks,
                               "tensors": encode_tensors(core.weights)})
            self._body_key = key
        return self._body

    async def ticker(self) -> None:
        """Background task: leases, start-up grace, round deadlines."""
        while True:
            await asyncio.sleep(self.settings.tick_seconds)
            self.core.tick(self.now())
            self.notify()

    def run_guarded(self, fn: Callable[[], object]) -> object:
        """Run a core call and wake the waiters whatever happened."""
        try:
            return fn()
        finally:
            self.notify()
