"""A sharded PS's follower closing its partitions itself (ps_service/sharding/parts.py, docs/partitions.md, Shards), by
simulation: a follower's core holding one shard's pieces, planned into partitions over those pieces, takes the
workers' frames interleaved at random with the coordinator's decision anywhere among them (before every frame, after
all, in between); each partition closes when the decision is known and its contributors' frames are in, the step
advances with the last, and the weights, slots and iteration count are those of one PS applying the same rounds
whole, split to the shard's pieces, bit for bit. A member dropped mid-round is not waited for in its missing
partitions (each then the mean of the others), frames of workers the decision does not name are dropped, and the
partitions' frames for the pulls are those weights. And real shards (S = 2, 4) with stock workers pushing partitions
and pulling alongside end bit-identical to one process."""
from __future__ import annotations

import random

import numpy as np
import pytest

from cluster.processes import wait_for
from ps_service.core import Decided, ParameterServerCore
from ps_service.core.errors import CoreError
from ps_service.core.rounds import Accumulator
from ps_service.sharding import parts
from ps_service.sharding.holds import Held, Holds
from ps_service.transport.streamed import Partitions
from shared import frame
from shared.compression import SparseTensor
from shared.errors import ProtocolError
from shared.partitions import plan as partitions_plan
from shared.protocol import ModelInit, PushRequest, PushStatus
from shared.shards import plan as shard_plan, spec_of, split
from tests.clusters import run_job
from tests.configs import core_config
from tests.reference import train_reference
from tests.test_partitions import OPTIMIZERS, STEPS, WORKERS, core, gradient, partitioned_core, state, weights0
from tests.test_partitions import frame as pushed_frame
from tests.timing import allow
from worker_service.tasks import load_task

SHARD = 1  # of 2, at a split bound that cuts "a" (35 elements) into slices: pieces named "a[0:12]" etc.


def shard_map():
    return shard_plan(spec_of(weights0("float32")), 2, 12)


def follower(optimizer: dict, aggregation: str, partition_bytes: int, **cfg) -> ParameterServerCore:
    """A follower's core as ShardRole makes it: it follows, then takes its pieces."""
    c = ParameterServerCore(core_config(aggregation=aggregation, **cfg))
    c.partition_bytes = partition_bytes
    c.follow()
    c.init_model(ModelInit({k: v.copy() for k, v in split(weights0("float32"), shard_map().pieces[SHARD]).items()},
                           dict(optimizer)), 0.0)
    return c


def pieces(step: int, rank: int) -> dict[str, np.ndarray]:
    return split(gradient(step, rank, "float32"), shard_map().pieces[SHARD])


def give(c, step: int, rank: int, q: int, now: float = 0.0) -> str:
    g = {k: v.copy() for k, v in c.partitions.split(pieces(step, rank), q).items()}
    return parts.frame(c, f"w{rank}", step, q, g, now)


def contributors(ranks) -> list[tuple[int, str]]:
    return [(r, f"w{r}") for r in sorted(ranks)]


