"""``python -m bench.run --workers N --params P --seconds S``: one measured syncps run, a table (``--json``: one JSON
line).

Starts a real PS and N real worker processes on loopback (:class:`cluster.processes.LocalCluster`)
running :mod:`bench.task` (the anchors' workload), waits until training runs, warms up for
``--warmup`` seconds, then counts global steps (rounds) over ``--seconds`` from the PS's
``/v1/status``. Prints the anchors' fields (``../shared/bench/common.py``): ``system``,
``workers``, ``params``, ``params_requested``, ``steps_per_s``, ``grad_MB_per_s``
(= workers * params * 4 / 1e6 * steps_per_s, the anchors' formula), ``final_loss``, plus
``peak_rss_MB`` (the PS's peak resident memory, VmHWM), ``peak_anon_MB`` (its anonymous memory at its peak,
sampled every 20 ms: what it holds of its own, without the shared pages it maps: a same-host PS maps each worker's
gradient file), ``tensor_MB_per_s`` (payload
through the PS: gradients in + weights out), ``ps_cpu_s`` (PS CPU seconds in the window),
``workers_cpu_s`` (every worker's CPU seconds in the window, summed), ``cpu_ms_per_step`` (the two together per
global step: what one step costs the machine), ``cpu_busy`` (the same CPU over the window's core-seconds, with
``os.cpu_count()`` cores: how much of the machine the job kept busy; the rest waited on the barrier, the
scheduler or the other processes), ``steps``, ``window_s``, ``load_avg``. Exit status 1 (and an ``error`` field)
when the run failed.

``--compression X`` (``none``, ``bf16``, ``fp16``, ``topk``, ``2bit``) sets the job's ``PS_COMPRESSION`` (with
``--transport http``: same-host workers stay uncompressed); the line gets ``compression`` and
``wire_MB_per_s``, the bytes the PS really received and sent per second (``/v1/status``), and
``up_bytes_per_step`` / ``down_bytes_per_step`` (received / sent per step, all workers: ``down`` shrinks with
weight deltas, ``PS_WEIGHT_DELTAS``, reported as ``weight_deltas``). It measures top-k's steady state: the job has
no warm-up (``PS_COMPRESSION_TOPK_WARMUP_STEPS=0``) unless that variable is set in the environment.

``--shards S`` (default 1) runs S PS processes (``PS_SHARDS``; docs/guides/shards.md): ``ps_cpu_s`` is then the CPU
of every shard summed, ``peak_rss_MB`` the largest shard's, and the line gets ``shards``, ``shard_cpu_s`` and
``shard_peak_rss_MB``, ``shard_urls`` and ``shard_wire_bytes_per_step`` (bytes received + sent a step; one per
shard, the coordinator first); ``wire_MB_per_s`` sums every shard's bytes.
Its cost model: docs/scaling.md.

Workers run as ``make run`` starts them (:class:`~cluster.processes.LocalCluster`): each on a CPU of its own when
there are no more workers than CPUs; ``pinned_cpus`` lists each worker's CPU (null: not pinned). ``--no-pin``
leaves them wherever the OS puts them.

``--standby`` runs a hot-standby pair (docs/guides/standby.md): ``ps_cpu_s`` is then both PS processes' CPU, and the
line gets ``cpu_ms_per_step_of`` (the primary's, the standby's and the workers' CPU a step, in ms) and ``pair_ms``
(the ``costs`` of each PS's ``GET /v1/ha`` over the window, ms a step: where replication's time goes, and
``exposed``, the share of steps whose answers waited for the acknowledgement). ``--alternate`` (with ``--standby``)
measures its cost: each repeat runs the job alone and with a pair, the order swapped every other repeat, every line
with ``load_1min`` (``os.getloadavg``, as the run ends) and ``machine``.

``--pin`` measures a same-host standby with a core of its own (issue 51; :mod:`bench.pin`): the job (the PS, its
shards, the workers) started on every CPU but the last (``taskset``), a ``--standby``'s standby on the last alone, in
both arms of ``--alternate`` (alone, the last CPU idle); the workers' own pinning is then off. The line gets ``pin``
(``job``: its CPUs, ``standby``: the standby's) and ``affinity`` (the CPUs each process's threads may run on, read
from them as the window ends: ``ps``, one list per shard; ``standby``; ``workers``), and ``oversubscribed`` counts the
job's CPUs only.

``--task cnn`` measures the torch ``cnn`` task instead (syncps/cnn.py, batch 32 per
worker; ``--params`` does not apply): its side-by-side with torch DDP is ``python -m bench.ddp_cnn``.
"""
from __future__ import annotations

import argparse
import os
import sys
import threading
import time

import httpx

from bench import pin as pinning
from bench.output import Results, add_json_option
from bench.task import task_workload
from cluster.processes import LocalCluster, patience, wait_for
from shared.protocol import PHASES


