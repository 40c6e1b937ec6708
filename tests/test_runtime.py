"""``ps_service.runtime.Runtime``'s waits: when the barrier moves, the waits marked ``first`` (answered with the
weights in a body: megabytes to write, maybe over a slow link) resume before the others, each kind in the order it
started waiting (a same-host answer is a few hundred bytes: written after them, it delays them no more)."""
from __future__ import annotations

import asyncio

import numpy as np

from ps_service.runtime import Runtime
from ps_service.settings import PSSettings
from shared.protocol import ModelInit, PushRequest


async def _resume_order() -> list[str]:
    rt = Runtime(PSSettings(min_workers=1, startup_grace_seconds=0.0, shm_dir=""))
    core = rt.core
    core.init_model(ModelInit({"w": np.zeros(4, np.float32)}, {}), rt.now())
    wid = core.register("w0", rt.now())[0].worker_id
    rt.notify()
    resumed: list[str] = []

    async def wait(name: str, first: bool) -> None:
        assert await rt.wait_for(lambda: core.global_step > 0, 30.0, first=first)
        resumed.append(name)

    order = [("shm-1", False), ("body-1", True), ("shm-2", False), ("body-2", True), ("shm-3", False)]
    tasks = []
    for name, first in order:  # each starts waiting before the next one is made
        tasks.append(asyncio.create_task(wait(name, first)))
        for _ in range(3):
            await asyncio.sleep(0)
    assert len(rt._waiters) == len(order)
    rt.run_guarded(lambda: core.push(PushRequest(wid, 0, {"w": np.ones(4, np.float32)}), rt.now()))
    await asyncio.wait_for(asyncio.gather(*tasks), 10.0)
    rt.tensors.close()
    return resumed


def test_waits_answered_with_a_body_resume_first_each_kind_in_the_order_it_waited():
    assert asyncio.run(_resume_order()) == ["body-1", "body-2", "shm-1", "shm-2", "shm-3"]