@pytest.mark.parametrize("optimizer", [OPTIMIZERS[0], OPTIMIZERS[3], OPTIMIZERS[8]], ids=["sgd", "adam", "torch-adamw"])
@pytest.mark.parametrize("aggregation", ["mean", "sum"])
def test_a_followers_partitions_closed_in_any_order_end_with_one_ps_bits(optimizer, aggregation):
    ref, ids = core(optimizer, aggregation, "float32")  # one PS, whole pushes
    for step in range(STEPS):
        for rank in range(WORKERS):
            ref.push(PushRequest(ids[rank], step, gradient(step, rank, "float32")), 0.0)
    m = shard_map()
    mine = m.pieces[SHARD]
    want = {f"w/{k}": v.tobytes() for k, v in split(ref.weights, mine).items()}
    want.update({f"{s}/{k}": v.tobytes() for s, t in ref.optimizer.slots.items() for k, v in split(t, mine).items()})
    want["iterations"] = str(ref.optimizer.iterations).encode()
    names = {p.key for p in mine}
    for seed in (1, 2, 3, 4):
        c = follower(optimizer, aggregation, 24)
        pulls = Partitions(c)
        c.on_partition = pulls.closed
        q_count, rng = c.partitions.count, random.Random(seed)
        assert q_count > 2 and any("[" in p.key for p in m.pieces[SHARD])
        for step in range(STEPS):
            events = [(r, q) for r in range(WORKERS) for q in range(q_count)]
            rng.shuffle(events)
            events.insert(rng.choice([0, len(events), rng.randrange(len(events) + 1)]), None)  # the decision
            for i, ev in enumerate(events):
                assert c.global_step == step, (i, len(events))
                if ev is None:
                    assert parts.decide(c, step, contributors(range(WORKERS)), 0.0)
                    assert not parts.decide(c, step, contributors(range(WORKERS)), 0.0)  # a repeat
                else:
                    assert give(c, step, *ev) == "held"
                    assert give(c, step, *ev) == ("duplicate" if c.global_step == step else "late")
            assert c.global_step == step + 1 and not c.deciding and c.parts is None
            # the pulls' frames of the step are its weights, partition by partition (none made when the decision
            # came last and closed the round at once: no pull could be answered partition by partition)
            cur = pulls.current
            if events[-1] is None:
                continue
            assert cur.step == step + 1 and cur.complete
            got = {}
            for q, body in enumerate(cur.frames):
                f = frame.decode(bytes(body).rstrip(b"\0") if q < q_count - 1 else body)
                assert f.meta.get("partitions", None) == (q_count if q == 0 else None)
                got.update(f.tensors)
            assert {k: v.tobytes() for k, v in got.items()} == {
                k: v.tobytes() for q in range(q_count) for k, v in c.partitions.split(c.weights, q).items()}
        got = state(c)
        assert set(k.split("/", 1)[-1] for k in got if "/" in k) == names
        assert got == want


def test_frames_before_the_decision_wait_and_others_are_dropped():
    c = follower(OPTIMIZERS[0], "mean", 24)
    q_count = c.partitions.count
    for q in range(q_count):  # worker 2 is not a contributor (fixed R: its head was late on the coordinator)
        assert give(c, 0, 2, q) == "held"
    for q in range(q_count):
        assert give(c, 0, 0, q) == "held"
    assert not c.deciding and c.global_step == 0
    assert parts.decide(c, 0, contributors([0, 1]), 0.0)
    assert c.deciding and c.global_step == 0 and "partitions" in c.wait_reason(0.0)
    assert give(c, 0, 2, 0) == "late"  # not named
    for q in range(q_count - 1):
        assert give(c, 0, 1, q) == "held"
    assert c.deciding
    assert give(c, 0, 1, q_count - 1) == "held"
    assert c.global_step == 1 and c.gradients_applied == 2 and c.optimizer.iterations == 1
    assert give(c, 0, 1, 0) == "late"  # its round is over here
    lr, w0 = np.float32(0.1), split(weights0("float32"), shard_map().pieces[SHARD])
    for k, w in c.weights.items():
        total = pieces(0, 0)[k].copy()
        total += pieces(0, 1)[k]
        mean = total / np.float32(2)
        assert w.tobytes() == (mean if k.startswith("buffer:") else w0[k] - mean * lr).tobytes(), k


def test_a_member_dropped_mid_round_is_not_waited_for():
    c = follower(OPTIMIZERS[0], "mean", 24)
    p = c.partitions
    assert give(c, 0, 2, 0) == "held"  # worker 2 sends its first partition only
    for rank in (0, 1):
        for q in range(p.count):
            assert give(c, 0, rank, q) == "held"
    assert parts.decide(c, 0, contributors(range(3)), 0.0)
    assert c.deciding and c.global_step == 0
    assert parts.drop(c, 0, ["w2"], 0.0)  # its lease ended: the partitions without it close
    assert c.global_step == 1 and not c.deciding
    assert not parts.drop(c, 0, ["w2"], 0.0)  # passed
    lr, w0 = np.float32(0.1), split(weights0("float32"), shard_map().pieces[SHARD])
    for q in range(p.count):
        n = 3 if q == 0 else 2
        for x in p.partitions[q]:
            total = None
            for rank in range(n):
                g = p.split(pieces(0, rank), q)[x.key].copy()
                total = g if total is None else np.add(total, g, out=total)
            mean = total / np.float32(n)
            want = mean if x.name.startswith("buffer:") else p.split(w0, q)[x.key] - mean * lr
            assert p.split(c.weights, q)[x.key].tobytes() == want.tobytes(), (q, x.key)


