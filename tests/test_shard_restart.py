"""A sharded PS recovers by itself when a follower shard restarts (issue 14; docs/architecture.md, Shards).

- sans-IO: the core's live rewind to a checkpoint (``ParameterServerCore.rewind``): the state is the
  checkpoint's, the open round and the abandoned round records are gone, every worker gets a rejoin code,
  registers again at the checkpoint's step and redoes it (not a duplicate);
- live (real uvicorn shards and worker processes): a follower killed with -9 mid-training and started again
  from its checkpoint directory: the coordinator rolls the job back to the newest step every shard has, the
  workers register again, the job finishes by itself, bit-identical (float64, 0 ulp) to one PS's job.
"""
from __future__ import annotations

import re
import time

import numpy as np
import pytest

from cluster.processes import LocalCluster, wait_for
from ps_service.core import ParameterServerCore
from tests.configs import core_config
from ps_service.http import REFUSALS, status_of
from shared.protocol import ModelInit, PushRequest, PushStatus
from tests.clusters import closed_rounds, final_weights, settled
from tests.reference import train_reference
from tests.timing import allow
from worker_service.loop import REJOIN_CODES

W0 = {"w": np.zeros((3, 2)), "b": np.zeros(2)}


def grad(step: int, rank: int) -> dict:
    rng = np.random.default_rng(100 * step + rank)
    return {k: rng.standard_normal(v.shape) for k, v in W0.items()}


def one_round(core, ids, now):
    step = core.global_step
    return [core.push(PushRequest(w, step, grad(step, r)), now).status for r, w in enumerate(ids)]


def test_the_core_goes_back_live_to_a_checkpoint_and_every_worker_rejoins_there():
    core = ParameterServerCore(core_config(min_workers=2, startup_grace_seconds=0.0))
    core.init_model(ModelInit({k: v.copy() for k, v in W0.items()}, {"name": "momentum", "learning_rate": 0.1}), 0.0)
    ids = [core.register(f"w{i}", 0.0)[0].worker_id for i in range(2)]
    for t in range(3):
        one_round(core, ids, 1.0 + t)
    saved = core.export_state()  # the checkpoint of step 3
    for t in range(2):
        one_round(core, ids, 5.0 + t)
    core.push(PushRequest(ids[0], 5, grad(5, 0)), 7.0)  # round 5 open, with one gradient in
    applied, closed, version = core.gradients_applied, core.rounds_closed, core.version

    gone = core.rewind(saved, 8.0)

    assert [m.worker_id for m in gone] == ids and core.global_step == 3 and core.round is None
    assert all(core.weights[k].tobytes() == saved["weights"][k].tobytes() for k in W0)
    assert core.optimizer.iterations == saved["optimizer"]["iterations"] == 3
    assert all(core.optimizer.slots["accum"][k].tobytes() == saved["optimizer"]["slots"]["accum"][k].tobytes()
               for k in W0)
    assert [r.step for r in core.rounds] == [0, 1, 2]  # the abandoned rounds 3, 4 are not listed
    assert (core.gradients_applied, core.rounds_closed, core.rewinds) == (applied, closed, 1)  # work done: counted
    assert core.version > version and core.state().value == "waiting_for_workers"
    for call in (lambda: core.push(PushRequest(ids[1], 5, grad(5, 1)), 8.5),
                 lambda: core.members.touch(ids[0], 8.5), lambda: core.members.begin_wait(ids[1], 8.5)):
        with pytest.raises(REFUSALS) as err:
            call()
        assert status_of(err.value) == 409 and err.value.code in REJOIN_CODES
    # each registers again: same id and rank, at the checkpoint's step; round 3 opens once both are back
    (m0, s0), (m1, s1) = core.register("w0", 9.0), core.register("w1", 9.0)
    assert [m0.worker_id, m1.worker_id] == ids and (m0.rank, m1.rank) == (0, 1) and (s0, s1) == (3, 3)
    assert core.started and core.round is not None and core.round.step == 3
    assert one_round(core, ids, 10.0) == [PushStatus.ACCEPTED] * 2  # step 3 again: no duplicate
    assert core.global_step == 4 and [r.step for r in core.rounds] == [0, 1, 2, 3]


