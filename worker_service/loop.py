"""The worker's training loop: register, (initialise), then pull -> compute -> push until done.

Contract:
- The first worker to find the PS empty initialises it with the task's weights and optimizer; the others pull.
- Each step's shard is the worker's position among the pull's ``ranks`` out of their count; a pull whose ranks do not
  hold this worker (it joined mid-round) is skipped to the next step. A heartbeat thread keeps the lease.
- While a push and its round are out, the next step's batch is drawn in a thread (:mod:`worker_service.prefetch`).
- A 404/409 from the PS (:data:`REJOIN_CODES`: it restarted, or the lease expired) means register again and carry on
  from the PS's step.
- The first weights pulled after each registration must be the task's model (tensor names, shapes and dtypes), else
  :class:`WrongModel` (retrying cannot help), before any gradient is computed or the weights evaluated.
- ``stop`` (SIGTERM; a ``StopFlag``, which a signal handler may set) ends the loop between two calls; the worker then
  leaves the cluster. Returns a summary (its metrics: of the last weights pulled, or those the last push brought back).
- A step's weights are let go before its push, so the answer's weight delta is written into the transport's copy in
  place, not into a copy.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Mapping

import numpy as np

from shared.errors import ProtocolError
from shared.rawhttp import StaleConnection
from worker_service.client import PSClient
from worker_service.prefetch import BatchAhead
from worker_service.progress import ProgressLog
from worker_service.stopping import StopFlag
from worker_service.tasks import Task, optimizer_for, writes_into

log = logging.getLogger("worker")
#: PS answers that mean "register again and carry on" (it restarted, or our lease expired; shard_behind: a
#: shard of a sharded PS restarted and the job goes back to a checkpoint; not_held: a follower answered the hold late
#: as the worker joined a stuck round again, docs/protocol-shards.md: the step is redone from its pull)
REJOIN_CODES = frozenset({"unknown_worker", "not_active", "not_initialized", "not_started", "shard_behind",
                          "not_held"})


class WrongModel(RuntimeError):
    """The PS holds another model than this worker's task computes gradients for."""


def model_layout(tensors: Mapping[str, np.ndarray]) -> dict[str, str]:
    """Each tensor's shape and dtype, as text: ``"(3, 2) float32"``."""
    return {k: f"{tuple(np.shape(v))} {np.asarray(v).dtype}" for k, v in tensors.items()}


def check_model(pulled: Mapping[str, np.ndarray], expected: Mapping[str, str]) -> None:
    """Raise :class:`WrongModel` unless ``pulled`` has exactly the tensor names, shapes and dtypes of ``expected``
    (:func:`model_layout`)."""
    got = model_layout(pulled)
    if got == expected:
        return
    missing, extra = sorted(expected.keys() - got.keys()), sorted(got.keys() - expected.keys())
    other = sorted(f"{k} {got[k]} (the task's: {expected[k]})" for k in expected.keys() & got.keys()
                   if got[k] != expected[k])
    raise WrongModel(
        "the PS's model is not this task's model (tensors missing: %s; not the task's: %s; other shapes or "
        "dtypes: %s). The PS was initialised, or restored from its checkpoint, for another model (another "
        "WORKER_TASK or WORKER_DTYPE?): start the job afresh with no checkpoint (Docker Compose: `docker compose "
        "down -v` deletes the checkpoints volume), or run the task that model belongs to."
        % (missing[:5] or "none", extra[:5] or "none", other[:3] or "none"))


def pull_wait(lease: float) -> float:
    """How long a pull waits for its round: half the ``lease``, 0.5 to 10 s (the PS holds the lease meanwhile)."""
    return max(0.5, min(10.0, float(lease) / 2))


@dataclass
class Summary:
    name: str = ""
    rank: int = -1
    steps: int = 0
    statuses: dict[str, int] = field(default_factory=dict)
    final_step: int = 0
    done: bool = False
    last_loss: float | None = None
    metrics: dict[str, float] = field(default_factory=dict)
    prefetched: dict[str, int] = field(default_factory=dict)  # next batches drawn ahead: used, dropped (guess wrong)


class Heartbeat(threading.Thread):
    """Renews the lease (own client and kept-alive connection) whenever ``period`` s passed without a renewal by the
    main loop (``renewed()``: :attr:`PSClient.lease_renewed`), so a worker whose steps are shorter than ``period`` sends
    none; one that waits longer for a slow round beats on, so the PS hears it (docs/protocol.md). A kept connection
    the PS had closed (:class:`~shared.rawhttp.StaleConnection`) is tried once more on a new one, not a failure."""

    def __init__(self, base_url: str, worker_id: str, period: float, timeout: float, token=None,
                 renewed: Callable[[], float] = lambda: float("-inf")) -> None:
        super().__init__(daemon=True, name="heartbeat")
        self.client = PSClient(base_url, timeout=timeout, attempts=1, token=token)
        self.worker_id = worker_id
        self.period = period
        self.renewed = renewed
        self.halt = threading.Event()
        self.sent = self.failed = self.failed_in_a_row = 0
        self.stale = 0  # kept connections the PS had closed (each heartbeat then sent again on a new one)

    @classmethod
    def of(cls, client: PSClient, worker_id: str, lease: float) -> "Heartbeat":
        """``client``'s worker's heartbeat, started: one every third of the ``lease`` without a renewal."""
        hb = cls(client.ps_url, worker_id, max(0.2, lease / 3), client.timeout, client.token,
                 lambda: client.lease_renewed)
        hb.start()
        return hb

    def run(self) -> None:
        last = time.monotonic()
        while not self.halt.wait(max(0.0, last + self.period - time.monotonic())):
            last = max(last, self.renewed())
            if time.monotonic() - last < self.period:
                continue  # the main loop renewed the lease meanwhile: wait a period from then
            last = time.monotonic()
            try:
                self.beat()
                self.sent += 1
                self.failed_in_a_row = 0
            except Exception as exc:  # the main loop notices real trouble on its next call
                self.failed += 1
                self.failed_in_a_row += 1
                # said at warning level: a lease that runs out while the worker computes begins here
                log.warning("heartbeat failed (%d in a row; the lease runs out if none gets through): %s: %s",
                            self.failed_in_a_row, type(exc).__name__, exc)
        self.client.close()

    def beat(self) -> None:
        """One heartbeat on the kept connection; once more on a new one if the PS had closed that."""
        try:
            self.client.heartbeat(self.worker_id)
        except StaleConnection:
            self.stale += 1
            self.client.heartbeat(self.worker_id)


