"""A sharded PS (PS_SHARDS > 1): the shard map, and real shards (uvicorn) and workers training exactly as one PS.

- the map (shared/shards.py): every element in exactly one piece, loads within one piece, deterministic;
- live local clusters of S = 2 PS processes: the final weights are bit-identical (float64, 0 ulp) to one PS's
  (the single-process reference, and a one-PS run), for SGD, momentum and Adam, over HTTP and same-host files;
- a worker that holds its pieces on one shard and never commits does not count and changes nothing; a bad
  push to one shard gets the one-PS 4xx and changes nothing;
- elastic: a worker leaving mid-job drops out at one round boundary on every shard (the whole job equals
  the one-PS replay of the coordinator's round records).
"""
from __future__ import annotations

import math
import signal
import time
from contextlib import contextmanager

import httpx
import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from cluster.processes import LocalCluster, wait_for
from ps_service.core.optimizers import Optimizer
from ps_service.sharding import receipts
from shared import frame, shards
from shared.errors import ProtocolError
from tests.clusters import closed_rounds, final_weights, run_job
from tests.live_ps import held_ports, live_ps, state_hash
from tests.reference import train_reference
from tests.timing import allow
from worker_service.tasks import load_task


def assemble(m, parts):
    """The whole tensors from every shard's pieces (``parts[i]``: shard i's tensors by key), as a sharded worker
    makes them: each shard's slices placed into new memory, then gathered."""
    into = shards.split_memory(m)
    for i, part in enumerate(parts):
        shards.place(m, i, part, into)
    return shards.gathered(m, parts, into)


# ---- the map -------------------------------------------------------------------------------------------

specs = st.dictionaries(st.text("abcdefgh", min_size=1, max_size=4),
                        st.tuples(st.lists(st.integers(0, 7), min_size=0, max_size=3).map(tuple),
                                  st.sampled_from(["float32", "float64", "float16"])), min_size=1, max_size=8)


@settings(max_examples=200, deadline=None)
@given(spec=specs, s=st.integers(1, 5), bound=st.integers(1, 50))
def test_the_map_covers_every_element_once_and_balances_within_one_piece(spec, s, bound):
    n_pieces = sum(max(1, math.ceil(math.prod(shape) / bound)) for shape, _ in spec.values())
    if n_pieces < s:
        with pytest.raises(ValueError, match="piece"):
            shards.plan(spec, s, bound)
        return
    m = shards.plan(spec, s, bound)
    assert m == shards.plan(dict(reversed(list(spec.items()))), s, bound)  # deterministic, whatever the order
    assert shards.from_wire(m.to_wire()).digest == m.digest
    covered = {name: np.zeros(math.prod(shape), int) for name, (shape, _) in spec.items()}
    for ps in m.pieces:
        assert ps  # every shard owns something
        for p in ps:
            assert p.size <= bound or (p.whole and p.size == 0)
            covered[p.name][p.start:p.stop] += 1
    assert all((c == 1).all() for c in covered.values())
    loads = [m.bytes_owned(i) for i in range(s)]
    largest = max(p.size * np.dtype(spec[p.name][1]).itemsize for ps in m.pieces for p in ps)
    assert max(loads) - min(loads) <= largest


def test_split_and_assemble_give_back_the_tensors():
    rng = np.random.default_rng(0)
    tensors = {"a": rng.standard_normal((5, 7)), "b": rng.standard_normal(3), "c": rng.standard_normal((2, 2, 2))}
    m = shards.plan(shards.spec_of(tensors), 3, 6)
    parts = [shards.split(tensors, ps) for ps in m.pieces]
    assert sorted(k for p in parts for k in p) == sorted(p.key for ps in m.pieces for p in ps)
    back = assemble(m, parts)
    assert all(back[k].tobytes() == tensors[k].tobytes() and back[k].shape == tensors[k].shape for k in tensors)


def test_assembled_tensors_reuse_memory_nothing_else_references():
    """The sharded transport assembles a split tensor into kept memory once nothing outside it views it (fresh
    memory costs page faults); never into memory the caller still holds."""
    from worker_service.transport.base import Pulled
    from worker_service.transport.sharded import ShardedTransport

    tensors = {"w": np.zeros((6, 5), np.float32), "b": np.zeros(5, np.float32)}
    m = shards.plan(shards.spec_of(tensors), 2, 15)
    assert m.split_names == ["w"]
    t = ShardedTransport(m, [Link(), Link()], None)

    def joined(value: float) -> dict:
        whole = {k: np.full_like(v, value) for k, v in tensors.items()}
        into, parts = t._target(), [Pulled(4, False, [0], shards.split(whole, ps)) for ps in m.pieces]
        for i, part in enumerate(parts):  # as each shard's answer arrives (ShardedTransport._pull)
            shards.place(m, i, part.tensors, into)
        return t._joined(parts, into).tensors

    def address(a: np.ndarray) -> int:
        return a.__array_interface__["data"][0]

    first = joined(1.0)
    second = joined(2.0)  # the first is still held: other memory
    assert not np.shares_memory(first["w"], second["w"]) and (first["w"] == 1).all() and (second["w"] == 2).all()
    held, at = first["w"].reshape(-1)[:3], address(first["w"])  # a view keeps the first's memory in use
    del first
    third = joined(3.0)
    assert address(third["w"]) not in (at, address(second["w"])) and (held == 1).all()
    del held
    fourth = joined(4.0)  # the first's memory is free again (second and third are still held): reused
    assert address(fourth["w"]) == at and (fourth["w"] == 4).all() and (second["w"] == 2).all()
    assert (third["w"] == 3).all()

    def fails() -> None:
        raise ConnectionError("a shard is gone")

    del fourth
    free = t._target()  # the fourth's memory, free again
    with pytest.raises(ConnectionError):
        t._all([fails], into=free)  # a call of that batch may still be writing into it: never handed out again
    assert all(k is not free for k in t._kept) and t._target() is not free
    t.close()


