"""``ps_service.runtime.Runtime``'s waits: when the barrier moves, the waits marked ``first`` (answered with the
weights in a body: megabytes to write, maybe over a slow link) resume before the others, each kind in the order it
started waiting (a same-host answer is a few hundred bytes: written after them, it delays them no more); a same-host
answer that first copies the step's weights into the weights file yields to them, even the one the request that
closed the round makes."""
from __future__ import annotations

import asyncio

import numpy as np

from ps_service.runtime import Runtime
from ps_service.settings import PSSettings
from shared.protocol import ModelInit, PushRequest
from tests.timing import allow


async def _resume_order() -> list[str]:
    rt = Runtime(PSSettings(min_workers=1, startup_grace_seconds=0.0, shm_dir=""))
    core = rt.core
    core.init_model(ModelInit({"w": np.zeros(4, np.float32)}, {}), rt.now())
    wid = core.register("w0", rt.now())[0].worker_id
    rt.notify()
    resumed: list[str] = []

    async def wait(name: str, first: bool) -> None:
        assert await rt.wait_for(lambda: core.global_step > 0, allow(30.0), first=first)
        resumed.append(name)

    order = [("shm-1", False), ("body-1", True), ("shm-2", False), ("body-2", True), ("shm-3", False)]
    tasks = []
    for name, first in order:  # each starts waiting before the next one is made
        tasks.append(asyncio.create_task(wait(name, first)))
        for _ in range(3):
            await asyncio.sleep(0)
    assert len(rt._waiters) == len(order)
    rt.run_guarded(lambda: core.push(PushRequest(wid, 0, {"w": np.ones(4, np.float32)}), rt.now()))
    await asyncio.wait_for(asyncio.gather(*tasks), allow(10.0))
    assert not rt.tensors.file_behind()  # no same-host file: never a copy to make
    rt.tensors.close()
    return resumed


def test_waits_answered_with_a_body_resume_first_each_kind_in_the_order_it_waited():
    assert asyncio.run(_resume_order()) == ["body-1", "body-2", "shm-1", "shm-2", "shm-3"]


async def _closer_and_waits(shm_dir: str, body_answered_before: bool) -> list[str]:
    rt = Runtime(PSSettings(min_workers=1, startup_grace_seconds=0.0, shm_dir=shm_dir))
    core = rt.core
    core.init_model(ModelInit({"w": np.zeros(4, np.float32)}, {}), rt.now())
    wid = core.register("w0", rt.now())[0].worker_id
    rt.notify()
    rt.tensors.shm.offer(core.weights, core.global_step)  # the weights in the same-host file
    if body_answered_before:
        rt.tensors.weights_response("http")  # they move into the body answers' frame: the file gets copies
    resumed: list[str] = []

    async def wait(name: str) -> None:
        assert await rt.wait_for(lambda: core.global_step > 0, allow(30.0), first=True)
        resumed.append(name)
        rt.tensors.weights_response("http")

    tasks = [asyncio.create_task(wait(f"body-{i}")) for i in (1, 2)]
    for _ in range(3):
        await asyncio.sleep(0)
    # the request that closes the round answers its same-host worker without waiting
    rt.run_guarded(lambda: core.push(PushRequest(wid, 0, {"w": np.ones(4, np.float32)}), rt.now()))
    assert rt.tensors.file_behind() == body_answered_before
    await rt.body_answers_first()
    resumed.append("shm")
    rt.tensors.weights_response("shm")
    assert not rt.tensors.file_behind() and rt.tensors.shm._weights.marker == 1
    await asyncio.wait_for(asyncio.gather(*tasks), allow(10.0))
    rt.tensors.close()
    return resumed


def test_a_same_host_answer_that_copies_into_the_file_lets_the_woken_body_answers_go_first(tmp_path):
    """Even the one the round-closing request makes (it was never a wait); with no copy to make it goes at once."""
    assert asyncio.run(_closer_and_waits(str(tmp_path), True)) == ["body-1", "body-2", "shm"]
    assert asyncio.run(_closer_and_waits(str(tmp_path), False)) == ["shm", "body-1", "body-2"]


def test_once_the_job_is_done_the_ps_says_once_that_it_stays_up_and_how_to_stop_it(caplog):
    """The workers exited and the PS stays up (its dashboard): its log says the job ended and what stops it. Its
    count of the deployment's workers (PS_WORKERS_DNS), for a step 0 that will not come, ends (it went on logging
    `the deployment runs no workers` as the workers' containers exited)."""
    rt = Runtime(PSSettings(min_workers=1, startup_grace_seconds=0.0, shm_dir="", max_steps=1, workers_dns="localhost"))
    rt.observers.append(rt.tell_done)
    core = rt.core
    core.init_model(ModelInit({"w": np.zeros(4, np.float32)}, {}), rt.now())
    wid = core.register("w0", rt.now())[0].worker_id
    with caplog.at_level("INFO", logger="ps_service"):
        rt.notify()
        assert "the job is done" not in caplog.text  # not before the last step
        rt.run_guarded(lambda: core.push(PushRequest(wid, 0, {"w": np.ones(4, np.float32)}), rt.now()))
        core.tick(rt.now())
        rt.notify()
    assert core.done
    told = [r.getMessage() for r in caplog.records if r.getMessage().startswith("the job is done")]
    assert told == ["the job is done at global step 1: this PS stays up to serve its dashboard (/), /v1/status, "
                    "/metrics and the final weights (`python -m syncps export`); Ctrl-C or SIGTERM stops it"], told
    asyncio.run(asyncio.wait_for(rt.deployment(every=allow(30.0)), allow(10.0)))  # returns at once: no sleep
    rt.tensors.close()
