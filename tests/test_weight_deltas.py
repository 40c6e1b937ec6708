"""Exact weight deltas PS -> worker (docs/protocol.md, "Weight deltas"; shared/weight_deltas.py,
ps_service/transport/deltas.py, worker_service/transport/http.py): the encoding applies bit for bit,
the PS finds the changed entries once per step, a worker's copy stays bit-identical to the PS's weights over
a live job, anything but the previous served step gets the dense weights, hostile ``since`` values are
refused and change nothing, and a real job ends with the same bits with and without deltas."""
from __future__ import annotations

import threading

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

from ps_service.core.optimizers import Touched
from ps_service.transport.deltas import WeightDeltas
from shared import compression as C, frame, weight_deltas as wd
from shared.errors import ProtocolError
from tests.clusters import run_job
from tests.live_ps import live_ps, state_hash
from tests.timing import allow
from worker_service.transport.http import HeldWeights

F32, U32 = np.float32, np.uint32
FRAME = {"content-type": frame.MEDIA_TYPE}


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).tobytes()


# ---- the encoding ----------------------------------------------------------------------------------------------
@settings(max_examples=60, deadline=None)
@given(st.integers(0, 400), st.integers(0, 2**32 - 1), st.floats(0.0, 1.0))
def test_changed_entries_rebuild_the_new_tensor_bit_for_bit(n, seed, share):
    rng = np.random.default_rng(seed)
    old = rng.standard_normal(n).astype(F32)
    old[::5] = 0.0
    new = old.copy()
    hit = rng.random(n) < share
    new[hit] = rng.standard_normal(int(hit.sum())).astype(F32)
    new[hit & (rng.random(n) < 0.2)] = -0.0  # -0.0 == 0.0 as a value, not as bits
    new[hit & (rng.random(n) < 0.05)] = np.nan
    idx = wd.changed_indices(old, new)
    assert idx.dtype == U32 and np.all(np.diff(idx.astype(np.int64)) > 0)
    assert np.array_equal(idx, np.flatnonzero(old.view(U32) != new.view(U32)))
    wire = wd.pack(idx, new)
    held = old.copy()
    wd.apply(held, wire, "w")
    assert bits(held) == bits(new)
    assert wd.worth_sparse(idx.size, n) == (8 * idx.size < 4 * n)


def test_apply_refuses_a_malformed_delta_and_writes_nothing():
    held = np.arange(10, dtype=F32)
    before = bits(held)
    val = lambda *v: np.array(v, F32).view(U32)  # noqa: E731
    for wire in [np.array([[3, 3], val(1, 2)], U32), np.array([[4, 3], val(1, 2)], U32),
                 np.array([[10], val(1)], U32), np.zeros((2, 11), U32), np.zeros((3, 1), U32),
                 np.zeros((2, 1), np.int32)]:
        with pytest.raises(ProtocolError) as info:
            wd.apply(held, wire, "w")
        assert info.value.code == "bad_encoding"
        assert bits(held) == before
    with pytest.raises(ValueError):
        wd.apply(np.zeros(4, np.float64), np.zeros((2, 0), U32), "d")


# ---- the PS's tracker -----------------------------------------------------------------------------------------
def test_the_tracker_finds_each_steps_changes_once():
    spec = C.Spec("topk")
    w = {"w": np.zeros(100, F32), "b": np.zeros(3, F32), "d": np.zeros(4, np.float64)}
    t = WeightDeltas(spec.compresses)
    t.observe(0, 0, w)
    assert t.base is None and not t.offers(0) and not t.offers(None)
    w["w"][[3, 50]] = 1.0
    w["b"][:] = 2.0  # every entry: dense
    w["d"][:] = 1.0  # float64: never tracked
    t.observe(1, 1, w)
    assert t.base == 0 and t.offers(0) and not t.offers(1) and set(t.changes) == {"w"}
    assert t.changes["w"].tolist() == [[3, 50], np.array([1.0, 1.0], F32).view(U32).tolist()]
    t.observe(1, 1, w)  # the same step again: nothing recomputed
    assert t.base == 0
    t.observe(2, 1, w)  # a step that changed nothing (a round of skipped pushes): an empty delta
    assert t.base == 1 and t.changes["w"].shape == (2, 0) and t.offers(1)
    lineage = t.lineage
    w["w"][7] = 5.0
    t.observe(2, 2, w)  # the weights of a step changed: a new lineage, nothing offered
    assert t.lineage != lineage and t.base is None and not t.offers(1)
    t.observe(3, 3, w)
    assert t.base == 2 and t.changes["w"].shape == (2, 0)  # the snapshot took step 2's second weights


