"""``python -m bench.containers``: one job as local processes, as ``docker compose`` and on a two-node Docker Swarm,
alternately; steps/s of each.

Runs the same job, :mod:`bench.task`'s linear workload at ``--params`` with ``--workers`` sync workers, ``--repeat``
times on each side, the sides taking turns (round r starts with side r mod the number of sides), so the machine's
load falls on them alike:

- ``local-http``: local processes as :mod:`bench.run` starts them (:class:`cluster.processes.LocalCluster`), every
  tensor over TCP on loopback (``--transport http``);
- ``local-auto``: the same with a local cluster's default transport (same-host files when available);
- ``compose``: the repository's docker-compose.yml, ``up -d --scale worker=N`` under a project of its own
  (``--project``), on a free host port (``SYNCPS_PORT``), with an image of its own (``--image``, built from this
  checkout first, cached layers: seconds). Its settings go in an env file, as docs/guides/compose.md keeps them in
  ``.env``; the caller's ``PS_*``, ``WORKER_*``, ``SYNCPS_*`` and ``COMPOSE_*`` variables are not passed to compose.
  The image holds no ``bench`` package, so a second compose file of this bench's mounts this checkout's ``bench/``
  read-only into the workers (``WORKER_TASK=bench.task:params_<P>``). Each line's ``transport`` says how the
  workers reached the PS (``/v1/workers``).
- ``swarm`` (only when named in ``--sides``): docker-stack.yml on a two-node swarm made for the run
  (:class:`bench.swarm.TwoNodes`: ``../shared/docker/swarm-2node.sh``, node 2 a Docker engine in a container, reached
  over the overlay network as another host; left at the end), the PS on the manager and half the workers on each node
  (``max_replicas_per_node``), every tensor over the overlay (TCP); deployed and removed each run. Node 2 cannot mount
  this host's bench/, so the workers run ``--image`` with it copied in (``<image>-swarm``, copied into node 2). CPU
  from the containers' cgroups. More swarm sides (:data:`SWARM_LAYOUTS`, each named only) take the same stack
  apart: ``swarm-published``, placed as ``swarm`` but the workers reach the PS at the manager's published port
  (``WORKER_PS_URL=http://<manager>:<port>``: the nodes' own network, no overlay); ``swarm-manager``, the 4 workers
  on the manager beside the PS (the overlay network, no packet crossing nodes); ``swarm-node2``, the 4 on node 2
  (every tensor through VXLAN between the nodes); ``swarm-node2-published``, the 4 on node 2 at the published port;
  ``swarm-hostnet``, placed as ``swarm`` with deploy/swarm/hostnet.yml (the PS and the workers on each node's
  ``host`` network, the workers at the manager's address: no container network on the way); ``swarm-node2-hostnet``,
  the 4 on node 2 with it.

Every side gets the same settings (:func:`job_settings`): ``PS_TOTAL_NUM_REPLICAS`` and ``PS_MIN_WORKERS`` = N, no
start grace, ``PS_MAX_STEPS`` (``--max-steps``) far beyond the runs, checkpoints every 100 steps (compose's volume;
a temporary directory locally), the task, dtype and quiet logs; workers run one BLAS/OpenMP thread
(worker_service/threads.py; bench.run sets it for local workers). Each run waits for training (global step >= 3),
warms up ``--warmup`` s, then counts global steps over ``--seconds`` from the PS's ``/v1/status``, with the PS's and
the workers' CPU seconds in the window (``/proc`` of each process; a container's by its host PID) and the PS's peak
RSS. Every line carries ``side``, ``run``, ``machine`` (:func:`bench.table.machine`), ``load`` (1, 5, 15 min) and
``utc``; then one summary line a side: the median steps/s, ``ratio`` = that median / the median of the local side
whose workers used the transport the container side's workers used (``against``: :func:`reference`; compose's workers
share the PS's ``shm`` volume, so same-host files when it works; the swarm's use TCP), ``ratio_to_local_http`` and
``ratio_to_local_auto``, for compose and swarm ``within_10pct`` (ratio >= 0.9), and the median ``cpu_ms_per_step`` (the PS's and the workers' CPU a global
step: what a step costs, which the other load on the machine changes less than steps/s). A table by default, JSON lines with ``--json``. Every command has a timeout; the
compose project is taken down with ``down -v`` and the swarm left at the end, whatever happened.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import httpx

from bench.output import Results, add_json_option
from bench.run import _cpu_seconds, _proc_status, measure
from bench.swarm import TwoNodes, cgroup_cpu_seconds
from bench.table import machine
from bench.task import actual_params, model_dims
from cluster.processes import free_port, patience, wait_for
from shared.protocol import PHASES

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
#: the swarm sides: where the workers run (``spread``: half on each node; ``manager``; ``worker``: node 2) and how
#: they reach the PS: ``overlay`` (``ps:8000``), ``published`` (the manager's published port), ``hostnet`` (the PS and
#: the workers on each node's ``host`` network, deploy/swarm/hostnet.yml: the manager's address, no container network)
SWARM_LAYOUTS = {"swarm": ("spread", "overlay"), "swarm-published": ("spread", "published"),
                 "swarm-hostnet": ("spread", "hostnet"), "swarm-manager": ("manager", "overlay"),
                 "swarm-node2": ("worker", "overlay"), "swarm-node2-published": ("worker", "published"),
                 "swarm-node2-hostnet": ("worker", "hostnet")}
HOSTNET_FILE = ROOT / "deploy" / "swarm" / "hostnet.yml"
SIDES = ("local-http", "local-auto", "compose", *SWARM_LAYOUTS)
#: the sides run without --sides (a swarm side brings up a second Docker engine: asked for by name)
DEFAULT_SIDES = SIDES[:3]
#: the sides that run in containers, each measured against the local side of its workers' transport
CONTAINED = ("compose", *SWARM_LAYOUTS)
TARGET = 0.9
SCRUBBED = ("PS_", "WORKER_", "SYNCPS_", "COMPOSE_")
COLUMNS = ("side", "run", "steps_per_s", "median_steps_per_s", "against", "ratio", "ratio_to_local_http",
           "ratio_to_local_auto", "within_10pct", "transport", "ps_cpu_s", "workers_cpu_s", "cpu_ms_per_step",
           "median_cpu_ms_per_step", "load_1min")


def job_settings(params: int, workers: int, max_steps: int, dtype: str = "float32") -> tuple[dict, dict]:
    """(PS settings, worker settings) of the job, the same on both sides."""
    ps = {"PS_TOTAL_NUM_REPLICAS": workers, "PS_MIN_WORKERS": workers, "PS_STARTUP_GRACE_SECONDS": 0,
          "PS_MAX_STEPS": max_steps, "PS_LOG_LEVEL": "warning", "PS_CHECKPOINT_EVERY_STEPS": 100}
    worker = {"WORKER_TASK": f"bench.task:params_{int(params)}", "WORKER_DTYPE": dtype,
              "WORKER_LOG_EVERY_SECONDS": 3600}
    return ps, worker


def override(bench_dir: Path = ROOT / "bench") -> str:
    """The second compose file: this checkout's bench/ in the workers, read-only (the image has no bench package)."""
    return f"services:\n  worker:\n    volumes:\n      - {json.dumps(str(bench_dir) + ':/app/bench:ro')}\n"