class Link:
    """A shard's transport that is never used (the tests below call the sharded transport's own parts)."""
    name = "http"

    def __init__(self) -> None:
        self.endpoint = self

    def close(self) -> None:
        pass


def test_a_sharded_push_starts_the_next_batch_once_its_holds_are_with_their_threads():
    """``on_way`` (the worker's next batch) is called while the holds run, not before they are handed out (woken
    first, the prefetch thread took the worker's core as the push was to start). That a push sent again does not
    call it again: tests/test_attach.py."""
    import threading
    from worker_service.transport.sharded import ShardedTransport

    tensors = {"w": np.zeros((6, 5), np.float32)}
    t = ShardedTransport(shards.plan(shards.spec_of(tensors), 2, 15), [Link(), Link()], None)
    began, on_way = [], threading.Event()

    def hold(i: int) -> int:
        began.append(i)
        assert on_way.wait(allow(10)), "on_way was not called while the holds ran"
        return i

    assert t._all([lambda i=i: hold(i) for i in range(2)], on_way.set) == [0, 1] and sorted(began) == [0, 1]
    assert t.name == "http+http"
    t.close()


# ---- live local clusters: exact, for every S ------------------------------------------------------------

TASK = {"WORKER_DTYPE": "float64", "WORKER_SEED": 7, "WORKER_BATCH_SIZE": 16}


@pytest.mark.parametrize("task,optimizer,transport", [
    ("linear", "sgd", "shm"), ("linear", "momentum", "http"),
    pytest.param("mlp", "adam", "shm", marks=pytest.mark.slow)])  # ~10 s: sklearn loads in every process
def test_two_shards_train_bit_identical_to_one_ps(task, optimizer, transport):
    steps, workers = 20, 3 if task == "linear" else 2
    ps_env = {"PS_MAX_STEPS": steps, "PS_OPTIMIZER": optimizer, "PS_SHARD_SPLIT_ELEMENTS": 2 if task == "linear" else 500}
    worker_env = {"WORKER_TASK": task, **TASK, **({"WORKER_SHM_DIR": ""} if transport == "http" else {})}
    job = run_job(workers, ps_env, worker_env, shards=2)
    assert job.exit_codes == [0] * workers and job.status["global_step"] == steps
    assert {w["transport"] for w in job.workers} == {transport}
    assert all(w["pushes"]["accepted"] == steps for w in job.workers)
    shard = job.status["shard"]
    assert [r["step"] for r in shard["shards"]] == [steps, steps] and all(r["error"] is None for r in shard["shards"])
    brought = load_task(task, 7, "float64").optimizer()
    spec = brought if brought["name"] == optimizer else {"name": optimizer}  # PS_OPTIMIZER replaces the task's spec
    _, ref = train_reference(task, workers, steps, batch_size=16, seed=7, dtype="float64", optimizer=spec)
    if optimizer == "momentum":  # and the same job on one PS process
        one = run_job(workers, ps_env, worker_env).tensors
        assert all(one[k].tobytes() == ref[k].tobytes() for k in ref)
    assert job.tensors.keys() == ref.keys()
    for k in ref:
        assert job.tensors[k].shape == ref[k].shape
        assert job.tensors[k].tobytes() == ref[k].tobytes(), f"{k}: not bit-identical (0 ulp)"


def test_cluster_cli_runs_two_shards(capsys):
    from cluster.__main__ import main

    assert main(["--shards", "2", "--workers", "2", "--steps", "15"]) == 0
    out = capsys.readouterr().out
    assert "2 PS shards" in out and "done: every worker exited 0" in out


