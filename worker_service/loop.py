"""The worker's training loop: register, (initialise), then pull -> compute -> push until done.

Contract:
- The first worker to find the PS empty initialises it with the task's weights
  and optimizer; the others get 409 and just pull.
- Each step's shard is the worker's position among the round's ranks (the
  ``ranks`` list of the pull) out of their count; a pull whose ranks do not hold
  this worker (it joined mid-round) is skipped to the next step.
- A heartbeat thread keeps the lease while the worker computes.
- A 404/409 from the PS (it restarted, or the lease expired) means register
  again and carry on from the PS's step.
- ``stop`` (SIGTERM) ends the loop between two calls; the worker then leaves the
  cluster so the barrier stops waiting for it. Returns a summary.
"""
from __future__ import annotations

import logging
import threading
import time
from dataclasses import dataclass, field

from shared.errors import ProtocolError
from worker_service.client import PSClient
from worker_service.tasks import Task

log = logging.getLogger("worker")


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


class Heartbeat(threading.Thread):
    """Renews the lease every ``period`` s (own client) until stopped."""

    def __init__(self, base_url: str, worker_id: str, period: float, timeout: float) -> None:
        super().__init__(daemon=True, name="heartbeat")
        self.client = PSClient(base_url, timeout=timeout, attempts=1)
        self.worker_id = worker_id
        self.period = period
        self.halt = threading.Event()

    def run(self) -> None:
        while not self.halt.wait(self.period):
            try:
                self.client.heartbeat(self.worker_id)
            except Exception as exc:  # the main loop notices real trouble on its next call
                log.debug("heartbeat failed: %s", exc)
        self.client.close()


def train(client: PSClient, task: Task, name: str, batch_size: int, stop: threading.Event | None = None,
          log_every: float = 5.0) -> Summary:
    stop = stop or threading.Event()
    summary = Summary(name=name)
    reg = client.register(name)
    if not reg["model_initialized"]:
        if client.init_model(task.init_params(), task.optimizer()):
            log.info("initialised the model on the PS")
    worker_id, rank, step = reg["worker_id"], reg["rank"], reg["start_step"]
    summary.rank = rank
    lease = float(reg["lease_seconds"])
    wait = max(0.5, min(10.0, lease / 2))
    hb = Heartbeat(str(client.http.base_url), worker_id, max(0.2, lease / 3), client.timeout)
    hb.start()
    log.info("registered as %r: rank %d, worker_id %s, starting at step %d", name, rank, worker_id, step)
    times = {"fetch": 0.0, "compute": 0.0, "push": 0.0}
    last_log, steps_at_log, t_start = time.monotonic(), 0, time.monotonic()
    params = None
    try:
        while not stop.is_set():
            t0 = time.monotonic()
            try:
                pulled = client.pull(step, worker_id, wait)
            except ProtocolError as exc:
                if exc.status in (404, 409) and exc.code in ("unknown_worker", "not_active", "not_initialized"):
                    reg = _rejoin(client, task, name, exc)
                    worker_id, step = reg["worker_id"], reg["start_step"]
                    hb.worker_id = worker_id
                    summary.rank = reg["rank"]
                    continue
                raise
            if pulled is None:
                continue
            params = pulled.tensors
            summary.final_step = pulled.step
            if pulled.done:
                summary.done = True
                break
            if summary.rank not in pulled.ranks:
                step = pulled.step + 1  # not in this round (joined mid-round): wait for the next
                continue
            t1 = time.monotonic()
            batch = task.batch(pulled.step, pulled.ranks.index(summary.rank), len(pulled.ranks), batch_size)
            loss, grads, n = task.loss_and_grads(pulled.tensors, batch)
            t2 = time.monotonic()
            try:
                res = client.push(worker_id, pulled.step, grads, loss, n, times)
            except ProtocolError as exc:
                if exc.status in (404, 409) and exc.code in ("unknown_worker", "not_active", "not_started"):
                    reg = _rejoin(client, task, name, exc)
                    worker_id, step = reg["worker_id"], reg["start_step"]
                    hb.worker_id = worker_id
                    summary.rank = reg["rank"]
                    continue
                raise
            t3 = time.monotonic()
            times = {"fetch": t1 - t0, "compute": t2 - t1, "push": t3 - t2}
            summary.statuses[res["status"]] = summary.statuses.get(res["status"], 0) + 1
            summary.steps += 1
            summary.last_loss = loss
            step = pulled.step + 1
            if t3 - last_log >= log_every:
                rate = (summary.steps - steps_at_log) / (t3 - last_log)
                log.info("step %d loss %.6g  %.1f steps/s  fetch %.1f ms compute %.1f ms push %.1f ms",
                         pulled.step, loss, rate, *(1e3 * times[k] for k in ("fetch", "compute", "push")))
                last_log, steps_at_log = t3, summary.steps
    finally:
        hb.halt.set()
        try:
            client.leave(worker_id)
        except Exception as exc:
            log.warning("could not leave the cluster: %s", exc)
    if params is not None:
        summary.metrics = task.evaluate(params)
    elapsed = time.monotonic() - t_start
    log.info("%s at global step %d: %d pushes %s in %.1f s, last loss %s, %s",
             "done" if summary.done else "stopped", summary.final_step, summary.steps, summary.statuses, elapsed,
             summary.last_loss, summary.metrics)
    return summary


def _rejoin(client: PSClient, task: Task, name: str, exc: ProtocolError) -> dict:
    log.warning("PS says %s (%s): registering again", exc.code, exc.detail)
    reg = client.register(name)
    if not reg["model_initialized"]:
        client.init_model(task.init_params(), task.optimizer())
    return reg