class ComposeJob:
    """One compose project of the repository's docker-compose.yml plus :func:`override`, settings in an env file."""

    def __init__(self, project: str, image: str, settings: dict, workdir: Path) -> None:
        self.project, self.port = project, free_port()
        self.env_file, self.extra = workdir / "compose.env", workdir / "bench-override.yml"
        env = {"SYNCPS_IMAGE": image, "SYNCPS_PORT": self.port, **settings}
        self.env_file.write_text("".join(f"{k}={v}\n" for k, v in env.items()))
        self.extra.write_text(override())
        self.url = f"http://127.0.0.1:{self.port}"
        self.environ = {k: v for k, v in os.environ.items() if not k.startswith(SCRUBBED)}

    def compose(self, *args: str, timeout: float = 180.0) -> str:
        cmd = ["docker", "compose", "-p", self.project, "--env-file", str(self.env_file), "-f", str(COMPOSE_FILE),
               "-f", str(self.extra), *args]
        done = subprocess.run(cmd, cwd=ROOT, env=self.environ, capture_output=True, text=True,
                              timeout=timeout * patience())
        if done.returncode != 0:
            raise RuntimeError(f"{' '.join(cmd[2:])}: exit {done.returncode}: {(done.stderr or done.stdout)[-1500:]}")
        return done.stdout

    def pids(self, service: str) -> list[int]:
        """Host PIDs of the service's running containers' main processes."""
        ids = self.compose("ps", "-q", service, timeout=60).split()
        if not ids:
            return []
        out = subprocess.run(["docker", "inspect", "-f", "{{.State.Pid}}", *ids], capture_output=True, text=True,
                             timeout=60, check=True).stdout
        return [int(p) for p in out.split() if int(p) > 0]

    def post_mortem(self) -> dict:
        """For a failed run's line: the PS's last ``/v1/status`` and the services' last log lines (what can be had)."""
        out: dict = {}
        try:
            out["last_status"] = httpx.get(f"{self.url}/v1/status", timeout=10.0).json()
        except (httpx.HTTPError, ValueError) as exc:
            out["last_status"] = f"{type(exc).__name__}: {exc}"[:300]
        try:
            out["log_tail"] = self.compose("logs", "--no-color", "--tail", "15", timeout=60)[-4000:]
        except (RuntimeError, subprocess.TimeoutExpired) as exc:
            out["log_tail"] = f"{type(exc).__name__}: {exc}"[:300]
        return out

    def down(self) -> None:
        self.compose("down", "-v", "--remove-orphans", timeout=180)