def test_the_tracker_takes_the_entries_one_sparse_apply_changed_and_compares_everything_otherwise(monkeypatch):
    """After one optimizer apply that updated a tensor as entries (SGD on a round of top-k pushes: ``Touched``,
    the entries whose bits it changed), the tracker takes those entries without a compare and offers what a full
    compare finds; a hint that is not of exactly one apply past the snapshot (another optimizer, two applies, a
    step that moved by two, no entries) is ignored and the whole tensor compared. Which tensors were compared is
    counted: a tracker that ignored valid hints would give the same changes, but not the same compares."""
    compared, compare = [], wd.changed_indices

    def counted(old, new, limit=None):
        compared.append(old.size)
        return compare(old, new, limit=limit)

    monkeypatch.setattr(wd, "changed_indices", counted)
    rng = np.random.default_rng(3)
    spec = C.Spec("topk")
    w = {"w": rng.standard_normal(5000).astype(F32), "b": np.zeros(3, F32)}
    hinted, full = WeightDeltas(spec.compresses), WeightDeltas(spec.compresses)
    hinted.observe(0, 0, w, Touched(7, 0))
    full.observe(0, 0, w)
    for step in range(1, 4):
        old = bits(w["w"])
        moved = np.sort(rng.choice(5000, 150, replace=False))
        w["w"][moved] += 1.0
        w["w"][moved[0]] = -0.0 if step == 2 else w["w"][moved[0]]
        changed = np.flatnonzero(np.frombuffer(old, U32) != w["w"].view(U32))
        w["b"][step % 3] = step  # a tensor with no entries recorded: compared whole
        compared.clear()
        written = {"w": w["w"].reshape(-1)[changed].copy()} if step % 2 else {}  # the values, when the apply gives them
        hinted.observe(step, step, w, Touched(7, step, {"w": changed}, written))
        assert compared == [3]  # "b" only: "w"'s entries were taken as they came
        assert hinted._snapshot["w"] is None  # not needed while every step is such an apply
        full.observe(step, step, w)
        assert compared == [3, 5000, 3]
        assert set(hinted.changes) == set(full.changes) == {"w", "b"}
        for name in ("w", "b"):
            assert hinted.changes[name].tobytes() == full.changes[name].tobytes()
    # hints that do not apply: every change is found, even outside the entries they name; "w", whose snapshot the
    # hints let go, is sent dense once (no entries of it offered), then compared whole as any other
    for i, (step, iterations, touched) in enumerate([(4, 4, Touched(8, 4, {"w": np.array([1], np.intp)})),  # another
                                                     (5, 6, Touched(7, 6, {"w": np.array([1], np.intp)})),  # 2 applies
                                                     (7, 7, Touched(7, 7, {"w": np.array([1], np.intp)})),  # 2 steps
                                                     (8, 8, Touched(7, 8))]):  # entries unknown
        w["w"][4000 + step] += 1.0
        compared.clear()
        hinted.observe(step, iterations, w, touched)
        assert hinted.base == step - 1 - (step == 7)
        if i == 0:
            assert compared == [3] and "w" not in hinted.changes
        else:
            assert sorted(compared) == [3, 5000]  # every tensor compared whole
            assert 4000 + step in hinted.changes["w"][0].tolist()
    assert hinted._snapshot["w"].tobytes() == w["w"].tobytes()


# ---- the worker's copy ------------------------------------------------------------------------------------------
def answer(tensors: dict, **meta) -> frame.Frame:
    return frame.decode(frame.encode_bytes(tensors, {"step": 0, "done": False, "ranks": [0], **meta}))


def test_held_weights_take_dense_then_deltas_and_forget_on_any_mismatch():
    held = HeldWeights()
    w0 = {"w": np.arange(8, dtype=F32), "d": np.zeros(2, np.float64)}
    assert held.take(answer(w0)) is not None and held.params() == {}  # no lineage: nothing kept
    got = held.take(answer(w0, step=4, lineage="a"))
    assert held.params() == {"since": 4} and not got["w"].flags.writeable  # the task cannot change the copy
    w1 = w0["w"].copy()
    w1[[1, 6]] = [-1.0, 9.0]
    delta = {"w": wd.pack(np.array([1, 6], U32), w1), "d": np.ones(2, np.float64)}
    got = held.take(answer(delta, step=5, lineage="a", since=4, sparse=["w"]))
    assert bits(got["w"]) == bits(w1) and got["d"].tolist() == [1.0, 1.0] and held.params() == {"since": 5}
    for meta in [dict(step=7, lineage="a", since=4, sparse=["w"]),  # not the held step
                 dict(step=6, lineage="b", since=5, sparse=["w"]),  # another lineage (a restarted PS)
                 dict(step=6, lineage="a", since=5, sparse="w"),
                 dict(step=6, lineage="a", since=5, sparse=["w", "x"])]:
        again = HeldWeights()
        again.take(answer(w0, step=5, lineage="a"))
        assert again.take(answer(delta, **meta)) is None and again.params() == {} and again.tensors == {}
    bad = {"w": np.array([[6, 1], [0, 0]], U32), "d": np.ones(2, np.float64)}  # indices not increasing
    assert held.take(answer(bad, step=6, lineage="a", since=5, sparse=["w"])) is None and held.params() == {}


