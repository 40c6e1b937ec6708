"""``python -m bench.table`` (``make bench``): our grid next to the anchors', one Markdown table.

For each cell (params x workers) of the grid, side by side in one run on this machine:
syncps (:mod:`bench.run`, ``--repeat`` runs, the median is tabled), as a local cluster runs it
(workers on the PS's host use the same-host transport) and with every tensor over TCP
(``WORKER_SHM_DIR=''``), over TCP with two PS shards (``--shards 2``, for the cells of ``--shard-params``: the 1e7 rows by
default, as small models only lose from shards; its ratio to one PS over TCP; docs/scaling.md), over TCP with
each gradient compression of ``--compressions`` (``PS_COMPRESSION``:
a column each, steps/s and the ratio to torch gloo's float32 all-reduce), then, when
``../shared/bench/compare.sh`` exists, TensorFlow SyncReplicasOptimizer and torch gloo
all-reduce on the same workload (its first use creates virtual environments under
``~/.cache/syncps-anchors``, about 5 minutes), and, when ``../shared/bench/compute_ceiling.py`` exists, the
machine's compute-only ceiling (the same workers computing their gradients with no PS at all: no synchronous
system can beat it), with syncps's share of it. Every JSON line goes to ``--out``; the table
(steps/s, ratios, the PS's peak RSS and payload rate) is printed at the end with the date,
the machine and the load average.

Then, when torch is installed (the ``torch`` extra), the CNN task (``WORKER_TASK=cnn``: a PyTorch model
through ``syncps.torch``) for each of ``--cnn-workers``: syncps same-host and over TCP (``--repeat`` runs)
next to torch DistributedDataParallel with gloo (:mod:`bench.ddp_cnn`, ``--cnn-steps`` steps), a second table.

Last, when run as root with ``ip`` and ``tc`` (a network namespace per host), the same workload between emulated hosts
(:mod:`bench.hosts`: each host behind a ``--hosts-rate`` link, 1 Gb/s by default) for the systems of ``--hosts``
(default: syncps uncompressed with one PS and with one shard beside each worker (``syncps-colocated``), top-k over
TCP, torch gloo's float32 all-reduce, TensorFlow's SyncReplicasOptimizer with its one ps task and with a ps task beside
each worker (``tf-colocated``)) at ``--hosts-params``: a third table, steps/s and each syncps column over each anchor.
On loopback a byte costs only CPU; this is where compression and co-located shards pay.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shlex
import shutil
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
CEILING = ROOT.parent / "shared" / "bench" / "compute_ceiling.py"


def compute_only(workers: int, params: int, seconds: float) -> dict:
    """The compute-only ceiling of one cell (``../shared/bench/compute_ceiling.py``): its JSON line, or an error line."""
    try:
        out = subprocess.run([sys.executable, str(CEILING), "--workers", str(workers), "--params", str(params),
                              "--seconds", str(seconds)], cwd=CEILING.parent, capture_output=True, text=True,
                             timeout=seconds + 120).stdout
    except subprocess.TimeoutExpired:
        out = ""
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return lines[-1] if lines else {"system": "compute_only", "workers": workers, "params_requested": params,
                                    "error": "no output"}


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


def tree() -> str | None:
    """This checkout's commit (short), ``+dirty`` when it has changes; None outside git."""
    try:
        head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                              timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=ROOT,
                               capture_output=True, text=True, timeout=10).stdout.strip()
    except (OSError, subprocess.TimeoutExpired):
        return None
    return (head + ("+dirty" if dirty else "")) or None


def median_of(lines: list[dict], key: str) -> float | None:
    values = [x[key] for x in lines if x.get(key) is not None]
    return statistics.median(values) if values else None


def fmt(v: float | None, digits: int = 3) -> str:
    if v is None:
        return "-"
    return f"{v:,.{max(0, digits - len(str(int(abs(v)))))}f}" if abs(v) < 10 ** digits else f"{v:,.0f}"


