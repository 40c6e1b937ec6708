"""``python -m cluster`` (``make run``): a PS and N workers as local processes, trained to the end.

``--shards S``: the PS is S processes (shard 0 coordinates; docs/architecture.md, Shards).

Shows a progress bar of the global step, then prints the final weights, loss, rounds/s (over the
training itself: from round 0 opening to the last round closing, start-up not counted), the task's
evaluation of the final weights (``task.evaluate``: held-out accuracy for ``mlp``) and a per-worker
table; exits 0 when every worker exited 0. The processes' logs go to a ``syncps-*`` temporary folder
that is removed after a clean run, kept (and named) with ``--keep-logs`` or when something failed. Ctrl-C stops
the processes, keeps the logs and exits 130; a PS that stops answering mid-job ends it with exit code 1, one line.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import httpx
from rich import box
from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Column, Table

from cluster.processes import LocalCluster, patience
from worker_service.client import PSClient

#: what a built-in task needs beyond the base install, and the install that brings it
TASK_EXTRAS = {"mlp": (("sklearn",), "pip install -e '.[mlp]'  (scikit-learn)"),
               "cnn": (("torch", "sklearn"), "pip install -e '.[torch,mlp]'  (PyTorch, and scikit-learn: its data)")}
#: lines of a failed worker's log shown when the job ends without it
LOG_TAIL_LINES = 20


def missing_extra(task: str) -> str | None:
    """Why ``task`` cannot run in this environment (a missing optional dependency), or None."""
    modules, install = TASK_EXTRAS.get(task, ((), None))
    missing = [m for m in modules if importlib.util.find_spec(m) is None]
    if missing:
        return f"the {task} task needs {' and '.join(missing)}, not installed: {install}"
    return None


def evaluate(task: str, tensors: dict, worker_env: dict) -> dict[str, float]:
    """The task's own evaluation of the final weights, with the seed and dtype the workers used
    (``task.evaluate``, as each worker logs it in its final line)."""
    from worker_service.tasks import load_task

    env = {**os.environ, **worker_env}
    t = load_task(task, int(env.get("WORKER_SEED") or 0), env.get("WORKER_DTYPE") or "float32")
    return t.evaluate(tensors)


def format_metrics(metrics: dict[str, float]) -> str:
    out = []
    for k, v in metrics.items():
        out.append(f"{k} {v:.4f} ({100 * v:.2f} %)" if k == "accuracy" else f"{k} {v:.6g}")
    return ", ".join(out) or "none"


def training_span(cluster: LocalCluster, st: dict) -> float | None:
    """Seconds from round 0 opening to the last round closing (the PS's clock), or None if unknown."""
    try:
        last = cluster.get("/v1/rounds", params={"limit": 1}).json()["rounds"]
        start = st.get("training_started_at")
        return last[0]["closed_at"] - start if last and start is not None else None
    except (KeyError, IndexError, TypeError, ValueError):
        return None


def make_console(file=None) -> Console:
    """rich's console for the output. Not a terminal (``make run | tee log``): rich would cut every line at 80
    columns (or $COLUMNS) and split the URLs and summary lines; soft wrap prints each one whole."""
    console = Console(file=file)
    if not console.is_terminal:
        console.soft_wrap = True
    return console


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m cluster", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4, help="worker processes (default 4)")
    ap.add_argument("--shards", type=int, default=1, help="PS processes the model is spread over (PS_SHARDS)")
    ap.add_argument("--split-elements", type=int, default=None,
                    help="cut tensors above this many elements into slices (PS_SHARD_SPLIT_ELEMENTS)")
    ap.add_argument("--task", default="linear", help="linear, mlp (needs the [mlp] extra), cnn (needs [torch,mlp]) or package.module:factory")
    ap.add_argument("--steps", type=int, default=200, help="global steps to train (PS_MAX_STEPS; default 200)")
    ap.add_argument("--optimizer", default=None, help="override the task's optimizer (sgd, momentum, adam, adagrad)")
    ap.add_argument("--learning-rate", type=float, default=None,
                    help="override the task's learning rate (PS_LEARNING_RATE)")
    ap.add_argument("--deadline", type=float, default=600.0, help="give up after this many seconds")
    ap.add_argument("--no-pin", action="store_true",
                    help="do not give each worker a CPU of its own (WORKER_CPUS; done when workers <= CPUs)")
    ap.add_argument("--keep-logs", action="store_true",
                    help="keep the processes' log folder after a clean run (it is always kept after a failure)")
    args = ap.parse_args(argv)
    console = make_console()
    if args.workers < 1 or args.steps < 1 or args.shards < 1:
        ap.error("--workers, --steps and --shards must be at least 1")
    missing = missing_extra(args.task)
    if missing:
        console.print(missing, style="red", markup=False)
        return 2
    ps_env = {"PS_MAX_STEPS": args.steps}
    if args.optimizer:
        ps_env["PS_OPTIMIZER"] = args.optimizer
    if args.learning_rate:
        ps_env["PS_LEARNING_RATE"] = args.learning_rate
    if args.split_elements:
        ps_env["PS_SHARD_SPLIT_ELEMENTS"] = args.split_elements
    elif args.shards > 1 and args.task == "linear":
        ps_env["PS_SHARD_SPLIT_ELEMENTS"] = 2  # the linear model's 4 weights: enough pieces for a few shards
    worker_env = {"WORKER_TASK": args.task}
    t_launch = time.monotonic()
    cluster = LocalCluster(args.workers, ps_env=ps_env, worker_env=worker_env, keep_logs=args.keep_logs,
                           shards=args.shards, pin_workers=not args.no_pin)
    console.print(f"syncps: PS at {cluster.url}, {args.workers} workers, task {args.task}, {args.steps} steps")
    if args.shards > 1:
        console.print(f"{args.shards} PS shards: " + ", ".join(f"shard {i} at http://127.0.0.1:{p}"
                                                               for i, p in enumerate(cluster.shard_ports)))
    console.print(f"dashboard {cluster.url}/  metrics {cluster.url}/metrics  API docs {cluster.url}/docs")
    ok, codes, metrics = False, [], None

    def where_logs() -> None:
        if not cluster.logs_removed:
            console.print(f"logs of the PS and the workers: {cluster.log_dir}")

    try:
        with cluster:
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
                    if time.monotonic() - t_launch > args.deadline:
                        console.print(f"[red]deadline passed ({args.deadline:g} s)")
                        raise SystemExit(1)
                    time.sleep(0.2)  # the progress bar's refresh period, not a synchronisation
            codes = cluster.wait_workers(60 * patience())
            wall = time.monotonic() - t_launch
            st = cluster.status()
            if st["state"] != "done":  # every worker exited before the end (e.g. a task that cannot import)
                cluster.mark_failed()
                for i, code in enumerate(codes):
                    if code != 0:
                        tail = "\n".join(cluster.log(f"worker-{i}").splitlines()[-LOG_TAIL_LINES:])
                        console.print(f"worker-{i} exited with code {code}; the end of its log:\n{tail}", style="red",
                                      markup=False)
                console.print(f"failed: the job is {st['state']} at step {st['global_step']}, and no worker is left",
                              style="red", markup=False)
                where_logs()
                return 1
            span = training_span(cluster, st)
            workers = cluster.get("/v1/workers").json()
            client = PSClient(cluster.url)
            try:
                client.attach_reader()  # a sharded PS: every shard's pieces
                final = client.pull(0, wait=5.0)
            finally:
                client.close()
            try:
                metrics = evaluate(args.task, final.tensors, worker_env)
            except Exception as exc:  # the job's result stands; say why there is no evaluation
                console.print(f"[red]evaluation failed: {type(exc).__name__}: {exc}")
            ok = all(c == 0 for c in codes) and st["state"] == "done" and metrics is not None
            if not ok:
                cluster.mark_failed()
    except (RuntimeError, TimeoutError) as exc:  # the PS did not start, or stopped answering
        console.print(f"failed: {exc}", style="red", markup=False)
        where_logs()
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the processes are stopped (LocalCluster.stop), the logs kept
        console.print("interrupted: the PS and the workers are stopped", style="yellow", markup=False)
        where_logs()
        return 130
    except httpx.TransportError as exc:  # the PS went away mid-job (a Ctrl-C that reached it first, a crash)
        console.print(f"failed: the PS stopped answering ({type(exc).__name__}: {exc})", style="red", markup=False)
        where_logs()
        return 1
    except BaseException:
        where_logs()
        raise
    steps = st["global_step"]
    if span and span > 0:  # the training alone: round 0 opening to the last round closing, on the PS's clock
        timing = f"{steps / span:.1f} rounds/s (training only: {steps} rounds in {span:.2f} s)"
    else:
        timing = "rounds/s unknown (no round closed)"
    console.print(f"global step {steps}, last loss {st['loss']['last']}, {timing}")
    console.print(f"wall time {wall:.1f} s in all, start-up (PS, {args.workers} workers, registration) and shutdown included")
    for name, arr in final.tensors.items():
        console.print(f"  {name} = {arr.reshape(-1).round(6).tolist() if arr.size <= 16 else f'<{arr.shape}>'}")
    if metrics is not None:
        held_out = " (held-out test split)" if args.task == "mlp" else ""
        console.print(f"evaluation of the final weights by the {args.task} task{held_out}: {format_metrics(metrics)}")
    table = Table("rank", Column("name", no_wrap=True), "state", "via", "acc", "stale", "late", "dup", "fetch\nms", "comp\nms",
                  "push\nms", "strag\nrounds", "strag\ns", box=box.SIMPLE_HEAD, padding=0, title="workers")
    for w in workers["workers"]:
        p, t = w["pushes"], w["mean_seconds"]
        name = f"[bold red]{w['name']} *" if w["name"] == workers["straggler"] else w["name"]
        table.add_row(str(w["rank"]), name, w["state"], w["transport"] or "-", *(str(p[k]) for k in ("accepted", "stale", "late", "duplicate")),
                      *(f"{1e3 * t[k]:.2f}" for k in ("fetch", "compute", "push")), str(w["straggler_rounds"]),
                      f"{w['straggler_seconds']:.3f}")
    console.print(table, soft_wrap=False)  # a table lays itself out in the width
    console.print("via: how tensors travelled (shm: same-host files, http: request bodies); "
                  "strag: rounds (of the last 100) the worker slowed, and the seconds it cost them")
    if workers["straggler"]:
        console.print(f"* straggler: {workers['straggler']} (cost the rounds the most waiting time)")
    console.print("[green]done: every worker exited 0" if ok else f"[red]failed: exit codes {codes}")
    where_logs()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