# ---- live: a real PS, two workers -----------------------------------------------------------------------------
SHAPES = {"b": (3,), "d": (4,), "w": (100, 60)}


def init_of(rng) -> dict:
    out = {k: rng.standard_normal(s).astype(F32) for k, s in SHAPES.items()}
    out["d"] = out["d"].astype(np.float64)
    return out


def train(ps, rounds: int, scale: float, seed: int = 1):
    """Two clients (threads) push and pull ``rounds`` rounds with push-with-pull; every answer's meta."""
    clients = [ps.client() for _ in range(2)]
    for c in clients:
        c.push_wait = 5.0
    regs = [c.register(f"w{i}") for i, c in enumerate(clients)]
    assert clients[0].init_model(init_of(np.random.default_rng(seed)), {"name": "sgd", "learning_rate": 0.5})
    metas: list[dict] = []
    for i, c in enumerate(clients):
        c.attach(regs[i]["worker_id"])
        take = c.tensors.current.held.take
        c.tensors.current.held.take = lambda f, take=take: metas.append(f.meta) or take(f)
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            c, wid, rng = clients[i], regs[i]["worker_id"], np.random.default_rng(seed * 10 + i)
            for step in range(rounds):
                assert c.pull(step, wid, 5.0).step == step
                g = {k: (rng.standard_normal(s) * scale).astype(F32 if k != "d" else np.float64)
                     for k, s in SHAPES.items()}
                assert c.push(wid, step, g, 1.0, 8)["status"] == "accepted"
        except BaseException as exc:  # noqa: BLE001 - reported by the main thread
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(allow(60))
    assert not errors, errors
    return clients, regs, metas


@pytest.mark.parametrize("name", ["topk", "2bit"])
def test_live_workers_hold_the_ps_weights_bit_for_bit(name):
    with live_ps(compression=name, compression_topk_ratio=0.02, compression_2bit_threshold=0.25,
                 total_num_replicas=2, startup_grace_seconds=0.0, shm_dir="", aggregation="mean") as ps:
        rounds = 8
        clients, _, metas = train(ps, rounds, 0.05 if name == "2bit" else 1.0)
        core = ps.rt.core
        assert core.global_step == rounds
        for c in clients:
            assert c.tensors.current.held.step == rounds
            for k, v in core.weights.items():
                assert bits(c.tensors.current.held.tensors[k]) == bits(v), k
        deltas = [m for m in metas if "since" in m]
        assert all(m["since"] == m["step"] - 1 and "w" in m["sparse"] and "d" not in m["sparse"]
                   for m in deltas), deltas
        assert len(metas) == 2 * (rounds + 1) and len(deltas) == 2 * rounds  # all but each worker's first pull
        for c in clients:
            c.close()