def test_a_worker_leaving_mid_job_leaves_every_shard_at_one_boundary():
    steps, task = 40, load_task("linear", 7, "float64")
    with LocalCluster(3, ps_env={"PS_MAX_STEPS": steps, "PS_SHARD_SPLIT_ELEMENTS": 2},
                      worker_env={"WORKER_TASK": "linear", **TASK, "WORKER_COMPUTE_DELAY_SECONDS": 0.005},
                      shards=2) as c:
        try:
            wait_for(lambda: c.status()["global_step"] >= 10, allow(60), "step 10")
            c.workers[2].send_signal(signal.SIGTERM)  # leaves the cluster (DELETE /v1/workers/...) and exits 0
            assert c.wait_workers(allow(120)) == [0, 0, 0]
            wait_for(lambda: c.status()["state"] == "done", allow(10), "done")
            rounds = closed_rounds(c, steps)
            names = {w["name"]: w["rank"] for w in c.get("/v1/workers").json()["workers"]}
            got = final_weights(c)
        except Exception:
            raise AssertionError(f"job failed; logs:\n{c.logs()}")
    counts = [len(r["contributors"]) for r in rounds]
    assert counts[0] == 3 and counts[-1] == 2 and len(rounds) == steps, counts
    # the one-PS replay: each round's contributors in rank order, on their shard of the round's batch
    params = {k: np.array(v) for k, v in sorted(task.init_params().items())}
    opt = Optimizer(task.optimizer(), params)
    for r in rounds:
        ranks = sorted({a["rank"] for a in r["contributors"]} | {names[n] for n in r["missing"]})
        total = None
        for a in sorted(r["contributors"], key=lambda a: (a["rank"], a["worker_id"])):
            _, g, _ = task.loss_and_grads(params, task.batch(r["step"], ranks.index(a["rank"]), len(ranks), 16))
            total = {k: v.copy() for k, v in g.items()} if total is None else {k: total[k] + g[k] for k in total}
        if len(r["contributors"]) > 1:
            total = {k: v / len(r["contributors"]) for k, v in total.items()}
        opt.apply(params, total)
    assert all(got[k].tobytes() == params[k].tobytes() for k in params)


def test_a_follower_that_stops_answering_for_a_while_delays_the_job_and_changes_nothing():
    steps = 30
    with LocalCluster(2, ps_env={"PS_MAX_STEPS": steps, "PS_SHARD_SPLIT_ELEMENTS": 2},
                      worker_env={"WORKER_TASK": "linear", **TASK, "WORKER_SHM_DIR": ""}, shards=2) as c:
        try:
            wait_for(lambda: c.status()["global_step"] >= 5, allow(60), "step 5")
            c.followers[0].send_signal(signal.SIGSTOP)  # unreachable: holds, pulls and applies wait and retry
            stuck = c.status()["global_step"]
            time.sleep(1.0)  # the outage's length, not a synchronisation
            assert c.status()["global_step"] <= stuck + 1  # at most the round in flight closes: the job waits
            c.followers[0].send_signal(signal.SIGCONT)
            assert c.wait_workers(allow(120)) == [0, 0]
            wait_for(lambda: c.status()["shard"]["shards"][1]["step"] == steps, allow(20), "shard 1 to catch up")
            got = final_weights(c)
        except Exception:
            c.followers[0].send_signal(signal.SIGCONT)
            raise AssertionError(f"job failed; logs:\n{c.logs()}")
    _, ref = train_reference("linear", 2, steps, batch_size=16, seed=7, dtype="float64")
    assert all(got[k].tobytes() == ref[k].tobytes() for k in ref)


# ---- in-process shards: what a push to one shard can and cannot do ----------------------------------------

def shard_settings(ports: list[int], **kw) -> dict:
    """The settings every shard of an in-process pair shares."""
    return {"shards": 2, "shard_urls": ",".join(f"http://127.0.0.1:{p}" for p in ports), "shard_split_elements": 2,
            "shm_dir": "", "min_workers": 2, "startup_grace_seconds": 0, **kw}


@pytest.fixture
def ports():
    """Two ports for shards started on them again and again, held between (tests/live_ps.py held_ports)."""
    with held_ports(2) as held:
        yield held


@contextmanager
def two_shards(ports: list[int] | None = None, each: tuple[dict, dict] = ({}, {}), **kw):
    """Shards 0 (the coordinator) and 1 in this process; ``each``: settings of one shard only. Without ``ports``, two
    held from other processes (held_ports: the coordinator's while shard 1 starts)."""
    with held_ports(0 if ports else 2) as fresh:
        ports = ports or fresh
        common = shard_settings(ports, **kw)
        with live_ps(port=ports[1], shard_index=1, **{**common, **each[1]}) as f, \
                live_ps(port=ports[0], shard_index=0, **{**common, **each[0]}) as c:
            yield c, f


W0 = {"w": np.array([[1.0], [2.0], [3.0]]), "b": np.array([0.5])}


def post_frame(http: httpx.Client, path: str, tensors: dict, meta: dict, **params) -> httpx.Response:
    return http.post(path, params=params, content=b"".join(bytes(p) for p in frame.encode(tensors, meta)),
                     headers={"content-type": frame.MEDIA_TYPE})


def start_job(c, f):
    """Two workers registered, the model initialised (SGD lr 0.5): (coordinator http, follower http, map, ids)."""
    hc, hf = c.http(), f.http()
    ids = [hc.post("/v1/workers", json={"name": f"w{i}"}).json()["worker_id"] for i in range(2)]
    body = b"".join(bytes(p) for p in frame.encode(W0, {"optimizer": {"name": "sgd", "learning_rate": 0.5}}))
    assert hc.put("/v1/model", content=body, headers={"content-type": frame.MEDIA_TYPE}).status_code == 201
    m = shards.from_wire(hc.get("/v1/shards").json()["map"])
    wait_for(lambda: c.rt.core.round is not None, allow(10), "round 0")
    return hc, hf, m, ids


