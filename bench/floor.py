"""``python -m bench.floor [--workers 2 4] [--params 1e6 1e7]``: the best steps/s this machine allows a synchronous
PS, and a ring all-reduce, when every tensor byte crosses loopback TCP: a table row (``--json``: a JSON line) per
cell.

On one host a byte through loopback TCP costs only CPU (a copy into the kernel at the sender, one out of it at
the receiver, and the TCP work between). So the TCP column of ``make bench`` is a CPU budget, and this module
measures its three parts on this machine, then adds them up for the two designs:

- ``c``: one worker's compute per step (``bench.task``'s workload: batch, forward, gradient; one BLAS thread),
  alone on the machine, median of ``--steps``;
- ``k``: loopback TCP CPU per byte, sender and receiver together (:func:`bench.loopback.stream`: one stream, one
  message of the cell's gradient size M at a time, their ``getrusage`` over ``--bytes``);
- the arithmetic per step, timed with numpy on arrays of size M: a PS sums N gradients ((N-1) adds of M),
  takes the mean and applies SGD once (divide, multiply, subtract) and, as syncps does, checks each push for
  NaN/Inf (one ``dot`` each); a ring's ranks add (N-1) chunks of M/N each and every rank applies SGD to all M.

Bytes per step: a PS receives N gradients and sends N weights answers, 2NM; a ring all-reduce (reduce-scatter,
then all-gather) moves 2(N-1)/N M out of each of the N ranks, 2(N-1)M in all. Neither overlaps its exchange
with compute (the step's gradient needs the step's weights; the anchor ``torch_allreduce.py`` reduces after the
whole backward pass), so with C cores a step takes at least

    T = c * max(1, N/C) + (k * bytes + arithmetic) / C

the exchange spread perfectly over every core, no interpreter, no HTTP, no waiting: a floor no implementation
reaches, and the same idealisation for both designs. Fields: ``ps_floor_steps_per_s`` (with syncps's NaN/Inf
checks), ``ps_floor_unchecked_steps_per_s``, ``ring_floor_steps_per_s``, ``ps_over_ring`` (below 1: no PS, whatever its
code, beats an ideal ring here; it beats a real one, gloo, only by running closer to its own floor than that ring
does to its), ``compute_only_steps_per_s`` (``1 / (c * max(1, N/C))``: one worker's compute alone, so faster than
``compute_ceiling.py``'s N processes sharing the memory bus at 1e7), ``ps_floor_over_compute`` (against that), and
the measured parts (``compute_ms``, ``tcp_ns_per_byte``, ``ps_arith_ms``, ``ring_arith_ms``). Between hosts the budget is the links, not CPU:
bench/results/2026-11-30-between-hosts-emulated-links.jsonl.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")  # as the workers and the anchors run

import numpy as np  # noqa: E402

from bench import loopback  # noqa: E402
from bench.output import Results, add_json_option  # noqa: E402
from bench.task import BenchLinearTask, actual_params  # noqa: E402

#: the table's columns (--json: every field)
COLUMNS = ["workers", "params", "compute_ms", "tcp_ns_per_byte", "ps_floor_steps_per_s", "ring_floor_steps_per_s",
           "ps_over_ring", "compute_only_steps_per_s", "load_avg"]


def tcp_ns_per_byte(message: int, total: int) -> dict:
    """CPU nanoseconds per byte of one loopback stream (sender + receiver), messages of ``message`` bytes."""
    s = loopback.stream(max(total, 4 * message), message)
    return {"ns_per_byte": (s["sender_cpu_s"] + s["receiver_cpu_s"]) / s["bytes"] * 1e9,
            "sender_ns_per_byte": s["sender_cpu_s"] / s["bytes"] * 1e9,
            "receiver_ns_per_byte": s["receiver_cpu_s"] / s["bytes"] * 1e9, "GB_per_s": s["bytes"] / s["seconds"] / 1e9}


def _median_s(fn, reps: int) -> float:
    fn()  # warm: page faults, BLAS set-up
    times = []
    for _ in range(reps):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def compute_s(params: int, reps: int) -> float:
    """One worker's compute per step, as the workers run it (batch, forward, gradient into reused buffers)."""
    task = BenchLinearTask(params)
    weights = task.init_params()
    step = [0]

    def one() -> None:
        step[0] += 1
        task.loss_and_grads(weights, task.batch(step[0], 0, 1, 32))
    return _median_s(one, reps)


