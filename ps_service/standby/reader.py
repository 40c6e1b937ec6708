"""The standby's reader of its same-host log (:mod:`.ring`; docs/protocol-standby.md, "Same host: the log").

Contract: a standby with a shared-memory directory (``PS_SHM_DIR``, a usable :mod:`.ring`) makes a new log with each
state it takes (:meth:`Reader.new_log`, the previous one closed and unlinked: :meth:`Reader.drop_log`) and advertises
it; it takes the records committed in it in order, each as it would take the message over HTTP
(:meth:`ps_service.standby.Pair.apply`, then its step applied), behind the primary. A record that does not apply closes
the log: the standby is no longer ``synced`` and the primary sends the state again. Taking over with a term
(:meth:`Reader.last_records`), it closes the log with that term first (a record committed after is refused by its
writer), then takes every record committed before, then drops the log.

Off the job's CPU: the records are taken by a thread of this process whose scheduling policy is ``SCHED_IDLE``
(:func:`idle`: it runs only when a core would otherwise idle; else nice 19; else as any thread), one record at a time
under :attr:`Reader.lock`, the lock of the standby's state (the core's model, the pair's messages taken): every call
of the event loop's that reads or changes that state holds it (:meth:`Reader.held`), and the thread takes no next
record while one waits for it, nor before the event loop ran its observers for the one it took. A thread in ``SCHED_IDLE`` cannot leave it, so nothing depends on it: before it answers
a ping or a message over HTTP the event loop takes the records committed itself (:meth:`Reader.drain`), and so does a
takeover. The thread lags by at most the ring's slots: with the ring full the primary sends over HTTP (:mod:`.link`).
"""
from __future__ import annotations

import contextlib
import logging
import os
import threading
import time

from ps_service.standby import ring
from shared import frame
from shared.errors import ProtocolError

log = logging.getLogger("ps_service")
#: how often the reader thread looks at the log while records come (backing off to 4 times that; no log: 50 ms)
READ_EVERY_SECONDS = 0.005


def idle() -> str:
    """Make the calling thread (only it, on Linux) run only when a core would otherwise idle: ``SCHED_IDLE``, else
    nice 19, else nothing; which (``"idle"``, ``"nice"``, ``"normal"``)."""
    with contextlib.suppress(AttributeError, OSError):
        os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
        return "idle"
    with contextlib.suppress(AttributeError, OSError):
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 19)
        return "nice"
    return "normal"


class Reader:
    """A pair's same-host log, as its standby (``pair``: :class:`ps_service.standby.Pair`)."""

    def __init__(self, pair) -> None:
        self.pair = pair
        self.log: ring.Log | None = None  # the log the primary writes the steps into (same host), from a state on
        self.log_dir: str | None = None  # where this PS makes it (PS_SHM_DIR, set by start(); None: none)
        self.lock = threading.RLock()  # the standby's state: the core's model, the pair's messages taken
        self.wanted = 0  # the event loop's calls waiting for the lock (the thread takes no record meanwhile)
        self.policy: str | None = None  # the reader thread's scheduling (idle())
        self.thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._loop = None

    def start(self, shm_dir: str | None, loop) -> None:
        """Logs go into ``shm_dir`` if it is a directory (the logs of a standby killed there unlinked); the reader
        thread starts with the first log (it tells ``loop``'s thread of each record taken): a PS that never had one
        (a primary) has no thread in ``SCHED_IDLE`` (on a saturated host such a thread holds back its process's
        exit)."""
        if shm_dir and os.path.isdir(shm_dir) and ring.USABLE:
            self.log_dir = shm_dir
            ring.sweep(shm_dir)  # the logs of a standby killed here
        self._loop = loop
        self._thread_for_log()

    def _thread_for_log(self) -> None:
        if self.log is not None and self.thread is None and self._loop is not None:
            self.thread = threading.Thread(target=self._run, name="standby-reader", daemon=True)
            self.thread.start()

    def close(self) -> threading.Thread | None:
        """Stop the thread (joined by the caller, off the event loop) and drop the log."""
        self._stop.set()
        with self.held():
            self.drop_log()
        return self.thread

    @contextlib.contextmanager
    def held(self):
        """The standby's state to this caller alone (the event loop's calls: the thread takes no next record)."""
        if threading.current_thread() is self.thread:
            with self.lock:
                yield
            return
        self.wanted += 1
        try:
            if not self.lock.acquire(blocking=False):  # the thread is applying a record: wait for it (``wait_s``)
                t = time.perf_counter()
                self.lock.acquire()
                self.pair.costs["wait_s"] += time.perf_counter() - t
            try:
                yield
            finally:
                self.lock.release()
        finally:
            self.wanted -= 1

    def drain(self, now: float, most: int | None = None) -> int:
        """Take and apply the records committed in the log after the last message taken, in order (at most ``most``);
        how many. A record that does not apply (it cannot, for a primary's of this model) closes the log: this PS is
        no longer ``synced`` and the primary sends the state again."""
        p, n = self.pair, 0
        with self.held():
            while self.log is not None and p.role != "primary" and not p.restarted and n != most:
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

    def _run(self) -> None:
        """The reader thread: a record at a time while they come (none while the event loop waits for the lock), else
        a look every :data:`READ_EVERY_SECONDS`, backing off to 4 times that."""
        self.policy = idle()
        log.info("hot standby: the log's records are applied by a thread of scheduling %s", self.policy)
        pause, clock = READ_EVERY_SECONDS, self.pair.rt.clock
        while not self._stop.is_set():
            found = 0
            if self.log is not None and not self.wanted:
                try:
                    found = self.drain(clock(), most=1)
                except Exception:  # never let the reader die
                    log.exception("hot standby: reading the log failed")
            if found:  # the event loop's observers (which hold the state) before the next record: no wait for it there
                told = threading.Event()
                self._loop.call_soon_threadsafe(self._told, told)
                told.wait(4 * READ_EVERY_SECONDS)
                pause = READ_EVERY_SECONDS
                continue
            self._stop.wait(pause if self.log is not None else 0.05)
            pause = min(4 * READ_EVERY_SECONDS, pause * 2)

    def _told(self, told: threading.Event) -> None:
        try:
            self.pair.rt.notify()
        finally:
            told.set()

    def last_records(self, term: int) -> None:
        """Taking over with ``term``: the log closed (a record committed after this is refused by its writer), then
        every record committed before taken; a record that does not apply: not ``synced`` (no takeover)."""
        p = self.pair
        with self.held():
            if self.log is None:
                return
            self.log.close_for(term)
            while (rec := self.log.record(p.applied + 1, p.term)) is not None:
                try:
                    p.settle()
                    p.take(p.applied + 1, rec[0], rec[1])
                    p.costs["logged"] += 1
                except ProtocolError as exc:
                    log.warning("hot standby: record %d of the log refused at takeover (%s)", p.applied + 1, exc)
                    p.synced = False
                    break
            p.settle()
            self.drop_log()

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
        self._thread_for_log()

    def drop_log(self) -> None:
        if self.log is not None:
            if not self.log.closed:  # (a takeover closed it with its new term)
                self.log.close_for(max(self.pair.term, 1))
            self.log.remove()
            self.log = None

    def advert(self) -> dict | None:
        return None if self.log is None else self.log.advert()