def train(client: PSClient, task: Task, name: str, batch_size: int, stop: StopFlag | threading.Event | None = None,
          log_every: float = 5.0, compute_delay: float = 0.0, prefetch: bool = True) -> Summary:
    stop = stop if stop is not None else StopFlag()
    summary = Summary(name=name)
    initial = task.init_params()
    expected = model_layout(initial)
    reg = client.join(name, lambda mode: (initial, optimizer_for(task, mode)))
    del initial
    worker_id, rank, step = reg["worker_id"], reg["rank"], reg["start_step"]
    summary.rank = rank
    wait = pull_wait(reg["lease_seconds"])
    hb = Heartbeat.of(client, worker_id, reg["lease_seconds"])
    log.info("registered as %r: rank %d, worker_id %s, starting at step %d", name, rank, worker_id, step)
    times = {"fetch": 0.0, "compute": 0.0, "push": 0.0}
    progress = ProgressLog(log, log_every)
    into_buffers = writes_into(task)
    ahead = BatchAhead(task, batch_size, prefetch)
    params = None
    checked = False  # the pulled model is the task's: checked once after each registration
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                pulled = client.pull(step, worker_id, wait)
                if pulled is None:
                    continue
                if not checked:
                    check_model(pulled.tensors, expected)
                    checked = True
                params = pulled.tensors
                summary.final_step = pulled.step
                if pulled.done:
                    summary.done = True
                    break
                if summary.rank not in pulled.ranks:
                    step = pulled.step + 1  # not in this round (joined mid-round): wait for the next
                    continue
                t1 = time.monotonic()
                place = (pulled.ranks.index(summary.rank), len(pulled.ranks))
                batch = ahead.get(pulled.step, *place)
                into = client.tensors.gradient_buffers() if into_buffers else None  # the same-host file: no copy
                loss, grads, n = (task.loss_and_grads(pulled.tensors, batch) if into is None
                                  else task.loss_and_grads(pulled.tensors, batch, out=into))
                if compute_delay > 0:
                    stop.wait(compute_delay)  # WORKER_COMPUTE_DELAY_SECONDS: a deliberately slow worker
                t2 = time.monotonic()
                times = {"fetch": t1 - t0, "compute": t2 - t1, "push": times["push"]}  # push: the previous one's
                this, params, pulled = pulled.step, None, None  # let go before the push (the module docstring)
                # the next batch, drawn while this push and its round are out
                res = client.push(worker_id, this, grads, loss, n, times,
                                  on_way=lambda s=this + 1, at=place: ahead.ahead(s, *at))
            except ProtocolError as exc:
                if exc.code not in REJOIN_CODES:
                    raise
                log.warning("PS says %s (%s): registering again", exc.code, exc.detail)
                reg = client.join(name, lambda mode: (task.init_params(), optimizer_for(task, mode)))
                # a PS restarted from a checkpoint is behind: step - global_step rounds are redone
                log.warning("registered again as rank %d: the PS is at step %d, this worker was at step %d, resuming "
                            "at %d", reg["rank"], reg["global_step"], step, reg["start_step"])
                worker_id, step, summary.rank = reg["worker_id"], reg["start_step"], reg["rank"]
                checked = False
                hb.worker_id = worker_id
                continue
            t3 = time.monotonic()
            times["push"] = t3 - t2
            summary.last_loss = loss
            step = this + 1
            progress.pushed(this, loss, times, res["status"])
    finally:
        hb.halt.set()
        if stop.is_set():
            log.info("stop requested (SIGTERM or SIGINT): leaving the cluster")
        try:
            client.leave(worker_id)
        except Exception as exc:
            log.warning("could not leave the cluster: %s", exc)
        ahead.close()  # after leaving: a batch still being drawn delays this process's end, not the barrier
        summary.prefetched = {"used": ahead.used, "dropped": ahead.dropped}
        summary.steps, summary.statuses = progress.pushes, dict(progress.statuses)  # (counted once, there)
    if params is None and client.prefetched is not None:  # stopped after a push: the weights it brought back
        params = client.prefetched.tensors
    if params is not None:
        summary.metrics = task.evaluate(params)
    progress.final(summary.done, summary.final_step, summary.last_loss, summary.metrics)
    return summary

