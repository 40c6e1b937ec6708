"""``python -m cluster`` (``make run``): a PS and N workers as local processes, trained to the end.

Shows a progress bar of the global step, then prints the final weights, loss,
rounds/s and a per-worker table; exits 0 when every worker exited 0.
"""
from __future__ import annotations

import argparse
import sys
import time

from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from cluster.processes import LocalCluster
from worker_service.client import PSClient


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster", description=__doc__)
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--task", default="linear")
    ap.add_argument("--steps", type=int, default=200)
    ap.add_argument("--optimizer", default=None, help="override the task's optimizer (sgd, momentum, adam, adagrad)")
    ap.add_argument("--learning-rate", type=float, default=None)
    ap.add_argument("--deadline", type=float, default=600.0, help="give up after this many seconds")
    args = ap.parse_args(argv)
    console = Console()
    ps_env = {"PS_MAX_STEPS": args.steps}
    if args.optimizer:
        ps_env["PS_OPTIMIZER"] = args.optimizer
    if args.learning_rate:
        ps_env["PS_LEARNING_RATE"] = args.learning_rate
    cluster = LocalCluster(args.workers, ps_env=ps_env, worker_env={"WORKER_TASK": args.task})
    console.print(f"syncps: PS at {cluster.url}, {args.workers} workers, task {args.task}, {args.steps} steps "
                  f"(logs in {cluster.log_dir})")
    console.print(f"dashboard {cluster.url}/  metrics {cluster.url}/metrics  API docs {cluster.url}/docs")
    with cluster:
        t0 = time.monotonic()
        with Progress(TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[info]}"),
                      TimeElapsedColumn(), console=console) as bar:
            job = bar.add_task("steps", total=args.steps, info="")
            while True:
                st = cluster.status()
                loss, rate = st["loss"]["last"], st["throughput"]["rounds_per_second"]
                info = st["state"] if loss is None else f"{st['state']}  loss {loss:.3g}  {rate:.1f} rounds/s"
                bar.update(job, completed=st["global_step"], info=info)
                if st["state"] == "done" or all(p.poll() is not None for p in cluster.workers):
                    break
                if time.monotonic() - t0 > args.deadline:
                    console.print("[red]deadline passed")
                    return 1
                time.sleep(0.2)
        codes = cluster.wait_workers(60)
        elapsed = time.monotonic() - t0
        st = cluster.status()
        workers = cluster.get("/v1/workers").json()
        client = PSClient(cluster.url)
        final = client.pull(0, wait=5.0)
        client.close()
    console.print(f"global step {st['global_step']}, last loss {st['loss']['last']}, "
                  f"{st['throughput']['mean_rounds_per_second']:.1f} rounds/s over the last "
                  f"{min(st['global_step'], 1000)} rounds ({elapsed:.1f} s wall)")
    for name, arr in final.tensors.items():
        console.print(f"  {name} = {arr.reshape(-1).round(6).tolist() if arr.size <= 16 else f'<{arr.shape}>'}")
    table = Table("rank", Column("name", no_wrap=True), "state", "via", "acc", "stale", "late", "dup", "fetch\nms", "comp\nms",
                  "push\nms", "strag\nrounds", "strag\ns", box=box.SIMPLE_HEAD, padding=0, title="workers")
    for w in workers["workers"]:
        p, t = w["pushes"], w["mean_seconds"]
        name = f"[bold red]{w['name']} *" if w["name"] == workers["straggler"] else w["name"]
        table.add_row(str(w["rank"]), name, w["state"], w["transport"] or "-", *(str(p[k]) for k in ("accepted", "stale", "late", "duplicate")),
                      *(f"{1e3 * t[k]:.2f}" for k in ("fetch", "compute", "push")), str(w["straggler_rounds"]),
                      f"{w['straggler_seconds']:.3f}")
    console.print(table)
    console.print("via: how tensors travelled (shm: same-host files, http: request bodies); "
                  "strag: rounds (of the last 100) the worker slowed, and the seconds it cost them")
    if workers["straggler"]:
        console.print(f"* straggler: {workers['straggler']} (cost the rounds the most waiting time)")
    ok = all(c == 0 for c in codes) and st["state"] == "done"
    console.print("[green]done: every worker exited 0" if ok else f"[red]failed: exit codes {codes}")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
