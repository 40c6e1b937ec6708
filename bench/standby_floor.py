"""``python -m bench.standby_floor [--params 1000000] [--workers 4] [--reps 200]``: the least CPU a step a same-host
hot standby can cost (issue 51): it must apply the optimizer step itself. Times in a tight loop on this machine
(process CPU time, median of ``--reps``), for ``bench.task``'s model and optimizer (the linear task's ``w`` and ``b``,
SGD on the mean of ``--workers`` gradients):

- ``apply_hot_ms``: the optimizer step alone (``ParameterServerCore.apply_round``, the standby's apply) on a sum just
  written by this process (in its cache); ``apply_cold_ms``: on one written :data:`COLD_RECORDS` sums ago (from
  memory, as a record the primary wrote on the other core may be);
- ``take_ms``: one log record read and checked (``Pair.apply``: decode, model check; its step pending);
- ``record_ms``: one committed record of a real same-host log (ps_service/standby/ring.py) taken and applied by the
  standby's own path (``Pair.apply`` then ``settle``, ``applied`` written); the primary's commit not counted.

A JSON line per figure (``--json``), each with ``machine`` and ``load_1min``. With ``J`` the job's CPU a step alone
(the PS and the workers: ``bench.run``'s ``ps_cpu_s`` and ``workers_cpu_s`` over its steps) on cores it saturates, a
standby that adds ``S`` ms of CPU a step costs at least ``S / (J + S)`` of the steps/s.
"""
from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from types import SimpleNamespace

import numpy as np

from bench import output, table
from bench.task import BenchLinearTask
from ps_service.core import ParameterServerCore
from ps_service.core.config import CoreConfig
from ps_service.settings import PSSettings
from ps_service.standby import Pair, messages, ring
from shared.protocol import ModelInit

#: sums written between one and its apply for ``apply_cold_ms`` (8 x 4 MB at 1e6: past the last-level cache)
COLD_RECORDS = 8


def _core(task: BenchLinearTask) -> ParameterServerCore:
    core = ParameterServerCore(CoreConfig.from_settings(PSSettings(min_workers=1)))
    core.init_model(ModelInit(task.init_params(), task.optimizer()), 0.0)
    core.follow()
    return core


def _apply_ms(core, total: dict, workers: int, reps: int, lag: int) -> float:
    """Median CPU ms of ``apply_round`` on a copy of ``total`` written ``lag`` copies before (it consumes it)."""
    ring_ = [{k: v.copy() for k, v in total.items()} for _ in range(lag)]
    times = []
    for _ in range(reps):
        ring_.append({k: v.copy() for k, v in total.items()})
        g = ring_.pop(0)
        t = time.process_time()
        core.apply_round(g, workers, workers)
        times.append(time.process_time() - t)
    return statistics.median(times) * 1e3


def _log_path_ms(task: BenchLinearTask, total: dict, workers: int, reps: int) -> tuple[float, float]:
    """(take, take and apply): a standby ``Pair`` reading records committed in its own log."""
    with tempfile.TemporaryDirectory(dir="/dev/shm" if os.path.isdir("/dev/shm") else None) as d:
        pair = Pair(PSSettings(role="standby", peer_url="http://peer:8000"), _core(task))
        pair.rt = SimpleNamespace(now=lambda: 0.0, notify=lambda: None, abort_waits=lambda: None)
        pair.reader.log_dir = d
        pair.adopt(1, 0, pair.core.export_state(), 0, 0.0)
        w = ring.LogWriter.open(d, pair.answer()["log"])
        takes, records = [], []
        try:
            for _ in range(reps):
                seq = pair.applied + 1
                msg = messages.encode_step(pair.core.global_step, total, workers, workers, {})
                w.commit(seq, 1, True, len(messages.copied([msg], w.begin(seq))))
                t = time.process_time()
                pair.apply(1, seq, True, pair.reader.log.record(seq, 1)[1], 0.0)
                takes.append(time.process_time() - t)
                pair.settle()
                records.append(time.process_time() - t)
        finally:
            w.release()
            pair.reader.drop_log()
    return statistics.median(takes) * 1e3, statistics.median(records) * 1e3


def measure(params: int, workers: int, reps: int) -> list[dict]:
    task = BenchLinearTask(params)
    rng = np.random.default_rng(0)
    total = {k: (1e-3 * rng.standard_normal(v.shape)).astype(v.dtype) for k, v in task.init_params().items()}
    core = _core(task)
    figures = {"apply_hot_ms": _apply_ms(core, total, workers, reps, 0),
               "apply_cold_ms": _apply_ms(core, total, workers, reps, COLD_RECORDS)}
    figures["take_ms"], figures["record_ms"] = _log_path_ms(task, total, workers, reps)
    load, machine = os.getloadavg()[0], table.machine()
    return [{"figure": k, "ms": round(v, 4), "params": sum(a.size for a in total.values()), "workers": workers,
             "optimizer": task.optimizer()["name"], "reps": reps, "machine": machine, "load_1min": round(load, 2)}
            for k, v in figures.items()]


def main() -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.standby_floor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--params", type=int, default=1_000_000, help="the model's parameters (bench.task's linear task)")
    ap.add_argument("--workers", type=int, default=4, help="the round's gradients: the mean's n")
    ap.add_argument("--reps", type=int, default=200, help="timed repetitions of each figure (their median)")
    output.add_json_option(ap)
    args = ap.parse_args()
    with output.Results(args.json) as results:
        for line in measure(args.params, args.workers, args.reps):
            results.add(line)


if __name__ == "__main__":
    main()
