"""The PS process's live objects: the core, its clock, the waiters, the tensor seam.

Routes get the :class:`Runtime` from ``request.app.state.runtime``. It owns the only clock (``time.monotonic``), holds
the tensor seam (:class:`ps_service.transport.TensorSeam`), and wakes the waits: a long poll waits on the *barrier*
(:meth:`Runtime.barrier`), woken only when it moved (once per round), body answers first; a push waits for its turn to
be read (:meth:`Runtime.turn`). The observers (metrics, checkpoints, a shard's and a pair's senders) run at every
change of the core and must be O(1). What the core tells the layer above (``core.told``: a sharded coordinator's
decisions) is delivered after every core call before anything is awaited (:meth:`Runtime.deliver`), so a message it
queues leaves as soon as the call's route yields, as if queued inside the call.
"""
from __future__ import annotations

import asyncio
import logging
import socket
import time
from typing import Callable

from ps_service.core import CoreConfig, ParameterServerCore
from ps_service.settings import PSSettings
from ps_service.transport import TensorSeam

log = logging.getLogger("ps_service")


def runtime(request) -> "Runtime":
    """The Runtime of the app serving ``request`` (set by ``app.py``'s lifespan)."""
    return request.app.state.runtime


def _look_again(fut: asyncio.Future) -> None:
    """A wait's future resolved False (its time is up, or it looks at its predicate again) unless it is done."""
    if not fut.done():
        fut.set_result(False)