def hold(http, m, i, wid, step, grads):
    return post_frame(http, "/v1/shard/gradients", shards.split(grads, m.pieces[i]), {"worker_id": wid, "step": step},
                      map=m.digest)


def commit(hc, wid, step, receipts=None) -> httpx.Response:
    """``POST /v1/shard/commit`` of (wid, step), with ``receipts`` (shard 1's) if given."""
    return post_frame(hc, "/v1/shard/commit", {}, {"worker_id": wid, "step": step,
                                                   **({} if receipts is None else {"receipts": receipts})})


def push_pieces(hc, hf, m, wid, step, grads) -> httpx.Response:
    """What a worker does: hold on both shards, then commit with shard 1's receipt (the commit's answer)."""
    assert hold(hc, m, 0, wid, step, grads).status_code == 200
    r = hold(hf, m, 1, wid, step, grads)
    assert r.status_code == 200 and r.json()["status"] == "held", r.text
    return commit(hc, wid, step, [r.json()["receipt"]])


def test_pieces_held_on_one_shard_without_a_commit_never_count():
    with two_shards() as (c, f):
        hc, hf, m, (a, b) = start_job(c, f)
        ga = {"w": np.full((3, 1), 100.0), "b": np.array([100.0])}
        gb = {"w": np.array([[1.0], [1.0], [1.0]]), "b": np.array([2.0])}
        before = state_hash(f.rt)
        assert hold(hf, m, 1, a, 0, ga).json()["status"] == "held"  # a reaches shard 1 only, never commits
        assert state_hash(f.rt) == before and a not in c.rt.core.round.acc
        assert commit(hc, a, 0).json()["error"] == "not_held"
        assert push_pieces(hc, hf, m, b, 0, gb).json()["status"] == "accepted"
        assert hc.delete(f"/v1/workers/{a}").status_code == 200  # the round closes with b alone
        wait_for(lambda: f.rt.core.global_step == 1, allow(10), "shard 1 to apply round 0")
        want = {k: W0[k] - gb[k] * 0.5 for k in W0}
        whole = assemble(m, [c.rt.core.weights, f.rt.core.weights])
        assert all(whole[k].tobytes() == want[k].tobytes() for k in W0)
        assert len(f.rt.shards.holds) == 0  # a's held pieces were dropped with the round
        assert [r["contributors"][0]["worker_id"] for r in hc.get("/v1/rounds").json()["rounds"]] == [b]
        # monitoring: the whole job on the coordinator, each follower says which shard it is
        mine = hf.get("/v1/status").json()["shard"]
        assert (mine["index"], mine["count"], mine["role"], mine["step"]) == (1, 2, "follower", 1)
        wait_for(lambda: hc.get("/v1/status").json()["shard"]["shards"][1]["step"] == 1, allow(10),
                 "the coordinator to hear shard 1's answer")  # its rows are what it last heard
        rows = hc.get("/v1/status").json()["shard"]["shards"]
        assert [(r["index"], r["step"], r["reachable"]) for r in rows] == [(0, 1, True), (1, 1, True)]
        assert sum(r["bytes_owned"] for r in rows) == 4 * 8
        assert 'ps_shard_step{shard="1"} 1.0' in hc.get("/metrics").text


def one_round(hc, hf, m, ids, step, grads):
    for w in ids:
        assert push_pieces(hc, hf, m, w, step, grads).status_code == 200


def test_a_restore_never_mixes_steps(tmp_path, ports):
    dirs = ({"checkpoint_dir": str(tmp_path / "0")}, {"checkpoint_dir": str(tmp_path / "1")})
    with two_shards(ports, dirs) as (c, f):
        hc, hf, m, ids = start_job(c, f)
        one_round(hc, hf, m, ids, 0, {"w": np.ones((3, 1)), "b": np.ones(1)})
        wait_for(lambda: f.rt.core.global_step == 1, allow(10), "shard 1 to apply round 0")
        before = assemble(m, [dict(c.rt.core.weights), dict(f.rt.core.weights)])
    with live_ps(port=ports[1], shard_index=1, **shard_settings(ports), **dirs[1]) as f:  # the follower alone
        assert f.rt.core.global_step == 1  # restored, but no coordinator gave it a receipt key: it holds nothing
        r = hold(f.http(), m, 1, ids[0], 1, {"w": np.ones((3, 1)), "b": np.ones(1)})
        assert (r.status_code, r.json()["error"]) == (409, "shard_behind") and len(f.rt.shards.holds) == 0
    with two_shards(ports, dirs) as (c, f):  # both restored step 1: workers come back, training goes on
        wait_for(lambda: c.rt.shards.links.blocked is None, allow(20), "the coordinator's check of the followers")
        hc, hf = c.http(), f.http()
        ids = [hc.post("/v1/workers", json={"name": f"w{i}"}).json()["worker_id"] for i in range(2)]
        wait_for(lambda: c.rt.core.round is not None, allow(10), "round 1")
        whole = assemble(m, [c.rt.core.weights, f.rt.core.weights])
        assert c.rt.core.global_step == 1 and all(whole[k].tobytes() == before[k].tobytes() for k in W0)
        one_round(hc, hf, m, ids, 1, {"w": np.ones((3, 1)), "b": np.ones(1)})
        wait_for(lambda: f.rt.core.global_step == 2, allow(10), "shard 1 to apply round 1")
    for p in (tmp_path / "1").iterdir():  # shard 1 lost its checkpoints: it would start from nothing
        p.unlink()
    with two_shards(ports, dirs) as (c, f):
        wait_for(lambda: not c.rt.shards.links.blocked.startswith("checking"), allow(20), "the check of the followers")
        r = c.http().post("/v1/workers", json={"name": "w0"})
        assert r.status_code == 503 and r.json()["error"] == "shards_inconsistent"
        assert "restored step 2 but shard 1 is at step none" in r.json()["detail"]
        assert c.http().get("/v1/status").json()["shard"]["blocked"] == r.json()["detail"]


