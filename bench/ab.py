"""``python -m bench.ab BEFORE AFTER``: two checkouts side by side in one pass, runs alternating.

How the data-path issue's "no worse than before" was measured
(bench/results/2026-12-01-issue-11-seventh-session-every-cell-five-runs-a-side.jsonl).
BEFORE and AFTER are source trees of syncps (e.g. ``git archive REV | tar -C DIR -xf -``), each run with this
interpreter from its own directory: ``python -m bench.run --workers N --params P --seconds S`` (plus
``--transport http`` for the TCP cells), ``--runs`` times a side per cell, before and after alternating so that
the machine's drift hits both (each tree's ``bench.run`` prints JSON lines: ``SYNCPS_BENCH_JSON=1``, which a tree
older than that option ignores). With ``--json`` it prints each run's JSON line (with ``tree``, ``ps_ms`` and
``workers_ms``: CPU milliseconds per step, when the tree's ``bench.run`` reports them) and, per cell and tree, a
``summary`` line: the median steps/s, its min and max, and the medians of the CPU per step (and of ``cpu_busy``,
when the tree's ``bench.run`` reports it); each line names its ``side`` (``before``, ``after``). Without it, a table
of the summaries. Cells: ``--cells`` as ``transport:params:workers``, then optionally a compression (``--compression``
of ``bench.run``), ``S`` with a number of PS shards (``--shards``), ``R`` with a fixed R (backup workers: the PS's
``PS_REPLICAS_TO_AGGREGATE``, e.g. ``shm:10000000:6:R4``) and ``standby`` (a hot-standby pair:
``--standby``) and ``pin`` (the job on every CPU but the last, a standby on the last alone: ``--pin``), e.g.
``http:10000000:2:S2``, ``shm:1000000:4:standby``, ``shm:1000000:4:standby:pin`` against ``shm:1000000:4:pin``
(default: the eight of ``make bench`` at 1e6
and 1e7, uncompressed, one PS); ``--interleave`` runs the cells in turn (each round every cell, both trees), so that
a cell and its baseline share the machine's drift. Each run's line has ``load_1min`` (as it ended) and ``machine``.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from bench import output, table

SUMMARY_COLUMNS = ["summary", "side", "runs", "failed", "median", "min", "max", "ps_ms", "workers_ms"]
DEFAULT_CELLS = [f"{t}:{p}:{n}" for p in (1_000_000, 10_000_000) for n in (2, 4) for t in ("shm", "http")]


def one_run(tree: str, transport: str, params: int, workers: int, seconds: float, warmup: float = 2.0,
            compression: str = "none", shards: int = 1, standby: bool = False, pin: bool = False,
            replicas: int | None = None) -> dict:
    cmd = [sys.executable, "-m", "bench.run", "--workers", str(workers), "--params", str(params),
           "--seconds", str(seconds), "--warmup", str(warmup)]
    cmd += ["--transport", "http"] if transport == "http" else []
    cmd += ["--compression", compression] if compression != "none" else []
    cmd += ["--shards", str(shards)] if shards > 1 else []
    cmd += ["--standby"] if standby else []
    cmd += ["--pin"] if pin else []
    try:
        out = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, timeout=seconds + 300,
                             env={**os.environ, output.ENV: "1",
                                  **({"PS_REPLICAS_TO_AGGREGATE": str(replicas)} if replicas else {})})
        lines = [json.loads(x) for x in out.stdout.splitlines() if x.startswith("{")]
    except subprocess.TimeoutExpired:
        lines = []
    d = lines[-1] if lines else {"error": "no output"}
    d["tree"] = tree
    d["cell"] = (f"{transport}:{params}:{workers}" + (f":{compression}" if compression != "none" else "")
                 + (f":S{shards}" if shards > 1 else "") + (":standby" if standby else "") + (":pin" if pin else "")
                 + (f":R{replicas}" if replicas else ""))
    steps = d.get("steps_per_s", 0) * d.get("window_s", 0)
    for key, name in (("ps_cpu_s", "ps_ms"), ("workers_cpu_s", "workers_ms")):
        if steps and key in d:
            d[name] = round(d[key] / steps * 1e3, 2)
    return d


def summary(cell: str, tree: str, runs: list[dict]) -> dict:
    rates = [r["steps_per_s"] for r in runs if "steps_per_s" in r]
    out = {"summary": cell, "tree": tree, "runs": len(runs), "failed": len(runs) - len(rates)}
    loads = [r["load_avg"] for r in runs if "load_avg" in r]
    out.update(machine=table.machine(), load=f"load average {min(loads):.1f}-{max(loads):.1f}" if loads else "unknown")
    if rates:
        out.update(median=statistics.median(rates), min=min(rates), max=max(rates))
    for name in ("ps_ms", "workers_ms", "cpu_busy"):
        values = [r[name] for r in runs if name in r]
        if values:
            out[name] = statistics.median(values)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.ab", description=__doc__.split("\n\n")[0])
    ap.add_argument("before", help="the source tree measured first in each pair (a directory)")
    ap.add_argument("after", help="the source tree measured second in each pair (a directory)")
    ap.add_argument("--runs", type=int, default=5, help="runs a side per cell")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds of each run (bench.run --seconds)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of training before each run's window")
    ap.add_argument("--cells", default=",".join(DEFAULT_CELLS),
                    help="transport:params:workers[:compression][:S<shards>][:R<replicas>][:standby][:pin],... "
                         "(R: PS_REPLICAS_TO_AGGREGATE, backup workers; pin: bench.run "
                         "--pin, the job on every CPU but the last, a standby on the last alone)")
    ap.add_argument("--interleave", action="store_true",
                    help="each round runs every cell once a side (a cost measured against its baseline cell in the "
                         "same round, e.g. shm:1000000:4:standby,shm:1000000:4)")
    output.add_json_option(ap)
    args = ap.parse_args(argv)
    trees = [os.path.abspath(args.before), os.path.abspath(args.after)]
    with output.Results(args.json, SUMMARY_COLUMNS, ap.prog) as summaries:
        failed = sum(run_cells(args, trees, summaries))
    return 1 if failed else 0


def run_cells(args: argparse.Namespace, trees: list[str], summaries: output.Results):
    """Each cell's runs (JSON lines with --json), then its two summaries; yields the failed runs of each. With
    ``--interleave`` each round runs every cell once a side, the summaries come at the end."""
    cells = args.cells.split(",")
    results = {cell: [[], []] for cell in cells}
    if args.interleave:
        for _ in range(args.runs):
            for cell in cells:
                _pair(args, trees, cell, results[cell])
    for cell in cells:
        for _ in range(0 if args.interleave else args.runs):
            _pair(args, trees, cell, results[cell])
        for side, tree in enumerate(trees):
            s = {**summary(cell, tree, results[cell][side]), "side": ("before", "after")[side]}
            summaries.add(s)
            yield s["failed"]


def _pair(args: argparse.Namespace, trees: list[str], cell: str, results: list[list[dict]]) -> None:
    """One run of ``cell`` a side, before then after, each line with the load as it ended and the machine."""
    from bench.table import machine
    transport, params, workers, *extra = cell.split(":")
    options = dict((x, True) if x in ("standby", "pin") else ("shards", int(x[1:])) if x.startswith("S")
                   else ("replicas", int(x[1:])) if x.startswith("R") else ("compression", x) for x in extra)
    for side, tree in enumerate(trees):
        d = one_run(tree, transport, int(params), int(workers), args.seconds, args.warmup, **options)
        d["side"], d["at"] = ("before", "after")[side], time.strftime("%H:%M:%S", time.gmtime())
        d["load_1min"], d["machine"] = round(os.getloadavg()[0], 2), machine()
        results[side].append(d)
        if args.json:
            print(json.dumps(d), flush=True)


if __name__ == "__main__":
    sys.exit(main())