# ---- live: kill -9 a follower mid-training, start it again -----------------------------------------------

TASK = {"WORKER_TASK": "linear", "WORKER_DTYPE": "float64", "WORKER_SEED": 7, "WORKER_BATCH_SIZE": 16}
ROLLED = re.compile(r"rolled the job back from step (\d+) to step (\d+)")


@pytest.mark.slow
@pytest.mark.parametrize("lose", [0, 2], ids=["restarts-at-its-step", "restarts-behind"])
def test_a_follower_killed_and_restarted_mid_job_rolls_the_job_back_and_it_finishes_bit_identical(tmp_path, lose):
    """``lose``: the follower's newest checkpoints deleted before it starts again (it comes back that far behind)."""
    steps, workers, kill_at = 40, 3, 12
    ckpt = tmp_path / "ckpt"
    ps_env = {"PS_MAX_STEPS": steps, "PS_TOTAL_NUM_REPLICAS": workers, "PS_SHARD_SPLIT_ELEMENTS": 2,
              "PS_CHECKPOINT_DIR": str(ckpt), "PS_CHECKPOINT_EVERY_STEPS": 1, "PS_CHECKPOINT_EVERY_SECONDS": 0,
              "PS_CHECKPOINT_KEEP": 8}
    with LocalCluster(workers, ps_env=ps_env, worker_env={**TASK, "WORKER_COMPUTE_DELAY_SECONDS": 0.02}, shards=2) as c:
        try:
            wait_for(lambda: c.status()["global_step"] >= kill_at, allow(60), f"step {kill_at}")
            killed_at = c.kill(c.followers[0])
            for newest in sorted((ckpt / "shard-1").glob("ckpt-*.msgpack"))[::-1][:lose]:
                newest.unlink()
            c.start_ps(allow(30))  # only shard 1 is not running: it comes back from its checkpoint directory
            up = time.time() - killed_at
            assert c.wait_workers(allow(60)) == [0] * workers
            wait_for(lambda: settled(c.status()), allow(10), "the PS to report done, every shard at its step")
            st = c.status()
            rounds = closed_rounds(c, steps)
            got = final_weights(c)
            coordinator, follower = c.log("ps"), c.log("ps-1")
            rejoined = sum(c.log(f"worker-{i}").count("registering again") for i in range(workers))
        except Exception:
            raise AssertionError(f"job failed; logs:\n{c.logs()}")
    rolled = [tuple(map(int, m)) for m in ROLLED.findall(coordinator)]
    assert len(rolled) == 1 and st["shard"]["rollbacks"] == 1 and st["shard"]["blocked"] is None, (rolled, st["shard"])
    (was, back), = rolled
    restored = int(re.search(r"restored ckpt-(\d+)\.msgpack", follower).group(1))  # where shard 1 came back
    assert kill_at - 2 - lose <= restored <= back <= was and (back == restored if lose else True)
    assert st["shard"]["last_rollback"].startswith(f"from step {was} to step {back}: shard 1 ")
    assert rejoined >= workers  # every worker registered again (a rejoin code), none died
    assert [r["step"] for r in rounds] == list(range(steps))  # each step once: the abandoned rounds are gone
    assert all(len(r["contributors"]) == workers for r in rounds)
    assert [r["step"] for r in st["shard"]["shards"]] == [steps, steps]
    print(f"\nfollower kill -9 at step >= {kill_at} (restarted {up:.2f} s later from step {restored}): job rolled back "
          f"from step {was} to {back} ({was - back} rounds redone)")
    _, ref = train_reference("linear", workers, steps, batch_size=16, seed=7, dtype="float64")
    assert got.keys() == ref.keys()
    for k in ref:
        assert got[k].tobytes() == ref[k].tobytes(), f"{k}: not bit-identical to one PS (0 ulp)"