def _cpu(pids: list[int]) -> float | None:
    values = [_cpu_seconds(p) for p in pids]
    return None if not values or None in values else sum(values)


def window(url: str, workers: int, seconds: float, warmup: float, cpu, headers: dict | None = None,
           start_deadline: float = 300.0) -> dict:
    """Once the job trains (global step >= 3) and ``warmup`` s more: global steps over ``seconds`` from ``/v1/status``,
    with ``cpu()`` -> (the PS's CPU seconds, the workers' or None, the PS's host PID or None) read at both ends; the
    line's fields as :func:`bench.run.measure` gives them (those that apply)."""
    with httpx.Client(base_url=url, headers=headers or {}, timeout=30.0) as client:
        def training() -> bool:
            try:
                st = client.get("/v1/status").json()
            except (httpx.TransportError, ValueError):
                return False
            return st.get("state") == "training" and st["global_step"] >= 3
        wait_for(training, start_deadline, "training to start", interval=0.2)
        time.sleep(warmup)
        cpu0, wcpu0, pid = cpu()
        t0, g0 = time.perf_counter(), client.get("/v1/status").json()["global_step"]
        time.sleep(seconds)
        t1, st = time.perf_counter(), client.get("/v1/status").json()
        cpu1, wcpu1, _ = cpu()
        members = client.get("/v1/workers").json()["workers"]
    g1, rate = st["global_step"], (st["global_step"] - g0) / (t1 - t0)
    ps_cpu = None if cpu0 is None or cpu1 is None else round(cpu1 - cpu0, 3)
    w_cpu = None if wcpu0 is None or wcpu1 is None else round(wcpu1 - wcpu0, 3)
    out = dict(steps_per_s=round(rate, 4), final_loss=st["loss"]["last"],
               peak_rss_MB=round(_proc_status(pid, "VmHWM") or 0.0, 1) if pid else None,
               ps_cpu_s=ps_cpu, workers_cpu_s=w_cpu, steps=g1 - g0, window_s=round(t1 - t0, 3),
               transport="+".join(sorted({m["transport"] for m in members if m["transport"]})),
               worker_phase_ms={k: round(1e3 * sum(m["mean_seconds"][k] for m in members) / len(members), 2)
                                for k in PHASES})
    if ps_cpu is not None and w_cpu is not None and g1 > g0:
        out["cpu_ms_per_step"] = round(1e3 * (ps_cpu + w_cpu) / (g1 - g0), 2)
    return out