def scripted_job(bad_at: int | None, steps: int = 4) -> tuple[dict, list, dict]:
    """Two workers on two in-process shards, ``steps`` rounds of seeded gradients: worker a (rank 0) through the
    stock sharded transport (``PSClient``), b through raw holds and commits. At step ``bad_at`` a's gradient has a
    NaN in shard 1's pieces first, and a client commits for a anyway, in every wrong way. (The whole model after
    the job, the rounds' contributors, the coordinator's ``/v1/status`` ``shard`` block.)"""
    with two_shards() as (c, f):
        hc, hf, m, (a, b) = start_job(c, f)
        worker = c.client()
        worker.attach_reader()
        worker.attach(a)
        rng = np.random.default_rng(11)
        first = None
        for step in range(steps):
            ga, gb = ({k: rng.standard_normal(v.shape) for k, v in W0.items()} for _ in range(2))
            assert push_pieces(hc, hf, m, b, step, gb).json()["status"] == "accepted"
            if step == bad_at:
                nan = {k: v.copy() for k, v in ga.items()}
                nan[next(iter(shards.split(nan, m.pieces[1])))].flat[0] = np.nan  # one of shard 1's pieces
                with pytest.raises(ProtocolError) as refused:  # shard 1 refuses the hold: nothing is committed
                    worker.push(a, step, nan)
                assert (refused.value.status, refused.value.code) == (422, "nonfinite_gradient")
                wait_for(lambda: c.rt.shards.holds.get(a, step) is not None, allow(10), "shard 0's hold of a's pieces")
                before = state_hash(c.rt), state_hash(f.rt)
                # a client commits for a all the same: the coordinator counts nothing a follower does not hold
                for wrong in (None, [None], ["0" * 64], [first], ["not hex"]):  # first: a's receipt of step 0
                    r = commit(hc, a, step, wrong)
                    assert (r.status_code, r.json()["error"]) == (409, "not_held"), (wrong, r.text)
                    assert "shard(s) [1]" in r.json()["detail"]
                for wrong in ("x", [], [None, None], [1]):  # not a list of one receipt per follower
                    r = commit(hc, a, step, wrong)
                    assert (r.status_code, r.json()["error"]) == (400, "bad_field"), (wrong, r.text)
                assert (state_hash(c.rt), state_hash(f.rt)) == before and a not in c.rt.core.round.acc
                assert c.rt.core.global_step == f.rt.core.global_step == step  # the round waits for a
            answer = worker.push(a, step, ga)  # the round closes with both
            assert answer["status"] == "accepted"
            if step == 0:  # the receipt shard 1 gave a's hold of step 0
                first = receipts.receipt(f.rt.shards.receipt_key, 1, a, 0)
            wait_for(lambda: f.rt.core.global_step == step + 1, allow(10), f"shard 1 to apply round {step}")
        whole = assemble(m, [dict(c.rt.core.weights), dict(f.rt.core.weights)])
        rounds = [sorted(x["rank"] for x in r["contributors"]) for r in hc.get("/v1/rounds").json()["rounds"]]
        def heard() -> dict | None:  # the coordinator's view of shard 1 is as its link last heard
            st = hc.get("/v1/status").json()["shard"]
            return st if [r["step"] for r in st["shards"]] == [steps, steps] else None
        st = wait_for(heard, allow(10), "the coordinator to hear shard 1's step")
        worker.close()
    return whole, rounds, st


def test_a_commit_without_every_followers_hold_is_refused_and_the_job_goes_on_as_without_it():
    """Issue 49, 1: shard 1 refused a NaN hold, yet the coordinator accepted the commit; shard 1 then refused the
    apply (409 missing_gradient) and the job rolled back (wedged for ever without checkpoints)."""
    got, rounds, st = scripted_job(bad_at=1)
    want, want_rounds, _ = scripted_job(bad_at=None)
    assert rounds == want_rounds == [[0, 1]] * 4
    assert all(got[k].tobytes() == want[k].tobytes() for k in W0), "not bit-identical to the job without the bad push"
    assert (st["rollbacks"], st["last_rollback"], st["blocked"]) == (0, None, None)
    assert [r["error"] for r in st["shards"]] == [None, None]


