"""The worker's progress log: a first line about a second into training, then one every ``every`` seconds, and a
final line.

Periodic line (INFO)::

    progress: step 120 loss 0.0123 | 41.7 rounds/s | own mean fetch 20.1 ms compute 1.2 ms push 2.0 ms | pushes 120 (accepted 120)

``rounds/s`` is the global step's progress since the last line; the phase times are this worker's means over the same
interval (the wait at the barrier is in fetch or push). The first line comes ``first`` seconds (1 s, at most
``every``) after this worker's first push; a shorter job logs only the final line. That one starts with ``FINISHED``
(training done) or ``STOPPED`` and sums up the run: ``after`` counts from the worker's start, its ``rounds/s`` from
the answer to its first push. A worker that joined a job already done (a PS that resumed a finished job from its
checkpoint) pushed nothing: its final line says so and how to start afresh (:data:`ALREADY_DONE`).
"""
from __future__ import annotations

import logging
import time

from shared.protocol import PHASES

#: the end of the final line of a worker that trained no step: the job was done before it joined
ALREADY_DONE = (" (the job was done before this worker joined, e.g. a PS resumed from a finished job's checkpoint: "
                "a fresh job needs a PS without them, e.g. `docker compose down -v`; a higher PS_MAX_STEPS trains on)")

#: seconds from the first push to the first progress line (at most ``every``)
FIRST_LINE_SECONDS = 1.0


class ProgressLog:
    def __init__(self, log: logging.Logger, every: float, clock=time.monotonic,
                 first: float = FIRST_LINE_SECONDS) -> None:
        self.log, self.every, self.clock = log, every, clock
        self.first = min(first, every)
        self.t_start = self.t_last = clock()
        self.t_first: float | None = None  # when the first push was answered
        self.lines = 0
        self.step_start: int | None = None
        self.step_last: int | None = None
        self.pushes = 0
        self.statuses: dict[str, int] = {}
        self.sums = dict.fromkeys(PHASES, 0.0)
        self.totals = dict.fromkeys(PHASES, 0.0)
        self.n = 0

    def pushed(self, step: int, loss: float | None, times: dict[str, float], status: str) -> None:
        """Account one push of ``step``; log a line when ``every`` seconds passed since the last one."""
        if self.step_start is None:
            self.step_start = self.step_last = step
            self.t_last = self.t_first = self.clock()  # the first line's interval starts at the first push
        self.pushes += 1
        self.n += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1
        for k in PHASES:
            self.sums[k] += times[k]
            self.totals[k] += times[k]
        now = self.clock()
        if now - self.t_last < (self.every if self.lines else self.first) or step == self.step_last:
            return
        rate = (step - self.step_last) / (now - self.t_last)
        self.log.info("progress: step %d loss %s | %.1f rounds/s | own mean %s | pushes %d (%s)",
                      step, _num(loss), rate, _phases(self.sums, self.n), self.pushes, _counts(self.statuses))
        self.t_last, self.step_last, self.n = now, step, 0
        self.lines += 1
        self.sums = dict.fromkeys(PHASES, 0.0)

    def final(self, done: bool, step: int, loss: float | None, metrics: dict) -> None:
        now = self.clock()
        elapsed = now - self.t_start
        rounds = step - self.step_start if self.step_start is not None else 0
        span = now - self.t_first if self.t_first is not None else 0.0
        self.log.info("%s at global step %d after %.1f s: %d pushes (%s), %.1f rounds/s, own mean %s, "
                      "last loss %s, evaluation %s%s",
                      "FINISHED: training done" if done else "STOPPED before the end", step, elapsed, self.pushes,
                      _counts(self.statuses) or "none", rounds / span if span > 0 else 0.0,
                      _phases(self.totals, self.pushes), _num(loss),
                      ", ".join(f"{k}={_num(v)}" for k, v in metrics.items()) or "none",
                      ALREADY_DONE if done and not self.pushes else "")


def _num(x: float | None) -> str:
    return "-" if x is None else f"{x:.6g}"


def _phases(sums: dict[str, float], n: int) -> str:
    return " ".join(f"{k} {1e3 * sums[k] / max(1, n):.1f} ms" for k in PHASES)


def _counts(statuses: dict[str, int]) -> str:
    return ", ".join(f"{k} {v}" for k, v in sorted(statuses.items()))
