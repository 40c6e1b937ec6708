"""The standby's reader of its same-host log (:mod:`.ring`; docs/protocol-standby.md, "Same host: the log").

Contract: a standby with a shared-memory directory (``PS_SHM_DIR``) makes a new log with each state it takes
(:meth:`Reader.new_log`, the previous one dropped) and advertises it; :meth:`Reader.drain` takes the records committed
in it in order, each as the message over HTTP (:meth:`ps_service.standby.Pair.apply`), its step applied, behind the
primary (a read loop, and before a ping or a message over HTTP); a record that does not apply closes the log (not
``synced``: the state again). Taking over, the pair closes the log with the new term first, then drains every record
committed before, then drops the log.
"""
from __future__ import annotations

import asyncio
import logging
import os

import ps_service.standby as standby  # its roles (read at call time: the package imports this module first)
from ps_service.standby import ring
from shared import frame
from shared.errors import ProtocolError

log = logging.getLogger("ps_service")
#: how often the standby looks at its log while records come (:meth:`Reader._run`)
READ_EVERY_SECONDS = 0.005


class Reader:
    """A pair's same-host log, as its standby (``pair``: :class:`ps_service.standby.Pair`)."""

    def __init__(self, pair) -> None:
        self.pair = pair
        self.log: ring.Log | None = None  # the log the primary writes the steps into (same host), from a state on
        self.log_dir: str | None = None  # where this PS makes it (PS_SHM_DIR, set by start(); None: none)
        self.task: asyncio.Task | None = None  # reads the log behind (drain)

    def start(self, shm_dir: str | None) -> None:
        """Logs go into ``shm_dir`` if it is a directory (the logs of a standby killed there unlinked), and the read
        loop starts."""
        if shm_dir and os.path.isdir(shm_dir) and ring.USABLE:
            self.log_dir = shm_dir
            ring.sweep(shm_dir)  # the logs of a standby killed here
        self.task = asyncio.create_task(self._run())

    async def close(self) -> None:
        if self.task is not None:
            self.task.cancel()
            await asyncio.wait({self.task}, timeout=self.pair.failover)
        self.drop_log()

    def drain(self, now: float | None) -> int:
        """Take and apply the records committed in the log after the last message taken, in order; how many (``now``
        None: at takeover, no primary heard). A record that does not apply (it cannot, for a primary's of this model)
        closes the log: this PS is no longer ``synced`` and the primary sends the state again."""
        p, n = self.pair, 0
        while self.log is not None and p.role != standby.PRIMARY and not p.restarted:
            rec = self.log.record(p.applied + 1, p.term)
            if rec is None:
                break
            try:
                p.apply(p.term, p.applied + 1, rec[0], rec[1], now)
                p.settle()
                p.costs["logged"] += 1
            except ProtocolError as exc:
                log.warning("hot standby: record %d of the log refused (%s): the state again", p.applied + 1, exc)
                p.synced = False
                self.drop_log()
            n += 1
        return n

    async def _run(self) -> None:
        """Read the log behind: every :data:`READ_EVERY_SECONDS` while records come, backing off to 4 times that (no
        log: 50 ms). Every record committed is read at each look, so the ring fills only if the standby falls behind
        by its slots; fewer looks leave the CPU to the job's processes (a look wakes this process)."""
        rt, pause = self.pair.rt, READ_EVERY_SECONDS
        while True:
            try:
                found = self.drain(rt.now()) if self.log is not None else 0
            except Exception:  # never let the reader die
                log.exception("hot standby: reading the log failed")
                found = 0
            if found:
                rt.notify()
            pause = READ_EVERY_SECONDS if found else min(4 * READ_EVERY_SECONDS, pause * 2)
            await asyncio.sleep(pause if self.log is not None else 0.05)

    def new_log(self) -> None:
        """A log for the primary of the state just taken (the old one closed), or none (no directory, no space)."""
        self.drop_log()
        core = self.pair.core
        if self.log_dir is None or not core.initialized:
            return
        try:
            self.log = ring.Log.create(self.log_dir, frame.Layout.of(core.weights), self.pair.applied)
        except OSError as exc:
            log.warning("hot standby: no log in %s (%s): the steps come over HTTP", self.log_dir, exc)

    def drop_log(self) -> None:
        if self.log is not None:
            if not self.log.closed:  # (a takeover closed it with its new term)
                self.log.close_for(max(self.pair.term, 1))
            self.log.remove()
            self.log = None
