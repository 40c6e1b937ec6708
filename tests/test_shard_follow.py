"""A shard's memory is flat in the worker count (ps_service/sharding/turns.py): with pieces of 1 MiB or more a
follower sums a round as the coordinator's round is summed, as told, and every shard reads a hold only in its worker's
turn (the coordinator's core's intake, ps_service/core/intake.py); the result is the rank-order sum of the round's
contributors, bit for bit, also when a worker that held its pieces never commits, and with fixed R (the first R holds
on the coordinator contribute; the others are answered late by every shard, kept by none).

In-process shards (uvicorn threads) so the test can count what each shard holds; workers are threads that do what
a worker does (hold on both shards, then commit with the follower's receipt), all at once, in reverse rank order.
Then real processes: a job trains bit-identical to the same job on one PS, over bodies and same-host files, and also
when a follower is killed (kill -9) and started again mid-job (the live rollback)."""
from __future__ import annotations

import threading

import numpy as np
import pytest

from cluster.processes import LocalCluster, wait_for
from ps_service.sharding.holds import Held, Holds
from ps_service.sharding.turns import FOLD_BYTES
from shared import frame, shards
from tests.clusters import final_weights, run_job
from tests.reference import train_reference
from tests.test_shards import assemble, commit, hold, two_shards
from tests.timing import allow
from worker_service.tasks import load_task

#: float32 elements: split in two pieces of 2.4 MB, one per shard (above the gate, FOLD_BYTES)
P = 1_200_000
W0 = {"w": np.zeros(P, np.float32)}
LR = 0.5


def gradient(i: int) -> dict[str, np.ndarray]:
    return {"w": np.random.default_rng(i).standard_normal(P).astype(np.float32)}


def start(c, f, n: int):
    hc, hf = c.http(), f.http()
    ids = [hc.post("/v1/workers", json={"name": f"w{i}"}).json()["worker_id"] for i in range(n)]
    body = b"".join(bytes(p) for p in frame.encode(W0, {"optimizer": {"name": "sgd", "learning_rate": LR}}))
    assert hc.put("/v1/model", content=body, headers={"content-type": frame.MEDIA_TYPE}).status_code == 201
    m = shards.from_wire(hc.get("/v1/shards").json()["map"])
    assert [len(p) for p in m.pieces] == [1, 1] and f.rt.shards.folds(1)
    wait_for(lambda: c.rt.core.round is not None, allow(10), "round 0")
    assert [c.rt.core.members.by_id[w].rank for w in ids] == list(range(n))
    return hc, hf, m, ids


def counting(rt) -> list[int]:
    """The most pieces a shard held at once, not summed yet (as a list of one, updated on every hold): its holds,
    and on the coordinator the gradients its round took and has not summed yet."""
    most, role = [0], rt.shards
    put = role.holds.put

    def counted(worker_id, held):
        put(worker_id, held)
        r = rt.core.round if role.coordinator else None
        most[0] = max(most[0], len(role.holds) + (len(r.acc.waiting) if r is not None else 0))
    role.holds.put = counted
    return most


def rank_order_weights(contributors: list[int]) -> np.ndarray:
    """One PS's result: W0 - lr * (the rank-order sum / n), float32."""
    total = None
    for i in contributors:
        g = gradient(i)["w"]
        total = g.copy() if total is None else np.add(total, g, out=total)
    if len(contributors) > 1:
        total /= np.float32(len(contributors))
    return W0["w"] - np.float32(LR) * total


ABSENT, FIXED_R = "holds and never commits", "fixed R = 3"