def test_an_empty_decision_steps_nothing_and_refusals_change_nothing():
    c = follower(OPTIMIZERS[3], "mean", 24)
    before = {k: v.copy() for k, v in c.weights.items()}
    with pytest.raises(ProtocolError) as e:
        parts.decide(c, 1, [], 0.0)
    assert e.value.code == "shard_behind"
    with pytest.raises(ProtocolError) as e:
        give(c, 1, 0, 0)
    assert e.value.code == "shard_behind"
    with pytest.raises(ProtocolError) as e:
        parts.frame(c, "w0", 0, c.partitions.count, {}, 0.0)
    assert e.value.code == "tensor_mismatch"
    bad = {k: np.full_like(v, np.nan) for k, v in c.partitions.split(pieces(0, 0), 0).items()}
    with pytest.raises(CoreError) as e:
        parts.frame(c, "w0", 0, 0, bad, 0.0)
    assert e.value.code == "nonfinite_gradient"
    assert c.parts is None or "w0" not in c.parts.came[0]
    assert parts.decide(c, 0, [], 0.0)  # nobody contributed: the step advances, no optimizer step
    assert c.global_step == 1 and c.optimizer.iterations == 0
    assert {k: v.tobytes() for k, v in c.weights.items()} == {k: v.tobytes() for k, v in before.items()}


def test_the_coordinators_decision_and_lost_members_close_a_follower_as_the_coordinator():
    """A coordinator's core tells the decision and a contributor lost mid-round (``core.told``: ``Decided``, ``Lost``,
    read after each call); a follower told them ends with the coordinator's weights, bit for bit."""
    c, ids = partitioned_core(OPTIMIZERS[3], 100, workers=3, lease_seconds=5.0)
    f = ParameterServerCore(core_config())
    f.partition_bytes = 100
    f.follow()
    f.init_model(ModelInit(weights0("float32"), dict(OPTIMIZERS[3])), 0.0)
    assert f.partitions == c.partitions
    c.told, seen = [], []

    def tell(now: float) -> None:  # what the sharding layer does after each call of the coordinator's core
        told, c.told = c.told, []
        for t in told:
            if isinstance(t, Decided):
                seen.append(("decided", t.record.step, t.lost))
                parts.decide(f, t.record.step, sorted((a.rank, a.worker_id) for a in t.record.contributors), now)
            else:
                seen.append(("lost", t.step, t.worker_id))
                parts.drop(f, t.step, [t.worker_id], now)
    p = c.partitions

    def both(rank: int, q: int, now: float = 0.0) -> None:
        g = p.split(gradient(0, rank, "float32"), q)
        assert pushed_frame(c, ids[rank], 0, rank, q, now=now).status is PushStatus.ACCEPTED
        tell(now)
        assert parts.frame(f, ids[rank], 0, q, {k: v.copy() for k, v in g.items()}, now) == "held"
    for rank in range(3):
        both(rank, 0)
    assert seen == [("decided", 0, ())]
    assert c.deciding and f.deciding
    for rank in (0, 1):
        for q in range(1, p.count):
            both(rank, q, now=4.0)
    c.tick(6.0)  # worker 2's lease ends: told, and every partition closes without it
    assert c.global_step == 1 and f.global_step == 0
    tell(6.0)
    assert seen == [("decided", 0, ()), ("lost", 0, ids[2])]
    assert c.global_step == f.global_step == 1 and not f.deciding
    assert {k: v.tobytes() for k, v in f.weights.items()} == {k: v.tobytes() for k, v in c.weights.items()}
    assert f.optimizer.iterations == c.optimizer.iterations == 1


def test_the_coordinator_tells_the_followers_its_decision_and_the_contributors_lost_before_and_after_it():
    """Partitioned rounds: a contributor lost before the decision (its partition 0 counted, then it left) goes with
    the decision (``lost``: the core's ``Decided.lost``, taken at the decision, as the round may close in the same
    call), one lost after it in a ``/shard/lost`` message; queued for every follower once the call returned
    (:meth:`ShardRole.tell`, the runtime's ``deliver``), in the order the core told them."""
    c, ids, r = decided_with_a_contributor_lost()
    c.leave(ids[1], 2.0)
    r.tell()
    assert c.told == []
    assert queued(r) == [("/shard/apply", apply_of(ids)), ("/shard/lost", {"step": 0, "workers": [ids[1]]})]