def table(cells: list[tuple[int, int]], results: dict, compressions: tuple[str, ...] = ()) -> str:
    """syncps as a local cluster runs it (same-host transport) and with every tensor over TCP, next to the anchors;
    then over TCP with two shards (steps/s, and its ratio to one PS over TCP; "-" where not measured), then a
    column per compression over TCP (steps/s, and its ratio to torch)."""
    rows = ["| params | workers | syncps steps/s | syncps TCP steps/s | TF steps/s | torch steps/s | syncps / TF "
            "| syncps / torch | TCP / TF | TCP / torch | compute-only steps/s | syncps / compute | TCP / compute "
            "| PS peak RSS MB (TCP) | PS payload MB/s | TCP S=2 steps/s (/ TCP) |"
            + "".join(f" TCP {c} steps/s (/ torch) |" for c in compressions),
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|" + "---:|" * len(compressions)]
    for params, workers in cells:
        r = results[(params, workers)]
        ours, tcp, tf, torch, ceiling, sharded = (median_of(r.get(k, []), "steps_per_s") for k in
                                                  ("syncps", "syncps_tcp", "tf", "torch", "compute", "syncps_tcp_s2"))
        ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
        share = lambda a: f"{a / ceiling:.0%}" if a and ceiling else "-"  # noqa: E731
        rss = lambda k: fmt(median_of(r[k], "peak_rss_MB"), 0)  # noqa: E731
        rows.append(f"| {params:,} | {workers} | {fmt(ours)} | {fmt(tcp)} | {fmt(tf)} | {fmt(torch)} "
                    f"| {ratio(ours, tf)} | {ratio(ours, torch)} | {ratio(tcp, tf)} | {ratio(tcp, torch)} "
                    f"| {fmt(ceiling)} | {share(ours)} | {share(tcp)} "
                    f"| {rss('syncps')} ({rss('syncps_tcp')}) | {fmt(median_of(r['syncps'], 'tensor_MB_per_s'), 0)} "
                    + (f"| {fmt(sharded)} ({ratio(sharded, tcp)}) |" if sharded else "| - |")
                    + "".join(f" {fmt(rate)} ({ratio(rate, torch)}) |"
                              for rate in (median_of(r[c], "steps_per_s") for c in compressions)))
    return "\n".join(rows)


def loopback_floors(params: list[int], workers: list[int]) -> list[dict]:
    """:mod:`bench.floor`'s lines for these cells (its own process: one BLAS thread unless ``OPENBLAS_NUM_THREADS``
    says otherwise, as for the PS)."""
    if not params:
        return []
    cmd = [sys.executable, "-m", "bench.floor", "--json", "--params", *map(str, params),
           "--workers", *map(str, workers)]
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600).stdout
    except subprocess.TimeoutExpired:
        out = ""
    return [json.loads(line) for line in out.splitlines() if line.startswith("{")]


