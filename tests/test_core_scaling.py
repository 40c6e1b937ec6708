"""Per-push work that does not grow with the worker count K (issue 17), measured without a clock: the Python
lines the core runs per push (a full round, its opening and closing included, divided by K) at K = 16 and
K = 512, and the waiters a push wakes in the runtime (none until the barrier moves)."""
from __future__ import annotations

import asyncio
import json
import random
import sys

import numpy as np

from ps_service.core import ParameterServerCore
from tests.configs import core_config
from tests.timing import allow
from ps_service.runtime import Runtime
from ps_service.settings import PSSettings
from shared.protocol import ModelInit, PushRequest

PARAMS = 8


def job(k: int) -> tuple[ParameterServerCore, list[str]]:
    core = ParameterServerCore(core_config(min_workers=k, startup_grace_seconds=0.0, lease_seconds=10.0))
    core.init_model(ModelInit({"w": np.zeros(PARAMS, np.float32)}, {"name": "sgd", "learning_rate": 0.1}), 0.0)
    return core, [core.register(f"w{i}", 0.0)[0].worker_id for i in range(k)]


def run_round(core: ParameterServerCore, ids: list[str], now: float, rng: random.Random) -> float:
    """Every worker pushes (shuffled) and waits on the barrier, with a heartbeat and a tick per push."""
    step, order = core.global_step, list(range(len(ids)))
    rng.shuffle(order)
    for n, i in enumerate(order):
        now += 0.001
        core.members.touch(ids[order[-1 - n]], now)
        core.tick(now)
        core.push(PushRequest(ids[i], step, {"w": np.full(PARAMS, i, np.float32)}), now)
        core.members.begin_wait(ids[i], now)
    for w in ids:
        core.members.end_wait(w, now)
    assert core.global_step == step + 1 and core.rounds[-1].aggregated == len(ids)
    return now


def lines_per_push(k: int) -> float:
    core, ids = job(k)
    rng = random.Random(k)
    now = run_round(core, ids, run_round(core, ids, 0.0, rng), rng)  # warm: two rounds untraced
    count = 0

    def tracer(frame, event, arg):
        nonlocal count
        count += event == "line"
        return tracer

    sys.settrace(tracer)
    try:
        run_round(core, ids, now, rng)
    finally:
        sys.settrace(None)
    return count / k


def test_a_push_runs_as_many_lines_with_512_workers_as_with_16():
    small, large = lines_per_push(16), lines_per_push(512)
    assert large <= 1.3 * small, (small, large)


async def _waiters_wake_once_per_round() -> None:
    k = 8
    rt = Runtime(PSSettings(min_workers=k, startup_grace_seconds=0.0, shm_dir=""))
    core = rt.core
    core.init_model(ModelInit({"w": np.zeros(PARAMS, np.float32)}, {}), rt.now())
    ids = [core.register(f"w{i}", rt.now())[0].worker_id for i in range(k)]
    rt.notify()
    checks, observed = [0], [0]
    rt.observers.append(lambda: observed.__setitem__(0, observed[0] + 1))

    def ready() -> bool:
        checks[0] += 1
        return core.global_step > 0

    waits = [asyncio.create_task(rt.wait_for(ready, allow(30.0), w)) for w in ids]
    for _ in range(1000):  # until every task waits (each has checked once)
        if len(core.members.waits) == k:
            break
        await asyncio.sleep(0)
    assert checks[0] == k
    for w in ids[:-1]:  # pushes that do not close the round: nobody wakes, the observers see each one
        rt.run_guarded(lambda w=w: core.push(PushRequest(w, 0, {"w": np.ones(PARAMS, np.float32)}), rt.now()))
        for _ in range(5):
            await asyncio.sleep(0)
    assert checks[0] == k and observed[0] == k - 1 and not any(t.done() for t in waits)
    rt.run_guarded(lambda: core.push(PushRequest(ids[-1], 0, {"w": np.ones(PARAMS, np.float32)}), rt.now()))
    assert await asyncio.wait_for(asyncio.gather(*waits), allow(10.0)) == [True] * k
    assert checks[0] == 2 * k and core.members.waits == {}
    rt.tensors.close()


def test_a_push_wakes_no_waiter_until_the_round_closes():
    asyncio.run(_waiters_wake_once_per_round())


def test_the_scaling_bench_prints_one_exact_line_per_part_and_k(capsys):
    from bench.core_scaling import main

    main(["--json", "--workers", "2", "5", "--rounds", "3"])
    lines = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [(x["part"], x["K"]) for x in lines] == [("core", 2), ("core", 5), ("runtime", 2), ("runtime", 5)]
    assert all(x["closed_full"] and x["pushes"] == 3 * x["K"] and x["us_per_push"] > 0 for x in lines)
    assert lines[0]["weights_sha"] == lines[2]["weights_sha"]  # the same sums, however they were driven