def arithmetic_s(params: int, workers: int, reps: int) -> dict:
    """Seconds of each design's per-step arithmetic on this machine, timed on arrays of the cell's size."""
    m = actual_params(params)
    g = np.random.default_rng(0).standard_normal(m).astype(np.float32)
    acc, w = g.copy(), np.zeros(m, np.float32)
    part = acc[: max(1, m // workers)]
    add = _median_s(lambda: np.add(acc, g, out=acc), reps)
    dot = _median_s(lambda: float(np.dot(g, g)), reps)
    chunk_add = _median_s(lambda: np.add(part, g[: part.size], out=part), reps)

    def sgd() -> None:  # divide, multiply, subtract; multiplied back by N so that repetitions never reach denormals
        np.divide(acc, np.float32(workers), out=acc)
        np.multiply(acc, np.float32(workers), out=acc)
        np.subtract(w, acc, out=w)
    sgd_s = _median_s(sgd, reps)
    return {"ps_unchecked": (workers - 1) * add + sgd_s, "checks": workers * dot,
            "ring": workers * ((workers - 1) * chunk_add + sgd_s)}


def floor(workers: int, params: int, cores: int, c: float, k: float, arith: dict) -> dict:
    m_bytes = 4 * actual_params(params)
    c_wall = c * max(1.0, workers / cores)

    def steps_per_s(nbytes: float, arithmetic: float) -> float:
        return 1.0 / (c_wall + (k * 1e-9 * nbytes + arithmetic) / cores)

    ps = steps_per_s(2 * workers * m_bytes, arith["ps_unchecked"] + arith["checks"])
    ring = steps_per_s(2 * (workers - 1) * m_bytes, arith["ring"])
    return {"ps_floor_steps_per_s": round(ps, 3),
            "ps_floor_unchecked_steps_per_s": round(steps_per_s(2 * workers * m_bytes, arith["ps_unchecked"]), 3),
            "ring_floor_steps_per_s": round(ring, 3), "ps_over_ring": round(ps / ring, 3),
            "compute_only_steps_per_s": round(1.0 / c_wall, 3), "ps_floor_over_compute": round(ps * c_wall, 3)}


def lines(params_list: list[int], workers_list: list[int], steps: int = 40, nbytes: int = int(4e8),
          cores: int | None = None) -> list[dict]:
    """One JSON line per (params, workers): the measured parts and both floors."""
    cores = cores or os.cpu_count() or 1
    out = []
    for params in params_list:
        c = compute_s(params, steps)
        tcp = tcp_ns_per_byte(4 * actual_params(params), nbytes)
        for workers in workers_list:
            arith = arithmetic_s(params, workers, steps)
            out.append({"system": "floor", "workers": workers, "params": actual_params(params),
                        "params_requested": params, "cores": cores, "compute_ms": round(c * 1e3, 3),
                        "tcp_ns_per_byte": round(tcp["ns_per_byte"], 4),
                        "tcp_sender_ns_per_byte": round(tcp["sender_ns_per_byte"], 4),
                        "tcp_receiver_ns_per_byte": round(tcp["receiver_ns_per_byte"], 4),
                        "tcp_GB_per_s": round(tcp["GB_per_s"], 3),
                        "ps_arith_ms": round((arith["ps_unchecked"] + arith["checks"]) * 1e3, 3),
                        "ring_arith_ms": round(arith["ring"] * 1e3, 3),
                        **floor(workers, params, cores, c, tcp["ns_per_byte"], arith),
                        "load_avg": round(os.getloadavg()[0], 2)})
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.floor", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[2, 4], help="worker counts N, a cell each")
    ap.add_argument("--params", type=float, nargs="+", default=[1e6, 1e7],
                    help="model sizes M (parameters), a cell each")
    ap.add_argument("--steps", type=int, default=40, help="repetitions of each timed piece")
    ap.add_argument("--bytes", type=float, default=4e8, help="bytes streamed per TCP measurement")
    ap.add_argument("--cores", type=int, default=os.cpu_count() or 1,
                    help="C, the cores the floor spreads the work over (default: this machine's)")
    add_json_option(ap)
    args = ap.parse_args(argv)
    with Results(args.json, COLUMNS, ap.prog) as out:
        for line in lines([int(p) for p in args.params], args.workers, args.steps, int(args.bytes), args.cores):
            out.add(line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
