"""``python -m bench.prefetch``: what drawing the next batch during the round (``WORKER_PREFETCH``) is worth when data
costs time to load.

The benchmark's task (:mod:`bench.task`) whose ``batch`` also waits ``L`` ms, standing for data read from storage or
the network (the wait holds neither the CPU nor the GIL, as a read does): ``WORKER_TASK=bench.prefetch:load_<L>_params_<P>``.
For each ``L`` the same cluster runs with ``WORKER_PREFETCH=0`` and ``1``, alternating run by run (``--repeat``
passes), every tensor over loopback TCP; a table row (``--json``: a JSON line) a run (:func:`bench.run.measure`'s,
with ``load_ms`` and ``prefetch``). Without prefetching a step pays ``L``; with it, ``L`` is spent while the push and
its round are out.
"""
from __future__ import annotations

import argparse
import re
import time
from typing import Callable

from bench.output import Results, add_json_option
from bench.task import BenchLinearTask

#: the table's columns (--json: bench.run's every field)
COLUMNS = ["load_ms", "prefetch", "workers", "params", "steps_per_s", "cpu_busy", "load_avg"]

_NAME = re.compile(r"load_(\d+)_params_(\d+)")


class LoadingTask(BenchLinearTask):
    """:class:`bench.task.BenchLinearTask` whose ``batch`` also waits ``load_ms`` (a read from storage)."""

    def __init__(self, params: int, load_ms: int, seed: int = 0, dtype: str = "float32") -> None:
        super().__init__(params, seed, dtype)
        self.name, self.load_seconds = f"bench-linear-{params}-load-{load_ms}ms", load_ms / 1000

    def batch(self, step: int, shard_index: int, shard_count: int, batch_size: int):
        time.sleep(self.load_seconds)
        return super().batch(step, shard_index, shard_count, batch_size)


def __getattr__(name: str) -> Callable[..., LoadingTask]:
    """``load_<L>_params_<P>`` -> a task factory (what ``WORKER_TASK`` names)."""
    m = _NAME.fullmatch(name)
    if m is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    load_ms, params = int(m.group(1)), int(m.group(2))
    return lambda seed=0, dtype="float32": LoadingTask(params, load_ms, seed, dtype)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.prefetch", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="worker processes")
    ap.add_argument("--params", type=float, default=1e6, help="model size (parameters)")
    ap.add_argument("--load-ms", default="0,10",
                    help="comma list of L, the milliseconds each batch waits (data loading)")
    ap.add_argument("--seconds", type=float, default=6.0, help="measured seconds of each run")
    ap.add_argument("--repeat", type=int, default=2, help="passes, each running prefetch off then on")
    add_json_option(ap)
    a = ap.parse_args(argv)
    from bench.run import measure

    params = int(a.params)
    with Results(a.json, COLUMNS, ap.prog) as out:
        for _ in range(a.repeat):
            for load_ms in (int(v) for v in a.load_ms.split(",")):
                for prefetch in (0, 1):
                    env = {"WORKER_TASK": f"bench.prefetch:load_{load_ms}_params_{params}", "WORKER_PREFETCH": prefetch}
                    line = measure(a.workers, params, a.seconds, transport="http", worker_env=env)
                    out.add({**line, "load_ms": load_ms, "prefetch": bool(prefetch)})


if __name__ == "__main__":
    main()