def decided_with_a_contributor_lost():
    """A sharded coordinator's core (``ShardRole``), round 0 of 4 workers in partitions decided by the last head after
    worker 0 left (its partition 0 counted): (core, ids, role), the decision told, not read yet."""
    from ps_service.settings import PSSettings
    from ps_service.sharding import role
    c, ids = partitioned_core(OPTIMIZERS[0], 100, workers=4)
    r = role(PSSettings(shards=2, shard_index=0, shard_urls="http://127.0.0.1:9,http://127.0.0.1:10",
                        partition_bytes=100), c)
    assert c.told == []
    for rank in (0, 1, 2):
        assert pushed_frame(c, ids[rank], 0, rank, 0).status is PushStatus.ACCEPTED
    c.leave(ids[0], 1.0)
    assert c.told == [] and not c.deciding
    assert pushed_frame(c, ids[3], 0, 3, 0, now=1.0).status is PushStatus.ACCEPTED  # the last head: decided
    assert c.deciding and [type(t) for t in c.told] == [Decided] and c.told[0].lost == (ids[0],)
    return c, ids, r


def apply_of(ids: list[str]) -> dict:
    """Round 0's apply, as :func:`decided_with_a_contributor_lost` decided it: worker 0 lost before the decision."""
    return {"step": 0, "contributors": [[i, ids[i]] for i in range(4)], "mean_of": 4, "lost": [ids[0]]}


def queued(r) -> list:
    queue = r.links.followers[0].queue
    return [queue.get_nowait() for _ in range(queue.qsize())]


def test_a_decision_is_queued_before_anything_that_can_fail(monkeypatch):
    """:meth:`ShardRole.tell` queues a decided round's apply, with the contributors lost before it (``Decided.lost``),
    before anything that can fail: a timeline mark whose file cannot be written fails after it, at the decision and at
    the round's close alike, and the apply still goes (it was lost when both failed)."""
    from contextlib import suppress
    from shared import marks
    c, ids, r = decided_with_a_contributor_lost()

    def unwritable(*args, **kwargs):
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(marks, "ON", True)
    monkeypatch.setattr(marks, "mark", unwritable)
    with suppress(OSError):
        r.tell()
    assert c.told == []
    for rank in (1, 2, 3):
        for q in range(1, c.partitions.count):
            assert pushed_frame(c, ids[rank], 0, rank, q, now=2.0).status is PushStatus.ACCEPTED
    assert c.global_step == 1 and c.rounds[-1].step == 0
    with suppress(OSError):  # (the runtime logs an observer that fails)
        r.observe()
    assert queued(r) == [("/shard/apply", apply_of(ids))]


def test_a_partitioned_push_delivers_what_the_core_told_after_each_frame_the_decision_after_its_head():
    """The seam gives a partitioned push to the core frame by frame (:class:`Feed`) and calls ``after`` (the runtime's
    ``deliver``) after each: the decision the last head makes is told before the push's later frames are taken (a
    coordinator's apply then leaves before the rest of the body is read, as from a hook inside the call)."""
    from ps_service.transport.partitioned import Feed
    c, ids = partitioned_core(OPTIMIZERS[0], 100, workers=2)
    c.told = []
    plan = c.partitions
    assert plan.count > 2
    for q in range(plan.count):  # worker 0's push, whole: the round waits for worker 1's head
        assert pushed_frame(c, ids[0], 0, 0, q).status is PushStatus.ACCEPTED
    seen = []

    def after() -> None:
        seen.append(([type(t).__name__ for t in c.told], sorted(c.parts.closed) if c.parts else None, c.global_step))
        c.told.clear()
    feed = Feed(c, lambda: 1.0, after=after)
    feed.whole(PushRequest(ids[1], 0, {k: v.copy() for k, v in gradient(0, 1, "float32").items()}), plan)
    assert feed.status is PushStatus.ACCEPTED and c.global_step == 1
    assert seen[0] == (["Decided"], [0], 0)  # told after the head, partition 0 closed, the later ones waiting
    assert [s[0] for s in seen[1:]] == [[]] * (plan.count - 1) and len(seen) == plan.count