def floor_table(cells: list[tuple[int, int]], results: dict, floors: list[dict]) -> str:
    """Each cell's floors over loopback TCP (:mod:`bench.floor`: this machine's TCP cost per byte, compute and
    arithmetic, no overhead at all) next to what syncps over TCP and torch gloo reached in this pass."""
    rows = ["| params | workers | PS floor steps/s | ring floor steps/s | PS floor / ring floor | syncps TCP / PS floor "
            "| torch / ring floor | PS floor / torch |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    by_cell = {(f["params_requested"], f["workers"]): f for f in floors if "ps_floor_steps_per_s" in f}
    share = lambda a, b: f"{a / b:.0%}" if a and b else "-"  # noqa: E731
    for params, workers in cells:
        f = by_cell.get((params, workers))
        if f is None:
            continue
        r = results.get((params, workers), {})
        tcp, torch = (median_of(r.get(k, []), "steps_per_s") for k in ("syncps_tcp", "torch"))
        ps, ring = f["ps_floor_steps_per_s"], f["ring_floor_steps_per_s"]
        rows.append(f"| {f['params']:,} | {workers} | {fmt(ps)} | {fmt(ring)} | {ps / ring:.2f}x | {share(tcp, ps)} "
                    f"| {share(torch, ring)} | " + (f"{ps / torch:.2f}x |" if torch else "- |"))
    return "\n".join(rows)


def _has_torch() -> bool:
    try:
        import torch  # noqa: F401
    except ImportError:
        return False
    return True


def ddp_cnn(workers: int, steps: int) -> dict:
    """torch DDP (gloo) on the cnn task: its JSON line (an ``error`` line if it failed)."""
    try:
        out = subprocess.run([sys.executable, "-m", "bench.ddp_cnn", "--json", "--workers", str(workers),
                              "--steps", str(steps)],
                             cwd=ROOT, capture_output=True, text=True, timeout=900).stdout
    except subprocess.TimeoutExpired:
        out = ""
    lines = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return lines[-1] if lines else {"system": "torch_ddp_gloo", "workers": workers, "error": "no output"}


def cnn_table(results: dict) -> str:
    """The CNN task: syncps (same-host, TCP) next to torch DDP gloo, steps/s and ratios."""
    rows = ["| workers | syncps steps/s | syncps TCP steps/s | DDP gloo steps/s | syncps / DDP | TCP / DDP |",
            "|---:|---:|---:|---:|---:|---:|"]
    for workers, r in sorted(results.items()):
        ours, tcp, ddp = (median_of(r[k], "steps_per_s") for k in ("syncps", "syncps_tcp", "ddp"))
        ratio = lambda a, b: f"{a / b:.2f}x" if a and b else "-"  # noqa: E731
        rows.append(f"| {workers} | {fmt(ours)} | {fmt(tcp)} | {fmt(ddp)} | {ratio(ours, ddp)} | {ratio(tcp, ddp)} |")
    return "\n".join(rows)


def between_hosts(systems: str, params: str, workers: str, rate: str, seconds: float) -> tuple[list[dict], str]:
    """:mod:`bench.hosts`'s JSON lines and its table (or why it was skipped)."""
    if os.geteuid() != 0 or not (shutil.which("ip") and shutil.which("tc")):
        return [], "skipped: emulated hosts need root, ip and tc"
    cmd = [sys.executable, "-m", "bench.hosts", "--json", "--rate", rate, "--workers", workers, "--params", params,
           "--systems", systems, "--seconds", str(seconds)]
    runs = len(systems.split(",")) * len(workers.split(",")) * len(params.split(","))
    try:
        out = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=60 + runs * (120 + 3 * seconds))
    except subprocess.TimeoutExpired:
        return [], "timed out"
    lines = [json.loads(line) for line in out.stdout.splitlines() if line.startswith("{")]
    text = "\n".join(line for line in out.stdout.splitlines() if line.startswith(("|", "steps/s")))
    return lines, text or f"no table (exit {out.returncode}): {out.stderr[-500:]}"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.table", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", default="2,4", help="comma list of worker counts of the grid")
    ap.add_argument("--params", default="4,1000000,10000000", help="comma list of model sizes of the grid")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds of each run")
    ap.add_argument("--repeat", type=int, default=3, help="syncps runs per cell (median tabled)")
    ap.add_argument("--compressions", default="bf16,fp16,topk,2bit",
                    help="PS_COMPRESSION values measured over TCP, a column each ('' for none)")
    ap.add_argument("--shard-params", default="10000000",
                    help="params of the cells also measured over TCP with two PS shards ('' for none)")
    ap.add_argument("--anchors", default="tf,torch", help="anchor systems to run ('' for none)")
    ap.add_argument("--cnn-workers", default="4", help="worker counts of the CNN table ('' for none; needs torch)")
    ap.add_argument("--cnn-steps", type=int, default=200, help="DDP steps per CNN run")
    ap.add_argument("--hosts", default="syncps,syncps-colocated,syncps-topk,gloo,tf,tf-colocated",
                    help="bench.hosts systems of the between-hosts table (root, ip and tc; '' for none)")
    ap.add_argument("--hosts-params", default="1000000,10000000",
                    help="params of the between-hosts table (comma list)")
    ap.add_argument("--hosts-rate", default="1gbit", help="each emulated host's link (tc units)")
    ap.add_argument("--floor-params", default="1000000,10000000",
                    help="params of the cells whose loopback floors are measured (bench.floor; '' for none)")
    ap.add_argument("--out", default=os.path.join(tempfile.gettempdir(), "syncps-bench.jsonl"),
                    help="every JSON line, appended")
    args = ap.parse_args(argv)
    systems = [s for s in args.anchors.split(",") if s]
    if systems and not COMPARE.exists():
        print(f"[bench] {COMPARE} not found: syncps only", file=sys.stderr)
        systems = []
    cells = [(int(p), int(n)) for p in args.params.split(",") for n in args.workers.split(",")]
    compressions = tuple(c for c in args.compressions.split(",") if c)
    sharded = {int(p) for p in args.shard_params.split(",") if p}
    results: dict = {}
    started = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    stamp = {"command": "python -m bench.table " + shlex.join(sys.argv[1:] if argv is None else argv),
             "when": started, "tree": tree(), "machine": machine(), "repeat": args.repeat}
    with open(args.out, "a") as out:
        def keep(line: dict) -> dict:
            line = {**line, **stamp, "load_1min": round(os.getloadavg()[0], 2)}  # bench.report reads a pass so
            out.write(json.dumps(line) + "\n")
            out.flush()
            print(json.dumps(line), file=sys.stderr, flush=True)
            return line
        for params, workers in cells:
            r = results[(params, workers)] = {"syncps": [], "syncps_tcp": [], "syncps_tcp_s2": [], "tf": [], "torch": [],
                                              "compute": [], **{c: [] for c in compressions}}
            for _ in range(args.repeat):
                r["syncps"].append(keep(measure(workers, params, args.seconds)))
                r["syncps_tcp"].append(keep(measure(workers, params, args.seconds, transport="http")))
                if params in sharded:  # alternating with one PS over TCP: the ratio is of one pass
                    r["syncps_tcp_s2"].append(keep(measure(workers, params, args.seconds, transport="http", shards=2)))
                for c in compressions:
                    r[c].append(keep(measure(workers, params, args.seconds, transport="http", compression=c)))
            for line in anchors(workers, params, args.seconds, systems) if systems else []:
                kind = next((k for k, name in ANCHORS.items() if line.get("system") == name), None)
                if kind:
                    r[kind].append(keep(line))
            if CEILING.exists():
                r["compute"].append(keep(compute_only(workers, params, args.seconds)))
        floor_params = [int(p) for p in args.floor_params.split(",") if p]
        floors = [keep(line) for line in loopback_floors([p for p in floor_params if any(p == c[0] for c in cells)],
                                                         sorted({n for _, n in cells}))]
        cnn: dict = {}
        for workers in [int(n) for n in args.cnn_workers.split(",") if n] if _has_torch() else []:
            r = cnn[workers] = {"syncps": [], "syncps_tcp": [], "ddp": []}
            for _ in range(args.repeat):
                r["syncps"].append(keep(measure(workers, 0, args.seconds, task="cnn")))
                r["syncps_tcp"].append(keep(measure(workers, 0, args.seconds, task="cnn", transport="http")))
            r["ddp"].append(keep(ddp_cnn(workers, args.cnn_steps)))
        hosts_lines, hosts_text = (between_hosts(args.hosts, args.hosts_params, args.workers, args.hosts_rate,
                                                 args.seconds) if args.hosts else ([], ""))
        for line in hosts_lines:
            keep(line)
    print(f"\nsyncps vs anchors, steps (rounds) per second, float32; {started}; {machine()}; "
          f"load average at the end {os.getloadavg()[0]:.2f}\n")
    print(table(cells, results, compressions))
    if floors:
        print("\nThe floors over loopback TCP (bench.floor: this machine's compute, TCP CPU per byte and arithmetic, "
              "spread over every core with no overhead), and each system's share of its own\n")
        print(floor_table(cells, results, floors))
    if cnn:
        print("\nThe cnn task (PyTorch model through syncps.torch) against torch DDP gloo, steps per second\n")
        print(cnn_table(cnn))
    if hosts_text:
        print(f"\nBetween emulated hosts (bench.hosts, a {args.hosts_rate} link per host; syncps over TCP; "
              f"colocated: a PS shard, or TensorFlow ps task, beside each worker; top-k at its steady-state ratio, "
              f"no warm-up)\n")
        print(hosts_text)
    ok = all(median_of(results[c]["syncps"], "steps_per_s") for c in cells)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
