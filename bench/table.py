"""``python -m bench.table`` (``make bench``): our grid next to the anchors', one Markdown table.

For each cell (params x workers) of the grid, side by side in one run on this machine:
syncps (:mod:`bench.run`, ``--repeat`` runs, the median is tabled), as a local cluster runs it
(workers on the PS's host use the same-host transport) and with every tensor over TCP
(``WORKER_SHM_DIR=''``), then, when
``../shared/bench/compare.sh`` exists, TensorFlow SyncReplicasOptimizer and torch gloo
all-reduce on the same workload (its first use creates virtual environments under
``~/.cache/syncps-anchors``, about 5 minutes). Every JSON line goes to ``--out``; the table
(steps/s, ratios, the PS's peak RSS and payload rate) is printed at the end with the date,
the machine and the load average.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from bench.run import measure

ROOT = Path(__file__).resolve().parent.parent
COMPARE = ROOT.parent / "shared" / "bench" / "compare.sh"
ANCHORS = {"tf": "tf_sync_replicas", "torch": "torch_allreduce"}


def anchors(workers: int, params: int, seconds: float, systems: list[str]) -> list[dict]:
    """The anchors' lines for one cell (an ``error`` line per system that failed)."""
    env = {**os.environ, "WORKERS": str(workers), "PARAMS": str(params), "SECONDS_PER_RUN": str(seconds),
           "SYSTEMS": " ".join(systems)}
    try:
        out = subprocess.run(["bash", str(COMPARE)], env=env, capture_output=True, text=True,
                             timeout=900 * len(systems)).stdout
    except subprocess.TimeoutExpired:
        out = ""
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return lines or [{"system": ANCHORS[s], "workers": workers, "params_requested": params, "error": "no output"}
                     for s in systems]


def machine() -> str:
    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next(line.split(":", 1)[1].strip() for line in f if line.startswith("model name"))
    except (OSError, StopIteration):
        pass
    return f"{os.cpu_count()} cores, {cpu}, {platform.system()} {platform.release()}, Python {platform.python_version()}"


def median_of(lines: list[dict], key: str) -> float | None:
    values = [x[key] for x in lines if x.get(key) is not None]
    return statistics.median(values) if values else None


def fmt(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    return f"{v:,.{max(0, digits - len(str(int(abs(v)))))}f}" if abs(v) < 10 ** digits else f"{v:,.0f}"


def table(cells: list[tuple[int, int]], results: dict) -> str:
    """syncps as a local cluster runs it (same-host transport) and with every tensor over TCP, next to the anchors."""
    rows = ["| params | workers | syncps steps/s | syncps TCP steps/s | TF steps/s | torch steps/s | syncps / TF "
            "| syncps / torch | TCP / TF | TCP / torch | PS peak RSS MB (TCP) | PS payload MB/s |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for params, workers in cells:
        r = results[(params, workers)]
        ours, tcp, tf, torch = (median_of(r[k], "steps_per_s") for k in ("syncps", "syncps_tcp", "tf", "torch"))
        ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
        rss = lambda k: fmt(median_of(r[k], "peak_rss_MB"), 0)  # noqa: E731
        rows.append(f"| {params:,} | {workers} | {fmt(ours)} | {fmt(tcp)} | {fmt(tf)} | {fmt(torch)} "
                    f"| {ratio(ours, tf)} | {ratio(ours, torch)} | {ratio(tcp, tf)} | {ratio(tcp, torch)} "
                    f"| {rss('syncps')} ({rss('syncps_tcp')}) | {fmt(median_of(r['syncps'], 'tensor_MB_per_s'), 0)} |")
    return "\n".join(rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.table", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="2,4")
    ap.add_argument("--params", default="4,1000000,10000000")
    ap.add_argument("--seconds", type=float, default=5.0)
    ap.add_argument("--repeat", type=int, default=3, help="syncps runs per cell (median tabled)")
    ap.add_argument("--anchors", default="tf,torch", help="anchor systems to run ('' for none)")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "syncps-bench.jsonl"),
                    help="every JSON line, appended")
    args = ap.parse_args(argv)
    systems = [s for s in args.anchors.split(",") if s]
    if systems and not COMPARE.exists():
        print(f"[bench] {COMPARE} not found: syncps only", file=sys.stderr)
        systems = []
    cells = [(int(p), int(n)) for p in args.params.split(",") for n in args.workers.split(",")]
    results: dict = {}
    started = time.strftime("%Y-%m-%d %H:%M %Z")
    with open(args.out, "a") as out:
        def keep(line: dict) -> dict:
            out.write(json.dumps(line) + "\n")
            out.flush()
            print(json.dumps(line), file=sys.stderr, flush=True)
            return line
        for params, workers in cells:
            r = results[(params, workers)] = {"syncps": [], "syncps_tcp": [], "tf": [], "torch": []}
            for _ in range(args.repeat):
                r["syncps"].append(keep(measure(workers, params, args.seconds)))
                r["syncps_tcp"].append(keep(measure(workers, params, args.seconds, transport="http")))
            for line in anchors(workers, params, args.seconds, systems) if systems else []:
                kind = next((k for k, name in ANCHORS.items() if line.get("system") == name), None)
                if kind:
                    r[kind].append(keep(line))
    print(f"\nsyncps vs anchors, steps (rounds) per second, float32; {started}; {machine()}; "
          f"load average at the end {os.getloadavg()[0]:.2f}\n")
    print(table(cells, results))
    ok = all(median_of(results[c]["syncps"], "steps_per_s") for c in cells)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