# ---- real shards and stock workers (uvicorn, worker processes) -----------------------------------------------------
def pushed(g: np.ndarray, topk: bool) -> np.ndarray | SparseTensor:
    """A copy of ``g`` (the round's from now on), or as a top-k push's decoded tensor: 3 entries in an even spread."""
    idx = np.linspace(0, g.size - 1, 3).astype(np.int64)
    return SparseTensor(g.shape, idx, g.reshape(-1)[idx].astype(np.float32)) if topk else g.copy()


@pytest.mark.parametrize("topk", [False, True], ids=["dense", "topk"])
@pytest.mark.parametrize("aggregation", ["mean", "sum"])
def test_an_unpartitioned_followers_round_is_one_partition_with_the_bits_of_one_step(aggregation, topk):
    """P = 0: a follower's round is one partition of its pieces whole, summed as the coordinator's sum reaches each key
    (:meth:`Holds.fold` to :func:`parts.fold`), the rest of C at the decision. Weights, iteration and TF1 SGD's touched
    entries are those of one optimizer step on the rank-order sum (the core's ``apply_round``, a standby's), top-k
    pushes' sparse sums included; held pushes of the round are dropped, and an empty decision applies nothing."""
    new, old = follower(OPTIMIZERS[0], aggregation, 0), follower(OPTIMIZERS[0], aggregation, 0)
    holds, c = Holds(lambda key, t: parts.fold(new, key, t)), contributors(range(WORKERS))
    for step in range(STEPS):
        acc = Accumulator(tuple(old.weights), "sum")
        for r in range(WORKERS):
            acc.apply(f"w{r}", r, {k: pushed(v, topk) for k, v in pieces(step, r).items()}, ())
            holds.put(f"w{r}", Held(step, {k: pushed(v, topk) for k, v in pieces(step, r).items()}, "http"))
        total, _ = acc.take_sum()
        old.apply_round(total, WORKERS if aggregation == "mean" else 1, WORKERS)
        assert holds.progress(new.global_step, step, 0, c[:1], None) and holds.folded == c[:1]
        holds.fold(step, 0, c, whole=True)
        assert parts.decide(new, step, c, 0.0) and new.parts is None and new.global_step == step + 1
        holds.drop_through(step)
        assert len(holds) == 0 and {k: v.tobytes() for k, v in new.weights.items()} == \
            {k: v.tobytes() for k, v in old.weights.items()}
        touched = set(new.optimizer.touched.entries)  # (top-k: TF1 SGD on the sum's entries)
        assert (new.optimizer.iterations, touched) == (old.optimizer.iterations, set(old.optimizer.touched.entries))
        assert bool(touched) == topk
    holds.put("w0", Held(STEPS, pieces(STEPS, 0), "http"))
    before = {k: v.tobytes() for k, v in new.weights.items()}
    assert holds.progress(STEPS, STEPS, 0, c[:1], None) and parts.decide(new, STEPS, [], 0.0)  # (the sum overflowed)
    assert new.global_step == STEPS + 1 and {k: v.tobytes() for k, v in new.weights.items()} == before


@pytest.mark.parametrize("shards", [2, 4])
def test_partitioned_rounds_on_shards_train_bit_identical_to_one_process(shards):
    """Stock workers over TCP, every shard's pieces pushed as partition frames while the next weights are pulled
    alongside, partition by partition: the weights are those of one process training on the concatenated batches."""
    steps, workers = 20, 4
    # the linear task's pieces cut to 2 elements (S = 2) or 1 (S = 4), each partition one float64 element
    ps_env = {"PS_MAX_STEPS": steps, "PS_OPTIMIZER": "momentum", "PS_SHARD_SPLIT_ELEMENTS": 4 // shards,
              "PS_PARTITION_BYTES": 8}
    worker_env = {"WORKER_TASK": "linear", "WORKER_DTYPE": "float64", "WORKER_SEED": 7, "WORKER_BATCH_SIZE": 16,
                  "WORKER_SHM_DIR": ""}
    job = run_job(workers, ps_env, worker_env, shards=shards)
    assert job.exit_codes == [0] * workers and job.status["global_step"] == steps
    assert all(w["pushes"]["accepted"] == steps for w in job.workers)
    rows = job.status["shard"]["shards"]
    assert [r["step"] for r in rows] == [steps] * shards and all(r["error"] is None for r in rows)
    brought = load_task("linear", 7, "float64").optimizer()
    spec = brought if brought["name"] == "momentum" else {"name": "momentum"}  # PS_OPTIMIZER replaces the task's
    _, ref = train_reference("linear", workers, steps, batch_size=16, seed=7, dtype="float64", optimizer=spec)
    assert job.tensors.keys() == ref.keys()
    for k in ref:
        assert job.tensors[k].tobytes() == ref[k].tobytes(), f"{k}: not bit-identical (0 ulp)"