def _proc_status(pid: int, field: str) -> float | None:
    """A ``kB`` field of /proc/PID/status in MB (None where /proc is missing)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class _PeakAnon:
    """The largest ``RssAnon`` (anonymous memory) of some processes, read from /proc every 20 ms on a thread, in MB.
    What a PS holds of its own: VmHWM also counts the shared pages it maps (a same-host PS maps each worker's
    gradient file, the worker's pages in the tmpfs)."""

    def __init__(self, pids: list[int]) -> None:
        self.peak = {pid: 0.0 for pid in pids}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.wait(0.02):
            for pid in self.peak:
                self.peak[pid] = max(self.peak[pid], _proc_status(pid, "RssAnon") or 0.0)

    def stop(self) -> list[float]:
        self._stop.set()
        self._thread.join(timeout=5.0)
        return [round(v, 1) for v in self.peak.values()]


def _cpu_seconds(pid: int) -> float | None:
    """The process's utime + stime (every thread, the exited ones too), in clock ticks: 10 ms steps."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            parts = f.read().rsplit(")", 1)[1].split()
        return (int(parts[11]) + int(parts[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


def _cpu_seconds_fine(pid: int) -> float | None:
    """The CPU time of the process's live threads to the nanosecond (``/proc/PID/task/*/schedstat``), for windows
    too short for :func:`_cpu_seconds`' clock ticks; :func:`_cpu_seconds` where the kernel has no schedstat."""
    try:
        total, read = 0, 0
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
                read += 1
            except FileNotFoundError:  # the thread exited meanwhile (or the kernel keeps no schedstat)
                continue
        return total / 1e9 if read else _cpu_seconds(pid)
    except (OSError, IndexError, ValueError):
        return _cpu_seconds(pid)


def _global_step(client: httpx.Client) -> tuple[float, int, dict]:
    st = client.get("/v1/status").json()
    return time.perf_counter(), st["global_step"], st


def _wait_next_step(client: httpx.Client) -> None:
    """Return (within 10 ms) when the next global step completes."""
    step = _global_step(client)[1]
    wait_for(lambda: _global_step(client)[1] > step, 600.0, "the next global step", interval=0.01)


def _wire_bytes(urls: list[str]) -> list[tuple[int, int]]:
    """Tensor bytes each shard received and sent so far (``/v1/status``), the coordinator first."""
    return [(st["bytes_received"], st["bytes_sent"])
            for st in (httpx.get(f"{url}/v1/status", timeout=10.0).json() for url in urls)]


def _shard_cpu(procs: list) -> list[float | None]:
    return [_cpu_seconds(p.pid) for p in procs]


def _pair_costs(cluster) -> list[dict] | None:
    """A hot-standby pair's ``costs`` (``GET /v1/ha``), the primary's then the standby's (None: no pair)."""
    if cluster.peer_url is None:
        return None
    return [httpx.get(f"{url}/v1/ha", timeout=10.0).json()["costs"] for url in (cluster.url, cluster.peer_url)]


def _pair_lines(costs0: list[dict], costs1: list[dict], steps: int, cpu: list, wcpu: list) -> dict:
    """A pair's fields (the module's docstring, ``--standby``): CPU a step per process kind, ``costs`` a step."""
    ms = lambda x: None if x is None else round(1e3 * x / steps, 3)  # noqa: E731
    pair = {side: {k: ms(b[k] - a[k]) for k in a if k.endswith("_s")} for side, a, b in
            zip(("primary", "standby"), costs0, costs1)}
    pair["primary"]["exposed"] = round((costs1[0]["exposed"] - costs0[0]["exposed"]) / steps, 3)
    return {"cpu_ms_per_step_of": {"primary": ms(cpu[0]), "standby": ms(cpu[-1]),
                                   "workers": ms(None if None in wcpu else sum(wcpu))}, "pair_ms": pair}


def measure(workers: int, params: int, seconds: float, warmup: float = 2.0, dtype: str = "float32",
            ps_env: dict | None = None, worker_env: dict | None = None, start_deadline: float | None = None,
            transport: str = "auto", task: str = "linear", compression: str = "none", shards: int = 1,
            cluster_options: dict | None = None, step_aligned: bool = False, pin: bool = False) -> dict:
    """One run; the result line as a dict. ``cluster_options``: more :class:`LocalCluster` arguments (``host`` or
    ``hosts``, ``prefix``: ``bench.hosts`` runs each process in a network namespace of its own). ``step_aligned``: the window
    starts and ends as a global step completes (polled every 10 ms), for runs of only a few steps. ``pin``: the job on
    every CPU but the last, a standby on the last (the module's docstring, ``--pin``). ``start_deadline``: seconds for
    the job to reach step 3 (default 120 times :func:`cluster.processes.patience`)."""
    p, (d, k), task_env = task_workload(task, params)
    out: dict = {"system": "syncps", "workers": workers, "params": p, "params_requested": int(params)}
    job_cpus = os.cpu_count() or 1
    if pin:
        job, standby = pinning.cpus()
        out["pin"], job_cpus = {"job": job, "standby": standby}, len(job)
        cluster_options = {**(cluster_options or {}), "prefix": pinning.prefix(job, standby), "pin_workers": False}
    if task != "linear":
        out.update(task=task, params_requested=p)
    if shards > 1:
        out["shards"] = shards
    if (cluster_options or {}).get("standby"):
        out["standby"] = True
    if transport == "http":  # no same-host transport: every tensor crosses the loopback socket
        worker_env = {"WORKER_SHM_DIR": "", **(worker_env or {})}
    if compression != "none":
        out["compression"] = compression
        steady = {} if "PS_COMPRESSION_TOPK_WARMUP_STEPS" in os.environ else {"PS_COMPRESSION_TOPK_WARMUP_STEPS": 0}
        ps_env = {"PS_COMPRESSION": compression, **steady, **(ps_env or {})}
    cluster = LocalCluster(
        workers,
        ps_env={"PS_TOTAL_NUM_REPLICAS": workers, "PS_LOG_LEVEL": "warning", **(ps_env or {})},
        worker_env={"WORKER_TASK": task_env, "WORKER_DTYPE": dtype,
                    "WORKER_LOG_EVERY_SECONDS": 3600, "OPENBLAS_NUM_THREADS": 1, "OMP_NUM_THREADS": 1,
                    "MKL_NUM_THREADS": 1, **(worker_env or {})}, shards=shards, **(cluster_options or {}))
    urls = cluster.shard_urls
    try:
        cluster.start()
        out["pinned_cpus"] = [cluster.pinned.get(i) for i in range(workers)]
        with httpx.Client(base_url=cluster.url, timeout=30.0) as client:
            def training() -> bool:
                if any(w.poll() is not None for w in cluster.workers):
                    raise RuntimeError("a worker exited:\n" + cluster.log("worker-0")[-2000:])
                st = client.get("/v1/status").json()
                return st["state"] == "training" and st["global_step"] >= 3
            procs = [cluster.ps, *cluster.followers, *([cluster.peer] if cluster.peer is not None else [])]
            anon = _PeakAnon([proc.pid for proc in procs])
            wait_for(training, 120 * patience() if start_deadline is None else start_deadline, "training to start",
                     interval=0.1)
            time.sleep(warmup)
            if step_aligned:
                _wait_next_step(client)
            cpu0, wcpu0, shard_wire0 = _shard_cpu(procs), _shard_cpu(cluster.workers), _wire_bytes(urls)
            costs0 = _pair_costs(cluster)
            t0, g0, _ = _global_step(client)
            time.sleep(seconds)
            if step_aligned:
                _wait_next_step(client)
            t1, g1, st = _global_step(client)
            cpu1, wcpu1, shard_wire1 = _shard_cpu(procs), _shard_cpu(cluster.workers), _wire_bytes(urls)
            costs1 = _pair_costs(cluster)
            if pin:
                out["affinity"] = {"ps": [pinning.affinity(proc.pid) for proc in [cluster.ps, *cluster.followers]],
                                   "standby": None if cluster.peer is None else pinning.affinity(cluster.peer.pid),
                                   "workers": [pinning.affinity(w.pid) for w in cluster.workers]}
            members = client.get("/v1/workers").json()["workers"]
        rate = (g1 - g0) / (t1 - t0)
        cpu, wcpu = ([None if a is None or b is None else round(b - a, 3) for a, b in zip(*ab)]
                     for ab in ((cpu0, cpu1), (wcpu0, wcpu1)))
        rss = [round(_proc_status(proc.pid, "VmHWM") or 0.0, 1) for proc in procs]
        anon_peak = anon.stop()
        wire0, wire1 = ([sum(col) for col in zip(*per_shard)] for per_shard in (shard_wire0, shard_wire1))
        if shards > 1:
            out.update(shard_cpu_s=cpu, shard_peak_rss_MB=rss, shard_urls=urls,
                       shard_wire_bytes_per_step=[round((sum(b) - sum(a)) / max(1, g1 - g0))
                                                  for a, b in zip(shard_wire0, shard_wire1)])
        if compression != "none":
            out.update(weight_deltas=str({**os.environ, **ps_env}.get("PS_WEIGHT_DELTAS", "true")),
                       **{f"{k}_bytes_per_step": round((b - a) / max(1, g1 - g0))
                          for k, a, b in zip(("up", "down"), wire0, wire1)})
        out.update({
            "steps_per_s": round(rate, 4),
            "grad_MB_per_s": round(workers * p * 4 / 1e6 * rate, 3),
            "final_loss": st["loss"]["last"],
            "peak_rss_MB": max(rss),
            "peak_anon_MB": max(anon_peak),
            "tensor_MB_per_s": round(2 * workers * p * 4 / 1e6 * rate, 3),
            "wire_MB_per_s": round((sum(wire1) - sum(wire0)) / 1e6 / (t1 - t0), 3),
            "ps_cpu_s": None if None in cpu else round(sum(cpu), 3),
            "workers_cpu_s": None if None in wcpu else round(sum(wcpu), 3),
            "steps": g1 - g0, "window_s": round(t1 - t0, 3), "batch": 32, "d": d, "k": k, "dtype": dtype,
            "load_avg": round(os.getloadavg()[0], 2),
            "transport": "+".join(sorted({m["transport"] for m in members})),
            "worker_phase_ms": {k: round(1e3 * sum(m["mean_seconds"][k] for m in members) / len(members), 2)
                                for k in PHASES},
        })
        if costs0 is not None and g1 > g0:
            out.update(_pair_lines(costs0, costs1, g1 - g0, cpu, wcpu))
        if out["ps_cpu_s"] is not None and out["workers_cpu_s"] is not None and g1 > g0:
            job_cpu = out["ps_cpu_s"] + out["workers_cpu_s"]
            out.update(cpu_ms_per_step=round(1e3 * job_cpu / (g1 - g0), 2),
                       cpu_busy=round(job_cpu / ((t1 - t0) * (os.cpu_count() or 1)), 3))
    except Exception as exc:  # a failed run is a line too, as the anchors do
        out.update({"steps_per_s": None, "grad_MB_per_s": None, "error": f"{type(exc).__name__}: {exc}"[:500],
                    "log_dir": str(cluster.log_dir)})
    finally:
        cluster.stop()
    out["oversubscribed"] = workers + shards > job_cpus
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.run", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=2, help="worker processes")
    ap.add_argument("--params", type=int, default=1_000_000, help="model size (parameters) of bench.task's workload")
    ap.add_argument("--seconds", type=float, default=5.0, help="measured seconds (the window)")
    ap.add_argument("--warmup", type=float, default=2.0, help="seconds of training before the window")
    ap.add_argument("--dtype", choices=["float32", "float64"], default="float32",
                    help="the model's dtype (WORKER_DTYPE)")
    ap.add_argument("--repeat", type=int, default=1, help="runs (one line each)")
    ap.add_argument("--task", choices=["linear", "cnn"], default="linear",
                    help="linear: the anchors' workload at --params; cnn: the torch cnn task (needs the torch extra)")
    ap.add_argument("--transport", choices=["auto", "http"], default="auto",
                    help="auto: the same-host transport when available (the default of a local cluster); "
                         "http: every tensor over the loopback socket")
    ap.add_argument("--compression", choices=["none", "bf16", "fp16", "topk", "2bit"], default="none",
                    help="the job's gradient compression (PS_COMPRESSION; applies to request bodies: --transport http)")
    ap.add_argument("--shards", type=int, default=1, help="PS processes (PS_SHARDS; docs/scaling.md)")
    ap.add_argument("--standby", action="store_true",
                    help="a hot-standby pair (PS_ROLE: every step also applied on a second PS; docs/guides/standby.md)")
    ap.add_argument("--alternate", action="store_true",
                    help="with --standby: each repeat runs the job alone and with a pair, alternating (its cost)")
    ap.add_argument("--pin", action="store_true",
                    help="the job (PS, shards, workers) on every CPU but the last, a --standby's standby on the last "
                         "alone (taskset; without a standby the last CPU idle): a standby's cost with a core of its "
                         "own (the workers' own pinning off)")
    ap.add_argument("--no-pin", action="store_true",
                    help="workers not pinned to CPUs (a local cluster pins each to its own when workers <= CPUs)")
    add_json_option(ap)
    args = ap.parse_args(argv)
    from bench.table import machine  # (bench.table imports this module)
    with Results(args.json, prog=ap.prog) as out:
        for i in range(args.repeat):
            sides = ((False, True) if i % 2 == 0 else (True, False)) if args.alternate else (args.standby,)
            for standby in sides:
                line = measure(args.workers, args.params, args.seconds, args.warmup, args.dtype,
                               transport=args.transport, task=args.task, compression=args.compression,
                               shards=args.shards, pin=args.pin,
                               cluster_options={**({"pin_workers": False} if args.no_pin else {}),
                                                **({"standby": True} if standby else {})} or None)
                if args.alternate:
                    line.update(standby=standby, pair=i, load_1min=round(os.getloadavg()[0], 2), machine=machine())
                out.add(line)
    return 0 if all(line.get("steps_per_s") is not None for line in out.lines) else 1


if __name__ == "__main__":
    sys.exit(main())