def measure_compose(job: ComposeJob, workers: int, params: int, seconds: float, warmup: float,
                    start_deadline: float = 300.0) -> dict:
    """One compose run (``up -d --scale worker=N``, the window, ``down -v``); the line as :func:`bench.run.measure`
    gives it (its fields that apply)."""
    out = _line(workers, params)

    def cpu() -> tuple:
        ps, ws = job.pids("ps"), job.pids("worker")
        return _cpu(ps), _cpu(ws) if len(ws) == workers else None, ps[0] if ps else None
    try:
        job.compose("up", "-d", "--scale", f"worker={workers}", timeout=start_deadline)
        out.update(window(job.url, workers, seconds, warmup, cpu, start_deadline=start_deadline))
    except Exception as exc:  # a failed run is a line too, with what the PS said last and the services' last lines
        out.update(steps_per_s=None, error=f"{type(exc).__name__}: {exc}"[:800], **job.post_mortem())
    finally:
        try:
            job.down()
        except Exception as exc:  # noqa: BLE001 - said in the line; main's finally tries again
            out.setdefault("error", f"down: {exc}"[:800])
    return out


def _line(workers: int, params: int) -> dict:
    d, k = model_dims(params)
    return {"system": "syncps", "workers": workers, "params": actual_params(params), "params_requested": int(params),
            "d": d, "k": k}


def swarm_image(image: str, workdir: Path) -> str:
    """``image`` with this checkout's bench/ in /app/bench (node 2 cannot mount a folder of this host), built as
    ``<image>-swarm``: the workers load ``bench.task`` from it."""
    context = workdir / "swarm-image"
    shutil.copytree(ROOT / "bench", context / "bench", ignore=shutil.ignore_patterns("__pycache__", "*.pyc", "results"))
    (context / "Dockerfile").write_text(f"FROM {image}\nCOPY bench/ /app/bench/\n")
    tag = f"{image}-swarm"
    subprocess.run(["docker", "build", "-q", "-t", tag, str(context)], capture_output=True, text=True, timeout=600,
                   check=True)
    return tag