def test_a_followers_partitioned_hold_takes_a_pushs_meta_but_no_shm_seq_nor_compression():
    """protocol-shards.md, Partitioned rounds: a follower's hold carries a push's meta (its ``loss`` and the like are
    ignored; ``compression`` ``none`` is no compression); ``shm_seq`` or another ``compression``: 400 ``bad_field``."""
    from tests.test_shards import W0 as W, post_frame, start_job, two_shards
    with two_shards(partition_bytes=8) as (c, f):
        hc, hf, m, ids = start_job(c, f)
        pieces = split({k: np.ones_like(v) for k, v in W.items()}, m.pieces[1])

        def hold(**meta):
            return post_frame(hf, "/v1/shard/gradients", pieces, {"worker_id": ids[0], "step": 0, **meta},
                              map=m.digest)
        for meta in ({"shm_seq": 3}, {"compression": "topk"}):
            r = hold(**meta)
            assert (r.status_code, r.json()["error"]) == (400, "bad_field"), r.text
        for meta in ({"loss": 0.5, "num_examples": 4}, {"compression": "none"}):
            r = hold(**meta)
            assert (r.status_code, r.json()["status"]) == (200, "held"), r.text
        hc.close(), hf.close()


def test_a_partitioned_followers_decision_naming_a_worker_twice_is_refused_not_summed_twice():
    """protocol-shards.md: a decision's contributors are in sum order, each worker once (400 ``bad_request``, nothing
    changes); a partitioned follower took ``[[0, a], [1, a]]`` and summed a's frames twice. The decision as the
    coordinator makes it then applies a's and b's mean."""
    from tests.live_ps import state_hash
    from tests.test_shards import W0 as W, start_job, two_shards
    with two_shards(partition_bytes=8) as (c, f):
        hc, hf, m, ids = start_job(c, f)
        lo, hi = sorted(ids)
        g = {lo: split({k: np.ones_like(v) for k, v in W.items()}, m.pieces[1]),
             hi: split({k: np.full_like(v, 3.0) for k, v in W.items()}, m.pieces[1])}
        p = partitions_plan(spec_of(g[lo]), 8)
        for w in ids:
            frames = [(p.split(g[w], 0), {"worker_id": w, "step": 0, "partitions": p.count})]
            frames += [(p.split(g[w], q), {"partition": q}) for q in range(1, p.count)]
            r = hf.post("/v1/shard/gradients", params={"map": m.digest}, headers={"content-type": frame.MEDIA_TYPE},
                        content=b"".join(bytes(b) for b in frame.encode_many(frames)))
            assert r.json()["status"] == "held", r.text
        before = state_hash(f.rt)
        r = hf.post("/v1/shard/apply", json={"step": 0, "contributors": [[0, lo], [1, lo]], "mean_of": 2})
        assert (r.status_code, r.json()["error"]) == (400, "bad_request") and state_hash(f.rt) == before
        assert hf.post("/v1/shard/apply", json={"step": 0, "contributors": [[0, lo], [1, hi]], "mean_of": 2}).json()[
            "applied"]
        wait_for(lambda: f.rt.core.global_step == 1, allow(10), "the follower's partitions to close")
        want = split({k: W[k] - 0.5 * 2.0 for k in W}, m.pieces[1])
        assert all(f.rt.core.weights[k].tobytes() == v.tobytes() for k, v in want.items())
        hc.close(), hf.close()
