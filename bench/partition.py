"""``python -m bench.partition``: node 2 of a two-node Docker Swarm cut off the network for a while, mid-job; what
the cut cost the job and whether Swarm kept node 2's tasks.

Brings up a two-node swarm (:class:`bench.swarm.TwoNodes`: ``../shared/docker/swarm-2node.sh``, node 2 a Docker
engine in a container), optionally sets the dispatcher heartbeat period (``--heartbeat``: Swarm marks a node down
after about three periods without one; 5 s by default), then for each cut in ``--cuts`` (seconds; ``--repeat``
times each) deploys docker-stack.yml as it ships, with the PS on the manager and 2 of the 4 workers on each node
(``max_replicas_per_node: 2``), the stock linear task in float64 paced by ``WORKER_COMPUTE_DELAY_SECONDS``
(``--delay``), and ``--lease`` as ``PS_LEASE_SECONDS`` when given (else the stack's). Once the job trains with 4
workers, every packet of node 2's link is dropped both ways for the cut (:meth:`bench.swarm.TwoNodes.cut`), then
the run watches ``--settle`` seconds more after every worker is back, sampling ``/v1/status`` every 0.1 s and
``docker node ls`` every 0.5 s. One JSON line a run (a table without ``--json``):

- ``stalled_s``: the longest time without a new global step from the cut on; ``steps_during_cut``;
- ``expired_after_cut_s``: when the PS expired each of node 2's workers (its membership events), seconds after the
  cut; ``back_after_return_s``: when each registered for the last time after the network came back (a worker Swarm
  replaced registers twice: its old task, then the new one), seconds after the return, and ``all_back_after_return_s``
  when 4 were active again for good; ``node2_status``: node 2's status changes (``docker node ls``), seconds after
  the cut; ``node2_marked_down``;
- ``replaced``: the workers whose task Swarm shut down and replaced by a new one (``docker service ps``: task ids
  before and after), ``kept``: node 2's workers still in their task;
- exactness, once every worker has left (``docker service scale <stack>_worker=0``: the counts stand still):
  ``applied_once`` (every accepted push applied once: the PS's ``pushes.accepted`` == ``gradients_applied`` == the
  sum of the workers' accepted pushes; duplicates are refused, counted in ``duplicates``) and ``max_weight_error``
  (the weights' largest distance to the linear task's solution);
- ``heartbeat_s`` (the swarm's dispatcher heartbeat period), ``lease_s``; ``machine``, ``load`` (1, 5, 15 min:
  ``os.getloadavg``), ``uptime`` (its line, printed as the run ended), ``utc``.

The swarm is left (``swarm-2node.sh down``, node 2's image store removed) at the end, whatever happened: this engine
is then in no swarm, as tests/test_swarm.py expects. Refuses to run on an engine already in a swarm.
"""
from __future__ import annotations

import argparse
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import numpy as np

from bench.containers import where
from bench.output import Results, add_json_option
from bench.swarm import NODE2, ROOT, TOKEN, StackJob, TwoNodes, scrubbed_env
from cluster.processes import wait_for
from worker_service.client import PSClient
from worker_service.tasks.linear import B_TRUE, W_TRUE

COLUMNS = ("cut_s", "heartbeat_s", "lease_s", "stalled_s", "steps_during_cut", "node2_marked_down",
           "all_back_after_return_s", "replaced", "kept", "applied_once", "max_weight_error", "load")
SPREAD = {"placement": {"max_replicas_per_node": 2}}


