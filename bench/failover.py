"""The crash loop of a hot-standby pair (issue 51; docs/guides/standby.md): one job of a pair and N workers (local
processes) run to the end uninterrupted, then jobs whose primary is kill -9'd at random moments again and again
(each time started again: it comes back as the standby of the newer term, and is killed in turn once it took over);
each job must end with the uninterrupted job's bits (weights, optimizer slots, step: ``GET /v1/ha?digest=1``).

Per job: the kills, whether its bits are the uninterrupted job's, how long after each kill a round closed again
(median, max), and the rounds redone beyond the one open (``lost``: a worker that resumed behind the round it had
open; must be 0). Then one line over every job: the kills, the times' median, p99 and max.
"""
from __future__ import annotations

import argparse
import datetime
import os
import random
import re
import statistics
import sys
import time

import httpx

from bench.output import Results, add_json_option
from bench.table import machine
from cluster.processes import LocalCluster, wait_for
from worker_service.client import PSClient

TASK = {"WORKER_TASK": "linear", "WORKER_DTYPE": "float64", "WORKER_SEED": 7, "WORKER_BATCH_SIZE": 16}
RESUMED = re.compile(r"this worker was at step (\d+), resuming at (\d+)")
#: seconds a PS has to answer a probe (``GET /v1/ha``, ``/v1/status``) on a quiet machine, times the patience
PROBE_SECONDS = 2.0


def ha(url: str, digest: bool = False, patience: float = 1.0) -> dict | None:
    """A PS's ``GET /v1/ha`` (None: no answer within ``patience`` x :data:`PROBE_SECONDS`)."""
    try:
        resp = httpx.get(f"{url}/v1/ha", params={"digest": digest}, timeout=PROBE_SECONDS * patience)
        return resp.json() if resp.status_code == 200 else None
    except httpx.HTTPError:
        return None


def status(url: str, patience: float = 1.0) -> dict | None:
    """A PS's ``GET /v1/status`` (None: no answer within ``patience`` x :data:`PROBE_SECONDS`)."""
    try:
        return httpx.get(f"{url}/v1/status", timeout=PROBE_SECONDS * patience).json()
    except (httpx.HTTPError, ValueError):
        return None


def primary(c: LocalCluster, patience: float = 1.0) -> tuple[str, dict] | None:
    """(URL, ``GET /v1/ha``) of the pair's PS that is the primary now."""
    for url in (c.url, c.peer_url):
        got = ha(url, patience=patience)
        if got is not None and got["role"] == "primary":
            return url, got
    return None


def same_bits(c: LocalCluster, patience: float = 1.0) -> bool:
    a, b = ha(c.url, True, patience), ha(c.peer_url, True, patience)
    return a is not None and b is not None and a["digest"] is not None and a["digest"] == b["digest"]


def _done(url: str, patience: float) -> bool:
    return (status(url, patience) or {}).get("state") == "done"


def kill_loop(c: LocalCluster, rng: random.Random, kills: int, patience: float = 1.0) -> list[float]:
    """Until ``kills`` kills or the job is done: once the primary's standby took its state, after a pause of 0-0.4 s,
    kill -9 the primary, wait until the other took over and closed a round, start the killed one again. The seconds
    from each kill until that round closed. Each wait: 30 s on a quiet machine, times ``patience``."""
    procs = {c.url: lambda: c.ps, c.peer_url: lambda: c.peer}
    again: list[float] = []
    while len(again) < kills:
        def ready():
            """The primary (its URL, ``GET /v1/ha``) once its standby took its state or the job is done, else None."""
            p = primary(c, patience)
            if p is None:
                return None
            other = ha(c.peer_url if p[0] == c.url else c.url, patience=patience)
            synced = other is not None and other["role"] == "standby" and other["synced"]
            return p if synced or _done(p[0], patience) else None

        url, _ = wait_for(ready, 30 * patience, "a primary whose standby took its state")
        time.sleep(rng.uniform(0.0, 0.4))  # the kill's moment in the round, at random (not a synchronisation)
        st = status(url, patience) or {}
        if st.get("state") == "done":
            break
        killed = time.monotonic()
        c.kill(procs[url]())
        other = c.peer_url if url == c.url else c.url

        def moved():
            s = status(other, patience)
            return s is not None and s["pair"]["role"] == "primary" and (
                s["global_step"] > st.get("global_step", 0) or s["state"] == "done")

        wait_for(moved, 30 * patience, "the standby to take over and close a round")
        again.append(time.monotonic() - killed)
        c.start_ps(30 * patience)  # the killed one comes back at its port: the standby of the newer term
    return again