def test_a_decision_or_progress_whose_keys_are_not_in_sum_order_is_refused_and_changes_nothing():
    """protocol-shards.md: ``contributors`` and ``folded`` are in sum order, (rank, worker_id) increasing, each worker
    once (else 400 ``bad_request``), and keys that sort before those a follower summed are 409 ``order_mismatch``;
    nothing changes, the held pieces stay, and the round applies as decided. Before, a worker named twice or keys out of
    order were a 500 after the first key's pieces were taken from the holds (an apply with a worker twice, or with two
    keys of one rank out of order, and a progress whose key sorted before the one summed) or a sum with that worker
    twice (a partitioned follower)."""
    with two_shards() as (c, f):
        hc, hf, m, ids = start_job(c, f)
        lo, hi = sorted(ids)
        g = {lo: {"w": np.full((3, 1), 1.0), "b": np.array([1.0])}, hi: {"w": np.full((3, 1), 3.0), "b": np.array([3.0])}}
        for w in ids:
            assert hold(hf, m, 1, w, 0, g[w]).json()["status"] == "held"
        refused = [("apply", {"contributors": [[0, lo], [1, lo]], "mean_of": 2}, 400, "bad_request"),
                   ("apply", {"contributors": [[0, hi], [0, lo]], "mean_of": 2}, 400, "bad_request"),
                   ("apply", {"contributors": [[1, hi], [0, lo]], "mean_of": 2}, 400, "bad_request"),
                   ("progress", {"start": 0, "folded": [[0, lo], [0, lo]], "turns": None}, 400, "bad_request"),
                   ("progress", {"start": 0, "folded": [[1, hi], [0, lo]], "turns": None}, 400, "bad_request")]
        for route, body, status, code in refused:
            before = state_hash(f.rt)
            r = hf.post(f"/v1/shard/{route}", json={"step": 0, **body})
            assert (r.status_code, r.json()["error"]) == (status, code), (body, r.text)
            assert state_hash(f.rt) == before
        assert hf.post("/v1/shard/progress", json={"step": 0, "start": 0, "folded": [[1, hi]], "turns": None}).json()[
            "summed"]
        r = hf.post("/v1/shard/progress", json={"step": 0, "start": 1, "folded": [[0, lo]], "turns": None})
        assert (r.status_code, r.json()["error"]) == (409, "order_mismatch"), r.text
        r = hf.post("/v1/shard/apply", json={"step": 0, "contributors": [[1, hi]], "mean_of": 1})
        assert r.json()["applied"] and f.rt.core.global_step == 1
        want = shards.split({k: W0[k] - 0.5 * g[hi][k] for k in W0}, m.pieces[1])
        assert all(f.rt.core.weights[k].tobytes() == v.tobytes() for k, v in want.items())
        hc.close(), hf.close()


def test_a_bad_push_to_one_shard_gets_the_one_ps_refusal_and_changes_nothing():
    with two_shards() as (c, f):
        hc, hf, m, (a, _) = start_job(c, f)
        before = state_hash(f.rt), state_hash(c.rt)
        good = {"w": np.ones((3, 1)), "b": np.ones(1)}
        pieces = shards.split(good, m.pieces[1])
        name = next(iter(pieces))
        cases = [({**pieces, name: pieces[name].astype(np.float32)}, 422, "tensor_mismatch"),
                 ({**pieces, name: np.full_like(pieces[name], np.nan)}, 422, "nonfinite_gradient"),
                 ({k: v for k, v in pieces.items() if k != name}, 422, "tensor_mismatch")]
        for bad, status, code in cases:
            r = post_frame(hf, "/v1/shard/gradients", bad, {"worker_id": a, "step": 0}, map=m.digest)
            assert (r.status_code, r.json()["error"]) == (status, code)
        r = post_frame(hf, "/v1/shard/gradients", pieces, {"worker_id": a, "step": 0}, map="0" * 64)
        assert (r.status_code, r.json()["error"]) == (409, "shard_map_mismatch")
        r = post_frame(hc, "/v1/gradients", good, {"worker_id": a, "step": 0})
        assert (r.status_code, r.json()["error"]) == (409, "sharded")
        # a hold for a step ahead of a follower is refused (it restarted: the worker registers again)
        r = post_frame(hf, "/v1/shard/gradients", pieces, {"worker_id": a, "step": 5}, map=m.digest)
        assert (r.status_code, r.json()["error"]) == (409, "shard_behind")
        r = post_frame(hc, "/v1/shard/gradients", shards.split(good, m.pieces[0]), {"worker_id": a, "step": 5},
                       map=m.digest)
        assert (r.status_code, r.json()["error"]) == (422, "future_step")  # on the coordinator: as a push
        # on the coordinator a hold is a member's, as a push is
        r = post_frame(hc, "/v1/shard/gradients", shards.split(good, m.pieces[0]), {"worker_id": "w-nobody", "step": 0},
                       map=m.digest)
        assert r.status_code == 404
        # membership is the coordinator's: a follower refuses registration; every shard refuses a plain push
        r = hf.post("/v1/workers", json={"name": "w9"})
        assert (r.status_code, r.json()["error"]) == (409, "not_coordinator") and "shard 0" in r.json()["detail"]
        for r in (hf.post(f"/v1/workers/{a}/heartbeat"), hf.delete(f"/v1/workers/{a}")):  # was 404 "register again"
            assert (r.status_code, r.json()["error"]) == (409, "not_coordinator") and "shard 0" in r.json()["detail"]
        r = post_frame(hf, "/v1/gradients", good, {"worker_id": a, "step": 0})
        assert (r.status_code, r.json()["error"]) == (409, "sharded") and "shard 1 of 2" in r.json()["detail"]
        assert len(f.rt.shards.holds) == 0 and (state_hash(f.rt), state_hash(c.rt)) == before