@pytest.mark.parametrize("case", [None, ABSENT, FIXED_R])
def test_a_follower_holds_at_most_two_pieces_and_sums_bit_identical(case):
    """5 workers at once. Elastic: every one contributes (but one that holds and leaves). Fixed R = 3: the first 3
    holds on the coordinator are the contributors (their heads), read in rank order on both shards; the other 2 are
    answered late by both shards, kept by neither, and their commits late."""
    n, absent = 5, case == ABSENT
    fixed = {"replicas_to_aggregate": 3} if case == FIXED_R else {}
    with two_shards(min_workers=n, lease_seconds=30.0, shard_split_elements=P // 2, **fixed) as (c, f):
        hc, hf, m, ids = start(c, f, n)
        most, coordinator = counting(f.rt), counting(c.rt)
        answers: dict[int, tuple[str, str, str]] = {}  # (coordinator's hold, follower's hold, commit)
        barrier = threading.Barrier(n)

        def worker(i: int) -> None:
            with c.http() as hc_i, f.http() as hf_i:
                hc_i.timeout = hf_i.timeout = allow(30)
                barrier.wait()
                rc = hold(hc_i, m, 0, ids[i], 0, gradient(i))
                assert rc.status_code == 200, rc.text
                r = hold(hf_i, m, 1, ids[i], 0, gradient(i))
                assert r.status_code == 200, r.text
                if absent and i == 1:  # its pieces are held on both shards; it is gone before its commit
                    assert hc_i.delete(f"/v1/workers/{ids[i]}").status_code == 200
                    return
                got = commit(hc_i, ids[i], 0, [r.json().get("receipt")]).json()["status"]
                answers[i] = (rc.json()["status"], r.json()["status"], got)

        threads = [threading.Thread(target=worker, args=(i,)) for i in reversed(range(n))]
        for t in threads:
            t.start()
        for t in threads:
            t.join(allow(60))
        wait_for(lambda: f.rt.core.global_step == 1 and c.rt.core.global_step == 1, allow(20), "round 0 applied")
        record = c.rt.core.rounds[-1]
        contributors = sorted(a.rank for a in record.contributors)
        assert len(contributors) == (3 if fixed else n - absent)
        assert answers == {i: ("held", "held", "accepted") if i in contributors else ("late", "late", "late")
                           for i in range(n) if not (absent and i == 1)}
        whole = assemble(m, [dict(c.rt.core.weights), dict(f.rt.core.weights)])
        assert whole["w"].tobytes() == rank_order_weights(contributors).tobytes(), "not the rank-order sum"
        # (a lease of 30 s: no hold waits its whole patience and is read out of turn, however loaded the machine)
        bound = 2 + absent  # the pieces of a worker that left before its commit stay to the apply
        assert most[0] <= bound, f"the follower held {most[0]} pieces at once"
        assert coordinator[0] <= bound, f"the coordinator held {coordinator[0]} pieces at once"
        assert f.rt.shards.gate.overdue == c.rt.core.intake.overdue == 0 and len(f.rt.shards.holds) == 0
        hc.close(), hf.close()


def test_a_follower_reads_a_late_workers_hold_and_keeps_none_of_it():
    """Sans-IO (ps_service/sharding/holds.py): the coordinator names late workers (fixed R); the follower drops a piece
    of one that it had read in its turn, lets a late worker's hold be read (to be answered late), and forgets them
    with the round; a worker named in ``turns`` again is not late."""
    h, piece = Holds(), {"w": np.ones(2, np.float32)}
    h.put("a", Held(0, piece, "http"))
    h.put("c", Held(0, piece, "http"))
    assert h.progress(0, 0, 0, [], ["a"]) and not h.may_read("b", 0, 0)
    assert h.progress(0, 0, 0, [], ["c"], late=["a", "b"])
    assert h.get("a", 0) is None and h.get("c", 0) is not None  # a's piece: read in its turn, then refused
    assert h.may_read("b", 0, 0) and h.late_for("b", 0) and not h.late_for("c", 0) and not h.may_read("d", 0, 0)
    assert h.progress(0, 0, 0, [], ["b"]) and not h.late_for("b", 0)  # named in turns: read and kept
    h.drop_through(0)
    assert not h.late_for("a", 0) and len(h) == 0


@pytest.mark.parametrize("transport", ["http", "shm"])
def test_a_job_whose_shards_sum_in_turn_trains_bit_identical_to_one_ps(transport):
    """Real processes: 4 workers, 2 shards, a model whose pieces are 1.2 MB a shard (summed as told, read in turn, over
    request bodies and same-host files): the final weights are those of the same job on one PS, 0 ulp."""

    steps, workers, task, split = 12, 4, "bench.task:params_600000", 300_000
    params = load_task(task, 7, "float32").init_params()
    m = shards.plan(shards.spec_of(params), 2, split)
    assert min(m.bytes_owned(0), m.bytes_owned(1)) >= FOLD_BYTES
    ps_env = {"PS_MAX_STEPS": steps, "PS_OPTIMIZER": "momentum", "PS_SHARD_SPLIT_ELEMENTS": split}
    worker_env = {"WORKER_TASK": task, "WORKER_DTYPE": "float32", "WORKER_SEED": 7, "WORKER_BATCH_SIZE": 16,
                  **({"WORKER_SHM_DIR": ""} if transport == "http" else {})}
    job = run_job(workers, ps_env, worker_env, deadline=120, shards=2)
    assert job.exit_codes == [0] * workers and job.status["global_step"] == steps
    assert {w["transport"] for w in job.workers} == {transport}
    ref = run_job(workers, ps_env, worker_env, deadline=120).tensors  # the same job on one PS process
    assert job.tensors.keys() == ref.keys()
    assert all(job.tensors[k].tobytes() == ref[k].tobytes() for k in ref), "not bit-identical (0 ulp)"


@pytest.mark.slow
def test_a_follower_killed_while_it_sums_in_turn_rolls_the_job_back_and_it_finishes_bit_identical(tmp_path):
    """kill -9 of a follower that sums as told (1.2 MB pieces), started again from its checkpoints: the coordinator
    rolls the job back live (its next progress or apply names pieces the follower lost, or its boot id changed) and
    the job ends with the weights of the same job on one PS, 0 ulp."""

    steps, workers, kill_at = 30, 3, 10
    base = {"PS_MAX_STEPS": steps, "PS_TOTAL_NUM_REPLICAS": workers, "PS_SHARD_SPLIT_ELEMENTS": 300_000}
    ckpt = {"PS_CHECKPOINT_DIR": str(tmp_path / "ckpt"), "PS_CHECKPOINT_EVERY_STEPS": 1,
            "PS_CHECKPOINT_EVERY_SECONDS": 0, "PS_CHECKPOINT_KEEP": 8}
    worker_env = {"WORKER_TASK": "bench.task:params_600000", "WORKER_DTYPE": "float32", "WORKER_SEED": 7,
                  "WORKER_BATCH_SIZE": 16, "WORKER_SHM_DIR": ""}
    with LocalCluster(workers, ps_env={**base, **ckpt}, worker_env=worker_env, shards=2) as c:
        try:
            wait_for(lambda: c.status()["global_step"] >= kill_at, allow(60), f"step {kill_at}")
            c.kill(c.followers[0])
            c.start_ps(allow(30))  # only shard 1 is not running: it comes back from its checkpoint directory
            assert c.wait_workers(allow(120)) == [0] * workers
            wait_for(lambda: c.status()["state"] == "done", allow(10), "the PS to report done")
            st, got = c.status(), final_weights(c)
        except Exception:
            raise AssertionError(f"job failed; logs:\n{c.logs()}")
    assert st["shard"]["rollbacks"] == 1 and st["shard"]["blocked"] is None, st["shard"]
    # the same job replayed in one process (as one PS sums: in rank order, then the mean), not a second cluster
    _, ref = train_reference("bench.task:params_600000", workers, steps, batch_size=16, seed=7, dtype="float32")
    assert got.keys() == ref.keys()
    assert all(got[k].tobytes() == ref[k].tobytes() for k in ref), "not bit-identical to one PS (0 ulp)"