def test_since_other_than_the_previous_step_is_dense_and_hostile_since_changes_nothing():
    with live_ps(compression="topk", compression_topk_ratio=0.02, total_num_replicas=2,
                 startup_grace_seconds=0.0, shm_dir="", aggregation="mean") as ps:
        clients, regs, _ = train(ps, 4, 1.0)
        core = ps.rt.core
        with ps.http() as h:
            def pull(since) -> frame.Frame:
                r = h.get("/v1/model", params={"min_step": 4, "since": since})
                assert r.status_code == 200, r.text
                return frame.decode(r.content)
            lineage = pull(0).meta["lineage"]
            for since in (0, 2, 4, 5, 2**53 - 1):  # behind by 2 or more, current, future: dense
                f = pull(since)
                assert "since" not in f.meta and f.meta["lineage"] == lineage
                assert {k: bits(v) for k, v in f.tensors.items()} == {k: bits(v) for k, v in core.weights.items()}
            f = pull(3)
            assert f.meta["since"] == 3 and "w" in f.meta["sparse"] and f.tensors["w"].dtype == U32
            held = {k: v.copy() for k, v in clients[0].tensors.current.held.tensors.items()}
            before = state_hash(ps.rt)
            wid = regs[0]["worker_id"]
            for q in ("since=-1", "since=abc", "since=1.5", "since=", "since=0x3", f"since={10**30}"):  # 2^53 on: 400
                r = h.get(f"/v1/model?min_step=4&{q}")
                assert r.status_code == 400 and r.json()["error"] == "bad_request", (q, r.text)
                r = h.post(f"/v1/gradients?pull=1&{q}", content=b"", headers=FRAME)
                assert r.status_code == 400 and r.json()["error"] == "bad_request", (q, r.text)
            assert state_hash(ps.rt) == before
            assert all(bits(held[k]) == bits(core.weights[k]) for k in held)
            r = h.get("/v1/model", params={"min_step": 4, "since": 3, "worker_id": wid, "shm": 1})
            assert r.status_code == 200 and "since" in frame.decode(r.content).meta  # no same-host file here
        for c in clients:
            c.close()


def test_async_workers_hold_the_ps_weights_bit_for_bit():
    """async: the delta is from the step served last, whoever it was served to; any other holder gets dense."""
    with live_ps(mode="async", compression="topk", compression_topk_ratio=0.02, startup_grace_seconds=0.0,
                 shm_dir="", min_workers=2) as ps:
        clients = [ps.client() for _ in range(2)]
        wids = [c.register(f"w{i}")["worker_id"] for i, c in enumerate(clients)]
        assert clients[0].init_model(init_of(np.random.default_rng(2)), {"name": "sgd", "learning_rate": 0.5})
        metas: list[dict] = []
        for c, wid in zip(clients, wids):
            c.attach(wid)
            c.push_wait = 5.0
            take = c.tensors.current.held.take
            c.tensors.current.held.take = lambda f, take=take: metas.append(f.meta) or take(f)
        rng = np.random.default_rng(3)
        for _ in range(6):
            for c, wid in zip(clients, wids):  # alternating: each worker's pull is one or two steps behind
                got = c.pull(0, wid, 5.0)
                g = {k: rng.standard_normal(s).astype(np.float64 if k == "d" else F32) for k, s in SHAPES.items()}
                c.push(wid, got.step, g, 1.0, 8)
        step = ps.rt.core.global_step
        assert step >= 10
        for c, wid in zip(clients, wids):
            c.prefetched = None
            assert c.pull(step, wid, 5.0).step == step
            assert all(bits(c.tensors.current.held.tensors[k]) == bits(v) for k, v in ps.rt.core.weights.items())
            c.close()
        assert any("since" in m for m in metas) and any("since" not in m for m in metas[2:])


def test_deltas_off_answers_dense():
    with live_ps(compression="topk", weight_deltas=False, total_num_replicas=2, startup_grace_seconds=0.0,
                 shm_dir="", aggregation="mean") as ps:
        clients, _, metas = train(ps, 3, 1.0)
        assert ps.rt.tensors.deltas is None and not any("lineage" in m for m in metas)
        for c in clients:
            c.close()


# ---- a real job: the same bits with and without deltas -----------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("name", ["topk"])  # 2bit: the live two-worker test above (make test's time budget)
def test_a_job_ends_with_the_same_bits_with_and_without_deltas(name):
    runs = {}
    for deltas in (True, False):
        runs[deltas] = run_job(2, {"PS_MAX_STEPS": 25, "PS_COMPRESSION": name, "PS_COMPRESSION_TOPK_RATIO": 0.01,
                                   "PS_COMPRESSION_TOPK_WARMUP_STEPS": 5,
                                   "PS_COMPRESSION_2BIT_THRESHOLD": 0.01, "PS_WEIGHT_DELTAS": str(deltas).lower()},
                               {"WORKER_TASK": "bench.task:params_20000", "WORKER_SEED": 3, "WORKER_SHM_DIR": ""})
    on, off = runs[True], runs[False]
    for job in (on, off):
        assert job.exit_codes == [0, 0] and job.status["global_step"] == 25
        assert all(w["pushes"]["accepted"] == 25 for w in job.workers)
    assert on.tensors.keys() == off.tensors.keys()
    for k in on.tensors:
        assert bits(on.tensors[k]) == bits(off.tensors[k]), k
    sent = on.status["bytes_sent"], off.status["bytes_sent"]
    assert sent[0] < sent[1] / (3 if name == "topk" else 1.5), sent
