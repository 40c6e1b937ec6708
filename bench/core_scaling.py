"""``python -m bench.core_scaling [--workers 16 64 256 1024] [--rounds 30] [--part core runtime]``: the PS's CPU per
push as the worker count K grows, without HTTP. A table row (``--json``: a JSON line) per (part, K).

- ``core``: drives the sans-IO :class:`ps_service.core.ParameterServerCore` directly with K simulated workers:
  a 1,000-param float32 model, SGD, elastic mode, ``--rounds`` rounds where every worker pushes (in a shuffled
  order) and then waits on the barrier (``begin_wait`` .. ``end_wait``, as a long-poll pull does), a heartbeat
  from each worker every lease/3 and a ``tick`` every 0.1 s of simulated time (simulated time moves 0.5 ms per
  push). Only the core calls are timed (process CPU time); gradients are made before each round.
- ``runtime``: the same job through :class:`ps_service.runtime.Runtime` in one asyncio loop: K tasks, each
  pushing (``run_guarded``), long-polling the next step (``wait_for``, the route's predicate) and making the
  weights answer (``TensorSeam.weights_response``), as ``POST /v1/gradients?pull=1`` does. Timed is the whole
  loop (push, wake-ups, predicates, answers, asyncio), gradient copies included.

Fields: ``part``, ``K``, ``rounds``, ``pushes``, ``us_per_push`` and ``us_per_round`` (CPU microseconds),
``weights_sha`` (the final weights' SHA-256: the same for every tree that sums exactly the same way) and
``closed_full`` (every round closed ``full`` with all K contributors).
"""
from __future__ import annotations

import argparse
import asyncio
import hashlib
import random
import time

import numpy as np

from bench.output import Results, add_json_option

from ps_service.core import CoreConfig, ParameterServerCore
from ps_service.settings import PSSettings
from shared.protocol import ModelInit, PushRequest

PARAMS = 1000
LEASE_SECONDS = 10.0
PUSH_DT = 0.0005  # simulated seconds between two pushes
TICK_DT = 0.1


def _init() -> ModelInit:
    return ModelInit({"w": np.zeros(PARAMS, np.float32)}, {"name": "sgd", "learning_rate": 0.01})


def _grads(step: int, k: int) -> list[dict[str, np.ndarray]]:
    rng = np.random.default_rng(step)
    base = rng.standard_normal(PARAMS).astype(np.float32)
    return [{"w": base + np.float32(i * 1e-3)} for i in range(k)]


def _summary(part: str, core: ParameterServerCore, k: int, rounds: int, cpu: float) -> dict:
    pushes = k * rounds
    full = all(rec.reason == "full" and rec.aggregated == k for rec in core.rounds)
    return {"part": part, "K": k, "rounds": rounds, "pushes": pushes, "us_per_push": round(cpu / pushes * 1e6, 2),
            "us_per_round": round(cpu / rounds * 1e6, 1),
            "weights_sha": hashlib.sha256(core.weights["w"].tobytes()).hexdigest()[:16],
            "closed_full": full and len(core.rounds) == rounds}


def run_core(k: int, rounds: int, seed: int = 0) -> dict:
    core = ParameterServerCore(CoreConfig.from_settings(PSSettings(min_workers=k, startup_grace_seconds=0.0,
                                                                  lease_seconds=LEASE_SECONDS)))
    now = 0.0
    core.init_model(_init(), now)
    ids = [core.register(f"w{i}", now)[0].worker_id for i in range(k)]
    next_beat = {w: (LEASE_SECONDS / 3) * (i / k) for i, w in enumerate(ids)}  # spread over one period
    next_tick, beat_at, rng, cpu = TICK_DT, 0, random.Random(seed), 0.0
    for step in range(rounds):
        grads, order = _grads(step, k), list(range(k))
        rng.shuffle(order)
        t0 = time.process_time()
        for i in order:
            now += PUSH_DT
            if now >= next_tick:
                core.tick(now)
                next_tick += TICK_DT
            beat, beat_at = ids[beat_at], (beat_at + 1) % k  # each worker's heartbeat is looked at once a round
            if next_beat[beat] <= now:
                core.members.touch(beat, now)
                next_beat[beat] = now + LEASE_SECONDS / 3
            core.push(PushRequest(ids[i], step, grads[i]), now)
            core.members.begin_wait(ids[i], now)
        for w in ids:
            core.members.end_wait(w, now)
        cpu += time.process_time() - t0
    return _summary("core", core, k, rounds, cpu)


async def _runtime(k: int, rounds: int) -> dict:
    from ps_service.runtime import Runtime
    from ps_service.settings import PSSettings

    rt = Runtime(PSSettings(min_workers=k, startup_grace_seconds=0.0, shm_dir=""))
    core = rt.core
    core.init_model(_init(), rt.now())
    ids = [core.register(f"w{i}", rt.now())[0].worker_id for i in range(k)]
    rt.notify()
    all_grads = {0: _grads(0, k)}

    async def worker(i: int) -> None:
        for step in range(rounds):
            if step not in all_grads:
                all_grads[step] = _grads(step, k)
            req = PushRequest(ids[i], step, {"w": all_grads[step][i]["w"].copy()})
            rt.run_guarded(lambda req=req: core.push(req, rt.now()))
            if await rt.wait_for(lambda step=step: core.done or core.global_step > step, 30.0, ids[i]):
                rt.tensors.weights_response("http")  # the answer of ``POST /v1/gradients?pull=1``

    t0 = time.process_time()
    await asyncio.gather(*(worker(i) for i in range(k)))
    cpu = time.process_time() - t0
    rt.tensors.close()
    return _summary("runtime", core, k, rounds, cpu)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m bench.core_scaling", description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", type=int, nargs="+", default=[16, 64, 256, 1024],
                    help="worker counts K, one line each")
    ap.add_argument("--rounds", type=int, default=30, help="rounds timed per K")
    ap.add_argument("--part", nargs="+", choices=("core", "runtime"), default=["core", "runtime"],
                    help="core: the sans-IO core alone; runtime: through the asyncio runtime (default both)")
    add_json_option(ap)
    args = ap.parse_args(argv)
    with Results(args.json, prog=ap.prog) as out:
        for part in args.part:
            for k in args.workers:
                out.add(run_core(k, args.rounds) if part == "core" else asyncio.run(_runtime(k, args.rounds)))


if __name__ == "__main__":
    main()