def test_the_model_put_to_a_follower_is_refused_before_its_body_and_changes_nothing():
    """It was a 500 (the follower has no links to give pieces to) and a reset connection (found by a black-box
    check from protocol.md); the model goes to shard 0."""
    with two_shards() as (c, f):
        body = b"".join(bytes(p) for p in frame.encode(W0, {}))
        for _ in range(2):  # before the model, and after it
            with f.http() as hf:
                r = hf.put("/v1/model", content=body, headers={"content-type": frame.MEDIA_TYPE})
                assert (r.status_code, r.json()["error"]) == (409, "not_coordinator")
                assert "shard 0" in r.json()["detail"]
                assert r.headers["connection"] == "close"  # answered before the body was read
            with f.http() as hf:  # the coordinator's route, without the hold receipt key it brings
                r = hf.put("/v1/shard/model", content=body, headers={"content-type": frame.MEDIA_TYPE})
                assert (r.status_code, r.json()["error"]) == (400, "bad_field") and "receipt_key" in r.json()["detail"]
            if not f.rt.core.initialized:
                assert c.rt.core.global_step == 0 and not c.rt.core.initialized
                hc, hf, m, _ = start_job(c, f)
                before = state_hash(f.rt)
        assert state_hash(f.rt) == before and f.rt.shards.digest == m.digest


def test_shards_that_plan_different_maps_refuse_the_model():
    with two_shards(each=({}, {"shard_split_elements": 3})) as (c, f):  # shard 1 was started with another bound
        body = b"".join(bytes(p) for p in frame.encode(W0, {"optimizer": {"name": "sgd"}}))
        r = c.http().put("/v1/model", content=body, headers={"content-type": frame.MEDIA_TYPE})
        assert (r.status_code, r.json()["error"]) == (409, "shard_init_failed"), r.text
        assert "shard_map_mismatch" in r.json()["detail"], r.text
        assert not c.rt.core.initialized and not f.rt.core.initialized
        assert c.http().get("/v1/shards").json()["map"] is None


def test_the_fast_lane_serves_the_shard_routes_only_on_a_sharded_ps(monkeypatch):
    from ps_service import hotpath

    served = []
    for key in [k for k in hotpath.ROUTES if "/shard/" in k[1]]:
        endpoint, parsers, defaults = hotpath.ROUTES[key]

        async def counted(*a, _e=endpoint, _p=key[1], **kw):
            served.append(_p)
            return await _e(*a, **kw)
        monkeypatch.setitem(hotpath.ROUTES, key, (counted, parsers, defaults))
    monkeypatch.setattr(hotpath, "SHARDED", frozenset(hotpath.ROUTES[k][0] for k in hotpath.ROUTES if "/shard/" in k[1]))
    with live_ps(shm_dir="") as one:  # unsharded: the routes do not exist, FastAPI answers 404
        r = post_frame(one.http(), "/v1/shard/gradients", {}, {"worker_id": "x", "step": 0}, map="0" * 64)
        assert r.status_code == 404 and served == []
    with two_shards() as (c, f):
        hc, hf, m, ids = start_job(c, f)
        one_round(hc, hf, m, ids, 0, {"w": np.ones((3, 1)), "b": np.ones(1)})
        assert served.count("/v1/shard/gradients") == 4 and served.count("/v1/shard/commit") == 2
        wait_for(lambda: f.rt.core.global_step == 1, allow(10), "shard 1 to apply round 0")
        assert served.count("/v1/shard/apply") == 1  # the coordinator's apply, in the follower's fast lane
        r = hc.post("/v1/shard/gradients", content=b"")  # no map: FastAPI's own 4xx
        assert r.status_code in (400, 422) and served.count("/v1/shard/gradients") == 4