class Sampler:
    """Samples ``/v1/status`` (every ``interval`` s) and node 2's status (every 5th sample) in a thread: lists of
    (monotonic time, global step, active workers) and (monotonic time, node 2 status) changes."""

    def __init__(self, job: StackJob, swarm: TwoNodes, interval: float = 0.1) -> None:
        self.job, self.swarm, self.interval = job, swarm, interval
        self.steps: list[tuple[float, int, int]] = []
        self.node2: list[tuple[float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        i = 0
        while not self._stop.is_set():
            s = self.job.try_status()
            if s is not None:
                self.steps.append((time.monotonic(), s["global_step"], s["workers"]["active"]))
            if i % 5 == 0:
                status = self.swarm.nodes().get(NODE2, "?")
                if not self.node2 or self.node2[-1][1] != status:
                    self.node2.append((time.monotonic(), status))
            i += 1
            self._stop.wait(self.interval)

    @contextmanager
    def running(self):
        self._thread.start()
        try:
            yield self
        finally:
            self._stop.set()
            self._thread.join(timeout=30)


def stalled(samples: list[tuple[float, int, int]], since: float) -> float:
    """The longest time without a new global step from ``since`` on (the last interval runs to the last sample)."""
    times = [since] + [t for (t, g, _), (_, g0, _) in zip(samples[1:], samples) if t >= since and g > g0]
    last = samples[-1][0] if samples else since
    return max(b - a for a, b in zip(times, times[1:] + [last]))


def all_back(samples: list[tuple[float, int, int]], since: float, workers: int) -> float | None:
    """Seconds after ``since`` from which every sample shows ``workers`` active (None: not at the end)."""
    after = [(t, a) for t, _, a in samples if t >= since]
    if not after or after[-1][1] != workers:
        return None
    t_back = after[-1][0]
    for t, a in reversed(after):
        if a != workers:
            break
        t_back = t
    return round(t_back - since, 2)


def exactness(job: StackJob, swarm: TwoNodes) -> dict:
    """Once every worker has left (the counts stand still): whether every accepted push was applied once, and the
    weights' largest distance to the task's solution."""
    st = job.stop_workers()
    workers = job.get("/v1/workers")["workers"]
    per_worker = sum(w["pushes"]["accepted"] for w in workers)
    client = PSClient(job.url, timeout=10.0, attempts=3, token=swarm.tokens[TOKEN])
    try:
        t = client.pull(0, wait=5.0).tensors
    finally:
        client.close()
    error = max(float(np.abs(t["w"].reshape(-1) - W_TRUE.reshape(-1)).max()), float(np.abs(t["b"] - B_TRUE).max()))
    return {"global_step": st["global_step"], "pushes_accepted": st["pushes"]["accepted"],
            "gradients_applied": st["gradients_applied"], "workers_accepted": per_worker,
            "duplicates": st["pushes"].get("duplicate"),
            "applied_once": st["pushes"]["accepted"] == st["gradients_applied"] == per_worker,
            "max_weight_error": round(error, 6)}


def active(job: StackJob) -> int | None:
    s = job.try_status()
    return None if s is None else s["workers"]["active"]


def running_tasks(job: StackJob) -> dict[str, dict]:
    """Worker name (as docker-stack.yml names it: ``<stack>_worker-<slot>``) -> its running task."""
    return {f"{job.name}_worker-{t['Name'].rsplit('.', 1)[1]}": t for t in job.tasks("worker")
            if t["DesiredState"] == "Running" and t["CurrentState"].startswith("Running")}


def measure_cut(swarm: TwoNodes, image: str, seconds: float, args: argparse.Namespace) -> dict:
    ps = {"PS_MAX_STEPS": 1_000_000, **({"PS_LEASE_SECONDS": args.lease} if args.lease else {})}
    job = swarm.job(f"cut{int(seconds)}", image, ps=ps,
                    worker={"WORKER_DTYPE": "float64", "WORKER_COMPUTE_DELAY_SECONDS": args.delay},
                    worker_deploy=SPREAD)
    out: dict = {"bench": "swarm-partition", "cut_s": seconds, "heartbeat_s": args.heartbeat,
                 "lease_s": args.lease or 10.0, "workers": 4, "delay_s": args.delay}
    try:
        job.deploy()
        job.wait_status(lambda s: s["state"] == "training" and s["workers"]["active"] == 4 and s["global_step"] >= 30,
                        300, "training with 4 workers")
        before = running_tasks(job)
        remote = sorted(n for n, t in before.items() if t["Node"] == NODE2)
        out["node2_workers"] = remote
        with Sampler(job, swarm).running() as sampler:
            time.sleep(1.0)
            with swarm.cut() as times:
                wall_cut = time.time()
                time.sleep(seconds)
            wall_back = time.time()
            t_cut, t_back = times
            wait_for(lambda: active(job) == 4 and swarm.nodes().get(NODE2) == "Ready", args.deadline,
                     "4 active workers and node 2 ready after the cut", interval=0.2)
            time.sleep(args.settle)  # a reconnected task Swarm shuts down goes in this time
            wait_for(lambda: active(job) == 4, args.deadline, "4 active again", interval=0.2)
        after = running_tasks(job)
        events = job.get("/v1/workers")["events"]
        regs = {n: [e["time"] for e in events if e["name"] == n and e["event"] in ("joined", "rejoined")
                    and e["time"] >= wall_back - 0.5] for n in remote}
        out.update(
            cut_s=round(t_back - t_cut, 2),
            stalled_s=round(stalled(sampler.steps, t_cut), 2),
            steps_during_cut=(max((g for t, g, _ in sampler.steps if t <= t_back), default=0)
                              - max((g for t, g, _ in sampler.steps if t <= t_cut), default=0)),
            expired_after_cut_s={e["name"]: round(e["time"] - wall_cut, 2) for e in events
                                 if e["event"] == "expired" and e["time"] >= wall_cut},
            back_after_return_s={n: round(ts[-1] - wall_back, 2) if ts else None for n, ts in regs.items()},
            registrations_after_return={n: len(ts) for n, ts in regs.items()},
            all_back_after_return_s=all_back(sampler.steps, t_back, 4),
            node2_status=[(round(t - t_cut, 1), s) for t, s in sampler.node2],
            node2_marked_down=any(s == "Down" for _, s in sampler.node2),
            replaced=sorted(n for n in remote if after.get(n, {}).get("ID") != before[n]["ID"]),
            kept=sorted(n for n in remote if after.get(n, {}).get("ID") == before[n]["ID"]),
            tasks_after={n: t["Node"] for n, t in sorted(after.items())},
            **exactness(job, swarm))
    except Exception as exc:  # a failed run is a line too, with the services' last lines
        out.update(error=f"{type(exc).__name__}: {exc}"[:800], ps_log=job.logs("ps"), worker_log=job.logs("worker"))
    finally:
        job.rm()
    return out


def build(image: str) -> None:
    """``docker compose build ps`` of this checkout, tagged ``image``."""
    subprocess.run(["docker", "compose", "-f", str(ROOT / "docker-compose.yml"), "build", "ps"], cwd=ROOT,
                   env=scrubbed_env(SYNCPS_IMAGE=image), capture_output=True, text=True, timeout=900, check=True)


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m bench.partition", description=__doc__.split("\n\n")[0])
    ap.add_argument("--cuts", default="10,20", help="seconds node 2 is cut off, comma-separated (a run each)")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each cut")
    ap.add_argument("--heartbeat", type=float, default=None,
                    help="docker swarm update --dispatcher-heartbeat (seconds) first; default: the swarm's (5 s)")
    ap.add_argument("--lease", type=float, default=None, help="PS_LEASE_SECONDS (default: the stack's, 10 s)")
    ap.add_argument("--delay", type=float, default=0.02, help="WORKER_COMPUTE_DELAY_SECONDS: paces the job")
    ap.add_argument("--settle", type=float, default=30.0,
                    help="seconds watched after every worker is back (Swarm replaces a task within them)")
    ap.add_argument("--deadline", type=float, default=120.0, help="seconds to wait for the workers after the cut")
    ap.add_argument("--image", default="syncps:bench-swarm", help="the image built from this checkout and deployed")
    ap.add_argument("--no-build", action="store_true", help="run --image as it is")
    add_json_option(ap)
    args = ap.parse_args(argv)
    args.cuts = [float(c) for c in args.cuts.split(",") if c]
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse(argv)
    if not args.no_build:
        build(args.image)
    swarm = TwoNodes()
    with Results(args.json, columns=COLUMNS, prog="python -m bench.partition") as results:
        try:
            swarm.up(args.image)
            args.heartbeat = swarm.heartbeat(args.heartbeat)
            for _ in range(args.repeat):
                for seconds in args.cuts:
                    line = measure_cut(swarm, args.image, seconds, args)
                    uptime = subprocess.run(["uptime"], capture_output=True, text=True, timeout=10).stdout.strip()
                    results.add({**line, **where(), "uptime": uptime})
        finally:
            left = swarm.down()
            if left:
                print(f"python -m bench.partition: left {left}", file=sys.stderr)
    return 0 if all(line.get("error") is None for line in results.lines) else 1


if __name__ == "__main__":
    sys.exit(main())
