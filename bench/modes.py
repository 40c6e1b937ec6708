"""``python -m bench.modes``: sync, sync with a backup worker, async and SSP side by side (issue 16's evidence).

Each configuration is a real PS and 4 real worker processes on loopback (:class:`cluster.processes.LocalCluster`)
training the ``mlp`` task (8x8 digits, Adam lr 0.001), worker 3 slowed by ``--delay`` seconds per step
(``WORKER_COMPUTE_DELAY_SECONDS``), for the same wall time (``--seconds``, counted from the start of training).
Every ``--every`` seconds the script pulls the weights (a pull without a worker id: never gated) and evaluates
them on the 360 held-out images, which gives the loss-against-wall-time series. A table row per configuration
(:data:`COLUMNS`); with ``--json``, one JSON line per configuration: ``config``, ``gradients_per_s`` (gradients
applied per second, from the PS's counter),
``steps_per_s`` (updates per second), ``held_out_accuracy`` and ``held_out_loss`` at the end, ``staleness``
(p50/p90/p99 of the applied gradients in global steps; 0 in sync by construction: a round applies only
gradients of its own step), ``pushes`` (by status), ``series`` ([seconds, held-out loss, accuracy]),
``load_avg`` (1-minute, at the end). ``--plot FILE`` draws the series (matplotlib); ``--load FILE`` tables (and
plots) the JSON lines of an earlier ``--json`` run instead of running.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench.output import Results, add_json_option
from cluster.processes import LocalCluster, patience, wait_for
from worker_service.client import PSClient
from worker_service.tasks.mlp import MLPTask

CONFIGS = {
    "sync": {"PS_MODE": "sync"},
    "sync N=4 R=3": {"PS_MODE": "sync", "PS_REPLICAS_TO_AGGREGATE": 3, "PS_TOTAL_NUM_REPLICAS": 4},
    "async": {"PS_MODE": "async"},
    "ssp s=2": {"PS_MODE": "ssp", "PS_SSP_STALENESS": 2},
    "ssp s=8": {"PS_MODE": "ssp", "PS_SSP_STALENESS": 8},
}
WORKERS = 4
#: the table's columns (--json: every field, the series too)
COLUMNS = ["config", "gradients_per_s", "steps_per_s", "held_out_accuracy", "held_out_loss", "staleness.p50",
           "staleness.p99", "max_clock_spread", "window_s", "load_avg"]


def run(name: str, env: dict, seconds: float, delay: float, every: float, task: MLPTask) -> dict:
    c = LocalCluster(WORKERS, ps_env={**env, "PS_LEASE_SECONDS": 30}, worker_env={"WORKER_TASK": "mlp"})
    try:
        c.start_ps()
        for i in range(WORKERS):
            c.start_worker(i, {"WORKER_COMPUTE_DELAY_SECONDS": delay if i == WORKERS - 1 else 0})
        wait_for(lambda: c.status()["state"] == "training", 60 * patience(), "training to start")
        client = PSClient(c.url, timeout=10.0 * patience(), attempts=3)
        t0, series, first = time.monotonic(), [], c.status()
        while True:
            t = time.monotonic() - t0
            metrics = task.evaluate(client.pull(0, wait=5.0).tensors)
            series.append([round(t, 2), round(metrics["loss"], 4), round(metrics["accuracy"], 4)])
            if t >= seconds:
                break
            time.sleep(max(0.0, min(every, seconds - t) - (time.monotonic() - t0 - t)))
        last = c.status()
        window = time.monotonic() - t0
        client.close()
    except BaseException:
        c.mark_failed()
        raise
    finally:
        c.stop()
    st = last["staleness"] or {"p50": 0, "p90": 0, "p99": 0}
    return {"config": name, "workers": WORKERS, "slow_worker_delay_s": delay, "window_s": round(window, 2),
            "gradients_per_s": round((last["gradients_applied"] - first["gradients_applied"]) / window, 1),
            "steps_per_s": round((last["global_step"] - first["global_step"]) / window, 1),
            "held_out_accuracy": series[-1][2], "held_out_loss": series[-1][1],
            "staleness": {k: st[k] for k in ("p50", "p90", "p99")}, "pushes": last["pushes"],
            "max_clock_spread": None if last["clocks"] is None else last["clocks"]["max_spread"],
            "series": series, "load_avg": round(os.getloadavg()[0], 2)}


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, acc) = plt.subplots(1, 2, figsize=(11, 4.2))
    for r in results:
        t = [p[0] for p in r["series"]]
        ax.plot(t, [p[1] for p in r["series"]], label=f"{r['config']} ({r['gradients_per_s']:.0f} grad/s)")
        acc.plot(t, [p[2] for p in r["series"]], label=r["config"])
    ax.set(xlabel="wall time (s)", ylabel="held-out loss", yscale="log",
           title=f"mlp, 4 workers, one slowed by {results[0]['slow_worker_delay_s']} s/step")
    acc.set(xlabel="wall time (s)", ylabel="held-out accuracy", ylim=(0, 1))
    ax.legend(fontsize=8)
    acc.legend(fontsize=8, loc="lower right")
    for a in (ax, acc):
        a.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.modes", description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="wall time of each configuration")
    ap.add_argument("--delay", type=float, default=0.1, help="WORKER_COMPUTE_DELAY_SECONDS of the slowed worker")
    ap.add_argument("--every", type=float, default=1.0, help="seconds between two held-out evaluations")
    ap.add_argument("--only", nargs="*", choices=list(CONFIGS), help="run only these configurations")
    ap.add_argument("--plot", help="write the loss-against-wall-time plot here (PNG, needs matplotlib)")
    ap.add_argument("--load", help="run nothing: table (and plot) the JSON lines of an earlier --json run in this file")
    add_json_option(ap)
    args = ap.parse_args(argv)
    with Results(args.json, COLUMNS, ap.prog) as out:
        if args.load:
            with open(args.load) as f:
                for line in f:
                    if line.strip():
                        out.add(json.loads(line))
        else:
            task = MLPTask()
            for name in args.only or CONFIGS:
                out.add(run(name, CONFIGS[name], args.seconds, args.delay, args.every, task))
    results = out.lines
    if args.plot:
        plot(results, args.plot)
        print(f"plot written to {args.plot}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