def test_a_coordinator_restored_behind_a_follower_has_it_restore_the_same_step(tmp_path, ports):
    dirs = tuple({"checkpoint_dir": str(tmp_path / str(i)), "checkpoint_every_steps": 1, "checkpoint_keep": 5}
                 for i in range(2))
    grads = {"w": np.ones((3, 1)), "b": np.ones(1)}
    with two_shards(ports, dirs) as (c, f):
        hc, hf, m, ids = start_job(c, f)
        one_round(hc, hf, m, ids, 0, grads)
        wait_for(lambda: f.rt.core.global_step == 1, allow(10), "shard 1 to apply round 0")
        at_1 = assemble(m, [{k: v.copy() for k, v in r.core.weights.items()} for r in (c.rt, f.rt)])
        one_round(hc, hf, m, ids, 1, grads)
        wait_for(lambda: f.rt.core.global_step == 2, allow(10), "shard 1 to apply round 1")
        wait_for(lambda: f.http().get("/v1/shard/state").json()["checkpoints"][:2] == [2, 1], allow(10),
                 "shard 1's checkpoint of step 2 (written in the background)")
    (tmp_path / "0" / "ckpt-0000000002.msgpack").unlink()  # the coordinator comes back at step 1, shard 1 at 2
    with two_shards(ports, dirs) as (c, f):
        wait_for(lambda: c.rt.shards.links.blocked is None, allow(20), "the coordinator to have shard 1 restore step 1")
        assert (c.rt.core.global_step, f.rt.core.global_step) == (1, 1)
        whole = assemble(m, [c.rt.core.weights, f.rt.core.weights])
        assert all(whole[k].tobytes() == at_1[k].tobytes() for k in W0)
        assert f.http().get("/v1/shard/state").json()["checkpoints"][0] == 1  # its step-2 future is gone
        hc = c.http()
        r = post_frame(f.http(), "/v1/shard/restore", {}, {})  # a frame, not the JSON body the route takes
        assert r.status_code in (400, 415)
        r = f.http().post("/v1/shard/restore", json={"step": 7, "receipt_key": "0" * 64})
        assert (r.status_code, r.json()["error"]) == (404, "unknown_checkpoint")
        r = f.http().post("/v1/shard/restore", json={"step": 1})  # the coordinator's key comes with every restore
        assert (r.status_code, r.json()["error"]) == (400, "bad_request") and "receipt_key" in r.json()["detail"]
        for path, body in [("/v1/shard/restore", {"step": 2**64 - 1}),  # integers beyond 2^53 - 1: 400, nothing done
                           ("/v1/shard/apply", {"step": 2**53, "contributors": [], "mean_of": 1}),
                           ("/v1/shard/apply", {"step": 1, "contributors": [[2**64, ids[0]]], "mean_of": 1}),
                           ("/v1/shard/apply", {"step": 1, "contributors": [], "mean_of": 2**63}),
                           # not JSON integers: lax, `true` was step 1 and applied it (the follower a step ahead)
                           ("/v1/shard/apply", {"step": True, "contributors": [], "mean_of": 1}),
                           ("/v1/shard/apply", {"step": "1", "contributors": [], "mean_of": True})]:
            r = f.http().post(path, json=body)
            assert (r.status_code, r.json()["error"], f.rt.core.global_step) == (400, "bad_request", 1), (path, body)
        r = hc.post("/v1/shard/restore", json={"step": 1})
        assert (r.status_code, r.json()["error"]) == (409, "not_follower")
        ids = [hc.post("/v1/workers", json={"name": f"w{i}"}).json()["worker_id"] for i in range(2)]
        wait_for(lambda: c.rt.core.round is not None, allow(10), "round 1")
        one_round(hc, f.http(), m, ids, 1, grads)
        wait_for(lambda: f.rt.core.global_step == 2, allow(10), "shard 1 to apply round 1 again")


def test_a_follower_restarted_with_nothing_to_go_back_to_leaves_registration_refused_saying_what_to_do(ports):
    common = shard_settings(ports)  # no PS_CHECKPOINT_DIR: a restarted follower comes back empty
    with live_ps(port=ports[0], shard_index=0, **common) as c:
        with live_ps(port=ports[1], shard_index=1, **common) as f:
            hc, hf, m, ids = start_job(c, f)
            one_round(hc, hf, m, ids, 0, {"w": np.ones((3, 1)), "b": np.ones(1)})
            wait_for(lambda: f.rt.core.global_step == 1, allow(10), "shard 1 to apply round 0")
        with live_ps(port=ports[1], shard_index=1, **common):  # the same follower, started again
            wait_for(lambda: (c.rt.shards.links.blocked or "").endswith("or all fresh"), allow(20),
                     "the rollback to give up")
            r = hc.post("/v1/workers", json={"name": "w0"})
            assert (r.status_code, r.json()["error"]) == (503, "shards_inconsistent")
            assert "shard 1 restarted" in r.json()["detail"] and "set PS_CHECKPOINT_DIR on every shard" in r.json()["detail"]
            st = hc.get("/v1/status").json()
            assert st["shard"]["blocked"] == r.json()["detail"] and st["shard"]["rollbacks"] == 1
            # it was null after a rollback that failed (issue 49): it says what happened
            assert st["shard"]["last_rollback"] == f"from step 1: failed, registration refused: {r.json()['detail']}"
            assert "ps_shard_rollbacks_total 1.0" in hc.get("/metrics").text
            r = hc.get("/v1/model", params={"worker_id": ids[1], "min_step": 1, "timeout": 0})
            assert (r.status_code, r.json()["error"]) == (409, "not_active")  # nothing goes on: every worker is out
            assert c.rt.core.global_step == 1 and c.rt.core.round is None