def swarm_layout(side: str, workers: int, manager: str, port: int) -> tuple[dict, dict, dict]:
    """(the worker service's ``deploy`` additions, its extra settings, :class:`bench.swarm.StackJob`'s ``files`` and
    ``env``) of a swarm side (:data:`SWARM_LAYOUTS`)."""
    where, reach = SWARM_LAYOUTS[side]
    placement = ({"max_replicas_per_node": (workers + 1) // 2} if where == "spread"
                 else {"constraints": [f"node.role == {where}"]})
    settings = {"WORKER_PS_URL": f"http://{manager}:{port}"} if reach == "published" else {}
    stack = {"files": (HOSTNET_FILE,), "env": {"SYNCPS_PS_HOST": manager}} if reach == "hostnet" else {}
    return {"placement": placement}, settings, stack


def measure_swarm(swarm: TwoNodes, image: str, workers: int, params: int, max_steps: int, seconds: float,
                  warmup: float, side: str = "swarm", start_deadline: float = 120.0) -> dict:
    """One run on the two-node swarm: docker-stack.yml with the job's settings, the PS on the manager and the workers
    where ``side`` puts them (:func:`swarm_layout`; ``swarm``: half on each node, every tensor over the overlay
    network); the window; ``docker stack rm``. CPU from the containers' cgroups (node 2's are in this host's tree)."""
    out = _line(workers, params)
    ps_env, worker_env = job_settings(params, workers, max_steps)
    port = free_port()
    deploy, reach, stack = swarm_layout(side, workers, swarm.address, port)
    job = swarm.job(side, image, ps=ps_env, worker={**worker_env, **reach}, worker_deploy=deploy, port=port, **stack)

    def cgroups(ids: list[str]) -> float | None:
        values = [cgroup_cpu_seconds(c) for c in ids]
        return None if not values or None in values else sum(values)

    found: dict = {}

    def cpu() -> tuple:  # the containers found once, before the window: its end reads only their cgroups
        if not found:
            found.update(ps=job.containers("ps"), ws=job.containers("worker"))
            pid = subprocess.run(["docker", "inspect", "-f", "{{.State.Pid}}", *found["ps"][:1]], capture_output=True,
                                 text=True, timeout=60).stdout.strip() if found["ps"] else ""
            found["pid"] = int(pid) if pid.isdigit() else None
        ws = found["ws"]
        return cgroups(found["ps"]), cgroups(ws) if len(ws) == workers else None, found["pid"]
    try:
        job.deploy()
        out.update(window(job.url, workers, seconds, warmup, cpu, headers=job.headers, start_deadline=start_deadline))
        out["nodes"] = sorted(t["Node"] for t in job.tasks("worker") if t["DesiredState"] == "Running")
    except Exception as exc:  # a failed run is a line too, with the services' last lines
        out.update(steps_per_s=None, error=f"{type(exc).__name__}: {exc}"[:800], last_status=job.try_status(),
                   log_tail=job.logs("ps") + job.logs("worker"))
    finally:
        job.rm()
    return out


def run_side(side: str, args: argparse.Namespace, job: ComposeJob | None, swarm: TwoNodes | None = None) -> dict:
    ps_env, worker_env = job_settings(args.params, args.workers, args.max_steps)
    if side == "compose":
        return measure_compose(job, args.workers, args.params, args.seconds, args.warmup)
    if side in SWARM_LAYOUTS:
        return measure_swarm(swarm, args.swarm_image, args.workers, args.params, args.max_steps, args.seconds,
                             args.warmup, side)
    with tempfile.TemporaryDirectory(prefix="syncps-bench-ckpt-") as ckpt:
        return measure(args.workers, args.params, args.seconds, args.warmup, ps_env={**ps_env, "PS_CHECKPOINT_DIR": ckpt},
                       worker_env=worker_env, transport=side.removeprefix("local-"))


def where() -> dict:
    """Where and under what load a line was measured: ``machine``, ``load`` (1, 5, 15 min), ``load_1min``, ``utc``."""
    load = os.getloadavg()
    return {"machine": machine(), "load": [round(x, 2) for x in load], "load_1min": round(load[0], 2),
            "utc": datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")}


def reference(lines: list[dict], side: str = "compose") -> str:
    """The local side a container side is measured against: the one whose workers used that side's transport
    (``local-auto`` when compose's workers passed tensors through the shared ``shm`` volume, ``local-http`` when they
    used TCP, as the swarm's workers on two nodes do)."""
    used = {line.get("transport") for line in lines if line.get("side") == side and line.get("transport")}
    return "local-auto" if used == {"shm"} else "local-http"


def summarize(lines: list[dict]) -> list[dict]:
    """One summary line a side (in :data:`SIDES` order, sides with a steps/s only): the median, ``ratio`` to the
    :func:`reference` side's median (named in ``against``: compose's for the local sides), ``ratio_to_local_http`` and
    ``ratio_to_local_auto``; a container side's says whether it is within 10 % of its reference (``within_10pct``)."""
    runs = [line for line in lines if line.get("side") in SIDES and line.get("steps_per_s") is not None
            and "median_steps_per_s" not in line]
    rates = {side: [x["steps_per_s"] for x in runs if x["side"] == side] for side in SIDES}
    medians = {side: statistics.median(v) for side, v in rates.items() if v}
    out = []
    for side in (s for s in SIDES if s in medians):
        against = reference(lines, side if side in CONTAINED else "compose")
        row = {"side": side, "run": "median", "runs": len(rates[side]), "median_steps_per_s": round(medians[side], 4)}
        cpu = [x["cpu_ms_per_step"] for x in runs if x["side"] == side and x.get("cpu_ms_per_step") is not None]
        if cpu:
            row["median_cpu_ms_per_step"] = round(statistics.median(cpu), 2)
        for name, ref in (("ratio", against), ("ratio_to_local_http", "local-http"), ("ratio_to_local_auto", "local-auto")):
            if medians.get(ref):
                row[name] = round(medians[side] / medians[ref], 3)
        row["against"] = against
        if side in CONTAINED and "ratio" in row:
            row["within_10pct"] = row["ratio"] >= TARGET
        out.append(row)
    return out


def order(run: int, sides: list[str]) -> list[str]:
    """Round ``run``'s order: the sides rotated by ``run``, so no side always goes first."""
    k = run % len(sides)
    return sides[k:] + sides[:k]


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.containers", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, default=4, help="workers (compose: --scale worker=N)")
    ap.add_argument("--params", type=int, default=1_000_000, help="model size of bench.task's workload")
    ap.add_argument("--seconds", type=float, default=10.0, help="measured seconds a run (the window)")
    ap.add_argument("--warmup", type=float, default=3.0, help="seconds of training before the window")
    ap.add_argument("--repeat", type=int, default=3, help="runs a side, alternating")
    ap.add_argument("--sides", default=",".join(DEFAULT_SIDES),
                    help=f"comma-separated, of {', '.join(SIDES)} (default: {', '.join(DEFAULT_SIDES)})")
    ap.add_argument("--max-steps", type=int, default=1_000_000, help="PS_MAX_STEPS of the job (both sides)")
    ap.add_argument("--project", default="syncpsbenchcontainers", help="the compose project's name")
    ap.add_argument("--image", default="syncps:bench-containers",
                    help="the image tag compose builds from this checkout and runs (SYNCPS_IMAGE)")
    ap.add_argument("--no-build", action="store_true", help="run --image as it is (no `docker compose build`)")
    add_json_option(ap)
    args = ap.parse_args(argv)
    args.sides = [s for s in args.sides.split(",") if s]
    unknown = sorted(set(args.sides) - set(SIDES))
    if unknown or not args.sides:
        ap.error(f"--sides: unknown {unknown} (of {', '.join(SIDES)})")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    with tempfile.TemporaryDirectory(prefix="syncps-bench-containers-") as tmp, \
            Results(args.json, columns=COLUMNS, prog="python -m bench.containers") as results:
        job = swarm = None
        if set(CONTAINED) & set(args.sides):
            ps_env, worker_env = job_settings(args.params, args.workers, args.max_steps)
            job = ComposeJob(args.project, args.image, {**ps_env, **worker_env}, Path(tmp))
        try:
            if job is not None and not args.no_build:
                job.compose("build", "ps", timeout=900)
            if set(SWARM_LAYOUTS) & set(args.sides):
                args.swarm_image = swarm_image(args.image, Path(tmp))
                swarm = TwoNodes()
                swarm.up(args.swarm_image)
            for run in range(args.repeat):
                for side in order(run, args.sides):
                    results.add({"side": side, "run": run, **run_side(side, args, job, swarm), **where()})
            for row in summarize(results.lines):
                results.add({**row, **where()})
        finally:
            if job is not None:
                job.down()
            if swarm is not None:
                left = swarm.down()
                if left:
                    print(f"python -m bench.containers: the swarm left {left}", file=sys.stderr)
    return 0 if all(line.get("error") is None for line in results.lines) else 1


if __name__ == "__main__":
    sys.exit(main())
