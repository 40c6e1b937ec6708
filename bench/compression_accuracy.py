"""``python -m bench.compression_accuracy``: does gradient compression change what training reaches?

For each task (``linear``: the seed problem of ``make run``; ``mlp``; ``cnn``, when torch is installed)
and each compression (``none`` first, then ``bf16``, ``fp16``, ``topk``, ``2bit``), trains one real local
job (a PS and ``--workers`` worker processes on loopback, every tensor over TCP: ``WORKER_SHM_DIR=''``)
to the same ``PS_MAX_STEPS``, pulls the final weights and evaluates them with the task's ``evaluate``
(held-out accuracy for mlp and cnn; loss on the task's data for linear). A table row (``--json``: a JSON line)
per job, with
``delta_pp`` (accuracy minus the uncompressed run's, percentage points) or ``delta_loss``.

``--topk-ratio``, ``--topk-warmup`` (``PS_COMPRESSION_TOPK_WARMUP_STEPS``; default: the PS's) and ``--threshold``
take one value for every task (``0.01``) or one per task
(``linear=0.01,mlp=0.25``; a task not named gets the PS's default): the right 2-bit threshold depends on
the scale of the task's gradients, as in MXNet.
"""
from __future__ import annotations

import argparse
import os
import sys
import time

from bench.output import Results, add_json_option
from cluster.processes import LocalCluster, wait_for
from worker_service.client import PSClient
from worker_service.tasks import load_task

STEPS = {"linear": 200, "mlp": 300, "cnn": 200}
ENCODINGS = ("none", "bf16", "fp16", "topk", "2bit")
#: the table's columns (--json: every field)
COLUMNS = ["task", "compression", "steps", "metrics.accuracy", "metrics.loss", "delta_pp", "delta_loss", "seconds",
           "error"]


def train(task: str, compression: str, workers: int, steps: int, ps_env: dict, deadline: float) -> dict:
    env = {"PS_MAX_STEPS": steps, "PS_TOTAL_NUM_REPLICAS": workers, "PS_LOG_LEVEL": "warning",
           "PS_COMPRESSION": compression, **ps_env}
    t0 = time.monotonic()
    with LocalCluster(workers, ps_env=env, worker_env={"WORKER_TASK": task, "WORKER_SHM_DIR": "",
                                                       "WORKER_BATCH_SIZE": 32, "WORKER_LOG_EVERY_SECONDS": 3600,
                                                       "OMP_NUM_THREADS": 1, "OPENBLAS_NUM_THREADS": 1}) as c:
        codes = c.wait_workers(deadline)
        wait_for(lambda: c.status()["state"] == "done", 10, "the PS to report done")
        status = c.status()
        client = PSClient(c.url)
        try:
            weights = dict(client.pull(steps, wait=5.0).tensors)
        finally:
            client.close()
    if any(codes):
        raise RuntimeError(f"worker exit codes {codes}")
    metrics = load_task(task).evaluate(weights)
    return {"task": task, "compression": compression, "workers": workers, "steps": status["global_step"],
            "metrics": {k: float(f"{v:.4g}") for k, v in metrics.items()}, "bytes_received": status["bytes_received"],
            "seconds": round(time.monotonic() - t0, 1), "load_avg": round(os.getloadavg()[0], 2),
            **{k.removeprefix("PS_").lower(): v for k, v in ps_env.items()}}


def per_task(value: str, default: float) -> dict[str, float]:
    """``0.1`` -> every task; ``mlp=0.25,cnn=0.1`` -> those tasks (the others: ``default``)."""
    if "=" not in value:
        return {t: float(value) for t in STEPS}
    named = {t: float(v) for t, v in (item.split("=") for item in value.split(","))}
    return {t: named.get(t, default) for t in STEPS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.compression_accuracy", description=__doc__.split("\n\n")[0])
    ap.add_argument("--tasks", default="linear,mlp,cnn", help="comma list of tasks to train (cnn needs torch)")
    ap.add_argument("--compressions", default=",".join(ENCODINGS[1:]),
                    help="comma list of PS_COMPRESSION values to compare with none (which always runs first)")
    ap.add_argument("--workers", type=int, default=4, help="worker processes of each job")
    ap.add_argument("--topk-ratio", default="0.01", help="PS_COMPRESSION_TOPK_RATIO: one value, or task=value,...")
    ap.add_argument("--topk-warmup", default="", help="PS_COMPRESSION_TOPK_WARMUP_STEPS: one value, or task=value,... "
                                                      "(default: the PS's)")
    ap.add_argument("--threshold", default="0.5", help="PS_COMPRESSION_2BIT_THRESHOLD: one value, or task=value,...")
    ap.add_argument("--steps", default="", help="global steps per task, e.g. mlp=1000 (default: linear=200, "
                                                "mlp=300, cnn=200)")
    ap.add_argument("--deadline", type=float, default=900.0, help="seconds one job may take")
    add_json_option(ap)
    args = ap.parse_args(argv)
    with Results(args.json, COLUMNS, ap.prog) as out:
        return 0 if all(compare(args, out)) else 1


def compare(args: argparse.Namespace, out: Results):
    """Each task's jobs, uncompressed first, as ``out``'s lines; yields whether each job ran."""
    ratios, thresholds = per_task(args.topk_ratio, 0.01), per_task(args.threshold, 0.5)
    warmups = {t: int(v) for t, v in per_task(args.topk_warmup, -1).items()} if args.topk_warmup else {}
    steps = {**STEPS, **{t: int(v) for t, v in (item.split("=") for item in args.steps.split(",") if item)}}
    for task in args.tasks.split(","):
        ps_env = {"PS_COMPRESSION_TOPK_RATIO": ratios[task], "PS_COMPRESSION_2BIT_THRESHOLD": thresholds[task]}
        if warmups.get(task, -1) >= 0:
            ps_env["PS_COMPRESSION_TOPK_WARMUP_STEPS"] = warmups[task]
        base = None
        for compression in ("none", *[c for c in args.compressions.split(",") if c and c != "none"]):
            try:
                line = train(task, compression, args.workers, steps[task], ps_env, args.deadline)
            except Exception as exc:  # a failed job is a line too
                out.add({"task": task, "compression": compression, "error": f"{type(exc).__name__}: {exc}"[:400]})
                yield False
                continue
            m = line["metrics"]
            base = base or m
            if "accuracy" in m:
                line["delta_pp"] = round(100 * (m["accuracy"] - base["accuracy"]), 2)
            else:
                line["delta_loss"] = m["loss"] - base["loss"]
            out.add(line)
            yield True


if __name__ == "__main__":
    sys.exit(main())