class Runtime:
    def __init__(self, settings: PSSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.clock = clock
        self.core = ParameterServerCore(CoreConfig.from_settings(settings))
        self.core.partition_bytes = settings.partition_bytes  # (before the model: its partitions)
        self.started_wall = time.time()
        self.started_mono = self._read_at = clock()
        #: the waits in flight (:meth:`wait_until`): future -> whether it goes first
        self._waiters: dict[asyncio.Future, bool] = {}
        #: waits marked first that notify woke and that have not resumed yet (:meth:`body_answers_first`)
        self._first_woken = 0
        #: pushes waiting for their turn to be read (:meth:`turn`): worker id -> futures, the longest-waiting first
        self._turns: dict[str, list[asyncio.Future]] = {}
        self._seen_version = self.core.version
        self._seen_barrier = self.barrier()
        self.tensors = TensorSeam(settings, self.core)
        if settings.partition_bytes:  # pulls answered partition by partition (ps_service/transport/streamed.py)
            self.core.on_partition = self._partition_closed
        #: requests refused for a missing or wrong token (issue: access control)
        self.auth_failures = 0
        #: the last checkpoint written or restored: {"step", "path", "time", "duration_seconds", "count"}
        self.checkpoint_info: dict | None = None
        #: called with no argument after each change of the core (e.g. metrics observing closed rounds)
        self.observers: list[Callable[[], None]] = []
        #: this process's part in a sharded PS (PS_SHARDS > 1; None: one PS): ps_service/sharding (:meth:`take_parts`)
        self.shards = None
        #: this process's part in a hot-standby pair (PS_ROLE; None: no pair): ps_service/standby
        self.ha = None
        #: waits in flight answer at once when it moves (:meth:`abort_waits`)
        self.aborts = 0
        #: who reads what the core tells (``core.told``; None: nobody): :meth:`deliver`
        self._reader: Callable[[], None] | None = None
        self._told_done = False  # :meth:`tell_done` logged its line

    def take_parts(self, shards, ha) -> None:
        """Take this process's parts in a sharded PS and in a hot-standby pair (None: none)."""
        self.shards, self.ha = shards, ha
        if shards is not None and shards.coordinator:
            self._reader = shards.tell  # decided rounds go to the followers
            self.observers.append(shards.observe)  # the open round's progress
        if ha is not None:
            self.observers.append(ha.observe)  # membership changes go to the standby

    def abort_waits(self) -> None:
        """Every wait in flight ends now and looks again (a pair's PS changed role: :meth:`wait_for` refuses)."""
        self.aborts += 1
        self.wake_waits()

    def wake_waits(self) -> None:
        """Every wait in flight looks at its predicate again (partitions closed: the core's ``on_partition``)."""
        waiters, self._waiters = self._waiters, {}
        for fut in waiters:
            _look_again(fut)

    def _partition_closed(self) -> None:
        self.deliver()  # a decision told in this call goes before the pulls woken here (their frames' writes)
        self.tensors.partitions.closed()
        self.wake_waits()

    def now(self) -> float:
        """The core's clock; a reading long after the one before is a stall, told first (:meth:`Membership.stalled`)."""
        t = self.clock()
        if t - self._read_at >= self.core.members.stall_seconds:  # (a call only when it can be one)
            self.core.members.stalled(self._read_at, t)
        self._read_at = t
        return t

    def barrier(self) -> tuple:
        """What waits wait on: (step, job state, SSP floor, the counts of rollbacks, recalls and leaves)."""
        core = self.core
        return core.global_step, core.state(), core.pull_floor, core.rewinds, core.recalls, core.leaves

    def deliver(self) -> None:
        """What the core told since the last call (``core.told``), to its reader: after every core call, before anything
        is awaited (:meth:`notify`; a partitioned push after each frame), and inside one before it wakes the pulls
        (``on_partition``), so the reader's sender is woken first, as from a hook called at the decision."""
        if self.core.told:
            self._reader()

    def notify(self) -> None:
        """What the core told (:meth:`deliver`); if the core changed since the last call: run the observers, and wake
        every waiter if the barrier moved."""
        self.deliver()  # (first: a message it queues goes before the waiters woken here run)
        if self.core.version != self._seen_version:
            self._seen_version = self.core.version
            barrier = self.barrier()
            moved = barrier != self._seen_barrier
            if self._turns:
                self._wake_turns(moved)
            if moved:
                self._seen_barrier = barrier
                waiters, self._waiters = self._waiters, {}
                for ahead in (True, False):  # the first ones, then the others, in the order they started waiting
                    for fut, first in waiters.items():
                        if first is ahead and not fut.done():
                            fut.set_result(True)
                            if first:
                                self._first_woken += 1
            for observe in self.observers:
                try:
                    observe()
                except Exception:  # monitoring must never break training
                    log.exception("observer failed")

    async def wait_until(self, predicate: Callable[[], bool], timeout: float, first: bool = False) -> bool:
        """Wait (at most ``timeout`` s) until ``predicate()``, a function of :meth:`barrier` only; its final value.
        ``first``: woken before the waits that are not."""
        deadline, rewinds, aborts = self.clock() + timeout, self.core.rewinds, self.aborts
        while not predicate():
            remaining = deadline - self.clock()
            if remaining <= 0 or self.core.rewinds != rewinds or self.aborts != aborts:  # went back to a checkpoint,
                # or this PS's role in a pair changed: answer now
                return False
            # one future and one timer per wait (asyncio.wait_for would make a task as well)
            loop = asyncio.get_running_loop()
            fut = loop.create_future()
            self._waiters[fut] = first
            timer = loop.call_later(remaining, _look_again, fut)
            try:
                await fut
            finally:
                timer.cancel()
                self._waiters.pop(fut, None)
                if first and fut.done() and not fut.cancelled() and fut.result():  # woken by notify (counted)
                    self._first_woken -= 1
        return True

    async def turn(self, worker_id: str, step: int, wait: float, last: bool = True) -> bool:
        """Wait, at most ``wait`` s and holding the worker's lease, until the core lets the tensors of ``worker_id``'s
        push for ``step`` be read (its claim: ps_service/core/intake.py). True once claimed; at the end of the wait,
        False, or, ``last``, claimed out of turn (True)."""
        core = self.core
        if core.claim(worker_id, step):
            return True
        deadline, loop = self.clock() + wait, asyncio.get_running_loop()
        core.members.begin_wait(worker_id, self.now())
        try:
            while True:
                over = deadline <= self.clock()
                if core.claim(worker_id, step, overdue=over and last):
                    return True
                if over:
                    return False
                fut = loop.create_future()
                self._turns.setdefault(worker_id, []).append(fut)
                timer = loop.call_later(max(0.0, deadline - self.clock()), _look_again, fut)
                try:
                    await fut
                finally:
                    timer.cancel()
                    futs = self._turns.get(worker_id)
                    if futs is not None and fut in futs:
                        futs.remove(fut)
                        if not futs:
                            del self._turns[worker_id]
        finally:
            core.members.end_wait(worker_id, self.now())

    def _wake_turns(self, everyone: bool) -> None:
        """Wake the pushes whose turn to be read may have come (every one when the barrier moved)."""
        ids = list(self._turns) if everyone else self.core.readers()
        if ids is None:  # anyone: the longest-waiting
            ids = list(self._turns)[:1]
        for worker_id in ids:
            for fut in self._turns.pop(worker_id, ()):
                if not fut.done():
                    fut.set_result(True)

    async def body_answers_first(self, turns: int = 16) -> None:
        """A same-host answer about to copy the step's weights into the weights file
        (:meth:`TensorSeam.file_behind`) yields to the event loop until the body answers just woken have resumed, at
        most ``turns`` times."""
        for _ in range(turns):
            if self._first_woken <= 0 or not self.tensors.file_behind():
                return
            await asyncio.sleep(0)

    async def wait_for(self, predicate: Callable[[], bool], timeout: float, worker_id: str | None = None,
                       first: bool = False) -> bool:
        """:meth:`wait_until`, at most ``PS_PULL_TIMEOUT_MAX_SECONDS``; with ``worker_id`` the wait keeps that
        worker's lease (404/409 first if it is unknown or not active) and ends with 409 ``not_active`` if the
        worker was expired meanwhile (a rollback of a sharded PS, a recall into a stuck round)."""
        timeout = min(timeout, self.settings.pull_timeout_max_seconds)
        if worker_id is None:
            ok = await self.wait_until(predicate, timeout, first)
        else:
            members = self.core.members
            self.core.members.begin_wait(worker_id, self.now())
            try:
                ok = await self.wait_until(lambda: predicate() or not members.is_active(worker_id), timeout, first)
            finally:
                self.core.members.end_wait(worker_id, self.now())
            members.active_member(worker_id)  # (not a heartbeat: the PS ending a wait has not heard from its worker)
        if self.ha is not None:
            self.ha.refuse()  # 503 if this PS stopped being the primary meanwhile
        return ok

    def tell_done(self) -> None:
        """An observer (and a call after the restore): once the job is done, log once that this PS stays up and what
        for, so a user watching its log (the workers exited) knows the job ended and how to stop it."""
        if self.core.done and not self._told_done and (self.shards is None or self.shards.coordinator):
            self._told_done = True
            log.info("the job is done at global step %d: this PS stays up to serve its dashboard (/), /v1/status, "
                     "/metrics and the final weights (`python -m syncps export`); Ctrl-C or SIGTERM stops it",
                     self.core.global_step)

    async def deployment(self, every: float = 1.0, timeout: float = 2.0) -> None:
        """Background task until step 0 or the job is done (``PS_WORKERS_DNS``): the deployment's worker count, the
        addresses its DNS name resolves to, given to the core every ``every`` s (a name that does not resolve: none)."""
        name, loop = self.settings.workers_dns, asyncio.get_running_loop()
        while name and not self.core.started and not self.core.done:  # (a finished job restored: no step 0)
            try:
                infos = await asyncio.wait_for(loop.getaddrinfo(name, None, type=socket.SOCK_STREAM), timeout)
                count = len({info[4][0] for info in infos})
            except (OSError, asyncio.TimeoutError):
                count = None
            if count != self.core.deployed:
                log.info("the deployment runs %s worker%s (DNS name %r, an address each)%s", count or "no",
                         "" if count == 1 else "s", name, ": step 0 waits for them" if count else "")
            now = self.now()
            self.core.deploy(count, now)
            self.core.tick(now)
            self.notify()
            await asyncio.sleep(every)

    async def ticker(self) -> None:
        """Background task: leases, start-up grace, round deadlines, a reading of the clock (:meth:`now`)."""
        while True:
            await asyncio.sleep(self.settings.tick_seconds)
            now = self.now()
            if self.shards is not None:
                self.shards.hold_leases(now)  # a coordinator whose follower does not answer
            if self.ha is not None:
                self.ha.watch(now)  # a standby that no longer hears its primary
            self.core.tick(now)
            self.notify()
            shm = self.tensors.shm
            if shm.attached and (self.shards is None or self.shards.coordinator):  # followers have no members
                shm.prune(self.core.members.active_by_id.keys())

    def run_guarded(self, fn: Callable[[], object]) -> object:
        """Run a core call and wake the waiters whatever happened."""
        try:
            return fn()
        finally:
            self.notify()