def run_job(workers: int, steps: int, kills: int, seed: int, patience: float = 1.0, carrier: str = "log") -> dict:
    """One job (``kills`` 0: uninterrupted). Its primary's digest and final weights, the kill times, the rounds
    lost. ``carrier``: the steps through the standby's same-host log, or over HTTP (``PS_SHM_DIR`` empty: as between
    hosts). ``patience``: how many times a quiet machine's time every wait allows (a test passes the load's,
    tests/timing.py; the job to train 120 s, each kill's takeover 30 s, the standby to hold the bits 10 s, a probe
    :data:`PROBE_SECONDS`)."""
    env = {"PS_MAX_STEPS": steps, "PS_TOTAL_NUM_REPLICAS": workers, **({"PS_SHM_DIR": ""} if carrier == "http" else {})}
    with LocalCluster(workers, ps_env=env, worker_env={**TASK, "WORKER_COMPUTE_DELAY_SECONDS": 0.02},
                      standby=True) as c:
        try:
            wait_for(lambda: (status(c.url, patience) or {}).get("global_step", 0) >= 2, 120 * patience, "training")
            again = kill_loop(c, random.Random(seed), kills, patience) if kills else []
            codes = c.wait_workers(120 * patience)
            wait_for(lambda: same_bits(c, patience), 10 * patience, "the standby to hold the primary's bits")
            url, got = wait_for(lambda: primary(c, patience), 10 * patience, "the primary's answer")
            digest = ha(url, True, patience)["digest"]
            # the steps the same-host log carried
            logged = sum(ha(u, patience=patience)["costs"]["logged"] for u in (c.url, c.peer_url))
            reader = PSClient(url, timeout=30 * patience)
            try:
                weights = dict(reader.pull(0, wait=5.0 * patience).tensors)
            finally:
                reader.close()
            resumed = [tuple(map(int, m)) for i in range(workers) for m in RESUMED.findall(c.log(f"worker-{i}"))]
        except Exception:
            c.mark_failed()
            raise RuntimeError(f"job failed; logs:\n{c.logs()}") from None
    return {"seed": seed, "kills": len(again), "again": again, "digest": digest, "weights": weights,
            "step": got["step"], "logged": logged,
            "exit_codes": codes, "lost": sum(1 for was, back in resumed if back < was - 1), "url": url}


def utc() -> str:
    return datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%dT%H:%M")


def percentile(xs: list[float], q: float) -> float | None:
    return None if not xs else sorted(xs)[min(len(xs) - 1, int(q * len(xs)))]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.failover", description=__doc__.split("\n\n")[0])
    ap.add_argument("--jobs", type=int, default=15, help="jobs with kills")
    ap.add_argument("--kills", type=int, default=8, help="kills per job at most (fewer if the job ends first)")
    ap.add_argument("--steps", type=int, default=400, help="steps of each job (PS_MAX_STEPS)")
    ap.add_argument("--workers", type=int, default=3, help="workers of each job")
    add_json_option(ap)
    args = ap.parse_args(argv)
    stamp = {"machine": machine(), "command": "python -m bench.failover " + " ".join(argv if argv is not None else
                                                                                   sys.argv[1:])}
    base = run_job(args.workers, args.steps, 0, 0)
    times: list[float] = []
    identical = lost = 0
    with Results(args.json, prog=ap.prog) as out:
        for seed in range(1, args.jobs + 1):
            job = run_job(args.workers, args.steps, args.kills, seed)
            times += job["again"]
            identical += job["digest"] == base["digest"]
            lost += job["lost"]
            out.add({**stamp, "utc": utc(), "load_1min": round(os.getloadavg()[0], 2), "job": seed,
                     "kills": job["kills"], "bit_identical": job["digest"] == base["digest"],
                     "lost_rounds": job["lost"],
                     "again_median_s": statistics.median(job["again"]) if job["again"] else None,
                     "again_max_s": max(job["again"], default=None)})
        out.add({**stamp, "utc": utc(), "load_1min": round(os.getloadavg()[0], 2), "job": "all", "kills": len(times),
                 "bit_identical": identical == args.jobs, "lost_rounds": lost,
                 "again_median_s": statistics.median(times) if times else None, "again_p99_s": percentile(times, 0.99),
                 "again_max_s": max(times, default=None)})
    return 0 if identical == args.jobs and lost == 0 else 1


if __name__ == "__main__":
    raise SystemExit(main())
